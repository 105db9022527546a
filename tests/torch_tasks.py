"""Rank-side functions for the torch-layer tests (run by LocalCluster, so
they live in an importable module). Each sets up what it needs on the
rank's store and tears it down, so clusters can be reused. Lossy calls get a
10 s deadline: the adaptive one (floor 1 s) can expire when a rank process
is off the CPU for a second on a loaded 2-core machine, which is not what
these tests are about."""
import contextlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ud_transport
import ud_transport.torch as udt
from ud_transport import exact

STEPS = 20


def small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(rank, steps, seed=100):
    generator = torch.Generator().manual_seed(seed + rank)
    return [(torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)) for _ in range(steps)]


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


@contextlib.contextmanager
def gloo_world(comm, name):
    """A default Gloo process group on the rank's store (under its own prefix)."""
    dist.init_process_group("gloo", store=dist.PrefixStore(name, comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train(model, optimizer_step, data):
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer_step()


def four_ways_at_no_loss(comm, tag):
    """The same 20 AdamW steps four ways; every rank starts from its own
    random init (the method must align them). Returns flat parameters of:
    DDP on Gloo, DDP on a "ud" group, DDP on Gloo with the lossy hook over
    ud, and the two-stage optimizer over ud."""
    data = batches(comm.rank, STEPS)
    results = {}
    with gloo_world(comm, f"four-{tag}"):
        ud_group = dist.new_group(backend="ud")
        for way in ("gloo", "ud_backend", "hook", "hook copies=2"):
            model = small_model(seed=comm.rank)
            ddp = DDP(model, process_group=ud_group if way == "ud_backend" else None)
            optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            if way.startswith("hook"):
                state = udt.LossyHookState(comm, loss_budget=0.0, copies=2 if "copies" in way else None)
                ddp.register_comm_hook(state, udt.lossy_allreduce_hook)
                step = lambda: (state.step(optimizer), optimizer.zero_grad())
            else:
                step = lambda: (optimizer.step(), optimizer.zero_grad())
            train(ddp, step, data)
            results[way] = flat_parameters(model)
        for copies in ("auto", 2):
            model = small_model(seed=comm.rank)
            optimizer = udt.LossTolerantOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), communicator=comm,
                                                  copies=copies)
            train(model, lambda: (optimizer.step(), optimizer.zero_grad()), data)
            results["two_stage" if copies == "auto" else "two_stage copies=2"] = flat_parameters(model)
    return results


def c10d_collectives(comm, tag):
    """all_gather_into_tensor, reduce_scatter_tensor, all_gather, reduce_scatter,
    all_reduce (SUM, AVG, MAX), broadcast and barrier on a "ud" group and on
    Gloo, same inputs: returns {name: (ud result, gloo result)}."""
    n, r = comm.world_size, comm.rank
    out = {}
    with gloo_world(comm, f"c10d-{tag}"):
        groups = {"ud": dist.new_group(backend="ud"), "gloo": dist.new_group(backend="gloo")}
        for name, group in groups.items():
            shard = torch.arange(5, dtype=torch.float32) + 10 * r
            gathered = torch.empty(5 * n)
            dist.all_gather_into_tensor(gathered, shard, group=group)
            full = torch.arange(3 * n, dtype=torch.float32) * (r + 1)
            scattered = torch.empty(3)
            dist.reduce_scatter_tensor(scattered, full, group=group)
            pieces = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
            dist.all_gather(pieces, torch.tensor([r, r * r], dtype=torch.int64), group=group)
            listed = torch.empty(2)
            dist.reduce_scatter(listed, [torch.full((2,), float(r + k)) for k in range(n)], group=group)
            sums = {op: torch.tensor([r + 1.0, 2.0 * r]) for op in ("SUM", "AVG", "MAX")}
            for op, tensor in sums.items():
                dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
            integers = torch.tensor([r, 7], dtype=torch.int64)
            dist.all_reduce(integers, group=group)
            broadcast = torch.tensor([float(r)] * 3)
            dist.broadcast(broadcast, src=n - 1, group=group)
            dist.barrier(group=group)
            out[name] = dict(all_gather_into_tensor=gathered, reduce_scatter_tensor=scattered,
                             all_gather=torch.stack(pieces), reduce_scatter=listed, integers=integers,
                             broadcast=broadcast, **{f"all_reduce_{op}": t for op, t in sums.items()},
                             **composite_collectives(group, n, r))
    return {key: (out["ud"][key], out["gloo"][key]) for key in out["ud"]}


def composite_collectives(group, n, r):
    """reduce, gather, scatter, all_to_all_single (even and uneven splits), all_to_all and the
    object collectives on `group`: {name: tensor} to compare across backends."""
    out = {}
    reduced = torch.tensor([r + 0.5, -r * 2.0])
    dist.reduce(reduced, dst=1, op=dist.ReduceOp.SUM, group=group)
    out["reduce at the root"] = reduced if r == 1 else torch.zeros(0)  # elsewhere Gloo leaves partial sums
    gathered = [torch.full((2, 2), -1, dtype=torch.int64) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([[r, r + 1], [r * r, 7]]), gathered, dst=0, group=group)
    out["gather"] = torch.stack(gathered) if r == 0 else torch.zeros(0)
    piece = torch.full((3,), -1.0)
    dist.scatter(piece, [torch.arange(3.0) + 10 * k for k in range(n)] if r == n - 1 else None, src=n - 1, group=group)
    out["scatter"] = piece
    even = torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + 100 * r
    received = torch.empty_like(even)
    dist.all_to_all_single(received, even, group=group)
    out["all_to_all_single, even"] = received
    # rank i sends i + j + 1 rows of width 2 to rank j (so receives j + i + 1 from rank j)
    sends = [r + j + 1 for j in range(n)]
    source = torch.arange(sum(sends) * 2, dtype=torch.int64).reshape(-1, 2) + 1000 * r
    uneven = torch.empty((sum(j + r + 1 for j in range(n)), 2), dtype=torch.int64)
    dist.all_to_all_single(uneven, source, output_split_sizes=[j + r + 1 for j in range(n)],
                           input_split_sizes=sends, group=group)
    out["all_to_all_single, uneven"] = uneven
    outputs = [torch.empty(2) for _ in range(n)]  # Gloo's takes equal sizes only
    dist.all_to_all(outputs, [torch.tensor([10.0 * r + j, -j]) for j in range(n)], group=group)
    out["all_to_all"] = torch.cat(outputs)
    empty = {"reduce": torch.empty(0), "gather": torch.empty(0, 3), "scatter": torch.empty(0),
             "broadcast": torch.empty(0), "all_reduce MAX": torch.empty(0, dtype=torch.int64)}
    dist.reduce(empty["reduce"], dst=0, group=group)
    dist.gather(empty["gather"], [torch.empty(0, 3) for _ in range(n)] if r == 0 else None, dst=0, group=group)
    dist.scatter(empty["scatter"], [torch.empty(0) for _ in range(n)] if r == 0 else None, src=0, group=group)
    dist.broadcast(empty["broadcast"], src=0, group=group)
    dist.all_reduce(empty["all_reduce MAX"], op=dist.ReduceOp.MAX, group=group)
    out.update({f"{name}, 0 elements": torch.tensor(list(tensor.shape)) for name, tensor in empty.items()})
    objects = [None] * n if r == 0 else None
    dist.gather_object({"rank": r, "name": "x" * r}, objects, dst=0, group=group)
    out["gather_object"] = torch.tensor([len(o["name"]) + o["rank"] for o in objects]) if r == 0 else torch.zeros(0)
    chosen = [None]
    dist.scatter_object_list(chosen, [f"piece {k}" * (k + 1) for k in range(n)] if r == 0 else None, src=0, group=group)
    out["scatter_object_list"] = torch.tensor([len(chosen[0])])
    return out


