"""Rank functions for tests/test_shrink.py: a "ud" group loses a rank (SIGKILL in the middle of
a collective) and the survivors shrink it (torch.distributed.shrink_group) and go on.

The groups meet through a TCPStore the test process hosts (as torchrun's agent hosts the
store), not the cluster's own, which lives in rank 0: a dead rank 0 must not take the store
with it. Every task makes its groups under its own prefix and destroys them before it returns."""
import contextlib
import datetime
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import ud_transport
import ud_transport.torch as udt

# float32 or int32 elements: 64 MiB, a call that lasts well past the kill (at 16 MiB and 20 ms a
# rank had received up to 21 of the 24 MB a ring of 4 brings it, on a quiet 2-core machine)
BIG = 16 << 20
JOIN_AFTER_S = 0.3     # the victim comes last: the others are in the call when it dies
DIE_AFTER_S = 0.05     # after the victim issued the call: it has joined, data is moving
GROUP_TIMEOUT_S = 30.0  # the join timeout: a survivor that waited it out took the slow way


def store(port):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))


@contextlib.contextmanager
def default_ud_group(comm, port, tag, **options):
    """The default process group on backend "ud", met through the test's store."""
    dist.init_process_group("ud", store=dist.PrefixStore(tag, store(port)), rank=comm.rank,
                            world_size=comm.world_size, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                            pg_options=udt.BackendOptions(**options))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def die_soon(seconds, note=None):
    """SIGKILL this process `seconds` from now, as a crash would end it; `note` (a store, key) is
    set to the moment (time.monotonic(), one clock for every process of the machine) first."""
    def die():
        if note is not None:
            note[0].set(note[1], repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Timer(seconds, die).start()


def collective_input(kind, fill, count):
    """A lossy call's input ("lossy": float32 SUM) or an exact one's ("exact": int32 SUM)."""
    return torch.full((count,), float(fill)) if kind == "lossy" else torch.full((count,), fill, dtype=torch.int32)


def outcome_of(error):
    """What a test compares of an error across ranks: (class name, blamed rank, message)."""
    if error is None:
        return "OK", None, ""
    return type(error).__name__, getattr(error, "rank", None), str(error)


def all_joined(error):
    """Whether every rank had joined the failed engine call (its data phase had begun: the
    victim died in the call, not before it): the join wait ended before the call did."""
    stats = getattr(error, "stats", None)
    if stats is None:
        return False, None
    return stats.join_wait_s < stats.elapsed_s - 1e-3, {name: getattr(stats, name) for name in (
        "join_wait_s", "elapsed_s", "agree_s", "output_s", "datagrams_received")}


def exact_sums(group, fills):
    """An int64 allreduce and a float32 one (lossy where the group allows, nothing injected) on
    `group`, each rank contributing its fill: (int result exact?, float result exact?)."""
    me = fills[dist.get_rank(group)]
    whole = sum(fills)
    integers = torch.full((1000,), me, dtype=torch.int64)
    dist.all_reduce(integers, group=group)
    floats = torch.full((100_000,), float(me))
    dist.all_reduce(floats, group=group)
    return bool(torch.all(integers == whole)), bool(torch.all(floats == whole))


def kill_and_shrink(comm, port, tag, victims, algorithm, kind):
    """On a default "ud" group of every rank: for each victim (a rank of the group as it is at
    that stage), every rank enters a 64 MiB allreduce, the victim last, and the victim dies
    50 ms into it; the others record their error and shrink the default group without it
    (shrink_group). At the end the survivors check exact sums on the group left.

    Returns, on a survivor: {"stages": [(outcome, seconds in the call, tensor unchanged?,
    seconds the shrink took, rank after, size after, all_joined(error), seconds from the kill to
    the call's end)], "ranks": get_process_group_ranks of the
    final default group, "sums": exact_sums(...) on it, then on a new_group made after the shrink,
    "backend": its backend name}."""
    fills = list(range(1, comm.world_size + 1))  # fills[rank]: a rank's contribution, by its first rank
    stages = []
    deaths = dist.PrefixStore(f"{tag}/deaths", store(port))
    with default_ud_group(comm, port, tag, deadline=5.0, algorithm=algorithm, loss_budget=0.1):
        dist.barrier()
        for stage, victim in enumerate(victims):
            rank = dist.get_rank()
            tensor = collective_input(kind, fills[rank], BIG)
            original = tensor.clone()
            if rank == victim:
                time.sleep(JOIN_AFTER_S)
                die_soon(DIE_AFTER_S, (deaths, str(stage)))
            start = time.monotonic()
            try:
                dist.all_reduce(tensor)
                error = None
            except Exception as caught:  # noqa: BLE001 - the test reads what it was
                error = caught
            ended = time.monotonic()
            elapsed = ended - start
            if rank == victim:
                time.sleep(60)  # reached only if the call ended before the kill: the others then see no error
            after_kill = ended - float(deaths.get(str(stage)).decode())
            start = time.monotonic()
            group = dist.shrink_group([victim])
            shrink_s = time.monotonic() - start
            fills = fills[:victim] + fills[victim + 1:]
            stages.append((outcome_of(error), elapsed, bool(torch.equal(tensor, original)), shrink_s,
                           dist.get_rank(), dist.get_world_size(), all_joined(error), after_kill))
            assert group is c10d._get_default_group()
        sums = exact_sums(None, fills)
        later = dist.new_group(backend="ud")  # a group made after the shrink, of the survivors
        return {"stages": stages, "ranks": dist.get_process_group_ranks(dist.group.WORLD),
                "sums": sums + exact_sums(later, fills), "backend": dist.get_backend()}


def shrink_a_subgroup_twice(comm, port, tag):
    """4 ranks; a "ud" subgroup of global ranks 1, 2, 3 (the default group is "ud" too). Global
    rank 2 is excluded, then global rank 3 (both alive: shrinking is the caller's choice, and
    an excluded rank only has to stay out). After each shrink: the group's global ranks, its
    size, a broadcast from its last rank named by global rank, and exact sums.

    Returns {"after": [(global ranks, size, broadcast value, sums)], "excluded": what the
    excluded rank's own shrink_group raised}."""
    out = {"after": [], "excluded": []}
    with default_ud_group(comm, port, tag, deadline=10.0):
        me = dist.get_rank()
        group = dist.new_group([1, 2, 3], backend="ud")
        members = [1, 2, 3]
        for excluded in (2, 3):
            if me not in members:
                break
            group_rank = members.index(excluded)
            if me == excluded:
                try:
                    dist.shrink_group([group_rank], group=group)
                    out["excluded"].append("no error")
                except RuntimeError as error:
                    out["excluded"].append(str(error))
                break
            group = dist.shrink_group([group_rank], group=group)
            members.remove(excluded)
            value = torch.tensor([float(me)])
            dist.broadcast(value, src=members[-1], group=group)
            out["after"].append((dist.get_process_group_ranks(group), group.size(), value.item(),
                                 exact_sums(group, [m + 1 for m in members])))
        dist.barrier()
    return out


def refusals(comm, port, tag):
    """What shrink_group refuses on a healthy default "ud" group of 3, as torch validates:
    {case: (exception class, message)}; then the group still works (an exact sum)."""
    out = {}

    def attempt(case, *arguments, **keywords):
        try:
            dist.shrink_group(*arguments, **keywords)
            out[case] = ("no error", "")
        except Exception as error:  # noqa: BLE001 - the test reads what it was
            out[case] = (type(error).__name__, str(error))

    with default_ud_group(comm, port, tag, deadline=10.0):
        attempt("every rank", [0, 1, 2])
        attempt("nobody", [])
        attempt("a rank twice", [1, 1])
        attempt("out of range", [3])
        attempt("a flag torch does not know", [2], shrink_flags=7)
        attempt("this rank", [dist.get_rank()])
        alone = dist.new_group([0], backend="ud")
        if dist.get_rank() == 0:
            attempt("a group of one", [0], group=alone)
        sub = dist.new_group(backend="ud")
        if dist.get_rank() != 2:  # rank 2, excluded, stays out
            dist.shrink_group([2], group=sub)
            attempt("a group already shrunk", [2], group=sub)  # torch destroyed it: its store is let go
        out["still works"] = exact_sums(None, [1, 2, 3])
        out["backend refuses pg_options of another kind"] = _backend_shrink_refusal()
    return out


def _backend_shrink_refusal():
    backend = c10d._get_default_group()
    try:
        backend.shrink([2 if dist.get_rank() != 2 else 1], 0, {"deadline": 1})
        return "no error"
    except TypeError as error:
        return str(error)


def abort_what_waits(comm, port, tag):
    """3 ranks; rank 2 is alive but never comes to an all_reduce that ranks 0 and 1 issue
    (async). Ranks 0 and 1 shrink with SHRINK_ABORT: the waiting Work ends with "interrupted" at
    once (the group timeout is 30 s), and the new group of two sums exactly. Rank 2, excluded,
    calls shrink_group too and is refused. Returns (what the Work raised, seconds from the
    shrink to the Work's end, the shrink's seconds, sums) on ranks 0 and 1, the refusal on 2."""
    with default_ud_group(comm, port, tag, deadline=10.0):
        dist.barrier()
        if dist.get_rank() == 2:
            try:
                dist.shrink_group([2])
                refused = "no error"
            except RuntimeError as error:
                refused = str(error)
            time.sleep(1.0)  # keep this process's socket open: the others must not learn of it by ICMP
            return refused
        work = dist.all_reduce(torch.ones(1000), async_op=True)
        time.sleep(0.5)
        start = time.monotonic()
        group = dist.shrink_group([2], shrink_flags=c10d.SHRINK_ABORT)
        shrink_s = time.monotonic() - start
        try:
            work.wait()
            ended = "no error"
        except ud_transport.TransportError as error:
            ended = str(error)
        ended_s = time.monotonic() - start
        return ended, ended_s, shrink_s, exact_sums(group, [1, 2])


def ddp_recipe(comm, port, tag, victim, steps, kill_at):
    """The recipe of docs/elastic.md: DDP on the default "ud" group; `victim` dies just before
    step `kill_at`; the survivors catch the error, shrink, re-wrap the same module in DDP on the
    new group (which broadcasts new rank 0's parameters) and train to `steps`.

    Returns on a survivor (the step the error came at, its outcome, flat parameters at the end,
    the last loss)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(100 + comm.rank)
    data = [(torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)) for _ in range(steps)]
    failed_at, outcome = None, None
    with default_ud_group(comm, port, tag, deadline=5.0):
        model = DDP(module)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
        step = 0
        while step < steps:
            if step == kill_at and dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = data[step]
            optimizer.zero_grad()
            try:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            except RuntimeError as error:  # DDP raises the collective's error as a RuntimeError
                cause = dist.group.WORLD.last_error  # the backend keeps the error itself
                if not isinstance(cause, ud_transport.PeerTimeout):
                    raise
                failed_at, outcome = step, (outcome_of(cause), type(error).__name__)
                group = dist.shrink_group([cause.rank], shrink_flags=c10d.SHRINK_ABORT)
                model = DDP(module, process_group=group)
                continue  # the step again, on the survivors
            optimizer.step()
            step += 1
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        return failed_at, outcome, flat, loss.item()

