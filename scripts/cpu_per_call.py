"""CPU time the whole machine spends per allreduce call, for ud_transport and Gloo, with every rank
in a network namespace of its own (ud_transport.lab.hosts).

Where ranks share cores (4 ranks and a bridge on 2 cores), the run is bound by CPU and the backend
that burns less of it per call wins; wall time alone hides why. For each backend in turn (all of its
calls, then the next backend's), every call starts after a store barrier; rank 0 reads the machine's
busy jiffies (/proc/stat: user, nice, system, irq, softirq) before and after it. Reported per backend: the
median wall time of a call (slowest rank) and the median busy CPU time per call, over all cores.

    python3 scripts/cpu_per_call.py                                 # 4 ranks, bridge, MTU 1500
    python3 scripts/cpu_per_call.py --world-size 2 --mtu 9000 --backends ring,gloo --rounds 3

Needs root (network namespaces).
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from machine_cpu import busy_seconds  # noqa: E402  (a script: its own directory is sys.path[0])
from ud_transport.lab.hosts import Hosts, unavailable_reason  # noqa: E402
from ud_transport.lab.local_cluster import LocalCluster, free_tcp_port  # noqa: E402

def calls(comm, config):
    """On every rank: `iterations` calls of one backend; (wall s, machine busy s) per call."""
    import torch
    import torch.distributed as dist

    from ud_transport.lab.bench import store_barrier

    backend, count, iterations = config
    if backend == "gloo" and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("cpu-gloo", comm.store), rank=comm.rank,
                                world_size=comm.world_size)
    pristine = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
    work = pristine.copy()
    tensor = torch.from_numpy(work)
    measured = []
    for iteration in range(iterations):
        np.copyto(work, pristine)
        store_barrier(comm.store, comm.rank, comm.world_size, f"cpu/{backend}/{iteration}")
        busy, start = busy_seconds(), time.perf_counter()
        if backend == "gloo":
            dist.all_reduce(tensor)
        else:
            comm.allreduce(work, algorithm=backend)
        wall = time.perf_counter() - start
        busy = busy_seconds() - busy
        store_barrier(comm.store, comm.rank, comm.world_size, f"cpu/{backend}/{iteration}/done")
        measured.append((wall, busy))
    return measured


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB (float32)")
    parser.add_argument("--iterations", type=int, default=30, help="calls per backend per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the backends")
    parser.add_argument("--backends", default="direct,ring,gloo", help="ud schedules (auto, ring, direct) and/or gloo")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"# cpu_per_call: skipped: {reason}")
        return 0
    backends = args.backends.split(",")
    count = args.mib * (1 << 20) // 4
    port = free_tcp_port()
    print(f"# {args.world_size} ranks, {'bridge' if args.world_size > 2 else 'veth pair'}, MTU {args.mtu}, "
          f"{args.mib} MiB float32, {args.iterations} calls per backend per round, {os.cpu_count()} cores")
    with Hosts(args.world_size, mtu=args.mtu, switch=args.world_size > 2, exempt_tcp_port=port) as hosts:
        with LocalCluster(args.world_size, store_port=port, hosts=hosts) as cluster:
            for round_index in range(args.rounds):
                for backend in backends:
                    per_rank = cluster.run(calls, (backend, count, args.iterations), timeout_s=3600)
                    wall = np.max([[call[0] for call in rank] for rank in per_rank], axis=0)
                    busy = np.array([call[1] for call in per_rank[0]])
                    print(f"round {round_index + 1} {backend:>7}: wall p50 {np.median(wall) * 1e3:7.1f} ms   "
                          f"machine busy CPU per call p50 {np.median(busy) * 1e3:7.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
