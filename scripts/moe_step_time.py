"""Time a mixture-of-experts training step (expert parallel: one expert per rank) on the "ud"
backend against Gloo.

A step routes each rank's tokens to the experts by a learned gate (top 1), so every
all_to_all_single carries split sizes that change from step to step: first the counts (one
element per pair), then the tokens to their experts, the experts' outputs back, and both again
in backward (torch.distributed.nn.functional.all_to_all_single, which autograd runs backward);
the gate's gradients are all-reduced. Both arms live in the same processes, start from the same
parameters, see the same tokens and take turns step by step (a store barrier lines the ranks up
before each); a step's time is its slowest rank's.

    python3 scripts/moe_step_time.py                                   # 4 ranks, loopback
    python3 scripts/moe_step_time.py --ranks 8 --hosts veth --mtu 1500 # each rank in a namespace (root)
    python3 scripts/moe_step_time.py --hosts veth --kernel-loss 0.01   # 1% of UDP and TCP packets dropped

The all_to_alls of the "ud" arm are exact; the gate's gradients go through the backend's
all_reduce, lossy within its loss budget (0.1 by default). Without loss the arm ends on Gloo's
parameters but for the order of those sums (rank order against Gloo's ring); under loss the
gate's gradient is an unbiased estimate, so the arms part a little more, and a token may go to
another expert.
"""
import argparse
import os
import sys
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ud_transport.lab.bench import store_barrier  # noqa: E402
from ud_transport.lab.hosts import RankNetwork, run_on_network  # noqa: E402


class ExpertLayer:
    """A gate replicated on every rank and this rank's expert (an MLP), with the step's exchanges
    on `group` (None: the default group, Gloo)."""

    def __init__(self, config, rank, group):
        import torch

        torch.manual_seed(config["seed"])
        hidden = config["hidden"]
        self.gate = torch.nn.Linear(hidden, config["ranks"])
        experts = [torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden)) for _ in range(config["ranks"])]
        self.expert = experts[rank]  # the same initial experts on every arm
        self.group = group
        self.parameters = list(self.gate.parameters()) + list(self.expert.parameters())
        self.optimizer = torch.optim.SGD(self.parameters, lr=config["lr"])
        self.routed = 0

    def step(self, tokens, target):
        import torch
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        n = dist.get_world_size(self.group)
        probabilities = torch.softmax(self.gate(tokens), dim=-1)
        weight, expert = probabilities.max(dim=-1)
        order = torch.argsort(expert, stable=True)
        sends = torch.bincount(expert, minlength=n)
        takes = torch.empty_like(sends)
        dist.all_to_all_single(takes, sends, group=self.group)  # the counts: one element per pair
        send_sizes, take_sizes = sends.tolist(), takes.tolist()
        self.routed += sum(take_sizes)
        arrived = all_to_all_single(torch.empty(sum(take_sizes), tokens.shape[1]), tokens[order], take_sizes,
                                    send_sizes, group=self.group)
        processed = self.expert(arrived)
        returned = all_to_all_single(torch.empty(len(tokens), tokens.shape[1]), processed, send_sizes, take_sizes,
                                     group=self.group)
        output = torch.empty_like(returned).index_copy(0, order, returned) * weight[:, None]
        loss = torch.nn.functional.mse_loss(output, target)
        loss.backward()
        for parameter in self.gate.parameters():  # replicated: the mean of every rank's gradient
            dist.all_reduce(parameter.grad, group=self.group)
            parameter.grad /= n
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return float(loss.detach())