def point_to_point(comm, tag, with_options=False):
    """send, recv, isend/irecv and batch_isend_irecv on a "ud" group and on Gloo, the same
    messages: ({name: (ud result, gloo result)}, datagrams the ud group's injected loss dropped
    here). `with_options`: the "ud" group takes the
    cluster's communicator options (its injected loss and chunk size)."""
    n, r = comm.world_size, comm.rank
    after, before = (r + 1) % n, (r - 1) % n
    options = udt.BackendOptions(deadline=10.0, communicator={"inject": comm.options.inject,
                                                              "chunk_bytes": comm.options.chunk_bytes}) if with_options else None
    out = {}
    with gloo_world(comm, f"p2p-{tag}"):
        groups = {"ud": dist.new_group(backend="ud", pg_options=options), "gloo": dist.new_group(backend="gloo")}
        for name, group in groups.items():
            got = out[name] = {}
            # around the ring, both ways at once: each rank sends to and receives from both neighbours
            values = {"float32": torch.arange(3000.0) * (r + 1), "int64": torch.arange(7, dtype=torch.int64) - r,
                      "bfloat16": torch.linspace(-1, 1, 33, dtype=torch.bfloat16) * (r + 2),
                      "complex64": torch.tensor([r + 1j, -r - 2j], dtype=torch.complex64)}
            for dtype, value in values.items():
                forward, backward = torch.full_like(value, -9), torch.full_like(value, -9)
                works = [dist.isend(value, dst=after, group=group), dist.isend(value * 2, dst=before, group=group),
                         dist.irecv(forward, src=before, group=group), dist.irecv(backward, src=after, group=group)]
                for work in works:
                    work.wait()
                got[f"{dtype} from both neighbours"] = torch.stack([forward, backward])
            # several messages on one channel arrive in the order sent; tags are matched, not order
            if r == 0:
                for k in range(4):
                    dist.send(torch.tensor([k, 10 * k]), dst=1, group=group)
                first = dist.isend(torch.tensor([1.0]), dst=1, group=group, tag=1)
                dist.send(torch.tensor([2.0, 2.0]), dst=1, group=group, tag=2)
                first.wait()
            elif r == 1:
                received = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
                for piece in received:
                    dist.recv(piece, src=0, group=group)
                got["four in order"] = torch.stack(received)
                two, one = torch.zeros(2), torch.zeros(1)
                dist.recv(two, src=0, group=group, tag=2)  # sent second, received first
                dist.recv(one, src=0, group=group, tag=1)
                got["tag 2, then tag 1"] = torch.cat([two, one])
            # into a view that is not contiguous (Gloo's takes contiguous ones), and a message of many chunks
            matrix = torch.full((40, 30), -1.0)
            landing = matrix.t() if name == "ud" else torch.empty(30, 40)
            large = torch.randn(300_000, generator=torch.Generator().manual_seed(r))
            ops = [dist.P2POp(dist.isend, torch.arange(1200.0).reshape(30, 40) + r, after, group),
                   dist.P2POp(dist.irecv, landing, before, group),
                   dist.P2POp(dist.isend, large, after, group, tag=3),
                   dist.P2POp(dist.irecv, large_in := torch.zeros(300_000), before, group, tag=3)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            got["into a transposed view"] = matrix if name == "ud" else landing.t()
            got["300 000 floats"] = large_in
            dist.barrier(group=group)
        drops = groups["ud"]._channels.injected_drops
    return {key: (out["ud"][key], out["gloo"][key]) for key in out["ud"]}, drops


def pipeline_training(comm, tag, schedule_name):
    """A 3-layer model in as many pipeline stages as ranks (torch.distributed.pipelining, 4
    microbatches), 6 SGD steps on a "ud" group and the same on Gloo: (stage parameters on ud, on
    Gloo, the last stage's losses on ud, on Gloo). Activations and their gradients go by send
    and recv (batch_isend_irecv), the stages' shapes by send_object_list."""
    from torch.distributed import pipelining

    n, r = comm.world_size, comm.rank
    out = {}
    with gloo_world(comm, f"pipe-{tag}"):
        groups = {"ud": dist.new_group(backend="ud"), "gloo": dist.new_group(backend="gloo")}
        for name, group in groups.items():
            torch.manual_seed(0)
            layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(n)]
            stage = pipelining.PipelineStage(layers[r], r, n, torch.device("cpu"), group=group)
            losses = []
            schedule = getattr(pipelining, schedule_name)(stage, 4, loss_fn=torch.nn.functional.mse_loss)
            optimizer = torch.optim.SGD(layers[r].parameters(), lr=0.1)
            generator = torch.Generator().manual_seed(1)
            for _ in range(6):
                x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 8, generator=generator)
                if r == 0:
                    schedule.step(x)
                elif r == n - 1:
                    step_losses = []
                    schedule.step(target=y, losses=step_losses)
                    losses.extend(step_losses)
                else:
                    schedule.step()
                optimizer.step()
                optimizer.zero_grad()
            out[name] = (flat_parameters(layers[r]), torch.stack(losses).detach() if losses else torch.zeros(0))
        dist.barrier()
    return out["ud"][0], out["gloo"][0], out["ud"][1], out["gloo"][1]


def broadcast_version_steps(comm):
    """How far a broadcast moved each rank's tensor's autograd version counter (the root's
    memory is only read; the others' is written)."""
    tensor = torch.full((5000,), float(comm.rank))
    before = tensor._version
    comm.broadcast(tensor, 0)
    return tensor._version - before, tensor[0].item()


def abort_ends_what_waits(comm, tag):
    """Rank 1 waits on a receive whose sender sends no more and on an all_reduce rank 0 never
    joins; then aborts the group: (seconds abort took, each Work's error, the tensors unchanged).
    Rank 0 takes one message, then destroys the group as it is (nothing queued there)."""
    import time

    with gloo_world(comm, f"abort-{tag}"):
        group = dist.new_group(backend="ud")  # the group's timeout: 30 minutes
        if comm.rank == 0:
            dist.send(torch.ones(2), dst=1, group=group)  # the channel is met
            dist.barrier()  # on Gloo: rank 1 has queued its calls
            dist.barrier()  # rank 1 has aborted
            dist.destroy_process_group(group)
            return None
        first = torch.zeros(2)
        dist.recv(first, src=0, group=group)
        inbox, summed = torch.full((3,), 7.0), torch.full((5,), 3.0)
        works = {"irecv": dist.irecv(inbox, src=0, group=group),
                 "all_reduce": dist.all_reduce(summed, group=group, async_op=True),
                 "irecv on a channel whose sender never came": dist.irecv(torch.zeros(1), src=0, group=group, tag=5)}
        dist.barrier()
        time.sleep(0.5)  # both are waiting on rank 0 now
        start = time.monotonic()
        group.abort()
        took = time.monotonic() - start
        errors = {}
        for name, work in works.items():
            try:
                work.wait()
                errors[name] = "no error"
            except ud_transport.TransportError as error:
                errors[name] = str(error)
        dist.barrier()
        dist.destroy_process_group(group)
        return took, errors, bool(torch.all(inbox == 7.0)), bool(torch.all(summed == 3.0)), first.tolist()


def group_made_again_on_one_store(comm, tag):
    """init_process_group("ud") twice on the same store, a message and an all_reduce in each; in
    the second the receiver comes first (it read the first group's keys before): what arrived."""
    import time

    arrived = []
    for round_ in range(2):
        dist.init_process_group("ud", store=dist.PrefixStore(f"again-{tag}", comm.store), rank=comm.rank,
                                world_size=comm.world_size, pg_options=udt.BackendOptions(deadline=5.0))
        message, total = torch.zeros(2), torch.tensor([1.0])
        if comm.rank == 0:
            time.sleep(0.5 * round_)
            dist.send(torch.full((2,), round_ + 1.0), dst=1)
        elif comm.rank == 1:
            dist.recv(message, src=0)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        dist.barrier()
        dist.destroy_process_group()
        arrived.append(message.tolist() + total.tolist())
    return arrived


