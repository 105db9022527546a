"""Rank functions for tests/test_elastic.py: the two-stage step (LossTolerantOptimizer) over a
Communicator loses a rank (SIGKILL), the survivors shrink the communicator and re-shard the
optimizer over themselves, and a replacement process joins them later (Communicator.join /
grow) and takes its shard's state exactly.

Every communicator here meets through the test's TCPStore (shrink_tasks.store), which outlives
every rank, under the family the test names."""
import os
import signal

import torch

import ud_transport
from ud_transport import exact
from ud_transport import options as options_module
from ud_transport.torch import LossTolerantOptimizer

from shrink_tasks import store

DEADLINE = 5.0


def _communicator(rank, world_size, port, family):
    return ud_transport.Communicator(rank, world_size, store(port), "udp", options_module.build(deadline_cap_s=DEADLINE),
                                     name=family)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _batches(seed, steps):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 16, generator=generator), torch.randn(12, 8, generator=generator)) for _ in range(steps)]


def _optimizer(model, comm, join=False, replicate_every=None):
    # two groups with different settings: re-sharding must keep each piece's own
    groups = [{"params": list(model[0].parameters()), "lr": 0.01},
              {"params": list(model[2].parameters()), "lr": 0.02, "weight_decay": 0.0}]
    return LossTolerantOptimizer(torch.optim.AdamW(groups), communicator=comm, loss_budget=0.1, join=join,
                                 replicate_every=replicate_every)


def shard_state(opt):
    """What this rank owns: [(start, stop, lr, {state name: value}), ...] in absolute positions."""
    start = opt.shard[0]
    held = []
    for (param, low, high, _), group in zip(opt._pieces, opt.param_groups):
        state = {name: (value.clone() if torch.is_tensor(value) else value)
                 for name, value in opt._inner.state.get(param, {}).items()}
        held.append((start + low, start + high, group["lr"], state))
    return held


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(model, opt, batches, steps, first_step=0, die_at=None, will=None):
    """Steps [first_step, steps); returns (the step a PeerTimeout came at or None, the error, last loss).
    `will`: a path where a rank that dies at `die_at` leaves its shard_state() first, after the
    copy of it that its last step started (replicate_every) has reached the next rank."""
    loss = None
    for step in range(first_step, steps):
        if step == die_at:
            if opt.replica is not None:
                opt.replica.wait()
            if will:
                torch.save(shard_state(opt), will)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches[step]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        try:
            opt.step()
        except ud_transport.PeerTimeout as error:
            return step, error, loss.item()
    return None, None, loss.item()


