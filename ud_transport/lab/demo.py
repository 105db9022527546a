"""A demo allreduce across local ranks.

Starts N ranks on this machine (UDP over loopback, or verbs when an RDMA
device is active), injects seeded random loss, and shows what each call
delivered and how far the unbiased estimate lands from the exact sum.

    python -m ud_transport demo --world-size 4 --loss 0.1
"""
import sys

import numpy as np

from ..errors import LossBudgetExceeded
from .arguments import ArgumentParser, fraction, integer, start_cluster


def demo_rank(comm, count, calls, loss_budget, algorithm):
    # Like gradients: a signal every rank shares plus noise of its own.
    shared, own = np.random.default_rng(0), np.random.default_rng(comm.rank + 1)
    report = []
    for _ in range(calls):
        values = (shared.standard_normal(count) + 0.3 * own.standard_normal(count)).astype(np.float32)
        original = values.copy()
        try:
            stats, succeeded = comm.allreduce(values, op="mean", loss_budget=loss_budget, algorithm=algorithm), True
        except LossBudgetExceeded as error:  # every rank raises it alike; the tensor keeps its values
            stats, succeeded = error.stats, False
        report.append((original, values, stats, succeeded))
    return report


def build_parser():
    parser = ArgumentParser(prog="python -m ud_transport demo", description=__doc__)
    parser.add_argument("--world-size", type=integer(1), default=4)
    parser.add_argument("--count", type=integer(1), default=1 << 20, help="float32 elements per tensor")
    parser.add_argument("--calls", type=integer(1), default=5)
    parser.add_argument("--loss", type=fraction(one_allowed=False), default=0.1, help="injected datagram loss rate")
    parser.add_argument("--loss-budget", type=fraction(), default=0.1)
    parser.add_argument("--algorithm", default="auto", choices=["auto", "ring", "direct"])
    parser.add_argument("--chunk-bytes", type=integer(0), default=8192,
                        help="payload bytes per datagram; 0: the largest the MTU allows")
    parser.add_argument("--seed", type=int, default=7)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    from .. import Bernoulli

    inject = Bernoulli(args.loss, seed=args.seed) if args.loss > 0 else None
    print(f"ud_transport demo: {args.world_size} ranks, {args.count} float32 elements, mean allreduce, "
          f"{args.loss:.0%} injected datagram loss, chunks of {args.chunk_bytes} bytes")
    with start_cluster(parser, args.world_size, inject=inject, chunk_bytes=args.chunk_bytes) as cluster:
        transport = cluster.run(lambda_transport)[0]
        per_rank = cluster.run(demo_rank, args.count, args.calls, args.loss_budget, args.algorithm)
    print(f"transport: {transport}, algorithm: {per_rank[0][0][2].algorithm}, loss_budget {args.loss_budget}")
    print(f"{'call':>4} {'rank':>4} {'reduce':>7} {'gather':>7} {'delivered':>9} {'lost/total chunks':>18} {'ms':>7} "
          f"{'rms error / rms of exact':>24} outcome")
    for call in range(args.calls):
        exact = np.mean([per_rank[r][call][0].astype(np.float64) for r in range(args.world_size)], axis=0)
        spread = np.sqrt(np.mean(exact ** 2))
        for rank in range(args.world_size):
            _, result, stats, succeeded = per_rank[rank][call]
            rms = np.sqrt(np.mean((result - exact) ** 2))
            print(f"{call:>4} {rank:>4} {stats.reduce_fraction:>7.2%} {stats.gather_fraction:>7.2%} "
                  f"{stats.delivered_fraction:>9.2%} {stats.chunks_lost:>8}/{stats.chunks_total:<9} "
                  f"{stats.elapsed_s * 1e3:>7.1f} {rms / spread:>24.4f} {'ok' if succeeded else 'over budget, tensor kept'}")
    print("reduce: contributions that reached their owners; gather: fresh share of the worst rank's result (both agreed)")
    return 0


def lambda_transport(comm):
    return comm.transport_name


if __name__ == "__main__":
    sys.exit(main())
