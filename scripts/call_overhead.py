"""What a small call spends outside the engine: the Python (and the threads) around each entry
point's engine call, measured two ways, for A/B runs of the layers above the engine (run it once
per build: PYTHONPATH picks the build).

1. Alone: a world of one rank, whose engine sends nothing, calls back to back. What a call takes
   there is the layers around the engine (argument checks, tensor views, the exact layer's masks
   and copies, the stats) and the engine's own fixed cost.
2. Two or more ranks (loopback, or --hosts veth), each call after a store barrier: the call's
   time (the slowest rank's), the engine's own time (``stats.elapsed_s``, the slowest rank's) and
   the difference, with Gloo's time for the same call in the same run. Calls through a "ud" group
   (c10d) return no stats: their time only.

    python3 scripts/call_overhead.py                                 # 4 KiB, 2 ranks on loopback
    python3 scripts/call_overhead.py --bytes 65536 --world-size 4 --hosts veth
    PYTHONPATH=/tmp/before python3 scripts/call_overhead.py          # the same on another build
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


def direct_calls(comm, count):
    """name -> a call of ud_transport's own API that returns its stats (the last, for several)."""
    import torch

    from ud_transport import exact

    floats = torch.ones(count)
    integers = torch.ones(count, dtype=torch.int32)
    message = torch.full((count,), float(comm.rank))
    n = comm.world_size
    pieces = torch.ones(n * count)
    exchanged = torch.empty(count)
    return {
        "agree": lambda: comm._run(_agree_code(), None, None, 0, agree_value=1, loss_budget=0.0, deadline=5.0),
        "allreduce float32 (lossy)": lambda: comm.allreduce(floats.fill_(1.0), loss_budget=0.1),
        "exact.allreduce int32": lambda: exact.allreduce(comm, integers.fill_(1), "sum")[-1],
        "exact.broadcast": lambda: exact.broadcast(comm, message, 0)[-1],
        "exact.gather": lambda: exact.gather(comm, message, pieces if comm.rank == 0 else None, 0)[-1],
        "exact.scatter": lambda: exact.scatter(comm, pieces if comm.rank == 0 else None, message, 0)[-1],
        "exact.all_to_all": lambda: exact.all_to_all(comm, floats, exchanged)[-1],
    }


def _agree_code():
    from ud_transport import _native

    return _native.COLLECTIVE_AGREE