def die_shrink_rejoin(cluster_comm, port, family, world_size, victim, kill_at, rejoin_at, steps):
    """Ranks 0..world_size-1 train; `victim` dies at `kill_at`; the survivors shrink and regroup,
    train to `rejoin_at`, then grow by one; the cluster's last rank (not in the first group) joins
    there as the replacement, and all train to `steps`.

    Returns what each rank saw: on a survivor the error, its shard before and after each move, and
    parameters; on the newcomer the same from its join on."""
    rank = cluster_comm.rank
    model = _model()
    if rank == world_size:  # the replacement: joins when the group next grows
        comm = ud_transport.Communicator.join(store(port), family,
                                              options=options_module.build(deadline_cap_s=DEADLINE), timeout_s=120)
        opt = _optimizer(model, comm, join=True)
        joined = {"rank": comm.rank, "world_size": comm.world_size, "state": shard_state(opt), "flat": _flat(model),
                  "restarted": opt.restarted_elements}
        batches = _batches(100 + comm.rank, steps)
        _, error, loss = _train(model, opt, batches, steps, first_step=rejoin_at)
        comm.close()
        return {"joined": joined, "error": repr(error) if error else None, "flat": _flat(model), "loss": loss}
    comm = _communicator(rank, world_size, port, family)
    opt = _optimizer(model, comm)
    batches = _batches(100 + rank, steps)
    failed_at, error, first_loss = _train(model, opt, batches, rejoin_at, die_at=kill_at if rank == victim else None)
    before_shrink = shard_state(opt)
    shrunk = comm.shrink([error.rank])
    comm.close()
    opt.regroup(shrunk)
    after_shrink = {"rank": shrunk.rank, "state": shard_state(opt), "restarted": opt.restarted_elements,
                    "flat": _flat(model)}
    batches = _batches(100 + shrunk.rank, steps)
    # the failed step again, unless the owners had stepped (the parameters' all-gather failed)
    _, late_error, _ = _train(model, opt, batches, rejoin_at, first_step=failed_at + opt.shards_stepped)
    before_grow = shard_state(opt)
    grown = shrunk.grow(1)
    shrunk.close()
    opt.regroup(grown)
    after_grow = {"rank": grown.rank, "world_size": grown.world_size, "state": shard_state(opt),
                  "restarted": opt.restarted_elements, "flat": _flat(model)}
    batches = _batches(100 + grown.rank, steps)
    _, last_error, loss = _train(model, opt, batches, steps, first_step=rejoin_at)
    grown.close()
    return {"failed_at": failed_at, "error": (type(error).__name__, error.rank, str(error)),
            "late_errors": (repr(late_error) if late_error else None, repr(last_error) if last_error else None), "before_shrink": before_shrink, "after_shrink": after_shrink,
            "before_grow": before_grow, "after_grow": after_grow, "flat": _flat(model), "first_loss": first_loss,
            "loss": loss}


