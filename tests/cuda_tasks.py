"""Rank-side functions of the CUDA tests (tests/test_cuda.py), run by LocalCluster on a machine
with a GPU: every rank uses cuda:0. Each returns host tensors for the test to compare."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ud_transport.torch as udt
from ud_transport import exact, staging
from torch_tasks import STEPS, batches, flat_parameters, gloo_world, small_model

DEVICE = "cuda:0"
# awkward sizes: one element, fewer than a chunk, a prime past several chunks, past 1 MiB of float32
SIZES = (1, 7, 4099, (1 << 18) + 3)
ENGINE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32)


def _values(rank, count, dtype, salt=0):
    """Integer-valued inputs (exact in every dtype at these sizes: sums are bitwise comparable)."""
    base = (torch.arange(count, dtype=torch.int64) * (rank + 3) + salt) % 61 - 30
    return base.to(dtype)


def _both(function, rank, count, dtype, salt=0):
    """function(tensor) on a CPU tensor and on a CUDA copy of the same values; returns both
    results on the host."""
    host = _values(rank, count, dtype, salt)
    device = host.to(DEVICE)
    host_result = function(host)
    device_result = function(device)
    return host_result.cpu() if isinstance(host_result, torch.Tensor) else host_result, \
        device_result.cpu() if isinstance(device_result, torch.Tensor) else device_result


def api_collectives(comm, tag):
    """Communicator's collectives and the exact layer on CUDA and on CPU tensors, same inputs, no
    loss: {name: (cpu result, cuda result)}."""
    torch.cuda.set_device(0)
    n, r = comm.world_size, comm.rank
    out = {}
    for dtype in ENGINE_DTYPES:
        for count in SIZES:
            key = f"{str(dtype).split('.')[-1]}x{count}"

            def allreduce(t):
                comm.allreduce(t, loss_budget=0.0, deadline=20.0)
                return t
            out[f"allreduce {key}"] = _both(allreduce, r, count, dtype)

            def broadcast(t):
                comm.broadcast(t, src=n - 1, loss_budget=0.0, deadline=20.0)
                return t
            out[f"broadcast {key}"] = _both(broadcast, r, count, dtype)

            full = count * n

            def reduce_scatter(t):
                start, stop = comm.shard_range(t.numel())
                output = torch.zeros(stop - start, dtype=t.dtype, device=t.device)
                comm.reduce_scatter(t, output, loss_budget=0.0, deadline=20.0)
                return output
            out[f"reduce_scatter {key}"] = _both(reduce_scatter, r, full, dtype)

            def all_gather(t):
                start, stop = comm.shard_range(t.numel())
                output = torch.full_like(t, -1)
                comm.all_gather(t[start:stop].clone(), output, loss_budget=0.0, deadline=20.0)
                return output
            out[f"all_gather {key}"] = _both(all_gather, r, full, dtype)

            def all_to_all(t):
                output = torch.zeros_like(t)
                comm.all_to_all(t, output, loss_budget=0.0, deadline=20.0)
                return output
            out[f"all_to_all {key}"] = _both(all_to_all, r, full, dtype)
    for dtype in (torch.int64, torch.float32, torch.uint8):
        for op in ("sum", "max"):
            def exact_allreduce(t, op=op):
                exact.allreduce(comm, t, op, deadline=20.0)
                return t
            out[f"exact {op} {dtype}"] = _both(exact_allreduce, r, 4099, dtype, salt=40)
    return out


def c10d_collectives(comm, tag):
    """Every c10d collective of a "ud" group on CUDA tensors and on CPU tensors, same inputs:
    {name: (cpu result, cuda result)}."""
    torch.cuda.set_device(0)
    n, r = comm.world_size, comm.rank
    results = {}
    with gloo_world(comm, f"cuda-c10d-{tag}"):
        group = dist.new_group(backend="ud")
        for device in ("cpu", DEVICE):
            got = {}
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                for count in (1, 4099):
                    key = f"{str(dtype).split('.')[-1]}x{count}"
                    t = _values(r, count, dtype).to(device)
                    dist.all_reduce(t, group=group)
                    got[f"all_reduce {key}"] = t
                    t = _values(r, count, dtype).to(device)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                    got[f"all_reduce max {key}"] = t
                    t = _values(r, count, dtype).to(device)
                    dist.broadcast(t, src=n - 1, group=group)
                    got[f"broadcast {key}"] = t
                    gathered = torch.empty(count * n, dtype=dtype, device=device)
                    dist.all_gather_into_tensor(gathered, _values(r, count, dtype).to(device), group=group)
                    got[f"all_gather_into_tensor {key}"] = gathered
                    scattered = torch.empty(count, dtype=dtype, device=device)
                    dist.reduce_scatter_tensor(scattered, _values(r, count * n, dtype).to(device), group=group)
                    got[f"reduce_scatter_tensor {key}"] = scattered
                    pieces = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)]
                    dist.all_gather(pieces, _values(r, count, dtype).to(device), group=group)
                    got[f"all_gather {key}"] = torch.cat(pieces)
                    exchanged = torch.empty(count * n, dtype=dtype, device=device)
                    dist.all_to_all_single(exchanged, _values(r, count * n, dtype).to(device), group=group)
                    got[f"all_to_all_single {key}"] = exchanged
                    t = _values(r, count, dtype).to(device)
                    dist.reduce(t, dst=0, group=group)
                    got[f"reduce {key}"] = t
                    outputs = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)] if r == 0 else None
                    dist.gather(_values(r, count, dtype).to(device), outputs, dst=0, group=group)
                    got[f"gather {key}"] = torch.cat(outputs) if r == 0 else torch.zeros(0)
                    received = torch.empty(count, dtype=dtype, device=device)
                    dist.scatter(received, [_values(k, count, dtype).to(device) for k in range(n)] if r == 0 else None,
                                 src=0, group=group)
                    got[f"scatter {key}"] = received
                    message = _values(r, count, dtype).to(device)
                    if r % 2 == 0 and r + 1 < n:
                        dist.send(message, r + 1, group=group)
                    elif r % 2 == 1:
                        dist.recv(message, r - 1, group=group)
                    got[f"send/recv {key}"] = message
            dist.barrier(group=group)
            objects = [None] * n
            dist.all_gather_object(objects, {"rank": r, "device": "same"}, group=group)
            got["all_gather_object"] = torch.tensor([o["rank"] for o in objects])
            results[device] = {k: v.cpu() for k, v in got.items()}
    return {k: (results["cpu"][k], results[DEVICE][k]) for k in results["cpu"]}


def stream_order(comm, tag, skip_the_event=False):
    """The input of an async all_reduce is written by a kernel queued on a non-default stream just
    before the call (behind a ~50 ms GPU sleep), and the result is consumed on that stream right
    after work.wait(), with no synchronize. Returns the consumed result on the host.
    skip_the_event: the staging's side stream does not wait on the caller's event (the negative
    control: the copy to the host then reads the tensor before the kernel wrote it)."""
    torch.cuda.set_device(0)
    if skip_the_event:
        original = staging.DEVICE.stream_waits
        staging.DEVICE.stream_waits = lambda stream, event: None
    try:
        with gloo_world(comm, f"cuda-stream-{tag}-{skip_the_event}"):
            group = dist.new_group(backend="ud", pg_options=udt.BackendOptions(lossy=()))
            stream = torch.cuda.Stream()
            x = torch.zeros(1 << 20, device=DEVICE)
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the write
                x.fill_(comm.rank + 1.0)
                work = dist.all_reduce(x, group=group, async_op=True)
                work.wait()
                consumed = x * 2  # on `stream`, ordered after the copy back only through wait()
            torch.cuda.synchronize()
            return consumed.cpu()
    finally:
        if skip_the_event:
            staging.DEVICE.stream_waits = original


def _cuda_batches(rank):
    return [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches(rank, STEPS)]


def _train(model, step, data):
    for x, y in data:
        torch.nn.functional.mse_loss(model(x), y).backward()
        step()


def ddp_ways(comm, tag):
    """20 AdamW steps of a CUDA model from each rank's own init: DDP on Gloo (CUDA tensors), DDP on
    a "ud" group, DDP on Gloo with the lossy hook over ud at budget 0, and the two-stage step over
    ud. Returns {way: flat parameters on the host}."""
    torch.cuda.set_device(0)
    data = _cuda_batches(comm.rank)
    results = {}
    with gloo_world(comm, f"cuda-ddp-{tag}"):
        ud_group = dist.new_group(backend="ud")
        for way in ("gloo", "ud_backend", "hook"):
            model = small_model(seed=comm.rank).to(DEVICE)
            ddp = DDP(model, process_group=ud_group if way == "ud_backend" else None)
            optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            if way == "hook":
                state = udt.LossyHookState(comm, loss_budget=0.0)
                ddp.register_comm_hook(state, udt.lossy_allreduce_hook)
                step = lambda: (state.step(optimizer), optimizer.zero_grad())
            else:
                step = lambda: (optimizer.step(), optimizer.zero_grad())
            _train(ddp, step, data)
            results[way] = flat_parameters(model).cpu()
        model = small_model(seed=comm.rank).to(DEVICE)
        optimizer = udt.LossTolerantOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), communicator=comm)
        _train(model, lambda: (optimizer.step(), optimizer.zero_grad()), data)
        results["two_stage"] = flat_parameters(model).cpu()
    return results


def fsdp2_steps(comm, tag, backend, device=DEVICE, steps=5):
    """A two-layer model on `device` under FSDP2 on a default group of `backend`; the full
    parameters on the host after a few SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if torch.cuda.is_available():  # (the CPU reference runs on machines without one too)
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.PrefixStore(f"cuda-fsdp-{tag}-{backend}", comm.store), rank=comm.rank,
                            world_size=comm.world_size)
    try:
        model = small_model(seed=0).to(device)
        # named: without a mesh FSDP2 takes the machine's accelerator, and moves a CPU model there
        mesh = init_device_mesh(torch.device(device).type, (comm.world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in batches(comm.rank, steps):
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]).cpu()
    finally:
        dist.destroy_process_group()