def point_to_point_edges(comm, tag):
    """What a "ud" group's send and recv do at their edges: {case: outcome}."""
    import time

    r = comm.rank
    out = {}
    with gloo_world(comm, f"p2p-edges-{tag}"):
        group = dist.new_group(backend="ud", pg_options=udt.BackendOptions(deadline=1.5,
                                                                           communicator={"store_timeout_s": 2.0}))
        # a receive posted long before its message is sent (longer than a call's deadline and the
        # store's timeout: the sender is waited for as a late rank is, up to the group's timeout)
        late = torch.zeros(3)
        if r == 0:
            time.sleep(4.0)
            dist.send(torch.tensor([1.0, 2.0, 3.0]), dst=1, group=group)
        else:
            dist.recv(late, src=0, group=group)
        out["a message sent 4 s after its receive"] = late
        # sizes that differ, also by less than the 4-byte words exact calls move: both ends
        # raise, and the receiver's tensor keeps its values
        for sent, into in [(torch.zeros(3), torch.tensor([5.0, 6.0])),
                           (torch.tensor([1, 2, 3], dtype=torch.int16), torch.full((4,), 7, dtype=torch.int16)),
                           (torch.arange(7, dtype=torch.uint8), torch.full((5,), 9, dtype=torch.uint8)),
                           (torch.arange(5, dtype=torch.uint8), torch.full((7,), 9, dtype=torch.uint8))]:
            case = f"{sent.numel()} {sent.dtype} into {into.numel()}"
            kept = into.clone()
            try:
                if r == 0:
                    dist.send(sent, dst=1, group=group, tag=7)
                else:
                    dist.recv(kept, src=0, group=group, tag=7)
                out[f"sizes that differ: {case}"] = "no error"
            except ud_transport.TransportError as error:
                out[f"sizes that differ: {case}"] = type(error).__name__
            out[f"the receiver's tensor after it: {case}"] = torch.equal(kept, into)
        # the channel is usable after that error
        after = torch.zeros(2)
        if r == 0:
            dist.send(torch.tensor([8.0, 9.0]), dst=1, group=group, tag=7)
        else:
            dist.recv(after, src=0, group=group, tag=7)
        out["the next message on that channel"] = after
        for name, call in {"two tensors": lambda: group.send([torch.zeros(1), torch.zeros(1)], 1 - r, 0)}.items():
            try:
                call()
                out[name] = "no error"
            except (NotImplementedError, ValueError) as error:
                out[name] = str(error)
        dist.destroy_process_group(group)
        try:
            group.send([torch.zeros(1)], 1 - r, 0)
            out["send on a destroyed group"] = "no error"
        except ud_transport.TransportError as error:
            out["send on a destroyed group"] = str(error)
    return out


def backend_wait_raises(comm, tag, budget):
    """A "ud" group with policy raise under the cluster's injected loss:
    returns (exception class name or "ok", tensor unchanged). The group takes the cluster's chunk
    size too: a group's communicator reads its options from BackendOptions and the environment
    only, and at its default (the largest datagram) the call was 12 datagrams, all of which
    arrived in about 1.4% of runs (a within-budget call, rightly "ok")."""
    options = udt.BackendOptions(loss_budget=budget, on_budget_miss="raise", deadline=10.0,
                                 communicator={"inject": comm.options.inject, "chunk_bytes": comm.options.chunk_bytes})
    with gloo_world(comm, f"raise-{tag}"):
        group = dist.new_group(backend="ud", pg_options=options)
        assert group.communicator.chunk_bytes == comm.options.chunk_bytes
        tensor = torch.arange(4000, dtype=torch.float32) + comm.rank
        before = tensor.clone()
        try:
            dist.all_reduce(tensor, group=group)
            outcome = "ok"
        except ud_transport.TransportError as error:
            outcome = type(error).__name__
        return outcome, torch.equal(tensor, before), group.take_budget_misses()


def two_stage_branches(comm, steps, budget, policy):
    """Two-stage steps under the cluster's loss with a budget that is
    sometimes missed. Returns per step (branch taken, parameters and
    optimizer state unchanged when skipped), and the counters."""
    model = small_model(seed=comm.rank)
    optimizer = udt.LossTolerantOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), communicator=comm,
                                          loss_budget=budget, on_budget_miss=policy, deadline=10.0, copies=1)
    data = batches(comm.rank, steps)
    branches = []
    for x, y in data:
        torch.nn.functional.mse_loss(model(x), y).backward()
        before = flat_parameters(model)
        state_before = {k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)} for k, s in optimizer.state.items()}
        try:
            took = "stepped" if optimizer.step() else "skipped"
        except ud_transport.LossBudgetExceeded:
            took = "raised"
        unchanged = torch.equal(before, flat_parameters(model)) and all(
            torch.equal(v, optimizer.state[k][n]) for k, s in state_before.items() for n, v in s.items())
        branches.append((took, unchanged))
        optimizer.zero_grad()
    return branches, optimizer.counters.to_dict()