def ddp_shrink_rejoin(cluster_comm, port, tag, world_size, victim, kill_at, rejoin_at, steps):
    """docs/elastic.md's recipe on the default "ud" group with DDP and AdamW: `victim` dies before
    step `kill_at`, the survivors shrink_group and re-wrap; at `rejoin_at` they grow_group(1) and
    the cluster's last rank joins (join_group), takes rank 0's optimizer state
    (broadcast_object_list) and DDP's broadcast of the parameters, and all train to `steps`.

    Returns (the step the error came at, its outcome, parameters and optimizer state right after
    the join, parameters at the end)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ud_transport.torch as udt
    from shrink_tasks import outcome_of

    rank = cluster_comm.rank
    newcomer = rank == world_size
    torch.manual_seed(1 if newcomer else 0)  # the newcomer starts elsewhere: the join must bring it in line
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    job_store = dist.PrefixStore(tag, store(port))
    options = udt.BackendOptions(deadline=DEADLINE)
    timeout = datetime.timedelta(seconds=30)
    failed_at, outcome, joined = None, None, None

    def batch(step):
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)

    def take_in():  # every rank of the grown group, the newcomer too
        state = [optimizer.state_dict() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(state, src=0)
        optimizer.load_state_dict(state[0])
        model = DDP(module)  # broadcasts rank 0's parameters
        return model, {"flat": _flat(module), "state": optimizer.state_dict()["state"], "rank": dist.get_rank(),
                       "size": dist.get_world_size()}

    if newcomer:
        udt.join_group(job_store, timeout=timeout, pg_options=options, wait_s=120)
        model, joined = take_in()
        step = rejoin_at
    else:
        dist.init_process_group("ud", store=job_store, rank=rank, world_size=world_size, timeout=timeout,
                                pg_options=options)
        model = DDP(module)
        step = 0
    try:
        while step < steps:
            if step == kill_at and dist.get_rank() == victim and not newcomer and failed_at is None:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == rejoin_at and joined is None:
                udt.grow_group(1)
                model, joined = take_in()
            x, y = batch(step)
            optimizer.zero_grad()
            try:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            except RuntimeError:
                cause = dist.group.WORLD.last_error
                if not isinstance(cause, ud_transport.PeerTimeout):
                    raise
                failed_at, outcome = step, outcome_of(cause)
                group = dist.shrink_group([cause.rank], shrink_flags=c10d.SHRINK_ABORT)
                model = DDP(module, process_group=group)
                continue
            optimizer.step()
            step += 1
        return failed_at, outcome, joined, _flat(module)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def paused_past_the_deadline(cluster_comm, port, family, pause_s):
    """3 ranks on a Communicator: each enters a 64 MiB float allreduce (deadline DEADLINE), rank 2
    last, and rank 2 is stopped (SIGSTOP, by a process of its own) 50 ms into it for `pause_s`,
    then continued: a rank that is slow, not dead. Then every rank makes an exact int32 sum and a
    lossy one on the same communicator.

    Returns (the failed call's outcome, whether its tensor kept its values, the sums, world size)."""
    import subprocess
    import time

    from shrink_tasks import BIG, JOIN_AFTER_S, outcome_of

    rank = cluster_comm.rank
    comm = _communicator(rank, 3, port, family)
    tensor = torch.full((BIG,), float(rank + 1))
    original = tensor.clone()
    if rank == 2:
        time.sleep(JOIN_AFTER_S)
        subprocess.Popen(["sh", "-c", f"sleep 0.05; kill -STOP {os.getpid()}; sleep {pause_s}; kill -CONT {os.getpid()}"])
    try:
        comm.allreduce(tensor, loss_budget=0.1, deadline=DEADLINE)
        error = None
    except ud_transport.TransportError as caught:
        error = caught
    unchanged = bool(torch.equal(tensor, original)) if error is not None else None
    exact = torch.full((1000,), rank + 1, dtype=torch.int32)
    from ud_transport import exact as exact_layer

    exact_layer.allreduce(comm, exact, deadline=DEADLINE)
    lossy = torch.full((1000,), float(rank + 1))
    comm.allreduce(lossy, loss_budget=0.1, deadline=DEADLINE)
    comm.close()
    return outcome_of(error), unchanged, (exact[0].item(), lossy.tolist() == [6.0] * 1000), comm.world_size


def hook_shrink(cluster_comm, port, tag, world_size, victim, kill_at, steps):
    """docs/elastic.md's recipe for the DDP comm hook: DDP on Gloo, gradients over a Communicator
    (LossyHookState). `victim` dies before step `kill_at`; the survivors' state.step() raises the
    agreed PeerTimeout; they shrink the Communicator, make Gloo's default group again over
    themselves (Gloo cannot shrink), re-wrap and train to `steps`.

    Returns (the step the error came at, its outcome, the ranks after, parameters at the end)."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shrink_tasks import outcome_of
    from ud_transport.torch import LossyHookState, lossy_allreduce_hook

    rank = cluster_comm.rank
    job_store = dist.PrefixStore(tag, store(port))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    comm = _communicator(rank, world_size, port, tag)
    timeout = datetime.timedelta(seconds=30)

    def wrapped(comm):  # Gloo's default group over comm's ranks, DDP on it, the hook over comm
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gloo-{comm.session_id:016x}", job_store),
                                rank=comm.rank, world_size=comm.world_size, timeout=timeout)
        model = DDP(module)
        state = LossyHookState(comm, loss_budget=0.1, deadline=DEADLINE)
        model.register_comm_hook(state, lossy_allreduce_hook)
        return model, state

    model, state = wrapped(comm)
    failed_at, outcome, step = None, None, 0
    try:
        while step < steps:
            if step == kill_at and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            generator = torch.Generator().manual_seed(1000 * step + comm.rank)
            x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
            torch.nn.functional.mse_loss(model(x), y).backward()
            try:
                state.step(optimizer)
            except ud_transport.PeerTimeout as error:
                failed_at, outcome = step, outcome_of(error)
                shrunk = comm.shrink([error.rank])
                comm.close()
                comm = shrunk
                dist.destroy_process_group()
                model, state = wrapped(comm)
                optimizer.zero_grad()
                continue  # the step again, on the survivors
            optimizer.zero_grad()
            step += 1
        return failed_at, outcome, (comm.rank, comm.world_size), _flat(module)
    finally:
        comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def hand_over_then_grow(cluster_comm, port, family):
    """Ranks 0 and 1 train 2 steps, hand their shards over (as before a planned leave), but then
    grow by one instead: the cluster's rank 2 joins. The handed-over records must not be used,
    since the newcomer holds none: every rank gathers afresh. Returns
    (shard before the grow or None, shard after, restarted_elements, parameters)."""
    model = _model()
    if cluster_comm.rank == 2:
        comm = ud_transport.Communicator.join(store(port), family,
                                              options=options_module.build(deadline_cap_s=DEADLINE), timeout_s=120)
        opt = _optimizer(model, comm, join=True)
        before = None
    else:
        comm = _communicator(cluster_comm.rank, 2, port, family)
        opt = _optimizer(model, comm)
        _train(model, opt, _batches(100 + comm.rank, 2), 2)
        opt.hand_over()
        before = shard_state(opt)
        grown = comm.grow(1)
        comm.close()
        comm = grown
        opt.regroup(comm)
    result = (before, shard_state(opt), opt.restarted_elements, _flat(model))
    comm.close()
    return result


def die_in_the_parameter_gather(cluster_comm, port, family, world_size, victim, kill_at, steps):
    """Ranks 0..world_size-1 train; `victim` is SIGKILLed as its step `kill_at` starts the
    parameters' all-gather, after the gradients' reduce-scatter (which it took part in) and the
    owners' inner step. The survivors' step fails there: `shards_stepped` must say so on every
    one, and the step must stand after they shrink and regroup (each owner's updated shard
    becomes everyone's parameters there), without being taken again.

    Returns on a survivor the error, shards_stepped, the old shard's bounds, the parameters before
    the failed step, its owner values after it, the parameters after the regroup and at the end."""
    rank = cluster_comm.rank
    model = _model()
    comm = _communicator(rank, world_size, port, family)
    opt = _optimizer(model, comm)
    batches = _batches(100 + rank, steps)
    step_now = [None]
    if rank == victim:
        gather = comm.all_gather

        def dying(*arguments, **keywords):
            if step_now[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return gather(*arguments, **keywords)
        comm.all_gather = dying  # this communicator only: the optimizer calls it for the parameters
    for step in range(kill_at + 1):
        step_now[0] = step
        before = _flat(model)
        x, y = batches[step]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except ud_transport.PeerTimeout as error:
            failed = {"step": step, "error": (type(error).__name__, error.rank), "shards_stepped": opt.shards_stepped,
                      "shard": opt.shard, "before": before, "owned": opt.owner_values(),
                      "victim_shard": comm.shard_range(before.numel(), victim)}
            break
    else:
        return {"error": None}
    shrunk = comm.shrink([failed["error"][1]])
    comm.close()
    opt.regroup(shrunk)
    after = _flat(model)
    _, late_error, _ = _train(model, opt, _batches(200 + shrunk.rank, steps), steps,
                              first_step=failed["step"] + opt.shards_stepped)
    shrunk.close()
    return dict(failed, regrouped=after, late_error=repr(late_error) if late_error else None, flat=_flat(model))


def grow_nobody_then_somebody(cluster_comm, port, tag):
    """Ranks 0 and 1 form the default "ud" group and call grow_group(1) with nobody coming (it
    must fail and leave the group standing: an all-reduce of 1 + 2); then the cluster's rank 2
    joins (join_group) and the two grow again; then all three make a "ud" subgroup of ranks 1
    and 2 (how a subgroup grows: the default group grows, and the subgroup is made again).
    Returns (the first grow's error or None, the sum after it, (rank, size, sum of 1 + 2 + 3 in
    the grown group, sum of 2 + 3 in the subgroup or None))."""
    import datetime

    import torch.distributed as dist

    import ud_transport.torch as udt

    job_store = dist.PrefixStore(tag, store(port))
    timeout = datetime.timedelta(seconds=3)
    options = udt.BackendOptions(deadline=DEADLINE)
    failed, standing = None, None
    try:
        if cluster_comm.rank == 2:
            job_store.wait(["first grow failed"], datetime.timedelta(seconds=60))
            udt.join_group(job_store, timeout=timeout, pg_options=options, wait_s=60)
        else:
            dist.init_process_group("ud", store=job_store, rank=cluster_comm.rank, world_size=2, timeout=timeout,
                                    pg_options=options)
            try:
                udt.grow_group(1, seat_timeout=datetime.timedelta(seconds=1))
            except ud_transport.TransportError as error:
                failed = str(error)
            tensor = torch.tensor([float(cluster_comm.rank + 1)])
            dist.all_reduce(tensor)
            standing = tensor.item()
            job_store.set("first grow failed", "1")
            udt.grow_group(1)
        tensor = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(tensor)
        subgroup = dist.new_group([1, 2], backend="ud", pg_options=options)  # a survivor and the newcomer
        in_subgroup = None
        if dist.get_rank() in (1, 2):
            in_subgroup = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(in_subgroup, group=subgroup)
            in_subgroup = in_subgroup.item()
        return failed, standing, (dist.get_rank(), dist.get_world_size(), tensor.item(), in_subgroup)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def die_with_a_replica(cluster_comm, port, family, world_size, victim, kill_at, steps, will, every=1):
    """Ranks train with the optimizer state copied to the next rank every `every` steps
    (replicate_every); `victim` leaves its shard_state() at `will` and dies at `kill_at`; the
    survivors shrink, regroup and train on to `steps`. Returns each survivor's shard before and
    after the move, copied and restarted elements, the replica's counts, and parameters.
    Without a `will`, the victim dies in its refresh after step kill_at - 1, having sent the
    sizes but not the state: that copy never reaches the next rank, and the victim never starts
    step kill_at (it waits for that refresh first)."""
    rank = cluster_comm.rank
    model = _model()
    comm = _communicator(rank, world_size, port, family)
    opt = _optimizer(model, comm, replicate_every=every)
    if rank == victim and will is None:
        broadcast = exact.broadcast

        def die_sending_its_state(comm, tensor, *arguments, collective=None, **options):
            # the refresh after step kill_at - 1: its sizes went to the next rank, its state does not
            if collective == "replica" and comm is opt.replica._to_next and opt.replica.refreshes == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return broadcast(comm, tensor, *arguments, collective=collective, **options)

        exact.broadcast = die_sending_its_state  # its step kill_at waits for that exchange first
    batches = _batches(100 + rank, steps)
    failed_at, error, _ = _train(model, opt, batches, steps, die_at=kill_at if rank == victim else None, will=will)
    before_shrink, refreshed = shard_state(opt), (opt.replica.refreshes, opt.replica.failures)
    shrunk = comm.shrink([error.rank])
    comm.close()
    opt.regroup(shrunk)
    after_shrink = {"rank": shrunk.rank, "state": shard_state(opt), "restarted": opt.restarted_elements,
                    "copied": opt.copied_elements, "flat": _flat(model)}
    batches = _batches(100 + shrunk.rank, steps)
    resumed_at = failed_at + opt.shards_stepped
    _, late_error, _ = _train(model, opt, batches, steps, first_step=resumed_at)
    result = {"failed_at": failed_at, "resumed_at": resumed_at, "blamed": error.rank, "refreshed": refreshed,
              "before_shrink": before_shrink,
              "after_shrink": after_shrink, "late_error": repr(late_error) if late_error else None,
              "copies_after": (opt.replica.refreshes, opt.replica.failures), "flat": _flat(model)}
    opt.close()
    opt.close()  # idempotent
    shrunk.close()
    return result
