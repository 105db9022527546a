"""The simulator: N real engines in one process on a virtual clock, over an
in-memory network with loss injected below each engine (i.i.d. or
Gilbert-Elliott bursts). Same schedules, accounting and verdict round as real
runs (it steps the engine itself), so its figures cannot drift from them.

    python -m ud_transport simulate --worlds 2,4,8,16,64,256,1024 --losses 0.01,0.1 --calls 5

Per (world, loss, algorithm): the agreed reduce and gather fractions (mean and
5th percentile over calls), the share of calls that meet the budget (the engine's verdict; every
call writes its estimate anyway, write_on_budget_miss, so that every result can be measured),
"split": calls whose ranks reached different statuses,
the critical path in hops, and the bias and spread of the allreduce result
for both hole fills (unbiased: a rank's own partial rescaled; zero_fill):
bias = mean of (result - exact) * exact / RMS(exact)^2, the share by which the
result shrinks (zero fill) or grows; rms err = RMS(result - exact) / RMS(exact).
Inputs: a signal all ranks share plus as much noise of each rank's own. Writes simulation.md, simulation.csv and
simulation.png to --out."""
import csv
import logging
import os
import sys
import time

import numpy as np

from .. import _native
from ..tensors import ESTIMATOR_CODES, estimator_code
from .arguments import ArgumentParser, comma_separated, fraction, integer, one_of

log = logging.getLogger("ud_transport")

ALGORITHM_CODES = {"ring": _native.ALGORITHM_RING, "direct": _native.ALGORITHM_DIRECT}
LOSS_NONE, LOSS_BERNOULLI, LOSS_GILBERT_ELLIOTT = _native.LOSS_NONE, _native.LOSS_BERNOULLI, _native.LOSS_GILBERT_ELLIOTT


def loss_parameters(loss):
    """"0.01" (i.i.d.) or "burst" (Gilbert-Elliott: 80% loss in bursts of ~20 datagrams, ~3% mean)."""
    if loss == "burst":
        return dict(loss_kind=LOSS_GILBERT_ELLIOTT, good_to_bad=0.002, bad_to_good=0.05, loss_in_good=0.0, loss_in_bad=0.8)
    value = float(loss)
    return dict(loss_kind=LOSS_BERNOULLI if value > 0 else LOSS_NONE, loss=value)