def hook_branches(comm, tag, steps, budget):
    """DDP on Gloo, gradients over ud with the hook (policy skip) under the
    cluster's loss: per step, whether it stepped."""
    data = batches(comm.rank, steps)
    with gloo_world(comm, f"hook-{tag}"):
        model = small_model(seed=0)
        ddp = DDP(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        state = udt.LossyHookState(comm, loss_budget=budget, on_budget_miss="skip", deadline=10.0)
        ddp.register_comm_hook(state, udt.lossy_allreduce_hook)
        taken = []
        for x, y in data:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            taken.append(state.step(optimizer))
            optimizer.zero_grad()
        return taken, state.counters.to_dict()


def exact_under_loss(comm, count):
    """Exact broadcast / all_gather / allreduce under the cluster's loss for
    several dtypes; returns what each produced, for checking on the host."""
    n, r = comm.world_size, comm.rank
    out = {}
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
        t = (torch.arange(count) * (r + 1) % 97).to(dtype)
        exact.broadcast(comm, t, n - 1)
        out[f"broadcast_{dtype}"] = t
        gathered = torch.empty(n * count, dtype=dtype)
        exact.all_gather(comm, (torch.arange(count) + r).to(dtype) % 50, gathered)
        out[f"all_gather_{dtype}"] = gathered
    total = torch.arange(count, dtype=torch.float32) * (r + 1)
    exact.allreduce(comm, total, "sum")
    out["allreduce_sum"] = total
    largest = torch.tensor([r, -r], dtype=torch.int32)
    exact.allreduce(comm, largest, "max")
    out["allreduce_max"] = largest
    return out


def exact_gather_repaired(comm, count):
    """One exact all_gather of many chunks under the cluster's loss: what it gathered and the
    chunks each call it made carried (the first call, then the repairs)."""
    gathered = torch.empty(comm.world_size * count, dtype=torch.float32)
    stats = exact.all_gather(comm, torch.arange(count, dtype=torch.float32) * (comm.rank + 1), gathered)
    return gathered, [s.chunks_total for s in stats]


def exact_broadcast_repaired(comm, count, src):
    """One exact broadcast of many chunks from `src` under the cluster's loss: what every rank
    holds after it and the chunks each call it made carried."""
    tensor = torch.arange(count, dtype=torch.float32) * (comm.rank + 1)
    stats = exact.broadcast(comm, tensor, src)
    return tensor, [s.chunks_total for s in stats]


def exact_call_log(comm, collective, count, src=0):
    """One exact `collective` ("all_gather" or "broadcast" from `src`) of `count` float32 per
    rank under the cluster's loss: whether it came out exact, and every collective call it made
    on this rank as (method, elements of its output, copies it asked for, agreed gather
    fraction); agreement rounds as ("agree", 0, 0, 1.0)."""
    log = []

    def logged(name, method):
        def call(*arguments, **keywords):
            stats = method(*arguments, **keywords)
            output = arguments[1] if name == "all_gather" else arguments[0]
            log.append((name, int(output.size if isinstance(output, np.ndarray) else output.numel()),
                        keywords.get("copies"), stats.gather_fraction))
            return stats
        return call

    def agree(value, **keywords):
        log.append(("agree", 0, 0, 1.0))
        return type(comm).agree(comm, value, **keywords)

    comm.all_gather, comm.broadcast, comm.agree = logged("all_gather", comm.all_gather), logged("broadcast", comm.broadcast), agree
    try:
        if collective == "all_gather":
            gathered = torch.empty(comm.world_size * count, dtype=torch.float32)
            exact.all_gather(comm, torch.arange(count, dtype=torch.float32) * (comm.rank + 1), gathered)
            expected = torch.cat([torch.arange(count, dtype=torch.float32) * (r + 1) for r in range(comm.world_size)])
            return torch.equal(gathered, expected), log
        tensor = torch.arange(count, dtype=torch.float32) * (comm.rank + 1)
        exact.broadcast(comm, tensor, src)
        return torch.equal(tensor, torch.arange(count, dtype=torch.float32) * (src + 1)), log
    finally:
        del comm.all_gather, comm.broadcast, comm.agree  # the class's methods again


def exact_gives_up_cleanly(comm, count, attempts=1):
    """Few attempts under heavy loss: must raise and leave the tensor (with 2, the first call and
    one round of repair, which gives up partway)."""
    t = torch.arange(count, dtype=torch.float32) + comm.rank
    before = t.clone()
    try:
        exact.broadcast(comm, t, 0, attempts=attempts)
        return "ok", torch.equal(t, before) or torch.equal(t, torch.arange(count, dtype=torch.float32))
    except ud_transport.LossBudgetExceeded:
        return "LossBudgetExceeded", torch.equal(t, before)


def drift_and_sync(comm):
    """Replicas made different on purpose: drift is seen, ParameterSync from
    rank 0 removes it exactly."""
    model = small_model(seed=comm.rank)
    drift_before = udt.replica_drift(model, comm)
    sync = udt.ParameterSync(model, comm, every=2)
    first, second = sync(), sync()
    drift_after = udt.replica_drift(model, comm)
    return drift_before, (first, second), drift_after, flat_parameters(model)


def fsdp2_steps(comm, tag, backend, steps=5):
    """A two-layer model under FSDP2 (fully_shard) on a default group of
    `backend`; returns the full parameters after a few SGD steps."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(backend, store=dist.PrefixStore(f"fsdp-{tag}-{backend}", comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    try:
        model = small_model(seed=0)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in batches(comm.rank, steps):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    finally:
        dist.destroy_process_group()


def phase_schedule(comm, norms):
    """Feed PhaseAwareBudget gradients of the given norms (each rank's a
    little different); returns the budgets it chose."""
    phase = udt.PhaseAwareBudget(stable_budget=0.1, critical_budget=0.0, warmup=5, hold=4, communicator=comm)
    budgets = []
    for norm in norms:
        gradient = torch.zeros(100)
        gradient[comm.rank] = norm * (1 + 0.01 * comm.rank)
        budgets.append(phase.budget(gradient))
    return budgets, phase.critical_fraction()


def feedback_conservation(comm, steps, feedback):
    """SGD (lr 1) through the two-stage step with an exact parameter all-gather, known gradients
    ((rank + 1) * (1 + element % 7) * (step + 1)), under the cluster's loss. Returns the
    parameters at the end, what this rank still holds back (error feedback's residual, or None),
    and how many of its pieces missed an owner."""
    parameter = torch.nn.Parameter(torch.zeros(300))
    optimizer = udt.LossTolerantOptimizer(torch.optim.SGD([parameter], lr=1.0), communicator=comm, loss_budget=1.0,
                                          exact_gather=True, error_feedback=feedback, deadline=10.0, copies=1)
    pattern = 1.0 + torch.arange(300) % 7
    for step in range(steps):
        parameter.grad = (comm.rank + 1) * pattern * (step + 1)
        optimizer.step()
    residual = optimizer.feedback.residual.clone() if feedback else None
    missed = optimizer.feedback.missed_contributions if feedback else 0
    return parameter.detach().clone(), residual, missed


def extrapolated_replicas(comm, steps, stale_fill):
    """SGD through the two-stage step, every rank the same constant gradient (so each owner moves
    its shard by the same amount every step, and the rescaled reduce-scatter is exact). Returns,
    per step from the third on, the largest distance of this replica from the owners' values."""
    parameter = torch.nn.Parameter(torch.zeros(300))
    optimizer = udt.LossTolerantOptimizer(torch.optim.SGD([parameter], lr=0.1), communicator=comm, loss_budget=1.0,
                                          stale_fill=stale_fill, deadline=10.0, copies=1)
    gradient = 1.0 + torch.arange(300, dtype=torch.float32) % 5
    distances = []
    for step in range(steps):
        parameter.grad = gradient.clone()
        optimizer.step()
        owners = torch.empty(300)
        exact.all_gather(comm, optimizer.owner_values(), owners, deadline=10.0)
        if step >= 2:
            distances.append(float((parameter.detach() - owners).abs().max()))
    return distances


def auto_copies(comm, steps):
    """Two-stage steps with copies="auto" under the cluster's loss: the copies each step
    sent (in order) and the final parameters."""
    model = small_model(seed=comm.rank)
    optimizer = udt.LossTolerantOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), communicator=comm,
                                          loss_budget=1.0, deadline=10.0, copies="auto")
    sent = []
    for x, y in batches(comm.rank, steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        sent.append(optimizer._step_copies())
        optimizer.step()
        optimizer.zero_grad()
    assert sum(optimizer.copies_used.values()) == steps
    return sent, optimizer.last_stats.reduce_fraction


def striped_backend(comm, tag):
    """A "ud" group with two stripes beside Gloo, no loss injected: all_reduce (SUM, AVG; lossy
    calls, so whole only if no datagram is lost) and broadcast of 6 MiB tensors, and 3 DDP steps
    of a model with one 4 MiB parameter (one bucket), the same inputs on both. Returns {name:
    (ud result, gloo result)} and, per lossy ud call (each all_reduce, DDP's last bucket), the
    stripes it ran on and its delivered fraction."""
    options = udt.BackendOptions(loss_budget=0.1, deadline=10.0, communicator={"stripes": 2})  # lossy: striped, stats kept
    generator = torch.Generator().manual_seed(7 + comm.rank)
    inputs = {op: torch.randn(3 << 19, generator=generator) for op in ("SUM", "AVG")}
    source = torch.randn(3 << 19, generator=generator)
    data = [(torch.randn(6, 1024, generator=generator), torch.randn(6, 1024, generator=generator)) for _ in range(3)]
    out, calls = {}, {}

    def record(group, name):
        stats, group.last_stats = group.last_stats, None  # None: a call that keeps no stats is seen
        calls[name] = (stats.stripes, stats.delivered_fraction) if stats is not None else None

    with gloo_world(comm, f"striped-{tag}"):
        groups = {"ud": dist.new_group(backend="ud", pg_options=options), "gloo": dist.new_group(backend="gloo")}
        for name, group in groups.items():
            results = {}
            for op, tensor in inputs.items():
                results[f"all_reduce_{op}"] = tensor.clone()
                dist.all_reduce(results[f"all_reduce_{op}"], op=getattr(dist.ReduceOp, op), group=group)
                if name == "ud":
                    record(group, f"all_reduce_{op}")
            results["broadcast"] = source.clone()
            dist.broadcast(results["broadcast"], src=1, group=group)
            torch.manual_seed(comm.rank)  # ranks start apart; DDP's broadcast aligns them
            model = torch.nn.Linear(1024, 1024, bias=False)  # one parameter, so one bucket
            ddp = DDP(model, process_group=group)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-2)
            train(ddp, lambda: (optimizer.step(), optimizer.zero_grad()), data)
            if name == "ud":
                record(group, "ddp")
            results["ddp"] = flat_parameters(model)
            out[name] = results
    return {key: (out["ud"][key], out["gloo"][key]) for key in out["ud"]}, calls


