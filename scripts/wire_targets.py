"""Re-measure the wire benchmark's targets (issue 8) in one go and print one table.

Each case runs as `python -m ud_transport bench ... --json FILE`, ud_transport and Gloo taking
turns call by call; every ratio compares figures of the same runs. A case's calls are split over
rounds (--rounds, default 2): every case runs once per round, the cases taking turns, and each
case's rows are computed from the calls of all its rounds pooled. So two cases compared with each
other (the loss-growth check: 1% loss against one in a million) ran interleaved, and a faster or
slower period of the machine falls on both. Needs root (network namespaces, nftables); the bench
itself says it skipped without.

    python3 scripts/wire_targets.py                     # every case, 100 calls each over 2 rounds
    python3 scripts/wire_targets.py --only veth1500,bridge4 --iterations 100
    python3 scripts/wire_targets.py --with-many-ranks   # also 8 and 16 ranks on the bridge (16 MiB)
    python3 scripts/wire_targets.py --stripes 1,2,4     # every case at each UD_STRIPES (where cores are to spare)
    python3 scripts/wire_targets.py --keep DIR          # keep every run's bench JSON (per-call times, engine stats)
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

from ud_transport.lab.bench import summarize

# name: (bench arguments, what is checked, the target)
CASES = {
    "loopback": ("--sizes 64M", "p50", 0.6),
    "veth1500": ("--hosts veth --mtu 1500 --sizes 64M", "p50", 1.0),
    "veth9000": ("--hosts veth --mtu 9000 --sizes 64M", "p50", 0.7),
    "bridge4": ("--hosts veth --mtu 1500 --world-size 4 --sizes 64M", "p50", 1.0),
    "loss_loopback": ("--kernel-loss 0.01 --sizes 64M", "tail", None),
    "loss_veth1500": ("--hosts veth --mtu 1500 --kernel-loss 0.01 --sizes 64M", "tail", None),
    # the same path as loss_veth1500 (bridge, nftables rules on every packet) at a loss of one in a
    # million: what the 1% of loss itself costs each backend, apart from what the rules cost
    "rules_veth1500": ("--hosts veth --mtu 1500 --kernel-loss 0.000001 --sizes 64M", "p50", None),
}
MANY_RANKS = {
    "bridge8": ("--hosts veth --mtu 1500 --world-size 8 --sizes 16M --algorithm auto,ring", "p50", None),
    "bridge16": ("--hosts veth --mtu 1500 --world-size 16 --sizes 16M --algorithm auto,ring", "p50", None),
}
TAIL_OWN, TAIL_GLOO = 1.5, 3.0  # ud p99 <= 1.5x its own p50; Gloo's p99 >= 3x ud's
# ud's p99 at 1% loss over its p99 at one in a million on the same path (loss_veth1500 against
# rules_veth1500): what the loss itself adds to the tail, which Gloo's luck with TCP timeouts
# does not move (docs/performance/wire_targets.md, "What 1% loss costs", says why this is the
# better half of the tail target)
LOSS_TAIL_GROWTH = 1.1


def run_case(name, arguments, iterations, directory, stripes):
    """One bench run; its JSON result (None if it failed or skipped) and the copy time it measured."""
    out = os.path.join(directory, f"{name}.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(out)  # a kept directory may hold an earlier invocation's file, and a skipped bench writes none
    command = [sys.executable, "-m", "ud_transport", "bench", *arguments.split(), "--iterations", str(iterations),
               "--no-progress", "--json", out]
    environment = dict(os.environ, **({"UD_STRIPES": stripes} if stripes else {}))
    print(f"## {name}: {f'UD_STRIPES={stripes} ' if stripes else ''}{' '.join(command[1:])}", flush=True)
    finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    print(finished.stdout, flush=True)
    if finished.returncode != 0 or not os.path.exists(out):
        return None, None
    with open(out) as f:
        result = json.load(f)
    return result, result.get("copy_64mib_ms")


def calls_in_round(iterations, rounds, round_index):
    """A case's calls in one round: `iterations` split over `rounds`, the first rounds taking one more."""
    return iterations // rounds + (round_index < iterations % rounds)


