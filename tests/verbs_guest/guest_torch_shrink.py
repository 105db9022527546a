"""torch.distributed.shrink_group on the "ud" backend over verbs (issue 39), in the SoftRoCE guest.

Three ranks make the default "ud" group with transport="verbs" (ranks sharing rxe0), all-reduce
once, and rank 2 SIGKILLs itself 0.15 s into the second all-reduce (its QP goes with its process:
verbs has no ICMP, the survivors learn it from silence). The survivors' c10d call fails, the
group's last_error is the same PeerTimeout naming rank 2 on both, their tensors keep their values,
and shrink_group([2], SHRINK_ABORT) gives a group of two that sums exactly, still on verbs. The
group's all-reduces are exact (lossy=()), so a failed one leaves every tensor as it was.

torch is imported once by this pytest process (30-80 s under TCG) and the ranks are forked from
it, as ranks.py does for the torch-free tests; they meet through a FileStore in a scratch
directory, which outlives the dead rank."""
import datetime
import multiprocessing
import os
import signal
import tempfile
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import ud_transport
import ud_transport.torch as udt
from conftest import skip_or_fail
from ud_transport import _verbs as verbs

WORLD, VICTIM = 3, 2
DEADLINE = 8.0
LARGE = 4 << 20  # float32 elements: a call long enough under TCG for the kill to land inside it
KILL_AFTER_S = 0.15
RANKS_WAIT_S = 300  # well inside the host's guest timeout (tests/test_verbs_torch.py), which also covers boot and import
# As guest_allreduce.py (TCG is slow), and a join timeout that bounds the wait should the kill land
# before the survivors' call has met the victim: under TCG the c10d path before the engine takes
# long, so the 0.15 s may fall on either side of the meeting (verbs has no ICMP to say "gone").
RIG_TIMING = {"idle_close_us": 500_000, "deadline_cap_s": 60.0, "join_timeout_s": 15.0}


@pytest.fixture(scope="module", autouse=True)
def rdma_device():
    if verbs.verbs_active_device_count() == 0:
        skip_or_fail("no active RDMA device in this guest")


def _rank(rank, path, connection):
    try:
        options = udt.BackendOptions(transport="verbs", deadline=DEADLINE, lossy=(), communicator=dict(RIG_TIMING))
        dist.init_process_group("ud", store=dist.FileStore(path, -1), rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=300), pg_options=options)
        warm = torch.full((1024,), float(rank + 1))
        dist.all_reduce(warm)
        transport = dist.group.WORLD.communicator.transport_name
        tensor = torch.full((LARGE,), float(rank + 1))
        if rank == VICTIM:
            threading.Timer(KILL_AFTER_S, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        started = time.monotonic()
        try:
            dist.all_reduce(tensor)
            cause = None
        except RuntimeError:
            cause = dist.group.WORLD.last_error
        elapsed = time.monotonic() - started
        unchanged = bool(torch.all(tensor == rank + 1.0))
        shrunk = None
        if isinstance(cause, ud_transport.PeerTimeout):
            group = dist.shrink_group([cause.rank], shrink_flags=c10d.SHRINK_ABORT)
            after = torch.full((1 << 16,), float(rank + 1))
            dist.all_reduce(after, group=group)
            shrunk = (group.rank(), group.size(), after.unique().tolist(), group.communicator.transport_name)
        connection.send(("ok", (warm[0].item(), transport, type(cause).__name__ if cause else "OK",
                                getattr(cause, "rank", None), unchanged, elapsed, shrunk)))
    except BaseException as error:  # report, never hang the parent
        connection.send(("error", f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        connection.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_shrink_group_after_a_rank_dies_on_verbs():
    context = multiprocessing.get_context("fork")  # torch is imported already: forking spares each rank its import
    path = os.path.join(tempfile.mkdtemp(prefix="udt-shrink-"), "store")
    children = []
    for rank in range(WORLD):
        parent, child = context.Pipe(duplex=False)
        process = context.Process(target=_rank, args=(rank, path, child), daemon=True)
        process.start()
        child.close()
        children.append((rank, process, parent))
    results = {}
    deadline = time.monotonic() + RANKS_WAIT_S
    for rank, process, connection in children:
        if connection.poll(max(deadline - time.monotonic(), 0)):
            try:
                results[rank] = connection.recv()
            except EOFError:
                process.join(5)
                results[rank] = ("died", process.exitcode)
        else:
            results[rank] = ("silent", None)
    for _, process, _ in children:
        process.join(5)
        if process.is_alive():
            process.kill()
    assert results[VICTIM] == ("died", -signal.SIGKILL), f"the victim: {results[VICTIM]}"
    for rank in range(WORLD):
        if rank == VICTIM:
            continue
        status, value = results[rank]
        assert status == "ok", value
        warm, transport, name, blamed, unchanged, elapsed, shrunk = value
        assert (warm, transport) == (6.0, "verbs"), f"rank {rank}: before the death {warm}, {transport}"
        assert (name, blamed) == ("PeerTimeout", VICTIM), f"rank {rank}: {name} naming {blamed}"
        assert unchanged, f"rank {rank}: the tensor changed on error"
        assert elapsed < RIG_TIMING["join_timeout_s"] + DEADLINE + 5.0, f"rank {rank}: the failed call took {elapsed:.1f} s"
        assert shrunk == (rank, 2, [3.0], "verbs"), f"rank {rank}: on the shrunk group {shrunk}"
