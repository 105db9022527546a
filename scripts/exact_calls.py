"""Time ud_transport's exact broadcast and all-gather (ud_transport.exact: what the "ud" backend
runs for DDP's parameter broadcast, FSDP2's parameter all-gathers, ParameterSync), a ring
shift of messages on a "ud" group (every rank isends its tensor to the next and irecvs the
previous one's: send and recv, as a pipeline moves activations) and all_to_all_single on a
"ud" group (each rank's tensor cut into one piece per rank, as a mixture of experts routes
tokens), the exact int32 allreduce (ud_transport.exact.allreduce: "auto", each of its forms
forced, and through a "ud" group), the exact float32 allreduce ("auto": the engine's one call,
reduced in rank order; and its sharded form), the exact float32 reduce_scatter (the engine's, in
rank order; and the exact allreduce of a copy it falls back to), gather and scatter to and from rank 0 on a "ud" group (one
piece per rank of the tensor) and a barrier on a "ud" group against Gloo's, on the same ranks in
the same run, optionally under real packet loss.

    python3 scripts/exact_calls.py                                   # 2 ranks, loopback, 16 MiB
    python3 scripts/exact_calls.py --kernel-loss 0.01                # 1% of UDP and TCP packets dropped
    python3 scripts/exact_calls.py --hosts veth --mtu 1500 --kernel-loss 0.01 --world-size 4
    python3 scripts/exact_calls.py --world-size 8 --hosts veth --kernel-loss 0.1 --no-gloo   # ud only
    python3 scripts/exact_calls.py --world-size 8 --hosts veth --only all_to_all          # one operation
    python3 scripts/exact_calls.py --world-size 8 --hosts veth --only all_to_all_uneven   # split sizes drawn each call
    python3 scripts/exact_calls.py --world-size 4 --bytes 1M --only allreduce             # the exact allreduce
    python3 scripts/exact_calls.py --world-size 8 --hosts veth --only gather,scatter      # bytes each rank received

Each call starts after a store barrier; its time is its slowest rank's. Each rank runs torch with
CPUs / ranks threads (at least 1; --threads): with more ranks than cores, torch's default of a
thread per core has each rank's parallel copies wait for threads that other ranks' work holds
off the cores (8 ranks on 2 cores: an exact all-gather took twice as long). torchrun sets one
thread per process for the same reason. "calls" is how many calls that carry data one exact
call made on average (1 when nothing was lost; then the repairs; the mask exchanges between
them are not counted; not known for all_to_all, which runs through the group). With --hosts veth
each rank has its own network namespace, and "received" is what its interfaces took in during a
call (the kernel's count, headers included), the most over the ranks other than 0: for gather
and scatter, what a rank that is not the root receives.
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ud_transport.lab.bench import store_barrier  # noqa: E402
from ud_transport.lab.hosts import RankNetwork, run_on_network  # noqa: E402


def received_bytes():
    """Bytes this network namespace's interfaces other than loopback have received (the kernel's
    count, /proc/net/dev): with --hosts veth, this rank's alone."""
    total = 0
    with open("/proc/net/dev") as table:
        for line in table.readlines()[2:]:
            name, counts = line.split(":", 1)
            if name.strip() != "lo":
                total += int(counts.split()[0])
    return total