def steps(comm, config):
    """On every rank: warm-up and timed steps of both arms in turn."""
    import torch
    import torch.distributed as dist

    import ud_transport.torch as udt

    torch.set_num_threads(config["threads"])
    # its autograd is what this step needs; the functional collectives' one is another API
    warnings.filterwarnings("ignore", message=".*nn.functional.all_to_all_single is deprecated")
    dist.init_process_group("gloo", store=dist.PrefixStore("moe-gloo", comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    arms = {"gloo": ExpertLayer(config, comm.rank, None),
            "ud": ExpertLayer(config, comm.rank, dist.new_group(backend="ud", pg_options=udt.BackendOptions(
                communicator={"stripes": 1})))}
    generator = torch.Generator().manual_seed(config["seed"] * 1000 + comm.rank)
    times = {name: [] for name in arms}
    losses = {name: [] for name in arms}
    for step in range(config["warmup"] + config["steps"]):
        tokens = torch.randn(config["tokens"], config["hidden"], generator=generator)
        target = torch.randn(config["tokens"], config["hidden"], generator=generator)
        for name, layer in arms.items():
            store_barrier(comm.store, comm.rank, comm.world_size, f"moe/{step}/{name}")
            start = time.perf_counter()
            loss = layer.step(tokens, target)
            if step >= config["warmup"]:
                times[name].append(time.perf_counter() - start)
                losses[name].append(loss)
    difference = max(float((a - b).detach().abs().max()) for a, b in zip(arms["ud"].parameters, arms["gloo"].parameters))
    routed = {name: layer.routed for name, layer in arms.items()}
    dist.destroy_process_group()
    return dict(times=times, losses=losses, difference=difference, routed=routed)


def report(per_rank, config, where):
    slowest = {name: np.max(np.array([rank["times"][name] for rank in per_rank]), axis=0) for name in ("gloo", "ud")}
    hidden, n = config["hidden"], config["ranks"]
    print(f"# mixture-of-experts step, {n} ranks, {where}: one expert per rank (MLP {hidden}-{4 * hidden}-{hidden}), "
          f"top-1 gate, {config['tokens']} tokens of {hidden} float32 per rank ({config['tokens'] * hidden * 4 / 2**20:.2f} "
          f"MiB), 5 all_to_all_single (counts, tokens out and back, both again in backward) and the gate's all_reduce "
          f"a step; {config['threads']} torch thread{'s' if config['threads'] > 1 else ''} per rank on {os.cpu_count()} "
          f"CPUs; {config['steps']} steps (+{config['warmup']} warm-up), arms taking turns; time per step = slowest rank")
    print("| arm | step p50 / p99 ms | / Gloo p50, p99 | all steps s (/ Gloo) | final loss (rank 0) |")
    print("|---|---|---|---|---|")
    gloo = slowest["gloo"]
    for name in ("gloo", "ud"):
        times = slowest[name]
        p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
        ratio = "" if name == "gloo" else f"{p50 / np.percentile(gloo, 50):.2f}x, {p99 / np.percentile(gloo, 99):.2f}x"
        total = float(np.sum(times))
        total_ratio = "" if name == "gloo" else f" ({total / float(np.sum(gloo)):.2f}x)"
        print(f"| {name} | {p50 * 1e3:.1f} / {p99 * 1e3:.1f} | {ratio} | {total:.2f}{total_ratio} | "
              f"{per_rank[0]['losses'][name][-1]:.6f} |")
    print(f"\n# largest parameter difference, ud against Gloo, over ranks: "
          f"{max(rank['difference'] for rank in per_rank):.2e}; tokens routed (rank 0): {per_rank[0]['routed']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank a step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: CPUs / ranks)")
    parser.add_argument("--hosts", choices=("loopback", "veth"), default="loopback")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--kernel-loss", type=float, default=0.0, help="share of UDP and TCP packets nftables drops")
    args = parser.parse_args()
    config = dict(vars(args), threads=args.threads or max(1, (os.cpu_count() or 1) // args.ranks))
    reason = RankNetwork.unavailable_reason(args.hosts, args.kernel_loss)
    if reason:
        print(f"# moe_step_time: skipped: {reason}")
        return 0
    per_rank, where = run_on_network(args.ranks, steps, config, hosts=args.hosts, mtu=args.mtu,
                                     kernel_loss=args.kernel_loss, stripes=1)
    report(per_rank, config, where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
