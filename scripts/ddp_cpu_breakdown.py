"""Where a DDP step's CPU goes, by kind of work, with Gloo and with "ud" carrying its gradients.

It runs `scripts/ddp_step_time.py --only ARM` once per arm (gloo, then ud-1) under a
system-wide `perf record -a`, so that each run holds one backend beside the plain compute arm;
takes the samples between the 10th and 90th percentile of the kernel's socket copies (start-up
and tear-down left out); and sorts every sampled symbol into a kind of work as
`scripts/cpu_breakdown.py` does. Each kind is given in CPU milliseconds per step of the arm,
counting the compute arm's steps in the same window too (both runs have it, so a difference
between the columns is the backend's). The step times each run printed follow.

    python3 scripts/ddp_cpu_breakdown.py --ranks 4 --hosts veth --mtu 1500 --steps 100

Needs root (namespaces) and `perf`.
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_breakdown import KINDS, call_window, symbols  # noqa: E402


def measure(arm, args, directory):
    """({kind: CPU ms per step}, the script's table rows, samples' CPU ms in the window)."""
    data = os.path.join(directory, f"{arm}.data")
    command = [sys.executable, os.path.join(HERE, "ddp_step_time.py"), "--ranks", str(args.ranks), "--width", str(args.width),
               "--layers", str(args.layers), "--hosts", args.hosts, "--mtu", str(args.mtu), "--stripes", "1",
               "--steps", str(args.steps), "--only", arm]
    run = subprocess.run(["perf", "record", "-a", "-F", str(args.frequency), "-o", data, "--"] + command,
                         capture_output=True, text=True, check=True)
    rows = [line for line in run.stdout.splitlines() if line.startswith("| compute") or line.startswith(f"| {arm} ")]
    window = call_window(data)
    start, end = (float(t) for t in window.split(","))
    found = symbols(data, window)
    cpus = os.cpu_count() or 1
    # the window's CPU time: its length on every CPU; what perf saw as idle is left out below
    window_ms = (end - start) * 1e3 * cpus
    steps = 0.8 * args.steps  # the window holds about the middle 80% of the run's steps (each: compute, then the arm)
    kinds = {}
    for (dso, symbol), percent in found.items():
        kind = next((name for name, test in KINDS if test(dso, symbol)), f"other: {dso}")
        kinds[kind] = kinds.get(kind, 0.0) + percent / 100.0 * window_ms / steps
    return kinds, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hosts", choices=("loopback", "veth"), default="veth")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--frequency", type=int, default=499)
    args = parser.parse_args(argv)
    arms = ("gloo", "ud-1")
    with tempfile.TemporaryDirectory() as directory:
        results = {arm: measure(arm, args, directory) for arm in arms}
    print(f"# DDP step, {args.ranks} ranks, {args.hosts}, MTU {args.mtu}, MLP {args.layers}x{args.width}, {args.steps} steps "
          f"a run, one backend a run beside the compute arm; CPU ms per step (compute arm's step included) by kind of work, "
          f"{os.cpu_count()} CPUs")
    print("| kind of work | " + " | ".join(arms) + " | difference |")
    print("|---|" + "---|" * (len(arms) + 1))
    names = sorted({k for kinds, _ in results.values() for k in kinds}, key=lambda k: -max(r[0].get(k, 0.0) for r in results.values()))
    for name in names:
        values = [results[arm][0].get(name, 0.0) for arm in arms]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {values[1] - values[0]:+.1f} |")
    busy = [sum(v for k, v in results[arm][0].items() if k != "idle") for arm in arms]
    print("| **busy** | " + " | ".join(f"{v:.1f}" for v in busy) + f" | {busy[1] - busy[0]:+.1f} |")
    for arm in arms:
        print(f"# {arm} run's step table rows:")
        for row in results[arm][1]:
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