def timed(comm, config):
    """On every rank: per operation, (seconds, collective calls made) of each exact call."""
    import torch
    import torch.distributed as dist

    import ud_transport.torch  # noqa: F401 (registers "ud")
    from ud_transport import exact

    torch.set_num_threads(config["threads"])
    dist.init_process_group("gloo", store=dist.PrefixStore("exact-gloo", comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    count = config["bytes"] // 4
    n = comm.world_size
    shard = torch.arange(count // n, dtype=torch.float32) + comm.rank
    gathered = torch.empty(count // n * n, dtype=torch.float32)
    tensor = torch.empty(count, dtype=torch.float32)
    message, inbox = torch.full((count,), float(comm.rank)), torch.empty(count, dtype=torch.float32)
    pieces = torch.arange(count // n * n, dtype=torch.float32) // (count // n) + 100 * comm.rank  # piece q: 100 r + q
    routed = torch.empty_like(pieces)
    own = torch.empty(count // n, dtype=torch.float32)  # a scatter's piece
    listed = [torch.empty(count // n, dtype=torch.float32) for _ in range(n)] if comm.rank == 0 else None
    handed = [torch.full((count // n,), float(q)) for q in range(n)] if comm.rank == 0 else None
    integers = torch.empty(count, dtype=torch.int32)  # the exact allreduce's tensor: every rank's r + 1
    floats = torch.empty(count, dtype=torch.float32)  # the same as float32 (sums of small integers are exact)
    scattered = floats[:count // n * n]  # a reduce_scatter's input: Gloo's needs n equal shards
    reduced_shard = torch.empty(count // n, dtype=torch.float32)  # its output, this rank's shard
    fallback_form = exact.form_by_size(scattered.nbytes, n)

    def reduce_scatter_via_allreduce():
        """exact.reduce_scatter's fallback: the exact allreduce of a copy, in the form it takes by size, whose
        shard is kept (before ca993e1, what the backend ran for every exact float reduce_scatter)"""
        whole = scattered.clone()
        calls = len(exact.allreduce(comm, whole, "sum", form=fallback_form))
        reduced_shard.copy_(whole[comm.rank * (count // n):(comm.rank + 1) * (count // n)])
        return calls
    # the uneven all-to-all on a "ud" group of its own: its shapes would reset the even one's guess
    groups = {"ud": dist.new_group(backend="ud"), "gloo": dist.new_group(backend="gloo"),
              "ud uneven": dist.new_group(backend="ud")}
    uneven_case = {}

    def draw_uneven(iteration):
        """An all_to_all_single's split sizes drawn anew each call (as a mixture of experts routes
        tokens): rank p sends rank q from half to 1.5 times the even piece, the same draw on every
        rank (seeded by the call); each piece filled with 100 p + q. Made before the call's clock
        starts; ud and Gloo get the same sizes."""
        base = count // n
        rows = np.random.default_rng(iteration).integers(base // 2, base * 3 // 2 + 1, size=(n, n))
        sends, receives = rows[comm.rank].tolist(), rows[:, comm.rank].tolist()
        uneven_case.update(
            sends=sends, receives=receives,
            source=torch.cat([torch.full((k,), 100.0 * comm.rank + q) for q, k in enumerate(sends)]),
            output=torch.empty(sum(receives), dtype=torch.float32),
            want=torch.cat([torch.full((k,), 100.0 * p + comm.rank) for p, k in enumerate(receives)]))

    def uneven(backend):
        case = uneven_case
        dist.all_to_all_single(case["output"], case["source"], output_split_sizes=case["receives"],
                               input_split_sizes=case["sends"], group=groups["ud uneven" if backend == "ud" else "gloo"])
        return None if backend == "ud" else 1

    def shift(backend):
        channels = getattr(groups[backend], "_channels", None)
        before = channels.calls if channels else 0
        works = [dist.isend(message, (comm.rank + 1) % n, group=groups[backend]),
                 dist.irecv(inbox, (comm.rank - 1) % n, group=groups[backend])]
        for work in works:
            work.wait()
        return (channels.calls - before) / 2 if channels else 1  # calls per message (this rank sent one, received one)
    operations = {
        "ud broadcast": lambda: len(exact.broadcast(comm, tensor, 0)),
        "gloo broadcast": lambda: (dist.broadcast(tensor, 0), 1)[1],
        "ud all_gather": lambda: len(exact.all_gather(comm, shard, gathered)),
        "gloo all_gather": lambda: (dist.all_gather_single(gathered, shard), 1)[1],
        "ud send/recv": lambda: shift("ud"),
        "gloo send/recv": lambda: shift("gloo"),
        "ud all_to_all": lambda: (dist.all_to_all_single(routed, pieces, group=groups["ud"]), None)[1],
        "gloo all_to_all": lambda: (dist.all_to_all_single(routed, pieces, group=groups["gloo"]), 1)[1],
        "ud all_to_all_uneven": lambda: uneven("ud"),
        "gloo all_to_all_uneven": lambda: uneven("gloo"),
        # int32 SUM: exact on "ud" whatever the budget; "auto" picks the form by size and world
        "ud allreduce": lambda: len(exact.allreduce(comm, integers, "sum")),
        "ud allreduce gathered": lambda: len(exact.allreduce(comm, integers, "sum", form="gathered")),
        "ud allreduce sharded": lambda: len(exact.allreduce(comm, integers, "sum", form="sharded")),
        # the same through a "ud" group (c10d, its worker thread): what a training loop calls
        "ud allreduce group": lambda: (dist.all_reduce(integers, group=groups["ud"]), None)[1],
        "gloo allreduce": lambda: (dist.all_reduce(integers), 1)[1],
        # float32 SUM made exact (what a "ud" group with lossy=() runs): "auto" is the engine's one call,
        # reduced in rank order; "sharded" is the exact form it falls back to
        "ud allreduce_float": lambda: len(exact.allreduce(comm, floats, "sum")),
        "ud allreduce_float sharded": lambda: len(exact.allreduce(comm, floats, "sum", form="sharded")),
        "gloo allreduce_float": lambda: (dist.all_reduce(floats), 1)[1],
        # float32 SUM reduce_scatter made exact: the engine's reduce_scatter in rank order, against
        # the exact allreduce of a copy whose shard is kept (the form it falls back to, by size)
        "ud reduce_scatter_float": lambda: len(exact.reduce_scatter(comm, scattered, reduced_shard, "sum")),
        "ud reduce_scatter_float via allreduce": reduce_scatter_via_allreduce,
        "gloo reduce_scatter_float": lambda: (dist.reduce_scatter_tensor(reduced_shard, scattered), 1)[1],
        "ud gather": lambda: (dist.gather(shard, listed, dst=0, group=groups["ud"]), None)[1],
        "gloo gather": lambda: (dist.gather(shard, listed, dst=0, group=groups["gloo"]), 1)[1],
        "ud scatter": lambda: (dist.scatter(own, handed, src=0, group=groups["ud"]), None)[1],
        "gloo scatter": lambda: (dist.scatter(own, handed, src=0, group=groups["gloo"]), 1)[1],
        "ud barrier": lambda: (dist.barrier(group=groups["ud"]), None)[1],
        "gloo barrier": lambda: (dist.barrier(group=groups["gloo"]), 1)[1],
    }
    if config["no_gloo"]:  # Gloo at heavy loss waits out TCP timeouts for seconds a call
        operations = {name: run for name, run in operations.items() if name.startswith("ud ")}
    if config["only"]:
        operations = {name: run for name, run in operations.items() if name.split(" ")[1] in config["only"]}
    if count // n < 4:  # pieces of under 4 elements cannot be drawn uneven around their size
        operations = {name: run for name, run in operations.items() if not name.endswith("all_to_all_uneven")}
    if config["auto_only"]:  # no forced forms: "ud allreduce sharded" and the like have a third word
        operations = {name: run for name, run in operations.items() if len(name.split(" ")) == 2 or name.endswith(" group")}
    results = {name: ([], [], []) for name in operations}
    for iteration in range(config["warmup"] + config["iterations"]):
        for name, run in operations.items():  # taking turns call by call, as the benchmark does
            tensor.fill_(comm.rank)
            inbox.fill_(-1)
            routed.fill_(-1)
            integers.fill_(comm.rank + 1)
            floats.fill_(comm.rank + 1)
            reduced_shard.fill_(-1)
            own.fill_(-1)
            if name.endswith("all_to_all_uneven"):
                draw_uneven(iteration)
            store_barrier(comm.store, comm.rank, n, f"{name}/{iteration}")
            received = received_bytes()
            start = time.perf_counter()
            calls = run()
            elapsed = time.perf_counter() - start
            received = received_bytes() - received
            if name.endswith("broadcast"):
                assert torch.all(tensor == 0), "a broadcast ended with other values than the root's"
            elif name.endswith("all_to_all_uneven"):
                assert torch.equal(uneven_case["output"], uneven_case["want"]), \
                    "an uneven all_to_all ended with other pieces than its senders'"
            elif name.endswith("all_to_all"):
                want = torch.arange(n, dtype=torch.float32).repeat_interleave(count // n) * 100 + comm.rank
                assert torch.equal(routed, want), "an all_to_all ended with other pieces than its senders'"
            elif name.endswith("barrier"):
                pass  # nothing to check but that every rank came through
            elif name.endswith("gather") and not name.endswith("all_gather"):
                assert comm.rank != 0 or all(torch.equal(piece, shard - comm.rank + q) for q, piece in enumerate(listed)), \
                    "a gather ended with other pieces than its senders'"
            elif name.endswith("scatter"):
                assert torch.all(own == comm.rank), "a scatter ended with another piece than the root's for this rank"
            elif "reduce_scatter_float" in name:
                assert torch.all(reduced_shard == n * (n + 1) // 2), "a reduce_scatter ended with another sum"
            elif "allreduce_float" in name:
                assert torch.all(floats == n * (n + 1) // 2), "an allreduce ended with another sum"
            elif "allreduce" in name:
                assert torch.all(integers == n * (n + 1) // 2), "an allreduce ended with another sum"
            elif name.endswith("send/recv"):
                assert torch.all(inbox == (comm.rank - 1) % n), "a message ended with other values than its sender's"
            else:
                assert torch.equal(gathered.view(n, -1)[:, 0], torch.arange(n, dtype=torch.float32)), "an all-gather is wrong"
            if iteration >= config["warmup"]:
                results[name][0].append(elapsed)
                results[name][1].append(calls)
                results[name][2].append(received)
    dist.destroy_process_group()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bytes", type=lambda text: int(float(text.rstrip("M")) * 2**20) if text.endswith("M") else int(text),
                        default=16 << 20, help="bytes of the tensor (16M = 16 MiB)")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hosts", choices=("loopback", "veth"), default="loopback")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--no-gloo", action="store_true", help="time ud_transport's calls only")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default, 0: CPUs / ranks)")
    parser.add_argument("--kernel-loss", type=float, default=0.0, help="share of UDP and TCP packets nftables drops")
    parser.add_argument("--auto-only", action="store_true", help="skip the forms forced for comparison (the exact "
                                                                   "allreduce's gathered and sharded, ...): time what "
                                                                   "an application's call runs")
    parser.add_argument("--only", default="", help="operations to time, comma-separated (broadcast, all_gather, "
                                                   "send/recv, all_to_all, all_to_all_uneven, allreduce, "
                                                   "allreduce_float, "
                                                   "reduce_scatter_float, gather, scatter, barrier; "
                                                   "default: all)")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    unknown = set(only) - {"broadcast", "all_gather", "send/recv", "all_to_all", "all_to_all_uneven", "allreduce",
                           "allreduce_float",
                           "reduce_scatter_float", "gather", "scatter", "barrier"}
    if unknown:
        parser.error(f"--only: unknown operations {sorted(unknown)}")
    if args.threads < 0:
        parser.error(f"--threads must be 0 (CPUs / ranks) or more, got {args.threads}")
    reason = RankNetwork.unavailable_reason(args.hosts, args.kernel_loss)
    if reason:
        print(f"# exact_calls: skipped: {reason}")
        return 0
    config = dict(bytes=args.bytes, iterations=args.iterations, warmup=args.warmup, no_gloo=args.no_gloo, only=only,
                  auto_only=args.auto_only,
                  threads=args.threads or max(1, (os.cpu_count() or 1) // args.world_size))
    per_rank, where = run_on_network(args.world_size, timed, config, hosts=args.hosts, mtu=args.mtu,
                                     kernel_loss=args.kernel_loss, stripes=1)
    print(f"# exact calls, {args.world_size} ranks, {where}, {args.bytes / 2**20:g} MiB float32, {args.iterations} "
          f"calls (+{args.warmup} warm-up) of each, taking turns; time = slowest rank; {config['threads']} torch "
          f"thread{'s' if config['threads'] > 1 else ''} per rank on {os.cpu_count()} CPUs")
    veth = args.hosts == "veth"
    print("| operation | p50 / p99 ms | ud / Gloo p50, p99 | calls per exact call |" + (" received, ranks 1.. (KiB) |" if veth else ""))
    print("|---|---|---|---|" + ("---|" if veth else ""))
    slowest = {name: np.max(np.array([rank[name][0] for rank in per_rank]), axis=0) for name in per_rank[0]}
    for name, times in slowest.items():
        p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
        peer = slowest.get("gloo " + name.split(" ")[1]) if name.startswith("ud ") else None
        ratio = f"{p50 / np.percentile(peer, 50):.2f}x, {p99 / np.percentile(peer, 99):.2f}x" if peer is not None else ""
        known = [calls for calls in per_rank[0][name][1] if calls is not None]
        calls = f"{np.mean(known):.2f}" if name.startswith("ud ") and known else ""
        received = ""
        if veth and len(per_rank) > 1:
            received = f" {np.median(np.max(np.array([rank[name][2] for rank in per_rank[1:]]), axis=0)) / 1024:.0f} |"
        print(f"| {name} | {p50 * 1e3:.1f} / {p99 * 1e3:.1f} | {ratio} | {calls} |{received}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
