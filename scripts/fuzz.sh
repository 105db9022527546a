#!/usr/bin/env bash
# Fuzz the engine's receive path (tests/fuzz/fuzz_engine.c) with libFuzzer,
# ASan and UBSan, from a seed corpus of the datagrams peers really send.
# Bounded: FUZZ_SECONDS (default 120) of fuzzing after a ~20 s build.
# Exits non-zero on any sanitizer report, crash, or call that does not end.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${FUZZ_SECONDS:-120}
WORK=${FUZZ_WORK:-$(mktemp -d)}
CC=${FUZZ_CC:-clang}
mkdir -p "$WORK/corpus" "$WORK/seeds"
"$CC" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Inative \
  tests/fuzz/fuzz_engine.c native/engine.c native/verdict.c native/schedule.c native/elementwise.c \
  native/transport_memory.c -lm -o "$WORK/fuzz_engine"
PYTHONPATH=.:tests python3 tests/fuzz/make_seeds.py "$WORK/seeds"
cd "$WORK"
./fuzz_engine -max_total_time="$SECONDS_TO_RUN" -timeout=10 -rss_limit_mb=1024 -print_final_stats=1 \
  corpus seeds 2>&1 | tail -n 20
