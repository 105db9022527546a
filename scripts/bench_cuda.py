"""Time the "ud" backend on CUDA tensors (each call's CUDA tensors staged through pinned host
memory, ud_transport.staging) against Gloo's CUDA path and against "ud" on CPU tensors, on one
GPU, all in one run so that every ratio is to peers measured beside it.

Every rank is a local process (ud_transport.lab.local_cluster.LocalCluster) on loopback UDP, and
all of them use the one GPU, cuda:0. Three parts, each optional (--only):

allreduce  A float32 SUM allreduce of --mib MiB, three arms taking turns round by round (the
           order rotating each round, so machine noise and position hit them alike):
             ud_cuda    dist.all_reduce of a CUDA tensor on a "ud" group (the backend's default
                        options, its default loss budget, nothing injected)
             gloo_cuda  the same on a Gloo group
             ud_cpu     dist.all_reduce of a CPU tensor on the same "ud" group: the wire alone
           A call's time is rank 0's wall time of dist.all_reduce(t) and, for a CUDA tensor,
           torch.cuda.synchronize() (so the copy back to the device is in it), started after a
           barrier on another Gloo group (the default one) so that the ranks start together.
           The tensor is refilled (every rank's rank + 1) before the barrier, not timed.
ddp        A DistributedDataParallel step of an MLP on cuda:0 (--layers Linear(--width) layers,
           ddp_step_time.py's model: 16 MiB of float32 parameters at the defaults) over "ud"
           and over Gloo, taking turns step by step; same seed, same batches. A step's time is
           rank 0's forward + backward + optimizer.step() + torch.cuda.synchronize(), after
           the same barrier.
copies     What staging costs alone: on cuda:0, a --mib MiB pinned device-to-host and
           host-to-device copy timed with CUDA events, by rank 0 alone and by every rank at
           once (the ranks' staging shares one PCIe link), and a whole staging round trip
           through ud_transport.staging.Staged without the wire (wall time).

    python3 scripts/bench_cuda.py                                  # 4 ranks, 64 MiB, all parts
    python3 scripts/bench_cuda.py --only allreduce --iterations 200 --json cuda.json
    python3 scripts/bench_cuda.py --device cpu --ranks 2 --mib 1 --iterations 5 --steps 5   # smoke run, no GPU

The issue's targets: ud_cuda / gloo_cuda p50 at most 0.8, ud_cuda / ud_cpu p50 at most 1.2.
A part stops starting rounds after --part-seconds (rank 0's clock, agreed at each round) so a
slow machine still ends within a fixed time: the report then says how many calls it timed.
Progress goes to stderr; the tables to stdout; --json writes every number and where it was
measured (torch, GPU, cores, commit), after each part (a run cut short keeps what it had).

--device cpu is a smoke run for machines without CUDA: the *_cuda arms run on CPU tensors
(the names stay, the report says so) and the copies are host-to-host stand-ins; it checks the
plumbing (ranks, groups, timing, the report), not CUDA. Without CUDA and without --device cpu
the script exits with status 2.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from ddp_step_time import build_model  # noqa: E402 (the same MLP as the CPU DDP measurements)
from ud_transport.lab.local_cluster import LocalCluster, RankFailed  # noqa: E402

PARTS = ("allreduce", "ddp", "copies")
ALLREDUCE_ARMS = ("ud_cuda", "gloo_cuda", "ud_cpu")
DDP_ARMS = ("ud", "gloo")
TARGETS = {"ud_cuda/gloo_cuda": 0.8, "ud_cuda/ud_cpu": 1.2}  # p50 ratios the issue asks for, at most


# ---- on every rank -----------------------------------------------------------------------------

def _start(comm, config, prefix):
    """This rank's torch, on the device asked for, with a default Gloo group under `prefix`:
    returns (torch, dist, the arms' device, settle: waits for the device's queued work)."""
    import torch
    import torch.distributed as dist

    import ud_transport.torch

    ud_transport.torch.register()  # registers "ud" (the import already did; a no-op that keeps the import used)

    # with more ranks than cores, torch's thread per core has each rank wait for threads other
    # ranks hold (exact_calls.py); CPUs / ranks, as the other scripts
    torch.set_num_threads(config["threads"])
    if config["device"] == "cuda":
        torch.cuda.set_device(0)
        device, settle = torch.device("cuda", 0), torch.cuda.synchronize
    else:
        device, settle = torch.device("cpu"), (lambda: None)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, comm.store), rank=comm.rank,
                            world_size=comm.world_size, timeout=_call_timeout(config))
    return torch, dist, device, settle


def _call_timeout(config):
    """The groups' timeout: a collective whose peer failed raises after it instead of waiting out
    c10d's 30 minutes (on "ud" it is how long a call waits for a late rank, not a deadline)."""
    return datetime.timedelta(seconds=config["call_timeout"])


