"""Train train_under_loss.py's Shakespeare model while a rank dies mid-run, and compare what
the job loses on "ud" (the survivors shrink and go on; a replacement may rejoin) with what it
loses on Gloo (every rank restarts from the last checkpoint):

    python3 scripts/train_through_death.py --ranks 4 --kill-rank 1 --kill-at-step 300 --rejoin-at-step 400

Arms, from the same initial parameters and the same batches (batch b of a step goes to rank b):
  gloo                   data parallel over Gloo, no death (the reference)
  gloo kill+restart      the victim is SIGKILLed before step S; as torchrun's agent does, every
                         rank is stopped and a new job started, which loads the last checkpoint
                         (taken every --checkpoint-every steps) and trains on at the full size
  ud                     the two-stage step (LossTolerantOptimizer) over "ud", no death
  ud kill                the victim dies before step S; the survivors agree on it, shrink the
                         communicator, re-shard the optimizer and go on with one rank fewer
  ud leave               the same rank leaves at step S on purpose, handing its shard of the
                         optimizer state over first (LossTolerantOptimizer.hand_over): the
                         same data as "ud kill", nothing restarted; what "ud kill" loses
                         beyond it is the cost of the dead rank's lost state
  ud kill+rejoin         as "ud kill", and at step T a new process joins (grow) and takes its
                         shard exactly; the rest of the run is at the full size again
  ud kill+copy,          "ud kill" and "ud kill+rejoin" with each shard's optimizer state copied
  ud kill+rejoin+copy    to the next rank every --replicate-every steps (replicate_every): the
                         dead rank's shard takes its state from that copy instead of restarting
The time lost is measured from the kill: on "ud" until the survivors run the failed step again
(regrouped); on Gloo until the restarted job is back at step S.

No loss is injected unless --loss says so: the death is the event."""
import argparse
import json
import os
import signal
import sys
import tempfile
import time

import torch

import train_under_loss as tul
import ud_transport
from ud_transport import options as options_module
from ud_transport.lab.local_cluster import LocalCluster

CLOCK = time.monotonic  # one clock for every process of the machine


def _data(config):
    data = tul.corpus_bytes()
    split = int(len(data) * 0.95)
    return data[:split], data[split:]


def _model(config):
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    model = tul.TinyLM(config["width"], config["layers"], config["heads"], config["context"])
    return model, torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)


def _evaluate(step, config, model, valid_data, curve, is_rank0):
    if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
        if is_rank0:
            curve.append((step + 1, tul.validation_perplexity(model, valid_data, config)))


# -- "ud": the two-stage step, shrink on a death, grow on a rejoin -------------------------

