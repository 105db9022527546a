"""Allreduce benchmark: ud_transport beside torch.distributed's Gloo, same
ranks, same sizes, same run, taking turns call by call. Prints an nccl-tests-style table.

    python -m ud_transport bench --world-size 2 --sizes 1M,64M --iterations 50
    python -m ud_transport bench --kernel-loss 0.01      # real nftables loss for both backends
    python -m ud_transport bench --world-size 4 --algorithm ring,direct   # both schedules beside Gloo
    python -m ud_transport bench --hosts veth --mtu 1500   # each rank in its own network namespace (root)

With --hosts veth every rank runs in a network namespace of its own (ud_transport.lab.hosts): two
ranks share one veth pair, more go through a bridge (as does any run with --kernel-loss, whose
drops happen in the bridge); links carry MTU-sized packets. Gloo runs over the same links.
"""
import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from .. import loss_models
from ..sizes import human, parse_size
from .arguments import ArgumentParser, comma_separated, fraction, integer, one_of, positive_number, start_cluster

def rank_input(seed, rank, count, dtype):
    values = np.random.default_rng([seed, rank, count]).standard_normal(count)
    return values.astype(dtype)


def _memory_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_memory():
    """Make VmHWM restart from the current resident size (Linux clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def progress_bar(total, wanted):
    """A tqdm bar on stderr, or None: when not wanted, when stderr is no terminal (a log file
    would fill with redrawn lines), or when tqdm is not installed (it is optional: the
    `progress` extra)."""
    if not wanted or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="allreduce", unit="call", file=sys.stderr, leave=False)


def copy_time_ms(nbytes=64 << 20, repeats=20):
    """Median time of one copy of `nbytes` between two buffers on this machine. ud_transport makes
    more passes over memory per call than Gloo (the originals it saves so that a failed call can
    put them back, or for other calls its scratch and the copy out of it), so its ratio to Gloo
    depends on how fast memory is; printed with every run so ratios from different machines can be
    told apart."""
    source = np.ones(nbytes // 4, dtype=np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def store_barrier(store, rank, world_size, name):
    """Line the ranks up through the store, whose port is exempt from injected
    kernel loss: a barrier over a lossy link would start ranks skewed by TCP
    retransmission timeouts and charge that to the next call."""
    store.set(f"bench-barrier/{name}/{rank}", b"1")
    store.wait([f"bench-barrier/{name}/{r}" for r in range(world_size)])


def run_rank(comm, config):
    """Runs on every rank: time each call of each backend at each size."""
    import torch
    import torch.distributed as dist

    if config["gloo"] and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("bench-gloo", comm.store), rank=comm.rank, world_size=comm.world_size)
    backends = [f"ud-{name}" for name in config["algorithms"]] + (["gloo"] if config["gloo"] else [])
    total = len(backends) * len(config["sizes"]) * (config["iterations"] + config["warmup"])
    bar = progress_bar(total, comm.rank == 0 and config["progress"])
    results = {}
    for nbytes in config["sizes"]:
        dtype = np.dtype(config["dtype"])
        count = max(nbytes // dtype.itemsize, 1)
        pristine = rank_input(config["seed"], comm.rank, count, dtype)
        exact = sum(rank_input(config["seed"], r, count, dtype).astype(np.float64) for r in range(comm.world_size))
        if config["op"] == "mean":
            exact /= comm.world_size
        scale = float(np.max(np.abs(exact))) or 1.0
        exact_mean_square = float(np.mean(exact ** 2))
        # the error of each call is computed in a buffer kept for the whole size: allocating and
        # freeing hundreds of MiB between calls made the next calls of either backend slow here
        # (a VM giving freed memory back to its host), which is the checker's cost, not theirs
        difference = np.empty(count, dtype=np.float64)
        work = np.empty_like(pristine)
        work[:] = 0  # touch it: its pages belong to the caller, not to the backend
        tensor = torch.from_numpy(work)
        state = {backend: dict(times=[], delivered=[], errors=[], rms_errors=[], failures=0, engine=[], reasons=[],
                               extra_kib=0) for backend in backends}
        # Backends take turns call by call, so a busy machine slows them alike and their ratio holds.
        for iteration in range(config["warmup"] + config["iterations"]):
            for backend in backends:
                entry = state[backend]
                np.copyto(work, pristine)
                store_barrier(comm.store, comm.rank, comm.world_size, f"{backend}/{nbytes}/{iteration}")
                resident_kib = _memory_kib("VmRSS")
                peak_known = _reset_peak_memory()
                start = time.perf_counter()
                if backend == "gloo":
                    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if config["op"] == "sum" else dist.ReduceOp.AVG)
                    fraction = 1.0
                else:
                    try:
                        stats = comm.allreduce(work, op=config["op"], loss_budget=config["loss_budget"],
                                               deadline=config["deadline"], algorithm=backend.removeprefix("ud-"))
                        fraction = stats.delivered_fraction
                        if iteration >= config["warmup"]:
                            entry["engine"].append(dataclasses.asdict(stats))
                    except Exception as error:  # a failed call counts, with its time, and keeps the input
                        fraction = 0.0
                        entry["failures"] += 1
                        entry["reasons"].append(f"iteration {iteration}: {type(error).__name__}: {error}")
                elapsed = time.perf_counter() - start
                # check only once every rank is done: on a machine whose ranks share cores, a rank
                # that finished first would otherwise run the checker (hundreds of MiB of float64
                # arithmetic) on the cores the slowest rank still needs for the timed call
                store_barrier(comm.store, comm.rank, comm.world_size, f"{backend}/{nbytes}/{iteration}/done")
                if peak_known and entry["extra_kib"] is not None:  # what the call itself added to the resident size at its peak
                    entry["extra_kib"] = max(entry["extra_kib"], _memory_kib("VmHWM") - resident_kib)
                else:
                    entry["extra_kib"] = None
                if iteration >= config["warmup"]:
                    entry["times"].append(elapsed)
                    entry["delivered"].append(fraction)
                    np.subtract(work, exact, out=difference)
                    np.abs(difference, out=difference)
                    entry["errors"].append(float(difference.max()) / scale)
                    np.square(difference, out=difference)
                    entry["rms_errors"].append(float(np.sqrt(difference.mean() / exact_mean_square)))
                if bar:
                    bar.update(1)
        for backend, entry in state.items():
            results[backend, nbytes] = dict(
                backend=backend, bytes=count * dtype.itemsize, count=count, times=entry["times"],
                delivered=entry["delivered"], max_relative_error=max(entry["errors"]),
                rms_relative_error=max(entry["rms_errors"]), failures=entry["failures"],
                failure_reasons=entry["reasons"], peak_extra_kib=entry["extra_kib"], engine_stats=entry["engine"])
        del pristine, exact, work, tensor, difference
    results = [results[backend, nbytes] for backend in backends for nbytes in config["sizes"]]
    if bar:
        bar.close()
    return dict(results=results, stripes=comm.stripes)


def summarize(per_rank, world_size):
    """Per iteration, the collective took as long as its slowest rank."""
    rows = []
    for index, first in enumerate(per_rank[0]["results"]):
        entries = [rank["results"][index] for rank in per_rank]
        times = np.max(np.array([e["times"] for e in entries]), axis=0)
        p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
        algbw = first["bytes"] / p50 / 1e9
        rows.append(dict(backend=first["backend"], bytes=first["bytes"], count=first["count"], p50_ms=p50 * 1e3,
                         p99_ms=p99 * 1e3, algbw_gbps=algbw, busbw_gbps=algbw * 2 * (world_size - 1) / world_size,
                         delivered_percent=100 * float(np.mean([np.mean(e["delivered"]) for e in entries])),
                         max_relative_error=max(e["max_relative_error"] for e in entries),
                         rms_relative_error=max(e["rms_relative_error"] for e in entries),
                         peak_extra_mib=(max(e["peak_extra_kib"] for e in entries) / 1024
                                         if all(e["peak_extra_kib"] is not None for e in entries) else float("nan")),
                         failures=sum(e["failures"] for e in entries)))
    return rows


def format_table(rows, dtype):
    header = (f"{'size':>8} {'count':>10} {'type':>8} {'backend':>13} {'p50 ms':>9} {'p99 ms':>9} "
              f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'delivered%':>10} {'max rel err':>11} {'rms rel err':>11} "
              f"{'failed':>6} {'+peak MiB':>9}")
    lines = [header]
    for r in rows:
        lines.append(f"{human(r['bytes']):>8} {r['count']:>10} {dtype:>8} {r['backend']:>13} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} "
                     f"{r['algbw_gbps']:>10.3f} {r['busbw_gbps']:>10.3f} {r['delivered_percent']:>10.3f} "
                     f"{r['max_relative_error']:>11.2e} {r['rms_relative_error']:>11.2e} {r['failures']:>6} "
                     f"{r['peak_extra_mib']:>9.0f}")
    return "\n".join(lines)


def ratios_to_gloo(rows):
    """One line per ud_transport row: its p50 and p99 over Gloo's at the same size, same run."""
    gloo = {r["bytes"]: r for r in rows if r["backend"] == "gloo"}
    lines = []
    for r in rows:
        reference = gloo.get(r["bytes"])
        if r["backend"] == "gloo" or reference is None:
            continue
        lines.append(f"# {human(r['bytes'])} {r['backend']} / gloo: p50 {r['p50_ms'] / reference['p50_ms']:.2f}x, "
                     f"p99 {r['p99_ms'] / reference['p99_ms']:.2f}x")
    return lines