def c10d_edges(comm, tag):
    """What a user met at the edges of a "ud" group (each found by probing it): tensors that
    require grad, all-gather outputs of the wrong size, complex and read-only inputs to the exact
    collectives, UD_INJECT, and a group used after it was destroyed. Returns {case: outcome}."""
    out = {}
    with gloo_world(comm, f"edges-{tag}"):
        group = dist.new_group(backend="ud")
        # written in place as Gloo writes them, though autograd forbids in-place writes to leaves
        parameter = torch.nn.Parameter(torch.tensor([1.0 + comm.rank, -2.0 * comm.rank]))
        dist.all_reduce(parameter, op=dist.ReduceOp.MAX, group=group)  # an exact call
        out["MAX into a Parameter"] = parameter.detach().clone()
        matrix = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3) * (comm.rank + 1))
        dist.all_reduce(matrix.t(), group=group)  # a lossy call, on a view of a leaf
        with torch.no_grad():
            matrix.add_(comm.rank)  # so that the broadcast shows
        dist.broadcast(matrix.t(), src=1, group=group)
        out["SUM then broadcast into a view of a Parameter"] = matrix.detach().clone()
        for name, call in {
                "all_gather_into_tensor, an output of 7 for 2 x 3": lambda: dist.all_gather_into_tensor(
                    torch.empty(7), torch.zeros(3), group=group),
                "all_gather, one output for 2 ranks": lambda: dist.all_gather([torch.empty(3)], torch.zeros(3), group=group),
                # found only in the call's verdict (the sizes' checksum): every rank raises the same error
                "all_to_all_single, splits that disagree": lambda: dist.all_to_all_single(
                    torch.empty(3), torch.zeros(3), output_split_sizes=[1, 2],
                    input_split_sizes=[2, 1] if comm.rank == 0 else [1, 2], group=group),
                "all_to_all_single, 5 rows for 2 ranks": lambda: dist.all_to_all_single(
                    torch.empty(5), torch.zeros(5), group=group),
        }.items():
            try:
                call()
                out[name] = "no error"
            except ValueError as error:
                out[name] = str(error)
        # issue order: an all_to_all queued behind an all_reduce reads what the all_reduce wrote
        mine = torch.full((2,), float(comm.rank + 1))
        first = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group, async_op=True)
        exchanged = [torch.zeros(1) for _ in range(2)]
        second = dist.all_to_all(exchanged, list(mine.split(1)), group=group, async_op=True)
        first.wait()
        second.wait()
        out["all_to_all queued behind an all_reduce"] = torch.cat(exchanged)
        kept = torch.tensor([1.0, 2.0]) * (comm.rank + 1)
        dist.reduce(kept, dst=0, group=group)
        out["reduce: the root's sum, the others' own"] = kept
        complex_values = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (comm.rank + 1)
        exact.allreduce(comm, complex_values)
        out["exact complex sum"] = complex_values
        frozen = np.arange(4.0) + comm.rank
        frozen.flags.writeable = False
        for name, call in {"exact.allreduce of a read-only array": lambda: exact.allreduce(comm, frozen),
                           "exact.all_gather into a read-only array": lambda: exact.all_gather(comm, np.zeros(2), frozen)}.items():
            try:
                call()
                out[name] = "no error"
            except ValueError as error:
                out[name] = str(error)
        out["read-only array unchanged"] = bool(np.array_equal(frozen, np.arange(4.0) + comm.rank))
        # a broadcast only reads its source: a read-only one is fine there
        target = frozen if comm.rank == 1 else np.zeros(4)
        exact.broadcast(comm, target, 1)
        out["broadcast from a read-only source"] = target.copy()
        os.environ["UD_INJECT"] = "bernoulli:0.2"
        try:
            lossy = dist.new_group(backend="ud", pg_options=udt.BackendOptions(deadline=10.0))
        finally:
            del os.environ["UD_INJECT"]
        dist.all_reduce(torch.ones(1 << 14), group=lossy)
        out["UD_INJECT drops"] = lossy.last_stats.injected_drops
        dist.destroy_process_group(lossy)
        try:
            dist.all_reduce(torch.ones(2), group=lossy)
            out["all_reduce on a destroyed group"] = "no error"
        except Exception as error:  # c10d's logger turns ours into its "not initialized" ValueError
            out["all_reduce on a destroyed group"] = f"{error} (from: {error.__context__})"
        out["destroyed group let go of its store"] = lossy.communicator.store is None
    return out


def _refused_by_the_call(out, name, start):
    """start() makes an async call; out[name] records whether the call itself raised (the caller's
    thread refused it) rather than its wait()."""
    try:
        work = start()
    except (ValueError, TypeError):
        out[f"{name} refused by the call itself"] = True
        raise
    work.wait()


def refusals_of_one_rank(comm, tag):
    """Argument errors only one rank can see (a root's lists; one rank's own wrong outputs), then a
    wrong list on every rank, each followed by an all_reduce on the same group. Returns
    {case: [(what this rank's call raised, the rank the error names)], ..., "after": sums}."""
    n, r = comm.world_size, comm.rank
    root = n - 1
    out = {}
    with gloo_world(comm, f"refusals-{tag}"):
        group = dist.new_group(backend="ud", pg_options=udt.BackendOptions(deadline=120.0))
        cases = {
            "scatter, the root's pieces too short": lambda: dist.scatter(
                torch.empty(3), [torch.zeros(2) for _ in range(n)] if r == root else None, src=root, group=group),
            "gather, the root's outputs too few": lambda: dist.gather(
                torch.zeros(3), [torch.empty(3) for _ in range(n - 1)] if r == root else None, dst=root, group=group),
            "all_gather, one rank's outputs too few": lambda: dist.all_gather(
                [torch.empty(3) for _ in range(n - 1 if r == 0 else n)], torch.zeros(3), group=group),
            "all_gather, every rank's outputs too few": lambda: dist.all_gather(
                [torch.empty(3) for _ in range(n - 1)], torch.zeros(3), group=group),
            "reduce_scatter_tensor, one rank's input too long": lambda: dist.reduce_scatter_tensor(
                torch.empty(2), torch.ones(2 * n + (1 if r == 0 else 0)), group=group),
            "all_to_all_single, one rank's output rows differ": lambda: dist.all_to_all_single(
                torch.empty(2 * n if r == 1 else n), torch.zeros(n), group=group),
            "all_to_all_single, no rows on one rank": lambda: dist.all_to_all_single(
                torch.empty(0 if r == 0 else n), torch.zeros(0 if r == 0 else n), group=group),
            "broadcast of no elements": lambda: dist.broadcast(torch.empty(0), src=0, group=group),
            # the refusing rank has nothing to send: it still makes a round the others' call meets
            "reduce_scatter_tensor, no input on one rank": lambda: dist.reduce_scatter_tensor(
                torch.empty(1), torch.empty(0 if r == 0 else n), group=group),
            # an exact call of no elements on one rank only: its round meets the others' data
            "all_reduce of integers, no elements on one rank": lambda: dist.all_reduce(
                torch.zeros(0 if r == 0 else 2, dtype=torch.int64), group=group),
            # refused inside the call, before the engine: the round goes in its place
            "reduce_scatter_tensor, a float64 output on one rank": lambda: dist.reduce_scatter_tensor(
                torch.empty(1, dtype=torch.float64 if r == 0 else torch.float32), torch.ones(n), group=group),
            # refused on the caller's thread, by the call itself (not at wait()): a reduction the exact
            # path has not, and a tensor off the host (a meta tensor stands in for a CUDA one here)
            "all_reduce, BXOR on one rank": lambda: _refused_by_the_call(out, "BXOR", lambda: dist.all_reduce(
                torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BXOR if r == 0 else dist.ReduceOp.SUM,
                group=group, async_op=True)),
            "broadcast, a tensor off the host on one rank": lambda: _refused_by_the_call(out, "meta", lambda: dist.broadcast(
                torch.empty(2, device="meta" if r == 0 else "cpu"), src=0, group=group, async_op=True)),
        }
        out["after"] = []
        for name, call in cases.items():
            try:
                call()
                out[name] = ("no error", None)
            except Exception as error:  # noqa: BLE001 (the test reads what it was)
                out[name] = (type(error).__name__, getattr(error, "rank", None))
            summed = torch.full((4,), float(r + 1))
            dist.all_reduce(summed, group=group)  # the group goes on: every rank in step
            out["after"].append(summed.tolist())
        # splits on one rank, even on the others: as Gloo allows (the pieces are the same sizes)
        received = torch.empty(n)
        dist.all_to_all_single(received, torch.arange(n, dtype=torch.float32) + 10 * r, group=group,
                               **({"input_split_sizes": [1] * n, "output_split_sizes": [1] * n} if r == 0 else {}))
        out["all_to_all_single, splits on one rank only"] = received.tolist()
    return out


