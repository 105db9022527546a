"""Time a DistributedDataParallel training step on the "ud" backend against Gloo, and what the
step costs over the same step with no communication at all (with --fsdp, FSDP2 steps too).

DDP all-reduces each gradient bucket while backward still runs, so a step's time is the compute
plus whatever communication it could not hide. On the "ud" backend a call runs on the group's
worker thread and, with stripes, on that many engine threads: on a machine whose cores the
model's own threads already use, they compete. This measures the step, not the call.

Every arm lives in the same processes and takes turns step by step (machines are noisy): a plain
model with no communication ("compute"), DDP on Gloo (the default process group), and DDP on one
"ud" group per stripe count asked for. Every arm starts from the same parameters and sees the same
batches. A step's time is its slowest rank's (a store barrier lines the ranks up before it).

    python3 scripts/ddp_step_time.py                              # 2 ranks, loopback
    python3 scripts/ddp_step_time.py --stripes 1,auto --threads 4 --steps 100
    python3 scripts/ddp_step_time.py --hosts veth --mtu 1500      # each rank in a namespace (root)
    python3 scripts/ddp_step_time.py --hosts veth --kernel-loss 0.01   # 1% of UDP and TCP packets dropped
    python3 scripts/ddp_step_time.py --fsdp      # also FSDP2 (fully_shard per layer) on Gloo and on "ud"
    python3 scripts/ddp_step_time.py --two-stage # also the two-stage step (LossTolerantOptimizer) on "ud"
    python3 scripts/ddp_step_time.py --two-stage --optimizer adamw --replicate-every 1,10   # + its copies

With --kernel-loss, nftables drops that share of every UDP and TCP packet (the store's port
excepted), so Gloo's TCP retransmits and "ud" estimates; the "ud" arms then end on parameters
near Gloo's rather than equal, and "delivered" is the mean share of the gradients that arrived.
FSDP2 gathers parameters with all-gathers, which the "ud" backend makes exact (ud_transport.exact):
under loss those are what its FSDP arm pays for. The two-stage arm (--two-stage) trains the plain
model with ud_transport.torch.LossTolerantOptimizer over a "ud" group of one stripe (copies
"auto", the default budget): a lossy reduce-scatter of the gradients, the inner SGD step on this
rank's shard, a lossy all-gather of the parameters; its ratios are to DDP on Gloo, and it ends
near Gloo's parameters (another summation order), not on them.

--replicate-every K adds a two-stage arm whose optimizer copies each shard's state to the next
rank every K steps (LossTolerantOptimizer(replicate_every=K)); its step time is also given against
the two-stage arm's, which is the same step without the copies. SGD keeps no state, so that is
measured with --optimizer adamw (every arm then uses AdamW). A refresh runs on a thread of its own
beside the caller's next forward and backward; here each arm's step waits for its refresh, so the
figure is the copy's whole cost, as a machine without a free core pays it (the arms take turns, and
a refresh left running would be timed in the next arm's step instead).
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


def build_model(config):
    import torch

    torch.manual_seed(config["seed"])
    layers = []
    for _ in range(config["layers"]):
        layers += [torch.nn.Linear(config["width"], config["width"]), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(config["width"], 1))


def inner_optimizer(parameters, config):
    import torch

    if config["optimizer"] == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-3)
    return torch.optim.SGD(parameters, lr=1e-3)


def arms_on_rank(comm, config):
    """On every rank: the arms' models; name -> (model, optimizer, stripes, the "ud" group or None)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ud_transport.torch as udt

    dist.init_process_group("gloo", store=dist.PrefixStore("ddp-gloo", comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    arms = {}
    for name in config["arms"]:
        model = build_model(config)
        stripes = None
        if name.startswith("fsdp-"):
            arms[name] = fully_sharded(model, name, torch, dist, udt, config)
            continue
        if name.startswith("two-stage"):
            group = dist.new_group(backend="ud", pg_options=udt.BackendOptions(communicator={"stripes": 1}))
            every = int(name.removeprefix("two-stage+copy/")) if name.startswith("two-stage+copy/") else None
            optimizer = udt.LossTolerantOptimizer(inner_optimizer(model.parameters(), config), communicator=group,
                                                  replicate_every=every)
            arms[name] = (model, optimizer, group.communicator.stripes, optimizer)  # its counters: what arrived
            continue
        if name == "gloo":
            model = DDP(model, process_group=None)
        elif name.startswith("ud-"):
            group = dist.new_group(backend="ud", pg_options=udt.BackendOptions(
                communicator={"stripes": name.removeprefix("ud-") if name == "ud-auto" else int(name.removeprefix("ud-"))}))
            stripes = group.communicator.stripes
            model = DDP(model, process_group=group)
        arms[name] = (model, inner_optimizer(model.parameters(), config), stripes, group if name.startswith("ud-") else None)
    return arms


def fully_sharded(model, name, torch, dist, udt, config):
    """FSDP2 over Gloo (the default group) or over a "ud" group of one stripe: each Linear layer
    sharded, then the whole model."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = None if name == "fsdp-gloo" else dist.new_group(backend="ud", pg_options=udt.BackendOptions(communicator={"stripes": 1}))
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, inner_optimizer(model.parameters(), config), group.communicator.stripes if group else None, group


def steps(comm, config):
    """On every rank: warm-up and timed steps of every arm in turn; per arm, seconds per step."""
    import torch

    torch.set_num_threads(config["threads"])
    arms = arms_on_rank(comm, config)
    generator = torch.Generator().manual_seed(config["seed"] * 1000 + comm.rank)
    times = {name: [] for name in arms}
    for step in range(config["warmup"] + config["steps"]):
        batch = torch.randn(config["batch"], config["width"], generator=generator)
        target = torch.randn(config["batch"], 1, generator=generator)
        for name, (model, optimizer, _, _) in arms.items():
            store_barrier(comm.store, comm.rank, comm.world_size, f"ddp/{step}/{name}")
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(batch), target)
            loss.backward()
            optimizer.step()
            if name.startswith("two-stage+copy/") and optimizer.replica is not None:
                optimizer.replica.wait()  # its refresh, in the step's time: see the docstring
            optimizer.zero_grad(set_to_none=False)
            if step >= config["warmup"]:
                times[name].append(time.perf_counter() - start)
    parameters = {name: torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                                   for p in arm[0].parameters()]) for name, arm in arms.items()}  # FSDP's are sharded
    reference = parameters.get("gloo")
    drift = {name: (float((p - reference).abs().max()) if reference is not None else float("nan")) for name, p in parameters.items()}
    delivered = {}
    for name, arm in arms.items():
        if arm[3] is not None:
            counts = arm[3].counters.to_dict()
            delivered[name] = min(counts["mean_reduce_fraction"], counts["mean_gather_fraction"])
    copies = {name: (arm[1].replica.refreshes, arm[1].replica.failures) for name, arm in arms.items()
              if name.startswith("two-stage+copy/") and arm[1].replica is not None}
    for _, optimizer, _, _ in arms.values():
        if hasattr(optimizer, "close"):
            optimizer.close()  # a LossTolerantOptimizer's replica pairs
    import torch.distributed as dist

    dist.destroy_process_group()
    return dict(times=times, stripes={name: arm[2] for name, arm in arms.items()}, drift=drift, delivered=delivered,
                copies=copies)


def report(per_rank, config, where):
    names = list(per_rank[0]["times"])
    slowest = {name: np.max(np.array([rank["times"][name] for rank in per_rank]), axis=0) for name in names}
    compute_p50 = np.percentile(slowest["compute"], 50) if "compute" in slowest else float("nan")
    gloo = slowest.get("gloo")
    parameters = config["layers"] * (config["width"] ** 2 + config["width"]) + config["width"] + 1
    print(f"# training step, {config['ranks']} ranks, {where}: MLP {config['layers']}x{config['width']} "
          f"({parameters / 1e6:.1f} M parameters, {parameters * 4 / 2**20:.1f} MiB of gradients), batch {config['batch']}, "
          f"{config['threads']} torch thread{'s' if config['threads'] > 1 else ''} per rank on {os.cpu_count()} CPUs; "
          f"{config['steps']} steps (+{config['warmup']} warm-up), arms taking turns; time per step = slowest rank"
          + ("; fsdp-ud's ratios are to fsdp-gloo" if "fsdp-ud" in names else ""))
    print("| arm | stripes | step p50 / p99 ms | over compute p50 ms | / Gloo p50, p99 | delivered | max parameter difference from Gloo "
          "| all steps s (/ Gloo) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        p50, p99 = np.percentile(slowest[name], 50), np.percentile(slowest[name], 99)
        peer = slowest.get("fsdp-gloo") if name == "fsdp-ud" else gloo  # FSDP on "ud" against FSDP on Gloo
        ratio = (f"{p50 / np.percentile(peer, 50):.2f}x, {p99 / np.percentile(peer, 99):.2f}x"
                 if peer is not None and name not in ("gloo", "fsdp-gloo") else "")
        stripes = per_rank[0]["stripes"][name]
        drift = max(rank["drift"][name] for rank in per_rank)
        delivered = (f"{min(rank['delivered'][name] for rank in per_rank):.4f}" if name in per_rank[0]["delivered"]
                     else "1 (reliable)" if name == "gloo" else "")
        total = float(np.sum(slowest[name]))  # what a training run waits for: every step, its tail too
        total_ratio = f" ({total / float(np.sum(peer)):.2f}x)" if peer is not None and name not in ("gloo", "fsdp-gloo") else ""
        print(f"| {name} | {stripes if stripes is not None else ''} | {p50 * 1e3:.1f} / {p99 * 1e3:.1f} | "
              f"{(p50 - compute_p50) * 1e3:+.1f} | {ratio} | {delivered} | {'' if name in ('gloo', 'compute') else f'{drift:.1e}'} "
              f"| {total:.2f}{total_ratio} |")
    copied = [name for name in names if name.startswith("two-stage+copy/")]
    if copied and "two-stage" in slowest:
        base = slowest["two-stage"]
        print(f"\n# the optimizer state's copies ({config['optimizer']}), against the same two-stage step without them")
        print("| arm | step p50 / p99 ms | / two-stage p50, p99 | all steps s (/ two-stage) | refreshes, failed (rank 0) |")
        print("|---|---|---|---|---|")
        for name in copied:
            times = slowest[name]
            refreshes, failures = per_rank[0]["copies"].get(name, (0, 0))
            print(f"| {name} | {np.percentile(times, 50) * 1e3:.1f} / {np.percentile(times, 99) * 1e3:.1f} | "
                  f"{np.percentile(times, 50) / np.percentile(base, 50):.2f}x, {np.percentile(times, 99) / np.percentile(base, 99):.2f}x | "
                  f"{float(np.sum(times)):.2f} ({float(np.sum(times)) / float(np.sum(base)):.2f}x) | {refreshes}, {failures} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stripes", default="1,auto", help="comma-separated stripe counts of the ud arms")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: CPUs / ranks)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hosts", choices=("loopback", "veth"), default="loopback")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--kernel-loss", type=float, default=0.0, help="share of UDP and TCP packets nftables drops")
    parser.add_argument("--fsdp", action="store_true", help="add FSDP2 arms on Gloo and on \"ud\" (1 stripe)")
    parser.add_argument("--two-stage", action="store_true", help="add the two-stage step on \"ud\" (1 stripe)")
    parser.add_argument("--replicate-every", default="",
                        help="comma-separated K: a two-stage arm per K whose shards' state is copied every K steps")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="every arm's optimizer")
    parser.add_argument("--only", default="",
                        help="comma-separated arms to keep beside compute (e.g. gloo, or ud-1): one backend a run, "
                             "for a profiler that sees the whole machine")
    args = parser.parse_args()
    config = dict(vars(args), threads=args.threads or max(1, (os.cpu_count() or 1) // args.ranks),
                  arms=["compute", "gloo"] + [f"ud-{s.strip()}" for s in args.stripes.split(",") if s.strip()]
                  + (["fsdp-gloo", "fsdp-ud"] if args.fsdp else []) + (["two-stage"] if args.two_stage or args.replicate_every else [])
                  + [f"two-stage+copy/{int(k)}" for k in args.replicate_every.split(",") if k.strip()])
    if args.only:
        kept = [arm.strip() for arm in args.only.split(",") if arm.strip()]
        unknown = sorted(set(kept) - set(config["arms"]))
        if unknown:
            parser.error(f"--only: no such arm {', '.join(unknown)} (arms: {', '.join(config['arms'])})")
        config["arms"] = ["compute"] + [arm for arm in config["arms"] if arm in kept and arm != "compute"]
    reason = RankNetwork.unavailable_reason(args.hosts, args.kernel_loss)
    if reason:
        print(f"# ddp_step_time: skipped: {reason}")
        return 0
    per_rank, where = run_on_network(args.ranks, steps, config, hosts=args.hosts, mtu=args.mtu,
                                     kernel_loss=args.kernel_loss, stripes=1)
    report(per_rank, config, where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