def schedule(cases, stripes_values, rounds):
    """(round, run name, stripes, case) in the order they run: each round runs every case once."""
    return [(round_index, f"{name}/s{stripes}" if len(stripes_values) > 1 else name, stripes, case)
            for round_index in range(rounds) for name, case in cases.items() for stripes in stripes_values]


def pooled_rows(results):
    """The bench's rows over the calls of several runs of one case, as if they had been one run."""
    ranks = len(results[0]["per_rank"])
    merged = []
    for rank in range(ranks):
        entries = []
        for index, first in enumerate(results[0]["per_rank"][rank]["results"]):
            parts = [r["per_rank"][rank]["results"][index] for r in results]
            peaks = [p["peak_extra_kib"] for p in parts]
            entries.append(dict(first, times=[t for p in parts for t in p["times"]],
                                delivered=[d for p in parts for d in p["delivered"]],
                                failure_reasons=[f for p in parts for f in p.get("failure_reasons", [])],
                                engine_stats=[e for p in parts for e in p.get("engine_stats", [])],
                                max_relative_error=max(p["max_relative_error"] for p in parts),
                                rms_relative_error=max(p["rms_relative_error"] for p in parts),
                                failures=sum(p["failures"] for p in parts),
                                peak_extra_kib=None if None in peaks else max(peaks)))
        merged.append(dict(results=entries))
    return summarize(merged, ranks)


def row_of(rows, backend):
    """The row of `backend` among `rows`; None where it has none."""
    return next((r for r in rows if r["backend"] == backend), None)


def p50_over_gloo(rows, backend):
    """A backend's p50 over Gloo's in one set of rows; None where either is missing."""
    mine, gloo = row_of(rows, backend), row_of(rows, "gloo")
    return None if mine is None or gloo is None else mine["p50_ms"] / gloo["p50_ms"]


