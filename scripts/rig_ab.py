"""Before and after on the rig: two revisions' allreduce, taking turns inside one guest boot.

    python3 scripts/rig_ab.py e8c92c1 HEAD                       # UDP and verbs, 2 ranks, 1 and 8 MiB
    python3 scripts/rig_ab.py HEAD HEAD --rows verbs8 --rounds 8  # the spread of a pair where nothing changed

Each revision is checked out (git worktree) and built in place under one directory shared with the
guest; the guest then runs the two builds in turn, round after round (before-after, after-before,
...), each build in a fresh process that imports only its own checkout. Separate guest boots per
build (bench_rig.py's rows, one boot each) differ by more than most changes do under TCG; pairs
run a minute apart in one boot fall on the same period of the machine. Prints every round's
medians and, per row, the median of every round's medians and of the paired differences, with how
many pairs came out slower after. Needs the rig (python -m ud_transport.rig).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# row: (transport, ranks, bytes, calls timed per round)
ROWS = {"udp1": ("udp", 2, 1 << 20, 30), "udp8": ("udp", 2, 8 << 20, 12),
        "verbs1": ("verbs", 2, 1 << 20, 20), "verbs8": ("verbs", 2, 8 << 20, 10)}


def time_rows(build, rows):
    """In the guest, in a process whose PYTHONPATH is `build`: {row: per-call seconds (slowest rank)}."""
    sys.path.insert(0, os.path.join(build, "tests", "verbs_guest"))
    from ranks import run_ranks  # that checkout's forked ranks (DirectoryStore rendezvous, no torch)
    out = {}
    for row in rows:
        transport, world, nbytes, calls = ROWS[row]
        results = run_ranks(range(world), world, tempfile.mkdtemp(), _calls, nbytes, calls, transport=transport,
                            idle_close_us=500_000, deadline_cap_s=60.0)
        out[row] = {"seconds": [max(r[0][i] for r in results) for i in range(calls)],
                    "delivered": min(min(r[1]) for r in results)}
    return out


def _calls(comm, nbytes, calls):
    import numpy as np
    data = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
    seconds, fractions = [], []
    for i in range(calls + 1):  # the first call warms up
        stats = comm.allreduce(data.copy(), loss_budget=1.0, deadline=60.0)
        if i:
            seconds.append(stats.elapsed_s)
            fractions.append(stats.delivered_fraction)
    return seconds, fractions


def take_turns(builds, rows, rounds):
    """In the guest: each round runs both builds, the order flipping every round; prints as it goes."""
    medians = {name: {row: [] for row in rows} for name in builds}
    for round_ in range(rounds):
        for name in turn_order(list(builds), round_):
            process = subprocess.run([sys.executable, os.path.abspath(__file__), "--time", builds[name], "--rows",
                                      ",".join(rows)], env=dict(os.environ, PYTHONPATH=builds[name]),
                                     capture_output=True, text=True, timeout=900)
            if process.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{process.stdout[-2000:]}\n{process.stderr[-4000:]}")
            for row, result in json.loads(process.stdout.splitlines()[-1]).items():
                median = statistics.median(result["seconds"])
                medians[name][row].append(median)
                print(f"round {round_} {name:6} {row:6} median {median * 1e3:7.1f} ms, "
                      f"fastest {min(result['seconds']) * 1e3:7.1f} ms, delivered {result['delivered']:.4f}", flush=True)
    print()
    for line in summary(medians, rows):
        print(line)


def turn_order(names, round_):
    """before-after, then after-before, ...: a drift of the machine within a round favours neither."""
    return names if round_ % 2 == 0 else names[::-1]


def summary(medians, rows):
    """Markdown lines: per row, each build's median of its round medians (range), the median of the
    paired differences (after - before, same round) and how many pairs were slower after."""
    before, after = list(medians)
    lines = [f"| row | {before}: median of round medians, ms (range) | {after} | after - before, paired, "
             "median ms | pairs slower after |", "|---|---|---|---|---|"]
    for row in rows:
        a, b = medians[before][row], medians[after][row]
        differences = [y - x for x, y in zip(a, b)]
        lines.append(f"| {row} | {statistics.median(a) * 1e3:.1f} ({min(a) * 1e3:.1f}-{max(a) * 1e3:.1f}) | "
                     f"{statistics.median(b) * 1e3:.1f} ({min(b) * 1e3:.1f}-{max(b) * 1e3:.1f}) | "
                     f"{statistics.median(differences) * 1e3:+.1f} | {sum(d > 0 for d in differences)} of {len(differences)} |")
    return lines

def check_out(revision, directory):
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-f", directory, revision], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=directory, check=True,
                   capture_output=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", nargs="?")
    parser.add_argument("after", nargs="?")
    parser.add_argument("--rows", default="udp1,udp8,verbs1,verbs8", help=f"of {', '.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--timeout", type=int, default=1800, help="the guest's, seconds")
    parser.add_argument("--time", metavar="BUILD", help=argparse.SUPPRESS)  # in the guest: one build's rows
    parser.add_argument("--guest", nargs=4, metavar=("NAME", "BUILD", "NAME", "BUILD"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    rows = arguments.rows.split(",")
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(ROWS)}")
    if arguments.time:
        print(json.dumps(time_rows(arguments.time, rows)))
        return 0
    if arguments.guest:
        names, paths = arguments.guest[0::2], arguments.guest[1::2]
        take_turns(dict(zip(names, paths)), rows, arguments.rounds)
        return 0
    if not (arguments.before and arguments.after):
        parser.error("name two revisions")
    shared = tempfile.mkdtemp(prefix="rig-ab-", dir="/tmp")  # the guest sees it at the same path
    builds = [os.path.join(shared, "before"), os.path.join(shared, "after")]
    try:
        for revision, directory in zip((arguments.before, arguments.after), builds):
            check_out(revision, directory)
        script = shutil.copy(os.path.abspath(__file__), shared)
        names = (f"before:{arguments.before}", f"after:{arguments.after}")
        command = [sys.executable, "-m", "ud_transport.rig", "run", "--timeout", str(arguments.timeout),
                   "--share", shared, "--cwd", shared, "--", "python3", script, "--rows", arguments.rows,
                   "--rounds", str(arguments.rounds), "--guest", names[0], builds[0], names[1], builds[1]]
        print("$ " + " ".join(command), flush=True)
        return subprocess.run(command, cwd=ROOT).returncode
    finally:
        for directory in builds:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", directory], capture_output=True)
        shutil.rmtree(shared, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
