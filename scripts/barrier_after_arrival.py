"""How much of a barrier comes after its last rank arrives: the first question of
docs/plans/rooted_verdict.md (its step S0). Each rank stamps its entry into and exit from every
call on the machine's monotonic clock, which every process on one kernel shares (network
namespaces included), so the stamps of different ranks compare. Per call:

- spread: the last rank's entry less the first's (what the store barrier before it left);
- after the last: the last rank's exit less the last rank's entry, the time the call itself
  takes once everyone is in (a barrier's floor is one trip from the last arrival to everyone);
- the first out: the first rank's exit less the last rank's entry.

A `"ud"` group's barrier and Gloo's are timed taking turns call by call, each after a store
barrier, and the engine's own agree (`comm.agree`'s engine call, no torch) beside them; with
--broadcast-bytes B, a broadcast of B bytes from rank 0 on each group too.

    python3 scripts/barrier_after_arrival.py                                 # 2 ranks, loopback
    python3 scripts/barrier_after_arrival.py --world-size 8 --hosts veth --iterations 300
    python3 scripts/barrier_after_arrival.py --world-size 8 --hosts veth --broadcast-bytes 4096
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


def stamped(comm, config):
    """On every rank: name -> rows of (entry ns, exit ns) on CLOCK_MONOTONIC."""
    import torch
    import torch.distributed as dist

    import ud_transport.torch  # noqa: F401 (registers "ud")
    from ud_transport import _native

    # as exact_calls.py: with more ranks than cores, torch's default (a thread per core) has a
    # rank's parallel copies wait for threads that other ranks hold
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.world_size))
    dist.init_process_group("gloo", store=dist.PrefixStore("arrival-gloo", comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    groups = {backend: dist.new_group(backend=backend) for backend in ("ud", "gloo")}
    calls = {
        "engine agree": lambda: comm._run(_native.COLLECTIVE_AGREE, None, None, 0, agree_value=1, loss_budget=0.0,
                                          deadline=10.0),
        "ud group barrier": lambda: dist.barrier(group=groups["ud"]),
        "gloo group barrier": lambda: dist.barrier(group=groups["gloo"]),
    }
    if config["broadcast_bytes"]:
        message = torch.full((config["broadcast_bytes"] // 4,), float(comm.rank))
        for backend in ("ud", "gloo"):
            calls[f"{backend} group broadcast"] = lambda group=groups[backend]: dist.broadcast(message, 0, group=group)
    if config["only"]:
        calls = {name: call for name, call in calls.items() if any(word in name for word in config["only"])}
    rows = {name: [] for name in calls}
    clock = time.CLOCK_MONOTONIC
    for iteration in range(config["warmup"] + config["iterations"]):
        for name, call in calls.items():  # taking turns call by call
            store_barrier(comm.store, comm.rank, comm.world_size, f"{name}/{iteration}")
            entry = time.clock_gettime_ns(clock)
            call()
            leave = time.clock_gettime_ns(clock)
            if iteration >= config["warmup"]:
                rows[name].append((entry, leave))
    dist.destroy_process_group()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--hosts", choices=("loopback", "veth"), default="loopback")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--broadcast-bytes", type=int, default=0, help="also time broadcasts of this many bytes")
    parser.add_argument("--only", default="", help="comma-separated words: time only the calls whose names hold one")
    args = parser.parse_args()
    reason = RankNetwork.unavailable_reason(args.hosts, 0.0)
    if reason:
        print(f"skipped: {reason}")
        return 0
    config = dict(iterations=args.iterations, warmup=args.warmup, broadcast_bytes=args.broadcast_bytes,
                  only=[word for word in args.only.split(",") if word])
    per_rank, where = run_on_network(args.world_size, stamped, config, hosts=args.hosts, mtu=args.mtu, stripes=1)
    print(f"# {args.world_size} ranks, {where}, {args.iterations} calls of each (+{args.warmup}), each after a store barrier")
    print("| call | spread p50 us | after the last p50 / p99 us | the first out p50 us |")
    print("|---|---|---|---|")
    for name in per_rank[0]:
        stamps = np.array([rank[name] for rank in per_rank], dtype=np.int64)  # rank, call, (entry, exit)
        last_in = stamps[:, :, 0].max(axis=0)
        spread = (last_in - stamps[:, :, 0].min(axis=0)) / 1e3
        after = (stamps[:, :, 1].max(axis=0) - last_in) / 1e3
        first_out = (stamps[:, :, 1].min(axis=0) - last_in) / 1e3
        print(f"| {name} | {np.percentile(spread, 50):.0f} | {np.percentile(after, 50):.0f} / "
              f"{np.percentile(after, 99):.0f} | {np.percentile(first_out, 50):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