def run_ud(cluster_comm, arm, config):
    """One process of a "ud" arm: a rank of the first group, or (the cluster's last process) the
    spare that joins at the rejoin step. Returns its curve pieces, events and final rank."""
    import torch.distributed as dist

    from ud_transport.torch import LossTolerantOptimizer

    train_data, valid_data = _data(config)
    model, inner = _model(config)
    store = dist.TCPStore("127.0.0.1", config["store_port"], is_master=False)
    ranks, family = config["ranks"], f"{arm['name']}-{config['seed']}".replace(" ", "-")
    options = options_module.build(inject=tul.loss_model(config["loss"], seed=config["seed"] + cluster_comm.rank))
    make = dict(loss_budget=1.0, deadline=config["deadline"], copies=1,
                replicate_every=config["replicate_every"] if arm.get("copy") else None)
    events = []
    if cluster_comm.rank == ranks:  # the spare
        if not arm.get("rejoin"):
            return None
        comm = ud_transport.Communicator.join(store, family, options=options, timeout_s=7200)
        optimizer = LossTolerantOptimizer(inner, communicator=comm, join=True, **make)
        events.append({"event": "joined", "step": config["rejoin_at"]})
        step = config["rejoin_at"]
    else:
        comm = ud_transport.Communicator(cluster_comm.rank, ranks, store, "udp", options, name=family)
        optimizer = LossTolerantOptimizer(inner, communicator=comm, **make)
        step = 0
    curve, started, original = [], time.perf_counter(), cluster_comm.rank
    while step < config["steps"]:
        if arm.get("kill") and step == config["kill_at"] and original == config["kill_rank"]:
            store.set(f"{family}/killed", repr(CLOCK()))
            os.kill(os.getpid(), signal.SIGKILL)
        if arm.get("leave") and step == config["kill_at"] and comm.world_size == ranks:
            begun = CLOCK()
            optimizer.hand_over()  # every rank, the leaver too: its state is kept
            if original == config["kill_rank"]:
                comm.close()
                return None
            shrunk = comm.shrink([config["kill_rank"]])
            comm.close()
            comm = shrunk
            optimizer.regroup(comm)
            events.append({"event": "leave", "step": step, "seconds": CLOCK() - begun,
                           "restarted_elements": optimizer.restarted_elements})
        if arm.get("rejoin") and step == config["rejoin_at"] and original != ranks and comm.world_size < ranks:
            begun = CLOCK()
            grown = comm.grow(1)
            comm.close()
            comm = grown
            optimizer.regroup(comm)
            events.append({"event": "rejoin", "step": step, "seconds": CLOCK() - begun})
        tokens, targets = tul.batch(train_data, step, comm.rank, config["batch"], config["context"], config["seed"])
        tul.loss_of(model, tokens, targets).backward()
        try:
            optimizer.step()
        except ud_transport.PeerTimeout as error:
            caught = CLOCK()
            shrunk = comm.shrink([error.rank])
            comm.close()
            comm = shrunk
            optimizer.regroup(comm)
            optimizer.zero_grad()
            killed = float(store.get(f"{family}/killed").decode())
            events.append({"event": "kill", "step": step, "error_after_s": caught - killed,
                           "resumed_after_s": CLOCK() - killed, "restarted_elements": optimizer.restarted_elements,
                           "copied_elements": optimizer.copied_elements})
            if not optimizer.shards_stepped:
                continue  # the step again, on the survivors
            # the owners had stepped (the parameters' all-gather failed): the step stands
        optimizer.zero_grad()
        _evaluate(step, config, model, valid_data, curve, comm.rank == 0)
        step += 1
    optimizer.close()  # the replica's pairs, after its last refresh
    comm.close()
    return {"curve": curve, "events": events, "rank": comm.rank, "wall_s": time.perf_counter() - started}


# -- Gloo: a death ends the job; a new one resumes from the last checkpoint ----------------

def run_gloo(cluster_comm, arm, config, resume):
    import torch.distributed as dist

    train_data, valid_data = _data(config)
    model, optimizer = _model(config)
    parameters = list(model.parameters())
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gloo-{arm['name']}-{resume}", cluster_comm.store),
                            rank=cluster_comm.rank, world_size=cluster_comm.world_size)
    step, curve, events = 0, [], []
    if resume:
        saved = torch.load(config["checkpoint"], weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, curve = saved["step"], [tuple(point) for point in saved["curve"]]
        resumed_from = step
    try:
        while step < config["steps"]:
            if resume and step == config["kill_at"] and not events:
                events.append({"event": "back", "step": step, "at": CLOCK(), "resumed_from": resumed_from})
            if arm.get("kill") and not resume and step == config["kill_at"] and cluster_comm.rank == config["kill_rank"]:
                _wait_for_checkpoint(config, step)
                with open(config["kill_note"], "w") as note:
                    note.write(repr(CLOCK()))
                os.kill(os.getpid(), signal.SIGKILL)
            tokens, targets = tul.batch(train_data, step, cluster_comm.rank, config["batch"], config["context"],
                                        config["seed"])
            tul.loss_of(model, tokens, targets).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in parameters])
            dist.all_reduce(flat)
            flat /= cluster_comm.world_size
            offset = 0
            for p in parameters:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
            optimizer.zero_grad()
            _evaluate(step, config, model, valid_data, curve, cluster_comm.rank == 0)
            step += 1
            if arm.get("kill") and step % config["checkpoint_every"] == 0 and cluster_comm.rank == 0:
                partial = config["checkpoint"] + ".partial"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "curve": curve}, partial)
                os.replace(partial, config["checkpoint"])  # a death mid-save leaves the last whole one
                with open(config["checkpoint"] + ".step", "w") as note:
                    note.write(str(step))
    finally:
        dist.destroy_process_group()
    return {"curve": curve, "events": events, "rank": cluster_comm.rank}


