"""Where an allreduce's CPU goes, by kind of work, for ud_transport and Gloo on the same wire.

It runs `scripts/cpu_per_call.py` once per backend under a system-wide `perf record -a`, takes
the samples of the middle 80% of the calls (between the 10th and 90th percentile of the
kernel's socket copies, so start-up and tear-down are left out), sorts every sampled symbol
into a kind of work (the kernel's packet path, its copies to and from user memory, user-space
copies, the sum, ...) and prints each kind in milliseconds of CPU per call: its share of the
busy samples times the busy CPU per call that cpu_per_call.py measured. The symbols where the
two backends differ most follow.

    python3 scripts/cpu_breakdown.py --world-size 2 --mtu 1500 --mib 64 --iterations 60
    python3 scripts/cpu_breakdown.py --world-size 4 --mtu 1500 --mib 16 --iterations 100

cpu_per_call.py copies each call's input back in place before the call (np.copyto, outside
its timed window but inside the sampled one), so "user: memmove" holds one tensor copy per
call per rank for both backends. Needs root (namespaces) and `perf`.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# (kind, test on (dso, symbol)): the first that matches takes the symbol
KINDS = [
    ("idle", lambda d, s: s in ("pv_native_safe_halt", "default_idle", "cpuidle_enter_state", "intel_idle")),
    ("kernel: copy from user (send)", lambda d, s: s == "_copy_from_iter"),
    ("kernel: copy to user (receive)", lambda d, s: s == "_copy_to_iter"),
    ("kernel: scheduler, wake-ups, polls", lambda d, s: d == "[kernel.kallsyms]" and any(
        k in s for k in ("schedule", "switch", "wake", "futex", "poll", "enqueue_task", "dequeue", "update_curr",
                         "pick_next", "epoll", "ep_send"))),
    ("kernel: system call entry and arguments", lambda d, s: d == "[kernel.kallsyms]" and any(
        k in s for k in ("syscall", "entry_", "exit_to_user", "import_iovec", "copy_msghdr", "__check_object_size",
                         "sys_"))),
    ("kernel: memory management", lambda d, s: d == "[kernel.kallsyms]" and any(
        k in s for k in ("page", "folio", "mmap", "vma", "tlb", "clear_", "munmap", "pte"))),
    ("kernel: packet path (skbs, IP/UDP/TCP, GRO/GSO, veth, bridge, netfilter)", lambda d, s: d == "[kernel.kallsyms]"),
    ("user: memmove/memcpy (libc)", lambda d, s: "libc" in d and "mem" in s),
    ("ud engine: copies (saved originals, final values)", lambda d, s: "_native" in d and "copy" in s),
    ("ud engine: sum", lambda d, s: "_native" in d and "add" in s),
    ("ud engine: the rest (headers, schedule, transport)", lambda d, s: "_native" in d),
    ("Gloo and torch (their sum included)", lambda d, s: any(k in d for k in ("torch", "gloo", "c10"))),
    ("Python", lambda d, s: "python" in d),
]


def symbols(data, window):
    """{(dso, symbol): percent of all samples} in the window "start,end" (seconds)."""
    out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "-g", "none",
                          "--percent-limit", "0", "--time", window, "--stdio"],
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        match = re.match(r"\s+([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)$", line)
        if match:
            found[(match.group(2), match.group(3).strip())] = float(match.group(1))
    return found


def call_window(data):
    """'start,end': from the 10th to the 90th percentile of the kernel's socket copies."""
    out = subprocess.run(["perf", "script", "-i", data, "-F", "time,ip,sym"], capture_output=True, text=True,
                         check=True).stdout
    times = [line.split(":")[0].strip() for line in out.splitlines() if re.search(r"_copy_(to|from)_iter", line)]
    if len(times) < 10:
        raise RuntimeError(f"{data}: too few socket copies sampled ({len(times)}) to find the calls")
    return f"{times[len(times) // 10]},{times[len(times) * 9 // 10]}"


def measure(backend, args, directory):
    """(busy CPU ms per call, wall ms p50, {kind: ms per call}, {symbol: ms per call})."""
    data = os.path.join(directory, f"{backend}.data")
    command = [sys.executable, os.path.join(HERE, "cpu_per_call.py"), "--world-size", str(args.world_size),
               "--mtu", str(args.mtu), "--mib", str(args.mib), "--iterations", str(args.iterations),
               "--rounds", "1", "--backends", backend]
    run = subprocess.run(["perf", "record", "-a", "-F", str(args.frequency), "-o", data, "--"] + command,
                         capture_output=True, text=True, check=True)
    match = re.search(r"wall p50\s+([\d.]+) ms\s+machine busy CPU per call p50\s+([\d.]+) ms", run.stdout)
    if not match:
        raise RuntimeError(f"cpu_per_call.py printed no result:\n{run.stdout}\n{run.stderr[-2000:]}")
    wall, busy = float(match.group(1)), float(match.group(2))
    found = symbols(data, call_window(data))
    kinds, per_symbol = {}, {}
    idle = sum(p for (d, s), p in found.items() if KINDS[0][1](d, s))
    busy_share = sum(found.values()) - idle
    for (dso, symbol), percent in found.items():
        kind = next((name for name, test in KINDS if test(dso, symbol)), f"other: {dso}")
        if kind == "idle":
            continue
        ms = percent / busy_share * busy
        kinds[kind] = kinds.get(kind, 0.0) + ms
        per_symbol[symbol] = per_symbol.get(symbol, 0.0) + ms
    return busy, wall, kinds, per_symbol


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--frequency", type=int, default=999, help="perf samples per second per CPU")
    parser.add_argument("--backends", default="auto,gloo")
    parser.add_argument("--differences", type=int, default=12, help="symbols to show where the backends differ most")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        print("# cpu_breakdown: skipped: no perf on this machine (apt install linux-perf)")
        return 0
    backends = args.backends.split(",")
    with tempfile.TemporaryDirectory(prefix="cpu_breakdown-") as directory:
        results = {backend: measure(backend, args, directory) for backend in backends}
    print(f"# {args.world_size} ranks, MTU {args.mtu}, {args.mib} MiB float32, {args.iterations} calls per backend, "
          f"{os.cpu_count()} cores; CPU ms per call by kind of work (the whole machine's busy time)")
    print("| kind of work | " + " | ".join(backends) + " |")
    print("|---|" + "---|" * len(backends))
    kinds = sorted({k for _, _, found, _ in results.values() for k in found},
                   key=lambda k: -max(results[b][2].get(k, 0.0) for b in backends))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{results[b][2].get(kind, 0.0):.1f}" for b in backends) + " |")
    print("| **busy CPU per call** | " + " | ".join(f"{results[b][0]:.0f}" for b in backends) + " |")
    print("| wall p50 per call | " + " | ".join(f"{results[b][1]:.1f}" for b in backends) + " |")
    if len(backends) == 2:
        first, second = (results[b][3] for b in backends)
        names = sorted(set(first) | set(second), key=lambda s: -abs(first.get(s, 0.0) - second.get(s, 0.0)))
        print(f"\n# symbols where they differ most, CPU ms per call ({backends[0]} - {backends[1]})")
        for name in names[:args.differences]:
            print(f"{name:48s} {first.get(name, 0.0):7.1f} {second.get(name, 0.0):7.1f} "
                  f"{first.get(name, 0.0) - second.get(name, 0.0):+7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