def error_keeps_values(comm, tag):
    """A call refused across ranks (rank 0 passes another size: LayoutMismatch) on CUDA tensors:
    every rank's tensor keeps its values. Returns (error name, tensor before, tensor after)."""
    torch.cuda.set_device(0)
    count = 1000 + (comm.rank == 0)
    t = _values(comm.rank, count, torch.float32).to(DEVICE)
    before = t.cpu()
    try:
        comm.allreduce(t, loss_budget=0.0, deadline=10.0)
        name = None
    except Exception as error:  # the test names which
        name = type(error).__name__
    torch.cuda.synchronize()
    return name, before, t.cpu()


def back_to_back(comm, tag):
    """Two async all_reduces of one CUDA tensor queued at once, a broadcast of it behind them,
    then the waits: the second reads the first's result and the broadcast the second's (as on
    NCCL's one stream). Returns the tensor on the host."""
    torch.cuda.set_device(0)
    with gloo_world(comm, f"cuda-back-to-back-{tag}"):
        group = dist.new_group(backend="ud", pg_options=udt.BackendOptions(lossy=()))
        t = torch.full((1 << 18,), comm.rank + 1.0, device=DEVICE)
        works = [dist.all_reduce(t, group=group, async_op=True), dist.all_reduce(t, group=group, async_op=True),
                 dist.broadcast(t, src=comm.world_size - 1, group=group, async_op=True)]
        for work in works:
            work.wait()
        torch.cuda.synchronize()
        return t.cpu()