def _wait_for_checkpoint(config, step):
    """A kill at a checkpoint's step comes after the checkpoint is written (Gloo's best case: no
    step is redone); elsewhere the steps since the last one are (half an interval on average)."""
    if step % config["checkpoint_every"]:
        return
    note = config["checkpoint"] + ".step"
    for _ in range(6000):
        if os.path.exists(note) and open(note).read() == str(step):
            return
        time.sleep(0.01)


def run_until_a_death(cluster, function, *arguments, expect_death=False):
    """Run function on every rank; return (results, None), or, where `expect_death`, as soon as a
    rank's process dies or a rank fails (as torchrun's agent notices either), (None, the moment
    it was seen)."""
    for connection in cluster.connections:
        connection.send((function, arguments))
    results = {}
    while len(results) < cluster.world_size:
        for rank, connection in enumerate(cluster.connections):
            if rank not in results and connection.poll(0.02):
                try:
                    status, value, remote = connection.recv()
                except EOFError:  # its process is gone
                    return None, CLOCK()
                if status == "error" and expect_death:
                    return None, CLOCK()
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{remote}")
                results[rank] = value
        if any(not process.is_alive() for process in cluster.processes):
            return None, CLOCK()
    return [results[rank] for rank in range(cluster.world_size)], None


def gloo_arm(arm, config, workdir):
    config = {**config, "checkpoint": os.path.join(workdir, "checkpoint.pt"), "kill_note": os.path.join(workdir, "killed")}
    started = time.perf_counter()
    cluster = LocalCluster(config["ranks"])
    results = None
    try:
        results, seen = run_until_a_death(cluster, run_gloo, arm, config, False, expect_death=arm.get("kill", False))
    finally:
        if results is None:  # as torchrun's agent does: stop every rank at once
            for process in cluster.processes:
                process.kill()
        cluster.close()
    if results is None:  # the job restarts, every rank, from the last checkpoint
        with LocalCluster(config["ranks"]) as cluster:
            results, _ = run_until_a_death(cluster, run_gloo, arm, config, True)
        killed = float(open(config["kill_note"]).read())
        [back] = [e for e in results[0]["events"] if e["event"] == "back"]
        events = [{"event": "kill", "step": config["kill_at"], "seen_after_s": seen - killed,
                   "resumed_after_s": back["at"] - killed, "steps_redone": config["kill_at"] - back["resumed_from"]}]
    else:
        events = []
    return {"curve": results[0]["curve"], "events": events, "wall_s": time.perf_counter() - started}


