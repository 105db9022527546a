#!/usr/bin/env bash
# Every row of the README's "Measured" table, one command after the other, each against Gloo in
# the same run (the scripts take turns call by call or step by step). Prints each command with the
# time it started, then its output, in the form the raw files under docs/performance/runs/ keep.
# Needs root (network namespaces, nftables) and a quiet machine: about 35 minutes on 2 cores.
#   bash scripts/readme_sitting.sh > docs/performance/runs/<date>-sitting-<commit>.txt 2>&1
set -uo pipefail
cd "$(dirname "$0")/.."

echo "# the README's table at $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)'), $(date -u +%F)," \
     "$(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), kernel $(uname -r)"

run() {
  echo
  echo "\$ python3 $* # $(date -u +%T)"
  python3 "$@" 2>&1 | grep -v -E '^\[W[0-9]{4} .*\[c10d\]'   # c10d's hostname and store-poll warnings
}

small="--auto-only --only allreduce,broadcast,send/recv,barrier"
bridge="--hosts veth --mtu 1500"
exact="--auto-only --only allreduce,allreduce_float"

run scripts/exact_calls.py --bytes 4096 --iterations 300 $small
run scripts/exact_calls.py --bytes 65536 --iterations 300 $small
run scripts/exact_calls.py --world-size 8 $bridge --bytes 4096 --iterations 150 $small
run scripts/exact_calls.py --world-size 8 $bridge --bytes 65536 --iterations 150 $small
run scripts/exact_calls.py --world-size 4 --bytes 1M --iterations 100 $exact
run scripts/exact_calls.py --world-size 4 --bytes 16M --iterations 100 $exact
run scripts/exact_calls.py --world-size 4 $bridge --bytes 1M --iterations 100 $exact
run scripts/exact_calls.py --world-size 4 $bridge --bytes 16M --iterations 100 $exact
run scripts/exact_calls.py --world-size 8 $bridge --bytes 1M --iterations 100 $exact
run scripts/exact_calls.py --world-size 8 $bridge --bytes 16M --iterations 100 $exact
run scripts/exact_calls.py --world-size 8 $bridge --bytes 65536 --iterations 100 --auto-only --only gather,scatter,all_to_all,all_to_all_uneven
run scripts/exact_calls.py --bytes 4096 --iterations 300 --auto-only --only all_to_all_uneven
run scripts/exact_calls.py --world-size 8 $bridge --bytes 1M --iterations 100 --auto-only --only all_to_all_uneven
run scripts/exact_calls.py --world-size 16 $bridge --bytes 4096 --iterations 100 $small
run scripts/exact_calls.py --world-size 16 $bridge --bytes 65536 --iterations 100 --auto-only --only all_to_all_uneven
run scripts/exact_calls.py --world-size 16 $bridge --bytes 1M --iterations 100 $exact
run scripts/wire_targets.py --only loopback,veth1500 --iterations 100
run -m ud_transport bench $bridge --world-size 4 --sizes 1M,16M --iterations 100 --kernel-loss 0.01 --loss-budget 0.1 --no-progress
run -m ud_transport bench $bridge --world-size 16 --sizes 1M,16M --iterations 100 --no-progress
step="scripts/ddp_step_time.py --ranks 4 --width 1024 --layers 4 $bridge --stripes 1 --two-stage --steps 150"
run $step
run $step --kernel-loss 0.01
run $step --kernel-loss 0.01
run $step
run scripts/moe_step_time.py $bridge --steps 100 --ranks 4
run scripts/moe_step_time.py $bridge --steps 100 --ranks 4 --kernel-loss 0.01
run scripts/moe_step_time.py $bridge --steps 100 --ranks 8 --tokens 512
run scripts/moe_step_time.py $bridge --steps 100 --ranks 4
echo
echo "# ended $(date -u +%T)"