def byte_size(text):
    """type= for one of --sizes: "64K", "1M", "4096"."""
    try:
        size = parse_size(text)
    except (ValueError, KeyError, IndexError):
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size (e.g. 4K,1M,64M)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, not {text!r}")
    return size


def burst_parameters(text):
    """type= for --burst: the four rates of a Gilbert-Elliott model, checked by the model itself."""
    rates = comma_separated(fraction())(text)
    if len(rates) != 4:
        raise argparse.ArgumentTypeError(f"wants four rates good_to_bad,bad_to_good,loss_good,loss_bad, not {text!r}")
    try:
        loss_models.GilbertElliott(*rates)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return rates


def build_parser():
    parser = ArgumentParser(prog="python -m ud_transport bench", description=__doc__)
    parser.add_argument("--world-size", type=integer(1), default=2)
    parser.add_argument("--sizes", type=comma_separated(byte_size), default="4K,1M,64M",
                        help="comma-separated byte sizes, e.g. 4K,1M,64M")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "int32"])
    parser.add_argument("--op", default="sum", choices=["sum", "mean"])
    parser.add_argument("--iterations", type=integer(1), default=20)
    parser.add_argument("--warmup", type=integer(0), default=3)
    parser.add_argument("--loss", type=fraction(one_allowed=False), default=0.0,
                        help="injected loss rate (ud_transport only; Gloo cannot lose)")
    parser.add_argument("--loss-model", default="bernoulli", choices=["bernoulli", "gilbert_elliott"],
                        help="gilbert_elliott: bursts with the --burst parameters (then --loss is not used)")
    parser.add_argument("--burst", type=burst_parameters, default="0.002,0.05,0.0,0.8",
                        help="Gilbert-Elliott good_to_bad,bad_to_good,loss_good,loss_bad")
    parser.add_argument("--kernel-loss", type=fraction(one_allowed=False), default=0.0,
                        help="real loss for both backends: nftables drops this share of UDP and TCP packets in a private namespace")
    parser.add_argument("--loss-budget", type=fraction(), default=1.0)
    parser.add_argument("--deadline", type=positive_number, default=None,
                        help="seconds (default: ud_transport's adaptive deadline)")
    parser.add_argument("--chunk-bytes", type=integer(0), default=0, help="payload bytes per datagram; 0: the largest the MTU allows")
    parser.add_argument("--algorithm", type=comma_separated(one_of(("auto", "ring", "direct"))), default="auto",
                        help="comma-separated ud_transport schedules to run side by side: auto, ring, direct")
    parser.add_argument("--hosts", default="loopback", choices=["loopback", "veth"],
                        help="veth: every rank in its own network namespace, joined by veth links (needs root)")
    parser.add_argument("--mtu", type=integer(68, 65535), default=1500,
                        help="MTU of the veth links (1500, or 9000 for jumbo frames)")
    parser.add_argument("--switch", action="store_true", help="with --hosts veth: a bridge even for 2 ranks")
    parser.add_argument("--no-gloo", dest="gloo", action="store_false", help="run ud_transport only")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write all timings here")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (none is drawn off a terminal, nor without tqdm)")
    return parser