def group_calls(comm, count, backend):
    """name -> a call through a c10d group of `backend` ("ud" or "gloo")."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(backend=backend)
    floats = torch.ones(count)
    integers = torch.ones(count, dtype=torch.int32)
    message, inbox = torch.full((count,), float(comm.rank)), torch.empty(count)
    n = comm.world_size

    def shift():
        works = [dist.isend(message, (comm.rank + 1) % n, group=group),
                 dist.irecv(inbox, (comm.rank - 1) % n, group=group)]
        for work in works:
            work.wait()
    calls = {
        "all_reduce float32": lambda: dist.all_reduce(floats.fill_(1.0), group=group),
        "all_reduce int32": lambda: dist.all_reduce(integers.fill_(1), group=group),
        "broadcast": lambda: dist.broadcast(message, 0, group=group),
        "barrier": lambda: dist.barrier(group=group),
    }
    listed = [torch.empty(count) for _ in range(n)]
    calls["gather"] = lambda: dist.gather(message, listed if comm.rank == 0 else None, dst=0, group=group)
    calls["scatter"] = lambda: dist.scatter(inbox, listed if comm.rank == 0 else None, src=0, group=group)
    if count % n == 0:
        exchanged = torch.empty(count)
        calls["all_to_all_single"] = lambda: dist.all_to_all_single(exchanged, floats, group=group)
    if n > 1:
        calls["send/recv (a ring shift)"] = shift
    return calls


def alone(config):
    """Part 1, in this process: name -> per-call seconds, back to back."""
    import torch
    import torch.distributed as dist

    import ud_transport
    import ud_transport.torch  # noqa: F401 (registers "ud")
    from ud_transport import exact

    torch.set_num_threads(1)
    store = dist.HashStore()
    comm = ud_transport.init(0, 1, store=dist.PrefixStore("api", store))
    dist.init_process_group("gloo", store=dist.PrefixStore("c10d", store), rank=0, world_size=1)
    count = config["bytes"] // 4
    calls = dict(direct_calls(comm, count))
    calls["exact.barrier"] = lambda: exact.barrier(comm)  # returns no stats
    calls.update({f"'ud' group {name}": call for name, call in group_calls(comm, count, "ud").items()})
    times = {}
    for name, call in calls.items():
        for _ in range(config["warmup"]):
            call()
        row = []
        for _ in range(config["alone_iterations"]):
            start = time.perf_counter()
            call()
            row.append(time.perf_counter() - start)
        times[name] = np.array(row)
    dist.destroy_process_group()
    comm.close()
    return times


def together(comm, config):
    """Part 2, on every rank: name -> rows of (seconds, engine seconds or nan)."""
    import torch
    import torch.distributed as dist

    import ud_transport.torch  # noqa: F401 (registers "ud")

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.world_size))
    dist.init_process_group("gloo", store=dist.PrefixStore("overhead-gloo", comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    count = config["bytes"] // 4
    calls = {name: (call, True) for name, call in direct_calls(comm, count).items()}
    for backend in ("ud", "gloo"):
        calls.update({f"{backend} group {name}": (call, False) for name, call in group_calls(comm, count, backend).items()})
    rows = {name: [] for name in calls}
    for iteration in range(config["warmup"] + config["iterations"]):
        for name, (call, has_stats) in calls.items():  # taking turns call by call
            store_barrier(comm.store, comm.rank, comm.world_size, f"{name}/{iteration}")
            start = time.perf_counter()
            result = call()
            elapsed = time.perf_counter() - start
            if iteration >= config["warmup"]:
                rows[name].append((elapsed, result.elapsed_s if has_stats else float("nan")))
    dist.destroy_process_group()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--iterations", type=int, default=300, help="calls of each, part 2")
    parser.add_argument("--alone-iterations", type=int, default=3000, help="calls of each, part 1")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--hosts", choices=("loopback", "veth"), default="loopback")
    parser.add_argument("--mtu", type=int, default=1500)
    args = parser.parse_args()
    config = dict(bytes=args.bytes, iterations=args.iterations, alone_iterations=args.alone_iterations,
                  warmup=args.warmup)
    import ud_transport

    print(f"# call overhead, {args.bytes} bytes, build {os.path.dirname(os.path.abspath(ud_transport.__file__))}")
    print(f"\n## Alone: one rank, {args.alone_iterations} calls of each back to back")
    print("| call | p50 / p99 us |")
    print("|---|---|")
    for name, times in alone(config).items():
        print(f"| {name} | {np.percentile(times, 50) * 1e6:.1f} / {np.percentile(times, 99) * 1e6:.1f} |")

    reason = RankNetwork.unavailable_reason(args.hosts, 0.0)
    if reason:
        print(f"\n# part 2 skipped: {reason}")
        return 0
    per_rank, where = run_on_network(args.world_size, together, config, hosts=args.hosts, mtu=args.mtu, stripes=1)
    print(f"\n## Together: {args.world_size} ranks, {where}, {args.iterations} calls of each (+{args.warmup}), "
          "each after a store barrier; times are the slowest rank's")
    print("| call | p50 / p99 us | engine p50 us | outside the engine p50 us | ud / Gloo p50, p99 |")
    print("|---|---|---|---|---|")
    for name in per_rank[0]:
        table = np.array([rank[name] for rank in per_rank])  # rank, call, (wall, engine)
        wall = table[:, :, 0].max(axis=0)
        p50, p99 = np.percentile(wall, 50), np.percentile(wall, 99)
        engine = outside = ratio = ""
        if not np.isnan(table[:, :, 1]).any():
            engine_time = table[:, :, 1].max(axis=0)
            engine = f"{np.percentile(engine_time, 50) * 1e6:.0f}"
            outside = f"{np.percentile((table[:, :, 0] - table[:, :, 1]).max(axis=0), 50) * 1e6:.0f}"
        if name.startswith("ud group "):
            peer = np.array([rank["gloo group " + name[len("ud group "):]] for rank in per_rank])[:, :, 0].max(axis=0)
            ratio = f"{p50 / np.percentile(peer, 50):.2f}x, {p99 / np.percentile(peer, 99):.2f}x"
        print(f"| {name} | {p50 * 1e6:.0f} / {p99 * 1e6:.0f} | {engine} | {outside} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
