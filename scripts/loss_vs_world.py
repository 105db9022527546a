"""Delivered fraction against world size, ring vs direct, in real multi-process
runs with seeded loss injected below the engine (every datagram kind).

    python scripts/loss_vs_world.py --worlds 2,4,8,16 --losses 0.01,0.1 --calls 100

Per (world, loss, algorithm): mean and 5th percentile of the agreed reduce
and gather fractions, this rank's delivered fraction, the share of calls that
succeed with loss_budget=0.1, the median call time, and "split": calls on
which ranks disagreed about success (the verdict round makes this 0)."""
import argparse
import json
import sys

import numpy as np

import ud_transport
from ud_transport.lab.local_cluster import LocalCluster


def sweep_rank(comm, algorithms, calls, count, budget):
    rows = {}
    for algorithm in algorithms:
        reduce, gather, delivered, succeeded, seconds = [], [], [], [], []
        for call in range(calls):
            tensor = np.random.default_rng([call, comm.rank]).standard_normal(count).astype(np.float32)
            try:
                stats = comm.allreduce(tensor, loss_budget=budget, deadline=5.0, algorithm=algorithm)
                succeeded.append(True)
            except ud_transport.LossBudgetExceeded as error:
                stats = error.stats
                succeeded.append(False)
            reduce.append(stats.reduce_fraction)
            gather.append(stats.gather_fraction)
            delivered.append(stats.delivered_fraction)
            seconds.append(stats.elapsed_s)
        rows[algorithm] = dict(reduce=reduce, gather=gather, delivered=delivered, succeeded=succeeded, seconds=seconds)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4,8,16")
    parser.add_argument("--losses", default="0.01,0.1")
    parser.add_argument("--algorithms", default="ring,direct")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--count", type=int, default=4096, help="float32 elements per call")
    parser.add_argument("--chunk-bytes", type=int, default=256)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    algorithms = args.algorithms.split(",")
    print(f"# allreduce of {args.count} float32 in {args.chunk_bytes}-byte chunks, {args.calls} calls per cell, "
          f"i.i.d. loss injected below the engine; fractions are means (5th percentile)")
    print(f"{'ranks':>5} {'loss':>5} {'algorithm':>9} {'reduce':>15} {'gather':>15} {'delivered':>15} "
          f"{'ok@' + str(args.budget):>7} {'p50 ms':>7} {'split':>5}")
    out = []
    for loss in [float(v) for v in args.losses.split(",")]:
        for world in [int(v) for v in args.worlds.split(",")]:
            with LocalCluster(world, chunk_bytes=args.chunk_bytes, inject=ud_transport.Bernoulli(loss, seed=world)) as cluster:
                per_rank = cluster.run(sweep_rank, algorithms, args.calls, args.count, args.budget, timeout_s=3600)
            for algorithm in algorithms:
                entries = [rank[algorithm] for rank in per_rank]
                reduce = np.array(entries[0]["reduce"])  # agreed: the same on every rank
                gather = np.array(entries[0]["gather"])
                delivered = np.concatenate([e["delivered"] for e in entries])
                seconds = np.max([e["seconds"] for e in entries], axis=0)
                ok = float(np.mean(entries[0]["succeeded"]))
                disagreements = sum(len(set(outcomes)) > 1 for outcomes in zip(*(e["succeeded"] for e in entries)))
                row = dict(world=world, loss=loss, algorithm=algorithm, reduce_mean=reduce.mean(),
                           reduce_p5=np.percentile(reduce, 5), gather_mean=gather.mean(), gather_p5=np.percentile(gather, 5),
                           delivered_mean=delivered.mean(), delivered_p5=np.percentile(delivered, 5), success=ok,
                           p50_ms=np.median(seconds) * 1e3,
                           disagreements=disagreements)
                out.append(row)
                print(f"{world:>5} {loss:>5.2f} {algorithm:>9} {row['reduce_mean']:>7.3f} ({row['reduce_p5']:.3f}) "
                      f"{row['gather_mean']:>7.3f} ({row['gather_p5']:.3f}) {row['delivered_mean']:>7.3f} ({row['delivered_p5']:.3f}) "
                      f"{ok:>7.2f} {row['p50_ms']:>7.1f} {disagreements:>5}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