def verdicts(name, check, target, rows, rounds=()):
    """Table lines for one case's pooled rows; `rounds` (each round's own rows) adds each round's
    p50 ratio beside the pooled one, so the spread between rounds shows."""
    gloo = row_of(rows, "gloo")
    lines = []
    for r in rows:
        if r["backend"] == "gloo" or gloo is None:
            continue
        p50, p99 = r["p50_ms"] / gloo["p50_ms"], r["p99_ms"] / gloo["p99_ms"]
        by_round = [ratio for ratio in (p50_over_gloo(round_rows, r["backend"]) for round_rows in rounds) if ratio is not None]
        spread = f" (p50 by round: {', '.join(f'{ratio:.2f}x' for ratio in by_round)})" if len(by_round) > 1 else ""
        cells = [name, r["backend"], f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}", f"{gloo['p50_ms']:.1f} / {gloo['p99_ms']:.1f}",
                 f"{p50:.2f}x, {p99:.2f}x{spread}", f"{r['delivered_percent']:.3f}"]
        if check == "tail":
            own, gloo_over = r["p99_ms"] / r["p50_ms"], gloo["p99_ms"] / r["p99_ms"]
            met = own <= TAIL_OWN and gloo_over >= TAIL_GLOO
            cells.append(f"ud p99/p50 {own:.2f} (<= {TAIL_OWN}), Gloo p99/ud p99 {gloo_over:.2f} (>= {TAIL_GLOO}): "
                         f"{'met' if met else 'not met'}")
        elif target is not None:
            cells.append(f"p50 <= {target}x: {'met' if p50 <= target else 'not met'}")
        else:
            cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def loss_growth(name, lossy_rows, baseline_rows, rounds=()):
    """One line: each backend's p50 and p99 at 1% loss over the same at one in a million, from the
    pooled rows (the verdict; a ratio of pooled percentiles, not a mean of the rounds' ratios);
    `rounds` (pairs of rows, lossy and baseline, one pair per round) adds each backend's p99 ratio
    round by round, so a reader sees whether the rounds agree."""
    cells = []
    for r in lossy_rows:
        base = row_of(baseline_rows, r["backend"])
        if base is None:
            continue
        p50, p99 = r["p50_ms"] / base["p50_ms"], r["p99_ms"] / base["p99_ms"]
        verdict = "" if r["backend"] == "gloo" else f" (p99 <= {LOSS_TAIL_GROWTH}: {'met' if p99 <= LOSS_TAIL_GROWTH else 'not met'})"
        per_round = []
        for lossy_round, base_round in rounds:
            lossy_row, base_row = row_of(lossy_round, r["backend"]), row_of(base_round, r["backend"])
            if lossy_row and base_row:
                per_round.append(f"{lossy_row['p99_ms'] / base_row['p99_ms']:.2f}x")
        by_round = f" [p99 by round: {', '.join(per_round)}]" if len(per_round) > 1 else ""
        cells.append(f"{r['backend']} p50 {p50:.2f}x, p99 {p99:.2f}x{verdict}{by_round}")
    return f"# {name}, 1% loss over one in a million on the same path, rounds pooled: " + "; ".join(cells)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=100, help="calls per case, over all its rounds")
    parser.add_argument("--rounds", type=int, default=2,
                        help="every case runs this many times, the cases taking turns; its calls are pooled")
    parser.add_argument("--only", default="", help="comma-separated case names: " + ", ".join([*CASES, *MANY_RANKS]))
    parser.add_argument("--with-many-ranks", action="store_true", help="also 8 and 16 ranks on the bridge")
    parser.add_argument("--keep", metavar="DIR", help="keep every run's bench JSON in DIR (default: a temporary directory)")
    parser.add_argument("--stripes", default="",
                        help="comma-separated UD_STRIPES values: each case runs once per value in every round (Gloo in every run); "
                             "unset: as the environment says")
    args = parser.parse_args()
    if not 1 <= args.rounds <= args.iterations:
        parser.error("--rounds must be at least 1 and at most --iterations")
    cases = dict(CASES, **(MANY_RANKS if args.with_many_ranks else {}))
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in CASES and w not in MANY_RANKS]
        if unknown:
            parser.error(f"unknown case(s): {', '.join(unknown)}")
        cases = {w: {**CASES, **MANY_RANKS}[w] for w in wanted}
    table = ["| case | backend | ud p50 / p99 ms | Gloo p50 / p99 ms | ud / Gloo p50, p99 | delivered % | target |",
             "|---|---|---|---|---|---|---|"]
    copies, runs = [], {}
    stripes_values = args.stripes.split(",")
    if len(set(stripes_values)) < len(stripes_values):
        parser.error("--stripes names a value twice")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="wire-targets-")) as directory:
        for round_index, name, stripes, (arguments, _, _) in schedule(cases, stripes_values, args.rounds):
            calls = calls_in_round(args.iterations, args.rounds, round_index)
            result, copy_ms = run_case(f"{name.replace('/', '-')}-r{round_index + 1}", arguments, calls, directory, stripes)
            if copy_ms is not None:
                copies.append(copy_ms)
            runs.setdefault(name, []).append(result)
    results = {}
    for _, name, _, (_, check, target) in schedule(cases, stripes_values, 1):
        done = [r for r in runs[name] if r is not None]
        if len(done) < len(runs[name]):
            table.append(f"| {name} | ({len(runs[name]) - len(done)} of its {len(runs[name])} runs failed or skipped; "
                         "their output is above) | | | | | |")
            continue
        results[name] = pooled_rows(done)
        table.extend(verdicts(name, check, target, results[name], [pooled_rows([run]) for run in done]))
    print("\n".join(table))
    for name in results:
        baseline = name.replace("loss_", "rules_")
        if name.startswith("loss_veth1500") and baseline in results:
            rounds = [(pooled_rows([lossy]), pooled_rows([base])) for lossy, base in zip(runs[name], runs[baseline])]
            print(loss_growth(name, results[name], results[baseline], rounds))
    if copies:
        print(f"# one 64 MiB memory copy took {min(copies):.1f}-{max(copies):.1f} ms on this machine during these runs "
              "(ud_transport makes more passes over memory than Gloo: its ratios depend on it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