def _keep_going(torch, dist, rank, started, config):
    """Whether to run another round: rank 0's clock against --part-seconds, broadcast so that
    every rank stops at the same round (a collective none of the others joined would hang)."""
    flag = torch.tensor([int(rank != 0 or time.monotonic() - started < config["part_seconds"])], dtype=torch.int32)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _progress(rank, part, done, total, started):
    if rank == 0 and (done == total or done % max(1, total // 10) == 0):
        print(f"# {part}: round {done}/{total}, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def describe(comm, config):
    """On rank 0: the machine the arms run on."""
    import torch

    described = dict(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                     gpu=None, cores=os.cpu_count(), cores_usable=len(os.sched_getaffinity(0)))
    if config["device"] == "cuda":
        torch.cuda.set_device(0)
        described["gpu"] = torch.cuda.get_device_name(0)
    return described


def allreduce_on_rank(comm, config):
    """Every arm's call times (s) on this rank, the least share the "ud" calls delivered, the
    largest error of a result (every rank adds rank + 1) and the "ud" group's stripes."""
    torch, dist, device, settle = _start(comm, config, "cuda-allreduce")
    try:
        count = (config["mib"] << 20) // 4
        ud_group = dist.new_group(backend="ud", timeout=_call_timeout(config))  # the backend's default options
        gloo_group = dist.new_group(backend="gloo", timeout=_call_timeout(config))
        arms = {"ud_cuda": (ud_group, torch.empty(count, device=device)),
                "gloo_cuda": (gloo_group, torch.empty(count, device=device)),
                "ud_cpu": (ud_group, torch.empty(count))}
        expected = comm.world_size * (comm.world_size + 1) / 2
        times = {name: [] for name in arms}
        delivered = {name: 1.0 for name in arms if name.startswith("ud")}
        largest_error = {name: 0.0 for name in arms}
        total, started = config["warmup"] + config["iterations"], time.monotonic()
        for round_index in range(total):
            if not _keep_going(torch, dist, comm.rank, started, config):
                break
            order = ALLREDUCE_ARMS[round_index % 3:] + ALLREDUCE_ARMS[:round_index % 3]
            for name in order:
                group, tensor = arms[name]
                tensor.fill_(comm.rank + 1)
                settle()  # the fill is not the call's
                dist.barrier()  # the default group: Gloo, on its own connections
                start = time.perf_counter()
                dist.all_reduce(tensor, group=group)
                settle()  # the copy back to the device is part of the call
                elapsed = time.perf_counter() - start
                if round_index < config["warmup"]:
                    continue
                times[name].append(elapsed)
                largest_error[name] = max(largest_error[name], float((tensor - expected).abs().max()))
                stats = group.last_stats if name in delivered else None
                if stats is not None:
                    delivered[name] = min(delivered[name], stats.reduce_fraction, stats.gather_fraction)
            _progress(comm.rank, "allreduce", round_index + 1, total, started)
        return dict(times=times, delivered=delivered, largest_error=largest_error, stripes=ud_group.communicator.stripes)
    finally:
        dist.destroy_process_group()


def ddp_on_rank(comm, config):
    """Every arm's step times (s) on this rank and how far its parameters ended from Gloo's."""
    torch, dist, device, settle = _start(comm, config, "cuda-ddp")
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        groups = {backend: dist.new_group(backend=backend, timeout=_call_timeout(config)) for backend in DDP_ARMS}
        arms = {}
        for name, group in groups.items():
            model = DDP(build_model(config).to(device), device_ids=[0] if device.type == "cuda" else None,
                        process_group=group)
            arms[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
        generator = torch.Generator().manual_seed(config["seed"] * 1000 + comm.rank)  # each rank its own batches
        times = {name: [] for name in arms}
        total, started = config["warmup"] + config["steps"], time.monotonic()
        for round_index in range(total):
            if not _keep_going(torch, dist, comm.rank, started, config):
                break
            batch = torch.randn(config["batch"], config["width"], generator=generator).to(device)
            target = torch.randn(config["batch"], 1, generator=generator).to(device)
            order = DDP_ARMS[round_index % 2:] + DDP_ARMS[:round_index % 2]
            for name in order:
                model, optimizer = arms[name]
                settle()
                dist.barrier()
                start = time.perf_counter()
                loss = torch.nn.functional.mse_loss(model(batch), target)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                settle()
                if round_index >= config["warmup"]:
                    times[name].append(time.perf_counter() - start)
            _progress(comm.rank, "ddp", round_index + 1, total, started)
        flat = {name: torch.cat([p.detach().reshape(-1) for p in model.parameters()]) for name, (model, _) in arms.items()}
        drift = float((flat["ud"] - flat["gloo"]).abs().max())
        counts = groups["ud"].counters.to_dict()
        return dict(times=times, drift=drift, stripes=groups["ud"].communicator.stripes,
                    delivered=min(counts["mean_reduce_fraction"], counts["mean_gather_fraction"]))
    finally:
        dist.destroy_process_group()


def copies_on_rank(comm, config):
    """Copy times (ms): rank 0 alone (the others wait at a barrier), then every rank at once."""
    torch, dist, device, settle = _start(comm, config, "cuda-copies")
    try:
        count = (config["mib"] << 20) // 4
        repeats, warmup = config["copy_repeats"], 2
        measured = {}
        if device.type == "cuda":
            on_device = torch.ones(count, device=device)
            pinned = torch.empty(count, pin_memory=True)

            def copy_ms(destination, source):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                destination.copy_(source, non_blocking=True)
                end.record()
                end.synchronize()
                return begin.elapsed_time(end)
            copies = {"device_to_host": lambda: copy_ms(pinned, on_device),
                      "host_to_device": lambda: copy_ms(on_device, pinned)}
        else:  # the smoke run's stand-ins: host to host
            source, destination = torch.ones(count), torch.empty(count)

            def copy_ms(destination, source):
                start = time.perf_counter()
                destination.copy_(source)
                return 1e3 * (time.perf_counter() - start)
            copies = {"device_to_host": lambda: copy_ms(destination, source),
                      "host_to_device": lambda: copy_ms(source, destination)}

        def median_of(run):
            return float(np.median([run() for _ in range(warmup + repeats)][warmup:]))

        settle()
        dist.barrier()
        if comm.rank == 0:
            measured["alone"] = {name: median_of(run) for name, run in copies.items()}
            if device.type == "cuda":
                measured["alone"]["staging_round_trip"] = median_of(lambda: _staging_round_trip(torch, on_device))
        dist.barrier()
        measured["together"] = {}
        for name, run in copies.items():
            dist.barrier()  # every rank copies in the same direction at once
            measured["together"][name] = median_of(run)
        return measured
    finally:
        dist.destroy_process_group()


def _staging_round_trip(torch, tensor):
    """Wall ms of what a "ud" call on `tensor` does besides the wire: its pinned twin taken from
    torch's caching host allocator, the copy there and the host's wait for it, the copy back and
    the device's wait for that."""
    from ud_transport.staging import Staged

    start = time.perf_counter()
    staged = Staged(writes=[tensor])
    staged.landed()
    staged.write_back()
    staged.caller_waits()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


RANK_FUNCTIONS = {"allreduce": allreduce_on_rank, "ddp": ddp_on_rank, "copies": copies_on_rank}


# ---- in the parent: summaries and the report --------------------------------------------------

def spread_ms(seconds):
    values = 1e3 * np.asarray(seconds, dtype=float)
    if values.size == 0:
        return dict(calls=0, p50=None, p90=None, p99=None, mean=None)
    return dict(calls=int(values.size), p50=float(np.percentile(values, 50)), p90=float(np.percentile(values, 90)),
                p99=float(np.percentile(values, 99)), mean=float(values.mean()))


def slowest_rank_p50_ms(per_rank, name):
    """p50 over calls of the slowest rank's time at each call (ddp_step_time.py's measure)."""
    lengths = {len(rank["times"][name]) for rank in per_rank}
    if lengths != {len(per_rank[0]["times"][name])} or not per_rank[0]["times"][name]:
        return None
    return float(1e3 * np.percentile(np.max(np.array([rank["times"][name] for rank in per_rank]), axis=0), 50))


def ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def summarize_allreduce(per_rank, config):
    arms = {}
    for name in ALLREDUCE_ARMS:
        arms[name] = dict(spread_ms(per_rank[0]["times"][name]), slowest_rank_p50=slowest_rank_p50_ms(per_rank, name),
                          delivered=min(rank["delivered"][name] for rank in per_rank) if name.startswith("ud") else None,
                          largest_error=max(rank["largest_error"][name] for rank in per_rank),
                          times_s_per_rank=[rank["times"][name] for rank in per_rank])
    ratios = {"ud_cuda/gloo_cuda": ratio(arms["ud_cuda"]["p50"], arms["gloo_cuda"]["p50"]),
              "ud_cuda/ud_cpu": ratio(arms["ud_cuda"]["p50"], arms["ud_cpu"]["p50"])}
    return dict(arms=arms, ratios_p50=ratios, stripes=per_rank[0]["stripes"])


def summarize_ddp(per_rank, config):
    arms = {name: dict(spread_ms(per_rank[0]["times"][name]), slowest_rank_p50=slowest_rank_p50_ms(per_rank, name),
                       times_s_per_rank=[rank["times"][name] for rank in per_rank]) for name in DDP_ARMS}
    return dict(arms=arms, ratios_p50={"ud/gloo": ratio(arms["ud"]["p50"], arms["gloo"]["p50"])},
                ratios_mean={"ud/gloo": ratio(arms["ud"]["mean"], arms["gloo"]["mean"])},
                largest_parameter_difference=max(rank["drift"] for rank in per_rank),
                delivered=min(rank["delivered"] for rank in per_rank), stripes=per_rank[0]["stripes"],
                parameters=config["layers"] * (config["width"] ** 2 + config["width"]) + config["width"] + 1)


def summarize_copies(per_rank, config):
    nbytes = config["mib"] << 20
    alone = per_rank[0]["alone"]
    together = {name: max(rank["together"][name] for rank in per_rank) for name in per_rank[0]["together"]}
    return dict(bytes=nbytes, alone_ms=alone, together_slowest_rank_ms=together,
                together_ms_per_rank=[rank["together"] for rank in per_rank],
                alone_gb_per_s={name: nbytes / ms / 1e6 for name, ms in alone.items() if name != "staging_round_trip"})


SUMMARIES = {"allreduce": summarize_allreduce, "ddp": summarize_ddp, "copies": summarize_copies}


def _ms(value):
    return "n/a" if value is None else f"{value:.2f}"


def _target_verdict(name, value):
    if value is None:
        return "n/a"
    return f"{value:.3f} (target <= {TARGETS[name]}: {'met' if value <= TARGETS[name] else 'MISSED'})"


def print_allreduce(summary, config):
    print(f"## allreduce: {config['mib']} MiB float32 SUM, {config['ranks']} ranks, {config['iterations']} timed calls "
          f"per arm asked (+{config['warmup']} warm-up), arms taking turns round by round; time = rank 0's wall time of "
          f"dist.all_reduce{' + torch.cuda.synchronize()' if config['device'] == 'cuda' else ''} after a Gloo barrier; "
          f"\"ud\" group: {summary['stripes']} stripe{'s' if summary['stripes'] != 1 else ''}, default options")
    print("| arm | calls | p50 ms | p90 ms | p99 ms | mean ms | slowest rank p50 ms | delivered | largest error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, arm in summary["arms"].items():
        delivered = f"{arm['delivered']:.4f}" if arm["delivered"] is not None else "1 (reliable)"
        print(f"| {name} | {arm['calls']} | {_ms(arm['p50'])} | {_ms(arm['p90'])} | {_ms(arm['p99'])} | {_ms(arm['mean'])} "
              f"| {_ms(arm['slowest_rank_p50'])} | {delivered} | {arm['largest_error']:.1e} |")
    for name, value in summary["ratios_p50"].items():
        print(f"{name} p50: {_target_verdict(name, value)}")
    note_cut_short(summary, config["iterations"], config)


def print_ddp(summary, config):
    print(f"## ddp: MLP {config['layers']}x{config['width']} ({summary['parameters'] / 1e6:.1f} M parameters, "
          f"{summary['parameters'] * 4 / 2**20:.1f} MiB of float32 gradients) on {config['device']}, batch {config['batch']}, "
          f"{config['ranks']} ranks, {config['steps']} timed steps per arm asked (+{config['warmup']} warm-up), taking "
          f"turns; step = rank 0's forward + backward + optimizer.step"
          f"{' + torch.cuda.synchronize()' if config['device'] == 'cuda' else ''} after a Gloo barrier")
    print("| arm | steps | p50 ms | p90 ms | p99 ms | mean ms | slowest rank p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, arm in summary["arms"].items():
        print(f"| {name} | {arm['calls']} | {_ms(arm['p50'])} | {_ms(arm['p90'])} | {_ms(arm['p99'])} | {_ms(arm['mean'])} "
              f"| {_ms(arm['slowest_rank_p50'])} |")
    p50, mean = summary["ratios_p50"]["ud/gloo"], summary["ratios_mean"]["ud/gloo"]
    print(f"ud/gloo step: p50 {'n/a' if p50 is None else f'{p50:.3f}'}, mean {'n/a' if mean is None else f'{mean:.3f}'}; "
          f"\"ud\" delivered {summary['delivered']:.4f} of the gradients ({summary['stripes']} stripe"
          f"{'s' if summary['stripes'] != 1 else ''}); largest parameter "
          f"difference from Gloo at the end {summary['largest_parameter_difference']:.1e}")
    note_cut_short(summary, config["steps"], config)


def note_cut_short(summary, asked, config):
    short = [name for name, arm in summary["arms"].items() if arm["calls"] < asked]
    if short:
        print(f"NOTE: {', '.join(short)} timed fewer than the {asked} asked: the part reached --part-seconds "
              f"({config['part_seconds']:g} s)")


def print_copies(summary, config):
    kind = "pinned host <-> cuda:0, CUDA events" if config["device"] == "cuda" else "host-to-host stand-ins (no CUDA)"
    print(f"## copies: {config['mib']} MiB, {kind}, median of {config['copy_repeats']}")
    print("| copy | rank 0 alone ms | GB/s | every rank at once, slowest ms |")
    print("|---|---|---|---|")
    for name, ms in summary["alone_ms"].items():
        rate = summary["alone_gb_per_s"].get(name)
        print(f"| {name} | {ms:.2f} | {'' if rate is None else f'{rate:.1f}'} | "
              f"{_ms(summary['together_slowest_rank_ms'].get(name))} |")


def print_staging_against_wire(parts, config):
    """What staging costs next to the wire: the two copies of rank 0 alone against ud_cpu's p50,
    and ud_cuda's p50 less ud_cpu's (what staging cost inside the calls)."""
    if "allreduce" not in parts or "copies" not in parts:
        return None
    wire = parts["allreduce"]["arms"]["ud_cpu"]["p50"]
    cuda = parts["allreduce"]["arms"]["ud_cuda"]["p50"]
    alone = parts["copies"]["alone_ms"]
    copies = alone["device_to_host"] + alone["host_to_device"]
    if wire is None or cuda is None:
        return None
    against = dict(copies_ms=copies, copies_share_of_ud_cpu_p50=copies / wire, ud_cuda_minus_ud_cpu_p50_ms=cuda - wire,
                   staging_round_trip_ms=alone.get("staging_round_trip"))
    stand_ins = "" if config["device"] == "cuda" else " (host-to-host stand-ins)"
    print(f"## staging against the wire{stand_ins}: device-to-host + host-to-device {copies:.2f} ms = {copies / wire:.1%} "
          f"of ud_cpu's p50 ({wire:.2f} ms); ud_cuda p50 - ud_cpu p50 = {cuda - wire:+.2f} ms"
          + (f"; a Staged round trip alone {alone['staging_round_trip']:.2f} ms" if "staging_round_trip" in alone else ""))
    return against


PRINTS = {"allreduce": print_allreduce, "ddp": print_ddp, "copies": print_copies}


def commit():
    """UD_COMMIT where the caller names it (the lent machine's copy of the tree carries a stale
    .git: the runs of 2026-11-28 printed the session's first commit there), else git's."""
    if os.environ.get("UD_COMMIT"):
        return os.environ["UD_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def worktree_changed():
    """True where tracked files differ from the commit (the figures are then not the commit's); None if unknown."""
    if os.environ.get("UD_COMMIT"):
        return None  # the stale .git there cannot tell
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                                   text=True, timeout=10, check=True).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None


def cuda_unavailable_reason():
    """None where cuda:0 can be used, else why not."""
    try:
        import torch
    except ImportError as error:
        return f"torch does not import: {error}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.version.cuda = {torch.version.cuda})"
    return None


def write_json(path, results):
    if path:
        with open(path + ".partial", "w") as out:
            json.dump(results, out, indent=1)
        os.replace(path + ".partial", path)


def run_on_ranks(cluster, function, config, timeout_s):
    """cluster.run(function, config), except that the first rank to fail or die ends it: LocalCluster.run
    waits on the ranks in order, so a rank 0 stuck in a collective a failed peer left would be
    waited out to the timeout first."""
    from multiprocessing.connection import wait

    for connection in cluster.connections:
        connection.send((function, (config,)))
    pending, results = dict(enumerate(cluster.connections)), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"ranks {sorted(pending)} did not answer within {timeout_s:.0f} s")
        for rank, connection in list(pending.items()):
            if connection not in ready:
                continue
            try:
                status, value, remote_traceback = connection.recv()
            except EOFError:
                cluster.processes[rank].join(5)  # for its exit code
                raise RuntimeError(f"rank {rank} died (exit code {cluster.processes[rank].exitcode})") from None
            if status == "error":
                raise RankFailed(rank, value, remote_traceback)
            results[rank] = value
            del pending[rank]
    return [results[rank] for rank in range(len(cluster.connections))]


def abandon(cluster):
    """Stop every rank at once: after a part failed, the others may wait in a collective forever,
    and close() would give each 10 s to come out first."""
    for rank in range(cluster.world_size):
        if cluster.processes[rank].is_alive():
            cluster.kill(rank)
    cluster.close()


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (the measurement) or cpu (a smoke run: the *_cuda arms on CPU tensors)")
    parser.add_argument("--mib", type=int, default=64, help="MiB of the allreduce's float32 tensor and of the copies")
    parser.add_argument("--iterations", type=int, default=100, help="timed allreduce calls per arm")
    parser.add_argument("--steps", type=int, default=100, help="timed DDP steps per arm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds before the timed ones, in each part")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width (1024 x 4 layers: 16 MiB of parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default, 0: CPUs / ranks)")
    parser.add_argument("--part-seconds", type=float, default=70.0,
                        help="a part starts no round after this many seconds (a slow machine's run stays bounded)")
    parser.add_argument("--call-timeout", type=float, default=60.0,
                        help="seconds a collective waits for a late rank before it fails (the groups' timeout)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run, comma-separated ({', '.join(PARTS)})")
    parser.add_argument("--json", default="", metavar="PATH", help="write every number and the run's metadata here")
    args = parser.parse_args(argv)
    args.only = [part.strip() for part in args.only.split(",") if part.strip()]
    unknown = set(args.only) - set(PARTS)
    if unknown or not args.only:
        parser.error(f"--only: choose among {', '.join(PARTS)}, got {args.only}")
    if args.ranks < 2:
        parser.error("--ranks must be 2 or more")
    for name in ("mib", "iterations", "steps", "width", "layers", "batch", "copy_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be 1 or more")
    if args.warmup < 0 or args.threads < 0 or args.part_seconds <= 0 or args.call_timeout <= 0:
        parser.error("--warmup and --threads must be 0 or more, --part-seconds and --call-timeout more than 0")
    return args


def main(argv=None):
    args = parse_arguments(argv)
    if args.device == "cuda":
        reason = cuda_unavailable_reason()
        if reason:
            print(f"bench_cuda: no CUDA here: {reason}. Run it on a machine with a GPU, or pass --device cpu for a "
                  f"smoke run of the plumbing.", file=sys.stderr)
            return 2
    config = dict(vars(args), threads=args.threads or max(1, (os.cpu_count() or 1) // args.ranks))
    results = dict(meta=dict(commit=commit(), worktree_changed=worktree_changed(), python=sys.version.split()[0],
                             started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), network="loopback UDP",
                             ud_environment={k: v for k, v in os.environ.items() if k.startswith("UD_")}),
                   config=config, parts={}, errors={})
    began = time.monotonic()
    print(f"# bench_cuda: {args.ranks} ranks, parts {', '.join(args.only)}; starting the ranks", file=sys.stderr, flush=True)
    cluster = None
    try:
        for part in args.only:
            if cluster is None:
                # the cluster's own communicator is not measured: one stripe, as the other scripts
                cluster = LocalCluster(args.ranks, stripes=1, start_timeout_s=120)
                if "gpu" not in results["meta"]:
                    results["meta"].update(cluster.run(describe, config, ranks=[0], timeout_s=120)[0])
                    print(f"# bench_cuda: {args.ranks} ranks on loopback UDP, {results['meta']['cores']} cores, torch "
                          f"{results['meta']['torch']}, " + (f"all on cuda:0 ({results['meta']['gpu']})"
                                                            if args.device == "cuda" else
                                                            "SMOKE RUN on CPU: the *_cuda arms ran on CPU tensors")
                          + f", commit {results['meta']['commit']}" + (" (+ changes)" if results["meta"]["worktree_changed"] else ""),
                          flush=True)
            print(f"# {part}: starting ({time.monotonic() - began:.0f} s in)", file=sys.stderr, flush=True)
            try:
                # the rounds stop after --part-seconds; setting up and a last round fit in the rest, and
                # a collective stuck on a failed peer raises within --call-timeout
                per_rank = run_on_ranks(cluster, RANK_FUNCTIONS[part], config, args.part_seconds + args.call_timeout + 30)
            except Exception as error:  # the next part gets fresh ranks; the report says what failed
                results["errors"][part] = f"{type(error).__name__}: {error}"
                print(f"## {part}: FAILED: {results['errors'][part]}", flush=True)
                abandon(cluster)
                cluster = None
                write_json(args.json, results)
                continue
            results["parts"][part] = SUMMARIES[part](per_rank, config)
            PRINTS[part](results["parts"][part], config)
            sys.stdout.flush()
            write_json(args.json, results)
    finally:
        if cluster is not None:
            cluster.close()
    against = print_staging_against_wire(results["parts"], config)
    if against:
        results["staging_against_wire"] = against
    results["meta"]["seconds"] = time.monotonic() - began
    write_json(args.json, results)
    print(f"# bench_cuda: {results['meta']['seconds']:.0f} s" + (f"; wrote {args.json}" if args.json else ""), flush=True)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