def ud_arm(arm, config):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # outlives every rank
    config = {**config, "store_port": server.port}
    started = time.perf_counter()
    world = config["ranks"] + 1  # the last process is the spare that may rejoin
    victim = config["kill_rank"] if arm.get("kill") else None
    with LocalCluster(world) as cluster:
        others = [rank for rank in range(world) if rank != victim]
        if victim is not None:
            cluster.connections[victim].send((run_ud, (arm, config)))
        per_rank = [r for r in cluster.run(run_ud, arm, config, ranks=others, timeout_s=7200) if r is not None]
    curve = sorted({point for r in per_rank for point in r["curve"]})
    events = [e for r in per_rank for e in r["events"]]
    kills = [e for e in events if e["event"] == "kill"]
    merged = []
    if kills:
        merged.append({"event": "kill", "step": kills[0]["step"],
                       "error_after_s": max(e["error_after_s"] for e in kills),
                       "resumed_after_s": max(e["resumed_after_s"] for e in kills),
                       "restarted_elements": sum(e["restarted_elements"] for e in kills),
                       "copied_elements": sum(e["copied_elements"] for e in kills)})
    leaves = [e for e in events if e["event"] == "leave"]
    if leaves:
        merged.append({"event": "leave", "step": leaves[0]["step"], "seconds": max(e["seconds"] for e in leaves),
                       "restarted_elements": sum(e["restarted_elements"] for e in leaves)})
    rejoins = [e for e in events if e["event"] == "rejoin"]
    if rejoins:
        merged.append({"event": "rejoin", "step": rejoins[0]["step"], "seconds": max(e["seconds"] for e in rejoins)})
    return {"curve": curve, "events": merged, "wall_s": time.perf_counter() - started}


def arms_for(args):
    arms = [dict(name="gloo", method="gloo"), dict(name="gloo kill+restart", method="gloo", kill=True),
            dict(name="ud", method="ud"), dict(name="ud kill", method="ud", kill=True),
            dict(name="ud leave", method="ud", leave=True), dict(name="ud kill+copy", method="ud", kill=True, copy=True)]
    if args.rejoin_at_step is not None:
        arms.append(dict(name="ud kill+rejoin", method="ud", kill=True, rejoin=True))
        arms.append(dict(name="ud kill+rejoin+copy", method="ud", kill=True, rejoin=True, copy=True))
    return arms


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int, default=300)
    parser.add_argument("--rejoin-at-step", type=int, default=None, help="a new process joins here (after the kill)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="Gloo's checkpoints, in steps")
    parser.add_argument("--loss", default="0", help="loss injected on 'ud' (as train_under_loss.py's arms take it)")
    parser.add_argument("--replicate-every", type=int, default=1, help="the '+copy' arms' replicate_every, in steps")
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds per ud call")
    parser.add_argument("--quick", action="store_true", help="the small model and steps the tests run")
    parser.add_argument("--arms", default="", help="comma-separated arm names (default: all)")
    parser.add_argument("--json", default="")
    parser.add_argument("--plot", default="")
    parser.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                        help="print the table across seeds from saved --json results, train nothing")
    args = parser.parse_args()
    if args.summarize:
        summarize([json.load(open(path)) for path in args.summarize])
        return
    if not 0 < args.kill_rank < args.ranks or not 0 < args.kill_at_step < args.steps:
        parser.error("--kill-rank must be a rank other than 0 (rank 0 reports the curve) and --kill-at-step inside "
                     "the run")
    if args.rejoin_at_step is not None and not args.kill_at_step < args.rejoin_at_step < args.steps:
        parser.error("--rejoin-at-step must come after the kill and before the end")
    config = dict(width=128, layers=2, heads=4, context=64, batch=16, lr=2e-3, steps=args.steps, eval_every=50,
                  eval_batches=16, seed=args.seed, deadline=args.deadline, ranks=args.ranks, kill_rank=args.kill_rank,
                  kill_at=args.kill_at_step, rejoin_at=args.rejoin_at_step, checkpoint_every=args.checkpoint_every,
                  loss=args.loss, replicate_every=args.replicate_every)
    if args.quick:
        config.update(width=64, layers=1, context=32, batch=8, eval_every=10, eval_batches=8)
    arms = arms_for(args)
    if args.arms:
        wanted = {a.strip() for a in args.arms.split(",")}
        arms = [a for a in arms if a["name"] in wanted]
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for arm in arms:
            result = gloo_arm(arm, config, workdir) if arm["method"] == "gloo" else ud_arm(arm, config)
            results[arm["name"]] = {**result, "arm": arm}
            print(f"{arm['name']:>18}: perplexity {result['curve'][-1][1]:.3f} {result['events']}", file=sys.stderr,
                  flush=True)
    print_table(results, config)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "results": results}, f)
    if args.plot:
        plot(results, config, args.plot)