def main(argv=None):
    from .hosts import RankNetwork
    from .hosts import unavailable_reason as hosts_unavailable
    from .local_cluster import free_tcp_port

    parser = build_parser()
    args = parser.parse_args(argv)
    config = dict(sizes=args.sizes, dtype=args.dtype, op=args.op,
                  iterations=args.iterations, warmup=args.warmup, loss_budget=args.loss_budget, deadline=args.deadline,
                  gloo=args.gloo, seed=args.seed, progress=args.progress,
                  algorithms=args.algorithm)
    inject = None
    if args.loss_model == "gilbert_elliott":
        inject = loss_models.GilbertElliott(*args.burst, seed=args.seed)
    elif args.loss > 0:
        inject = loss_models.Bernoulli(args.loss, seed=args.seed)
    store_port = free_tcp_port()
    if args.hosts == "veth":
        reason = hosts_unavailable()
        if reason:
            print(f"# ud_transport bench --hosts veth: skipped: {reason}")
            return 0
    with RankNetwork(args.world_size, store_port=store_port, hosts=args.hosts, mtu=args.mtu, kernel_loss=args.kernel_loss,
                     switch=args.switch) as network:
        with start_cluster(parser, args.world_size, store_port=store_port, inject=inject,
                           chunk_bytes=args.chunk_bytes or None, **network.cluster_arguments) as cluster:
            per_rank = cluster.run(run_rank, config, timeout_s=3600)
        hosts, where = network.hosts, network.where
    rows = summarize(per_rank, args.world_size)
    copy_ms = copy_time_ms()
    loss_note = (f"kernel loss {args.kernel_loss:.2%} (nftables, UDP and TCP)" if args.kernel_loss else
                 f"injected {args.loss_model} loss, mean {inject.mean_loss:.2%} (ud_transport only)" if inject else "no loss")
    if hosts and not inject:
        where, loss_note = where.removesuffix(", no loss"), ("no loss" if not args.kernel_loss else "")
    print(f"# ud_transport bench: {args.world_size} ranks on one machine, {where}, {loss_note + ', ' if loss_note else ''}"
          f"{args.iterations} iterations (+{args.warmup} warm-up); time per call = slowest rank; "
          f"{per_rank[0]['stripes']} stripe{'s' if per_rank[0]['stripes'] > 1 else ''} per rank "
          f"(UD_STRIPES={os.environ.get('UD_STRIPES', 'auto')})")
    print(f"# this machine: one 64 MiB memory copy takes {copy_ms:.1f} ms (median of 20)")
    print(format_table(rows, args.dtype))
    for line in ratios_to_gloo(rows):
        print(line)
    for rank, result in enumerate(per_rank):
        for entry in result["results"]:
            for reason in entry["failure_reasons"]:
                print(f"# failed: {entry['backend']} {human(entry['bytes'])} rank {rank} {reason}")
    print("# +peak MiB: the most one call raised a rank's resident memory above what it was just before the call "
          "(the first, warm-up call includes ud_transport's scratch, which it then keeps)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(arguments=vars(args), rows=rows, per_rank=per_rank, copy_64mib_ms=copy_ms), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