def any_source_receives(comm, tag):
    """Receives from any source (dist.recv/irecv without src) on a "ud" group and on Gloo, the
    same messages: {name: (ud result, gloo result)}, each result only what both backends must
    agree on (who sent what, in which order per sender)."""
    n, r = comm.world_size, comm.rank
    out = {}
    with gloo_world(comm, f"any-{tag}"):
        groups = {"ud": dist.new_group(backend="ud", pg_options=udt.BackendOptions(deadline=10.0)),
                  "gloo": dist.new_group(backend="gloo")}
        for name, group in groups.items():
            got = out[name] = {}
            # torch's test_send_recv_any_source: each rank in turn receives twice from every other
            # rank (recv, then irecv), the others sending at once (blocking sends)
            taken = []
            for receiver in range(n):
                if receiver == r:
                    for _ in range(2 * (n - 1)):
                        landing = torch.full((10,), -1.0)
                        if len(taken) % 2 == 0:
                            sender = dist.recv(landing, group=group)
                        else:
                            work = dist.irecv(landing, group=group)
                            work.wait()
                            sender = work._source_rank()
                        taken.append((sender, bool(landing.eq(sender).all())))
                else:
                    dist.send(torch.full((10,), float(r)), receiver, group=group)
                    dist.send(torch.full((10,), float(r)), receiver, group=group)
            got["torch's pattern: (sender, its values) per message"] = sorted(taken)
            # every other rank sends 5 messages to rank 0 at once; rank 0 posts 5 x (n - 1) receives
            # from any source at once: each message arrives once, each sender's in the order sent
            if r == 0:
                landings = [torch.full((2,), -1, dtype=torch.int64) for _ in range(5 * (n - 1))]
                works = [dist.irecv(landing, group=group, tag=3) for landing in landings]
                for work in works:
                    work.wait()
                sources = [work._source_rank() for work in works]
                got["concurrent: sources match the values"] = all(int(t[0]) == s for t, s in zip(landings, sources))
                got["concurrent: every message once"] = sorted(tuple(t.tolist()) for t in landings)
                got["concurrent: each sender's in order"] = {
                    s: [int(t[1]) for t, source in zip(landings, sources) if source == s] for s in range(1, n)}
            else:
                sends = [dist.isend(torch.tensor([r, k]), 0, group=group, tag=3) for k in range(5)]
                for work in sends:
                    work.wait()
            # a receive naming its source takes that source's next message even when one from any
            # source was posted before it (Gloo's order); the other receives take the rest
            dist.barrier()
            if r == 0:
                anyone, named, later = (torch.full((2,), -1.0) for _ in range(3))
                first = dist.irecv(anyone, group=group, tag=4)
                second = dist.irecv(named, src=1, group=group, tag=4)
                dist.barrier()  # the senders start now
                first.wait()
                second.wait()
                third_sender = dist.recv(later, group=group, tag=4)
                got["mixed: the named receive's"] = named
                got["mixed: the others'"] = sorted([anyone.tolist(), later.tolist()])
                got["mixed: their senders"] = sorted([first._source_rank(), third_sender])
            else:
                dist.barrier()
                if r == 1:
                    dist.send(torch.tensor([1.0, 0.0]), 0, group=group, tag=4)
                    dist.send(torch.tensor([1.0, 1.0]), 0, group=group, tag=4)
                elif r == 2:
                    dist.send(torch.tensor([2.0, 0.0]), 0, group=group, tag=4)
            # messages sent before the receiver took any receive from any source under their tag
            # (on "ud" the senders have not counted them in the store yet: they do once it asks)
            sends = [] if r == 0 else [dist.isend(torch.tensor([r, k]), 0, group=group, tag=5) for k in range(2)]
            dist.barrier()
            if r == 0:
                landings = [torch.full((2,), -1, dtype=torch.int64) for _ in range(2 * (n - 1))]
                sources = []
                for landing in landings:
                    work = dist.irecv(landing, group=group, tag=5)
                    work.wait()
                    sources.append(work._source_rank())
                got["sent before asked: sources match the values"] = all(
                    int(t[0]) == s for t, s in zip(landings, sources))
                got["sent before asked: every message once"] = sorted(tuple(t.tolist()) for t in landings)
                got["sent before asked: each sender's in order"] = {
                    s: [int(t[1]) for t, source in zip(landings, sources) if source == s] for s in range(1, n)}
            for work in sends:
                work.wait()
            dist.barrier(group=group)
        # abort() ends a receive from any source that no message comes to
        aborted = dist.new_group(backend="ud")
        if r == 0:
            waiting = dist.irecv(torch.zeros(1), group=aborted, tag=9)
            aborted.abort()
            try:
                waiting.wait()
                out["abort"] = "no error"
            except ud_transport.TransportError as error:
                out["abort"] = str(error)
        dist.barrier()
        dist.destroy_process_group(aborted)
    result = {key: (out["ud"][key], out["gloo"][key]) for key in out["ud"]}
    result["abort"] = out.get("abort")
    return result


def torch_suite_any_source(comm, tag):
    """torch's own test_send_recv_any_source and its two profiler variants
    (torch/testing/_internal/distributed/distributed_test.py, as shipped in the wheel), their
    bodies run unchanged on a default "ud" group; the suite's file-based barrier is dist.barrier.
    Returns the names of those that ran to the end (any failure raises)."""
    import unittest

    os.environ.setdefault("BACKEND", "ud")  # the suite reads these on import, for its skip decorators
    os.environ.setdefault("WORLD_SIZE", str(comm.world_size))
    from torch.testing._internal.distributed import distributed_test as suite

    class Case(suite.DistributedTest._DistTestBase, unittest.TestCase):
        def _barrier(self, *args, **kwargs):
            dist.barrier()

        def runTest(self):
            pass

    case, passed = Case(), []
    dist.init_process_group("ud", store=dist.PrefixStore(f"suite-{tag}", comm.store), rank=comm.rank,
                            world_size=comm.world_size, pg_options=udt.BackendOptions(deadline=10.0))
    try:
        for name in ("test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
                     "test_send_recv_any_source_torch_profiler"):
            getattr(case, name)()  # a skip raises unittest.SkipTest: not a pass
            passed.append(name)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return passed


DIFFER_DEADLINE_S = 2.0


