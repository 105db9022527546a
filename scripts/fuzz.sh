#!/usr/bin/env bash
# Fuzz the engine's receive path with libFuzzer, ASan and UBSan: tests/fuzz/fuzz_engine.c (one
# rank of three in real calls, seeded with the datagrams peers really send) and then
# tests/fuzz/fuzz_engine_wide.c (the call's shape, the communicator's history and exact-size
# datagrams from the input too). Bounded: FUZZ_SECONDS (default 120) of fuzzing each, after a
# ~20 s build each. Exits non-zero on any sanitizer report, crash, or call that does not end.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${FUZZ_SECONDS:-120}
WORK=${FUZZ_WORK:-$(mktemp -d)}
CC=${FUZZ_CC:-clang}
SOURCES=(native/pieces.c native/control.c native/output.c native/liveness.c native/data.c native/recent_loss.c native/verdict.c native/call.c native/comm.c
         native/schedule.c native/elementwise.c native/transport_memory.c)
mkdir -p "$WORK/corpus" "$WORK/seeds" "$WORK/wide_corpus" "$WORK/wide_seeds"
"$CC" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Inative \
  tests/fuzz/fuzz_engine.c "${SOURCES[@]}" -lm -o "$WORK/fuzz_engine"
"$CC" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Inative \
  tests/fuzz/fuzz_engine_wide.c "${SOURCES[@]}" -lm -o "$WORK/fuzz_engine_wide"
PYTHONPATH=.:tests python3 tests/fuzz/make_seeds.py "$WORK/seeds"
python3 tests/fuzz/make_wide_seeds.py "$WORK/wide_seeds"
cd "$WORK"
# the final stats, found by name: the dictionary libFuzzer recommends can push them out of a
# plain tail of the log
for harness in fuzz_engine fuzz_engine_wide; do
  corpus=corpus seeds=seeds
  [ "$harness" = fuzz_engine_wide ] && corpus=wide_corpus seeds=wide_seeds
  echo "== $harness"
  "./$harness" -max_total_time="$SECONDS_TO_RUN" -timeout=10 -rss_limit_mb=1024 -print_final_stats=1 \
    "$corpus" "$seeds" > "$harness.log" 2>&1 || { tail -n 60 "$harness.log"; exit 1; }
  grep -E '^(Done|stat::)' "$harness.log"
done