def run_cell(world, loss, algorithm, estimator, calls, chunks_per_block, budget, seed):
    """One (world, loss, algorithm, estimator) cell: every rank's rows of every call."""
    chunk_bytes = 64  # 8 float64 per datagram
    count = world * chunks_per_block * (chunk_bytes // 8)
    # every call writes its estimate, missed budget or not (for bias and spread); whether it met
    # `budget` the engine says (stats["budget_missed"])
    return _native.simulate(world, _native.COLLECTIVE_ALLREDUCE, ALGORITHM_CODES[algorithm], count, chunk_bytes, calls,
                            estimator=estimator_code(estimator), loss_budget=budget, write_on_budget_miss=1, seed=seed,
                            **loss_parameters(loss)), count


def summarize(rows, count, world):
    reduce = np.array([call[0][1]["reduce_fraction"] for call in rows])
    gather = np.array([call[0][1]["gather_fraction"] for call in rows])
    statuses = np.array([[rank[0] for rank in call] for call in rows])
    split = int(sum(len(set(s)) > 1 for s in statuses))
    ok = (statuses[:, 0] == 0) & ~np.array([bool(call[0][1]["budget_missed"]) for call in rows])
    errors = [(rank[2], rank[3]) for call in rows for rank in call if rank[0] == 0]
    elements = count * max(len(errors), 1)
    bias = sum(e for e, _ in errors) / elements if errors else float("nan")
    rms = np.sqrt(sum(s for _, s in errors) / elements) if errors else float("nan")
    return dict(reduce_mean=reduce.mean(), reduce_p5=np.percentile(reduce, 5), gather_mean=gather.mean(),
                gather_p5=np.percentile(gather, 5), success=ok.mean(), split=split,
                critical_path=rows[0][0][1]["critical_path"], bias=bias, rms_error=rms)


def plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, title in ((axes[0], "reduce_mean", "contributions at the owner (reduce half)"),
                             (axes[1], "gather_mean", "fresh share of the worst rank (gather half)")):
        for (loss, algorithm), style in zip(sorted({(r["loss"], r["algorithm"]) for r in table}),
                                            ["o-", "s--", "^-", "v--", "D-", "x--"]):
            cells = sorted((r for r in table if r["loss"] == loss and r["algorithm"] == algorithm and r["estimator"] == "unbiased"),
                           key=lambda r: r["world"])
            axis.plot([r["world"] for r in cells], [r[key] for r in cells], style, label=f"{algorithm}, loss {loss}")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("ranks")
        axis.set_ylim(0, 1.02)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle("ud_transport simulator: allreduce under datagram loss (same engine, virtual clock)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def loss_setting(text):
    """type= for one of --losses: a rate in [0, 1), or "burst"; kept as text, the table's label."""
    if text != "burst":
        fraction(one_allowed=False)(text)
    return text


def build_parser():
    parser = ArgumentParser(prog="python -m ud_transport simulate", description=__doc__)
    parser.add_argument("--worlds", type=comma_separated(integer(1)), default="2,4,8,16,32,64,128,256,512,1024",
                        help="comma-separated world sizes")
    parser.add_argument("--losses", type=comma_separated(loss_setting), default="0.01,0.1,burst",
                        help="i.i.d. loss rates, or 'burst' (Gilbert-Elliott)")
    parser.add_argument("--algorithms", type=comma_separated(one_of(tuple(ALGORITHM_CODES))), default="ring,direct")
    parser.add_argument("--estimators", type=comma_separated(one_of(tuple(ESTIMATOR_CODES))), default="unbiased,zero_fill",
                        help="hole fills to measure bias and spread of")
    parser.add_argument("--calls", type=integer(1), default=5, help="calls per cell (each on every rank)")
    parser.add_argument("--chunks-per-block", type=integer(1), default=4)
    parser.add_argument("--budget", type=fraction(), default=0.1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="simulation", help="directory for the table and the plot")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    table = []
    header = (f"{'ranks':>6} {'loss':>6} {'algorithm':>9} {'estimator':>9} {'reduce':>15} {'gather':>15} "
              f"{'ok@' + str(args.budget):>7} {'split':>5} {'hops':>5} {'bias':>9} {'rms err':>8} {'seconds':>8}")
    print(header, flush=True)
    for loss in args.losses:
        for world in args.worlds:
            for algorithm in args.algorithms:
                for estimator in args.estimators:
                    started = time.perf_counter()
                    rows, count = run_cell(world, loss, algorithm, estimator, args.calls, args.chunks_per_block,
                                           args.budget, args.seed)
                    row = dict(world=world, loss=loss, algorithm=algorithm, estimator=estimator,
                               seconds=time.perf_counter() - started, **summarize(rows, count, world))
                    table.append(row)
                    print(f"{world:>6} {loss:>6} {algorithm:>9} {estimator:>9} {row['reduce_mean']:>7.4f} ({row['reduce_p5']:.3f}) "
                          f"{row['gather_mean']:>7.4f} ({row['gather_p5']:.3f}) {row['success']:>7.2f} {row['split']:>5} "
                          f"{row['critical_path']:>5} {row['bias']:>9.4f} {row['rms_error']:>8.3f} {row['seconds']:>8.1f}", flush=True)
    with open(os.path.join(args.out, "simulation.csv"), "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    with open(os.path.join(args.out, "simulation.md"), "w") as out:
        out.write("| " + " | ".join(table[0]) + " |\n|" + "---|" * len(table[0]) + "\n")
        for row in table:
            out.write("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()) + " |\n")
    try:
        plot(table, os.path.join(args.out, "simulation.png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