def calls_that_differ(comm, tag):
    """Calls whose arguments differ between ranks (issue 38): lists with an empty item, exact calls
    of no elements on rank 0 only, another collective or op on rank 0. Each on a "ud" group where every collective is exact, then an all_reduce on the
    same group. Returns {case: (error type, the rank it names, this rank's tensors unchanged)},
    "after": the all_reduce's sums (or its error)."""
    import datetime

    n, r = comm.world_size, comm.rank
    odd = r == 0
    out = {"after": []}
    with gloo_world(comm, f"differ-{tag}"):
        # lossy=(): every collective exact, as the issue's; a short join timeout makes a call the
        # others never pair with fail the test in seconds, not the group's 30 minutes. Calls of
        # different layouts end at once (a peer's JOIN or data of another layout ends the data
        # phase); the short deadline bounds what a regression would cost
        group = dist.new_group(backend="ud", timeout=datetime.timedelta(seconds=60), pg_options=udt.BackendOptions(
            lossy=(), deadline=DIFFER_DEADLINE_S, communicator={"join_timeout_s": 10.0}))
        ints = torch.int32

        def pieces(*sizes, dtype=ints):
            return [torch.arange(size, dtype=dtype) + 10 * r + 1 for size in sizes]

        cases = {
            "allreduce of lists, an empty item on rank 0": lambda: (
                pieces(0, 4) if odd else pieces(4, 4), lambda ts: group.allreduce(ts).wait()),
            "allreduce of lists, one item more on rank 0": lambda: (
                pieces(4, 4) if odd else pieces(4), lambda ts: group.allreduce(ts).wait()),
            "exact.broadcast of no elements on rank 0": lambda: (
                pieces(0 if odd else 4),
                lambda ts: exact.broadcast(group.communicator, ts[0], n - 1, deadline=DIFFER_DEADLINE_S)),
            "exact.all_gather of no elements on rank 0": lambda: (
                pieces(0 if odd else 4, n * (0 if odd else 4)),
                lambda ts: exact.all_gather(group.communicator, ts[0], ts[1], deadline=DIFFER_DEADLINE_S)),
            "exact.allreduce of no elements on rank 0": lambda: (
                pieces(0 if odd else 4), lambda ts: exact.allreduce(group.communicator, ts[0],
                                                                    deadline=DIFFER_DEADLINE_S)),
            "all_reduce MAX on rank 0, SUM elsewhere": lambda: (
                pieces(4), lambda ts: dist.all_reduce(ts[0], op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM,
                                                      group=group)),
            "all_reduce on rank 0, all_gather_into_tensor elsewhere": lambda: (
                pieces(4, 4 * n), lambda ts: dist.all_reduce(ts[0], group=group) if odd else
                dist.all_gather_into_tensor(ts[1], ts[0], group=group)),
            "broadcast on rank 0, scatter elsewhere": lambda: (
                pieces(2 * n if odd else 2), lambda ts: dist.broadcast(ts[0], src=0, group=group) if odd else
                dist.scatter(ts[0], None, src=0, group=group)),
            "reduce on rank 0, all_reduce elsewhere": lambda: (
                pieces(4), lambda ts: dist.reduce(ts[0], dst=0, group=group) if odd else
                dist.all_reduce(ts[0], group=group)),
            "gather on rank 0, all_gather elsewhere": lambda: (
                pieces(3, *([3] * n)), lambda ts: dist.gather(ts[0], ts[1:], dst=0, group=group) if odd else
                dist.all_gather(ts[1:], ts[0], group=group)),
        }
        for name, make in cases.items():
            tensors, call = make()
            kept = [t.clone() for t in tensors]
            try:
                call(tensors)
                outcome = ("no error", None)
            except ud_transport.TransportError as error:
                outcome = (type(error).__name__, getattr(error, "rank", None))
            out[name] = outcome + (all(torch.equal(t, k) for t, k in zip(tensors, kept)),)
            summed = torch.full((4,), r + 1, dtype=ints)
            try:
                dist.all_reduce(summed, group=group)  # the group goes on in step
                out["after"].append(summed.tolist())
            except ud_transport.TransportError as error:
                out["after"].append(type(error).__name__)
    return out


def a_message_of_no_elements(comm, tag):
    """Rank 0 sends 0 elements where rank 1 receives 4, then 4 on the same channel. Returns
    (what the first raised, the receiver's tensor unchanged, what the second brought)."""
    import datetime

    r = comm.rank
    with gloo_world(comm, f"empty-message-{tag}"):
        group = dist.new_group(backend="ud", timeout=datetime.timedelta(seconds=60), pg_options=udt.BackendOptions(
            deadline=DIFFER_DEADLINE_S, communicator={"join_timeout_s": 10.0}))
        into = torch.full((4,), -1.0)
        after = torch.zeros(4)
        outcome = []
        for message, received in ((torch.zeros(0), into), (torch.arange(4.0) + 100, after)):
            try:
                if r == 0:
                    dist.send(message, dst=1, group=group, tag=3)
                else:
                    dist.recv(received, src=0, group=group, tag=3)
                outcome.append("no error")
            except ud_transport.TransportError as error:
                outcome.append(type(error).__name__)
    return outcome, bool((into == -1.0).all()), after.tolist()


def all_gather_coalesced_against_gloo(comm, tag):
    """all_gather_coalesced with as many inputs as ranks (rank r's input k: 2 elements of
    r * 10 + k + 1) on "ud" and on Gloo: {backend: outputs[rank][input] as lists}."""
    import warnings

    n, r = comm.world_size, comm.rank
    out = {}
    with gloo_world(comm, f"coalesced-{tag}"):
        for backend in ("ud", "gloo"):
            group = dist.new_group(backend=backend)
            inputs = [torch.full((2,), float(r * 10 + k + 1)) for k in range(n)]
            outputs = [[torch.empty(2) for _ in range(n)] for _ in range(n)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated in torch, still c10d's API
                dist.all_gather_coalesced(outputs, inputs, group=group)
            out[backend] = [[t.tolist() for t in row] for row in outputs]
    return out


def ddp_under_icmp_storm(comm, tag, steps, rate_per_rank, loss):
    """DDP on a "ud" group for `steps` steps at `loss` injected loss, while this rank forges ICMP
    errors of every type and code at `rate_per_rank` a second against its own group socket,
    quoting datagrams to each peer (a stranger's session id). Returns (the step errors, the flat
    parameters, forged ICMP sent, what the group's sockets counted)."""
    import threading

    import icmp_forge

    with gloo_world(comm, f"storm-{tag}"):
        inject = ud_transport.Bernoulli(loss, seed=17 + comm.rank) if loss else None
        group = dist.new_group(backend="ud", pg_options=udt.BackendOptions(communicator={"inject": inject}))
        backend = group  # the ProcessGroupUD itself
        addresses = [None] * comm.world_size
        dist.all_gather_object(addresses, backend.communicator.address)
        me = icmp_forge.endpoint(addresses[comm.rank])
        targets = [(me, icmp_forge.endpoint(addresses[p]), comm.rank) for p in range(comm.world_size) if p != comm.rank]
        stop, sent = threading.Event(), [0]

        def storm():
            forgers = [icmp_forge.Forger(victim, peer, backend.communicator.session_id ^ 0x5A5A, sender)
                       for victim, peer, sender in targets]
            start = time.monotonic()
            while not stop.is_set():
                for _ in range(25):
                    forgers[sent[0] % len(forgers)].send(*icmp_forge.ALL_ERRORS[sent[0] % len(icmp_forge.ALL_ERRORS)])
                    sent[0] += 1
                ahead = sent[0] / rate_per_rank - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)

        model = small_model(seed=comm.rank)
        ddp = DDP(model, process_group=group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        errors = []
        storming = threading.Thread(target=storm, daemon=True)
        storming.start()
        try:
            for x, y in batches(comm.rank, steps):
                try:
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                    optimizer.step()
                except Exception as error:  # a step that fails is what the test counts
                    errors.append(f"{type(error).__name__}: {error}")
                optimizer.zero_grad()
        finally:
            stop.set()
            storming.join(10)
        counted = backend.communicator.udp_counters()
        dist.destroy_process_group(group)
        return errors, flat_parameters(model), sent[0], counted


def sparse_allreduce_against_gloo(comm, tag):
    """A sparse COO allreduce (SUM) on a "ud" group and on Gloo: each rank holds entries at rows
    of its own and rows shared with the others, a different count on each rank, duplicates
    uncoalesced. Returns (ud's result dense, Gloo's result dense)."""
    r, n = comm.rank, comm.world_size
    rows = torch.tensor([[r, (r + 1) % n, n, n] + list(range(r))])
    values = torch.arange(rows.shape[1] * 3, dtype=torch.float32).reshape(-1, 3) + 10 * r
    results = []
    with gloo_world(comm, f"sparse-{tag}"):
        ud_group = dist.new_group(backend="ud")
        for group in (ud_group, None):
            tensor = torch.sparse_coo_tensor(rows, values, (n + 1, 3))
            dist.all_reduce(tensor, group=group)
            results.append(tensor.to_dense())
    return results


def where_calls_run(comm, tag):
    """Which thread runs a "ud" group's all-reduce: a small synchronous one (made without
    async_op) runs on the caller's thread; an asynchronous one, left alone until it ends, on the
    group's thread; a large synchronous one (over the backend's INLINE_MAX_BYTES) on the group's
    thread too. Returns {case: (ran on the caller's thread, the sum is right)}."""
    import threading

    from ud_transport.torch import backend as backend_module

    out = {}
    with gloo_world(comm, f"where-{tag}"):
        group = dist.new_group(backend="ud")
        communicator = group.communicator
        threads = []
        real_allreduce = communicator.allreduce

        def recording(*arguments, **keywords):
            threads.append(threading.get_ident())
            return real_allreduce(*arguments, **keywords)
        communicator.allreduce = recording
        try:
            small = torch.ones(256)
            dist.all_reduce(small, group=group)
            out["small, synchronous"] = (threads[-1] == threading.get_ident(), bool(torch.all(small == comm.world_size)))
            small.fill_(1.0)
            work = dist.all_reduce(small, group=group, async_op=True)
            while not work.is_completed():  # no wait(): a waiter could take the call itself
                time.sleep(0.001)
            work.wait()
            out["small, asynchronous"] = (threads[-1] == threading.get_ident(), bool(torch.all(small == comm.world_size)))
            large = torch.ones(backend_module.INLINE_MAX_BYTES // 4 + 1)
            dist.all_reduce(large, group=group)
            out["large, synchronous"] = (threads[-1] == threading.get_ident(), bool(torch.all(large == comm.world_size)))
        finally:
            communicator.allreduce = real_allreduce
    return out


def replicate_every_mismatch(comm, every_by_rank):
    """Construct LossTolerantOptimizer with this rank's replicate_every; returns the error's
    text (or None) and whether the parameters kept their values."""
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        udt.LossTolerantOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), communicator=comm,
                                  replicate_every=every_by_rank[comm.rank], deadline=10.0)
        error = None
    except ValueError as caught:
        error = str(caught)
    return error, all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def all_to_all_loop_calls(comm, tag, periods, pattern):
    """all_to_all_single on a "ud" group, `periods` times `pattern` ("E": an even call, 2 rows a
    piece; "U": an uneven one, 1 or 2; "W": uneven, 4 to 8; "V": uneven, 6 to 10; "X": uneven, up
    to 9,387 rows of 12 bytes, pieces near 128 KiB; "EEEU" is a mixture of experts whose routing
    comes out even most steps): the engine calls of each."""
    n, r = comm.world_size, comm.rank
    options = udt.BackendOptions(deadline=20.0, communicator={"chunk_bytes": comm.options.chunk_bytes})
    calls = []
    with gloo_world(comm, f"a2a-loop-{tag}"):
        group = dist.new_group(backend="ud", pg_options=options)
        communicator = group.communicator
        for _ in range(periods):
            kinds = {"E": lambda p, q: 2, "U": lambda p, q: 1 + (p + q) % 2, "W": lambda p, q: 4 + (p + q) % 5,
                     "V": lambda p, q: 10 - (p + q) % 5, "X": lambda p, q: 9000 + 387 * ((p + q) % 2)}
            for rows_to in [kinds[kind] for kind in pattern]:
                source = torch.cat([torch.full((rows_to(r, q), 3), 100.0 * r + q) for q in range(n)])
                expected = torch.cat([torch.full((rows_to(p, r), 3), 100.0 * p + r) for p in range(n)])
                output = torch.empty_like(expected)
                before = communicator.sequence
                dist.all_to_all_single(output, source, group=group,
                                       output_split_sizes=[rows_to(p, r) for p in range(n)],
                                       input_split_sizes=[rows_to(r, q) for q in range(n)])
                assert torch.equal(output, expected)
                calls.append(communicator.sequence - before)
    return calls