def print_table(results, config):
    print(f"\n{config['ranks']} ranks, {config['steps']} steps, seed {config['seed']}, rank {config['kill_rank']} "
          f"killed before step {config['kill_at']}" + (f", a new one joins at step {config['rejoin_at']}"
                                                       if config["rejoin_at"] is not None else "") + "\n")
    print("| arm | final perplexity | vs the same method without a death | seconds from the kill to training again |")
    print("|---|---|---|---|")
    for name, r in results.items():
        ppl = r["curve"][-1][1]
        reference = results.get(r["arm"]["method"])
        versus = f"{100 * (ppl / reference['curve'][-1][1] - 1):+.2f}%" if reference and reference is not r else ""
        kill = next((e for e in r["events"] if e["event"] == "kill"), None)
        lost = f"{kill['resumed_after_s']:.2f}" if kill else ""
        print(f"| {name} | {ppl:.3f} | {versus} | {lost} |")


# what each arm is compared with: (the arm, its reference, what the difference is)
COMPARISONS = [("ud kill", "ud leave", "the dead rank's lost optimizer state (same data: the rank leaves either way)"),
               ("ud kill", "ud", "the death, all told (one rank's data fewer after it)"),
               ("ud leave", "ud", "the reduced data alone"),
               ("ud kill+copy", "ud leave", "what the copy leaves of the lost state (same data)"),
               ("ud kill+rejoin", "ud", "a death at S and a rejoin at T"),
               ("ud kill+rejoin+copy", "ud", "a death at S and a rejoin at T, the dead shard's state from its copy"),
               ("gloo kill+restart", "gloo", "a restart from the checkpoint")]


def summarize(saved):
    """Final perplexity of each comparison, seed by seed, and the seconds from the kill to training."""
    seeds = [s["config"]["seed"] for s in saved]
    config = saved[0]["config"]
    print(f"{config['ranks']} ranks, {config['steps']} steps, rank {config['kill_rank']} killed before step "
          f"{config['kill_at']}, rejoin at {config['rejoin_at']}, seeds {seeds}\n")
    print("| arm | against | what the difference is | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean |")
    print("|---|---|---|" + "---|" * (len(seeds) + 1))
    for arm, reference, meaning in COMPARISONS:
        if not all(arm in s["results"] and reference in s["results"] for s in saved):
            continue
        gaps = [100 * (s["results"][arm]["curve"][-1][1] / s["results"][reference]["curve"][-1][1] - 1) for s in saved]
        print(f"| {arm} | {reference} | {meaning} | " + " | ".join(f"{gap:+.2f}%" for gap in gaps)
              + f" | **{sum(gaps) / len(gaps):+.2f}%** |")
    print("\n| arm | seconds from the kill to training again, by seed |")
    print("|---|---|")
    for arm in ("ud kill", "ud kill+copy", "ud kill+rejoin", "ud kill+rejoin+copy", "gloo kill+restart"):
        seconds = [next((e["resumed_after_s"] for e in s["results"].get(arm, {}).get("events", [])
                         if e["event"] == "kill"), None) for s in saved]
        if any(x is not None for x in seconds):
            print(f"| {arm} | " + ", ".join("-" if x is None else f"{x:.2f}" for x in seconds) + " |")


def plot(results, config, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        steps, ppl = zip(*r["curve"])
        axis.plot(steps, ppl, label=name, linestyle="-" if r["arm"]["method"] == "ud" else "--")
    axis.axvline(config["kill_at"], color="red", linestyle=":", label=f"rank {config['kill_rank']} killed")
    if config["rejoin_at"] is not None:
        axis.axvline(config["rejoin_at"], color="green", linestyle=":", label="a new rank joins")
    axis.set(xlabel="step", ylabel="validation perplexity", yscale="log",
             title=f"{config['ranks']} ranks, a rank killed at step {config['kill_at']}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
