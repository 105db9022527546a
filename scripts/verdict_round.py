"""What the verdict round costs: small allreduces on the engine alone (no torch), and per call the
verdict datagrams each rank sent, the time its verdict round took, and the call's time (the
slowest rank's), with what was relayed and presumed, and how often a rank stayed after its last answer. For A/B runs of the verdict protocol:
run it once per build (PYTHONPATH picks the build) on the same network.

    python3 scripts/verdict_round.py                                   # 2 ranks, loopback
    python3 scripts/verdict_round.py --world-size 8 --hosts veth --kernel-loss 0.01
    PYTHONPATH=/tmp/before python3 scripts/verdict_round.py --world-size 4 --hosts veth

Each call starts after a store barrier. Counts are means over calls and ranks. A call that misses
its budget (a small tensor has few chunks) is counted as one, and timed like the others.
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after PYTHONPATH, so that an A/B build given there wins

from ud_transport.lab.bench import store_barrier  # noqa: E402
from ud_transport.lab.hosts import RankNetwork, run_on_network  # noqa: E402


def timed(comm, config):
    """On every rank, per call: (seconds, verdict datagrams sent, verdict round seconds, relayed, presumed,
    whether the call missed its budget, whether the rank stayed after its last answer)."""
    from ud_transport.errors import LossBudgetExceeded

    tensor = np.empty(config["bytes"] // 4, np.float32)
    rows = []
    for call in range(config["warmup"] + config["iterations"]):
        tensor.fill(comm.rank)
        store_barrier(comm.store, comm.rank, comm.world_size, f"verdict/{call}")
        start = time.perf_counter()
        try:
            stats, missed = comm.allreduce(tensor, loss_budget=config["loss_budget"], deadline=10.0), 0
        except LossBudgetExceeded as error:  # a few chunks a call: one lost is a large share (every rank raises)
            stats, missed = error.stats, 1
        elapsed = time.perf_counter() - start
        if call >= config["warmup"]:
            rows.append((elapsed, stats.agree_messages_sent, stats.agree_s, getattr(stats, "verdicts_relayed", 0),
                         stats.verdict_acks_presumed, missed, stats.answer_waits))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--loss-budget", type=float, default=0.1)
    parser.add_argument("--hosts", choices=("loopback", "veth"), default="loopback")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--kernel-loss", type=float, default=0.0, help="share of UDP and TCP packets nftables drops")
    args = parser.parse_args()
    reason = RankNetwork.unavailable_reason(args.hosts, args.kernel_loss)
    if reason:
        print(f"# verdict_round: skipped: {reason}")
        return 0
    config = dict(bytes=args.bytes, iterations=args.iterations, warmup=args.warmup, loss_budget=args.loss_budget)
    per_rank, where = run_on_network(args.world_size, timed, config, hosts=args.hosts, mtu=args.mtu,
                                     kernel_loss=args.kernel_loss, stripes=1)
    rows = np.array(per_rank, dtype=float)  # rank x call x field
    import ud_transport

    slowest = rows[:, :, 0].max(axis=0)
    print(f"# verdict round, {args.world_size} ranks, {where}, {args.bytes} B allreduces, {args.iterations} calls "
          f"(+{args.warmup} warm-up), build {os.path.dirname(ud_transport.__file__)}")
    print("| call p50 / p99 ms | verdict round p50 / p99 ms | verdict datagrams per rank per call | relayed | presumed | budget missed |")
    print("|---|---|---|---|---|---|")
    agree = rows[:, :, 2].ravel()
    print(f"| {np.percentile(slowest, 50) * 1e3:.3f} / {np.percentile(slowest, 99) * 1e3:.3f} "
          f"| {np.percentile(agree, 50) * 1e3:.3f} / {np.percentile(agree, 99) * 1e3:.3f} "
          f"| {rows[:, :, 1].mean():.2f} | {int(rows[:, :, 3].sum())} | {int(rows[:, :, 4].sum())} | {int(rows[0, :, 5].sum())} "
          f"| {rows[:, :, 6].mean():.0%} of rank-calls |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