def all_to_all_calls(comm, tag, inject=None):
    """all_to_all_single on a "ud" group, even and uneven, narrow and wide, sizes given or not,
    pieces past 128 KiB, a disagreement on one pair and a refusal on one rank: per case, (engine
    calls it made, what this rank's output holds equals what the senders sent it), or the error's
    name and whether the output kept its values."""
    n, r = comm.world_size, comm.rank
    options = udt.BackendOptions(deadline=20.0, communicator={"inject": inject, "chunk_bytes": comm.options.chunk_bytes})
    out = {}
    with gloo_world(comm, f"a2a-{tag}"):
        group = dist.new_group(backend="ud", pg_options=options)
        communicator = group.communicator

        def call(name, rows_to, width=3, **splits):
            """Rank r sends rows_to(r, q) rows of `width` to rank q, each row filled with 100 r + q."""
            source = torch.cat([torch.full((rows_to(r, q), width), 100.0 * r + q) for q in range(n)])
            expected = torch.cat([torch.full((rows_to(p, r), width), 100.0 * p + r) for p in range(n)])
            output = torch.full_like(expected, -1.0)
            before = communicator.sequence
            try:
                dist.all_to_all_single(output, source, group=group, **splits)
                out[name] = (communicator.sequence - before, torch.equal(output, expected))
            except Exception as error:  # noqa: BLE001 (the test reads what it was)
                out[name] = (type(error).__name__, torch.equal(output, torch.full_like(expected, -1.0)))

        def even(rows):
            return lambda p, q: rows

        def uneven(p, q):
            return 1 + (p + 2 * q) % 3

        call("even, the group's first", even(2))
        call("even again", even(2))
        call("even, sizes given", even(2), output_split_sizes=[2] * n, input_split_sizes=[2] * n)
        call("uneven", lambda p, q: 1 + (p + q) % 2,
             output_split_sizes=[1 + (p + r) % 2 for p in range(n)], input_split_sizes=[1 + (r + q) % 2 for q in range(n)])
        call("even after uneven", even(2))
        call("even, the same", even(2))
        call("even, wider rows", even(5))
        call("uneven, wider rows", uneven, output_split_sizes=[uneven(p, r) for p in range(n)],
             input_split_sizes=[uneven(r, q) for q in range(n)])
        call("even, wider rows again", even(5))

        def wider(p, q):
            return 4 + (p + 2 * q) % 3  # up to 6 rows of 12 bytes: past the 60 of five

        call("uneven, wider pieces", wider, output_split_sizes=[wider(p, r) for p in range(n)],
             input_split_sizes=[wider(r, q) for q in range(n)])
        call("even, no rows", even(0))
        call("even, one", even(1))
        call("even, one again", even(1))
        over = (128 << 10) // 12 + 1  # rows of 12 bytes: a piece past 128 KiB
        call("even, pieces past 128 KiB", even(over))
        call("even, pieces past 128 KiB again", even(over))
        call("even, pieces past 128 KiB a third time", even(over))
        call("even, pieces past 128 KiB a fourth time", even(over))
        call("even, pieces past 128 KiB a fifth time", even(over))
        a, b = max(n - 2, 0), n - 1  # one more row from a to b, one fewer from b to a; the rest even

        def skewed(p, q):
            return over + (p == a and q == b) - (p == b and q == a)

        call("past 128 KiB, uneven between the last two ranks", skewed,
             output_split_sizes=[skewed(p, r) for p in range(n)], input_split_sizes=[skewed(r, q) for q in range(n)])
        call("even past 128 KiB after an uneven call", even(over))
        call("even past 128 KiB, twice after an uneven call", even(over))
        call("even past 128 KiB, three times after an uneven call", even(over))
        # refused on rank 0 alone (5 rows for 2 or more ranks, no sizes): the others' call ends in
        # LayoutMismatch; the next even call must pair on every rank (the width is forgotten alike)
        refused = torch.zeros(5 if r == 0 else n, 3)
        try:
            dist.all_to_all_single(torch.empty_like(refused), refused, group=group)
            out["refused on rank 0"] = "no error"
        except Exception as error:  # noqa: BLE001
            out["refused on rank 0"] = type(error).__name__
        dist.barrier(group=group)  # rank 0's round in the refused call's place is queued: let it end first
        call("even after a refusal", even(1))
        call("even after a refusal, again", even(1))

        # the last rank sends rank 0 a row more than rank 0 takes: each rank's own sizes pass its
        # checks, only the call can tell
        sends = [2 + (r == n - 1 and q == 0) for q in range(n)]
        source = torch.cat([torch.full((rows, 3), 100.0 * r + q) for q, rows in enumerate(sends)])
        output = torch.full((2 * n, 3), -1.0)
        try:
            dist.all_to_all_single(output, source, group=group, output_split_sizes=[2] * n, input_split_sizes=sends)
            out["the last rank sends rank 0 a row more than it takes"] = "no error"
        except Exception as error:  # noqa: BLE001
            out["the last rank sends rank 0 a row more than it takes"] = (
                type(error).__name__, bool((output == -1.0).all()), str(error))
        call("even after a disagreement", even(2))
    return out
