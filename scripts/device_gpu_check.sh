#!/usr/bin/env bash
# Issue 37's checks on the lent GPU machine (the `device` tool's run: one H100 or H200, 16 cores,
# its own python3 with torch and CUDA, nothing to fetch), in one call of at most ~9 minutes:
#
#   run(command="UD_COMMIT=$(short commit here) bash scripts/device_gpu_check.sh", timeout_s=600)
#
# 1. builds the extension there (UD_BUILD_VERBS=0: no libibverbs headers there; UDP only);
# 2. runs the CUDA tests (tests/test_cuda.py) and the staging's host tests (tests/test_staging.py);
# 3. runs scripts/bench_cuda.py: 4 ranks, 64 MiB float32 CUDA allreduce ("ud" vs Gloo vs "ud" on a
#    CPU tensor), a DDP step of a CUDA model over "ud" vs Gloo, and the staging copies alone.
# Logs go to $OUT (gpu_check.log, tests.log, bench.log, bench.json); they are kept under
# docs/device_runs/ and the figures of docs/gpu.md are read from them. Each stage has its own
# time limit, so a hang in one still leaves the others' logs.
set -uo pipefail
cd "$(dirname "$(realpath "$0")")/.."
# UD_GPU_TESTS: pytest's arguments (default: both test files); the script's own arguments go to the benchmark
tests=(${UD_GPU_TESTS:-tests/test_cuda.py tests/test_staging.py})
UD_GPU_TRAIN=${UD_GPU_TRAIN:-}
bench_arguments=("$@")
out=${OUT:-/tmp/device_gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

{
    echo "commit ${UD_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nproc) cores, kernel $(uname -r), $(python3 -V)"
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
    start=$(date +%s)
    UD_BUILD_VERBS=0 python3 setup.py -q build_ext --inplace -j "$(nproc)" >/dev/null 2>"$out/build.err" \
        || { echo "build failed:"; tail -n 40 "$out/build.err"; exit 1; }
    echo "built in $(( $(date +%s) - start )) s"
} 2>&1 | tee "$out/gpu_check.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

start=$(date +%s)
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 200)
UD_STRIPES=1 timeout 330 python3 -m pytest -q -p no:cacheprovider -rs "${per_test[@]}" \
    "${tests[@]}" 2>&1 | tee "$out/tests.log"
tests_status=${PIPESTATUS[0]}
echo "tests: exit $tests_status in $(( $(date +%s) - start )) s" | tee -a "$out/gpu_check.log"

start=$(date +%s)
timeout 200 python3 scripts/bench_cuda.py --json "$out/bench.json" "${bench_arguments[@]}" 2>&1 | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}
echo "bench: exit $bench_status in $(( $(date +%s) - start )) s" | tee -a "$out/gpu_check.log"
# UD_GPU_TRAIN=1,2,3: also the two-stage step on CUDA at 10% injected loss against Gloo (CUDA) on the
# Shakespeare task, one run per seed (scripts/train_under_loss.py --device cuda; not yet run there:
# size the seeds and UD_GPU_TRAIN_STEPS to the device time left)
train_status=0
for seed in ${UD_GPU_TRAIN//,/ }; do
    timeout 200 python3 scripts/train_under_loss.py --device cuda --seed "$seed" --steps "${UD_GPU_TRAIN_STEPS:-600}" \
        --arms "two_stage 10% auto" --json "$out/train_seed$seed.json" 2>&1 | tee -a "$out/train.log"
    train_status=$(( train_status || PIPESTATUS[0] ))
done
exit $(( tests_status || bench_status || train_status ))
