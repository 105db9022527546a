"""Allreduce over the verbs UD transport on rxe, one guest, several ranks on one device.

Runs inside the SoftRoCE guest (tests/test_verbs_allreduce.py boots it). Ranks are forked
processes with the production Communicator on transport="verbs" (see ranks.py for why not
LocalCluster). Exact at zero loss for world sizes 2, 3 and 4; a large call delivers 100%
(the receive queue covers the window); "auto" picks verbs; device and GID options are honored;
a soak under injected loss leaves no QP, CQ, MR, PD or descriptor behind; all_to_all exact at zero
loss and stale-retaining under injected loss; a rank killed mid-call is named alike by the survivors.
"""
import json
import os
import subprocess
import tempfile

import numpy as np
import pytest

import ud_transport
from conftest import skip_or_fail
from support import expected_allreduce, in_place_at_cache_share, many_large, rank_values
from ud_transport import _native as native, _verbs as verbs
from verbs_guest.ranks import run_ranks

# TCG runs ~15x slower than the host and 4 ranks share 2 vCPUs: a healthy upstream can pause
# for many milliseconds, so the engine's idle-after-loss close is stretched to match.
RIG_TIMING = {"idle_close_us": 500_000, "deadline_cap_s": 60.0}
SMALL = {"chunk_bytes": 256, "window_bytes": 256 << 10, **RIG_TIMING}
DTYPES = ["float32", "float64", "float16", "int32"]


@pytest.fixture(scope="module", autouse=True)
def rdma_device():
    if verbs.verbs_active_device_count() == 0:
        skip_or_fail("no RDMA device with an active port here: these tests run in the SoftRoCE guest "
                     "(python -m pytest tests/test_verbs_allreduce.py boots it)")


def store_directory():
    return tempfile.mkdtemp(prefix="udt-store-")


def element_counts(world):
    return sorted({0, 1, max(world - 1, 1), 6 * world + 5, 1000, 20_000})


def exact_cases(comm):
    """Every dtype, op and size on this communicator: [(dtype, op, count, result, delivered, lost)]."""
    out = []
    for dtype in DTYPES:
        for op in ("sum", "mean"):
            for count in element_counts(comm.world_size):
                tensor = rank_values(comm.rank, count, dtype)
                stats = comm.allreduce(tensor, op=op, loss_budget=0.0, deadline=30.0)
                out.append((dtype, op, count, tensor, stats.delivered_fraction, stats.chunks_lost))
    return out, comm.transport_name


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exact_without_loss(world):
    results = run_ranks(range(world), world, store_directory(), exact_cases, transport="verbs", **SMALL)
    for rank, (cases, transport) in enumerate(results):
        assert transport == "verbs"
        for dtype, op, count, result, delivered, lost in cases:
            want = expected_allreduce(world, count, op)
            where = f"rank {rank} {dtype} {op} count {count}"
            assert delivered == 1.0 and lost == 0, where
            if dtype == "int32":
                want = np.round(want) if op == "sum" else np.rint(want)
                np.testing.assert_array_equal(result, want.astype(np.int32), err_msg=where)
            elif op == "sum":
                np.testing.assert_array_equal(result.astype(np.float64), want, err_msg=where)
            else:
                tolerance = 1e-3 if dtype == "float16" else 1e-6
                np.testing.assert_allclose(result.astype(np.float64), want, rtol=tolerance, atol=tolerance, err_msg=where)


def large_calls(comm, count, calls):
    return (*many_large(comm, count, calls), comm.chunk_bytes)


def test_large_allreduce_at_full_mtu_delivers_everything():
    """Default chunk (active MTU - header) and default window: no self-inflicted loss."""
    results = run_ranks(range(4), 4, store_directory(), large_calls, 1 << 20, 3, transport="verbs", **RIG_TIMING)
    for rank, (fractions, lost, exact, chunk_bytes) in enumerate(results):
        assert chunk_bytes == 4096 - native.HEADER_BYTES - (4096 - native.HEADER_BYTES) % 8, chunk_bytes
        assert fractions == [1.0] * 3 and lost == 0 and exact, (rank, fractions, lost)


def allreduce_with_a_death(comm, victim, count, die_after_s, deadline):
    """Every rank allreduces; `victim` SIGKILLs itself `die_after_s` into the call, its QP
    destroyed with its process (UD sends to it then vanish without an error). The others return
    (error class, blamed rank, tensor unchanged?, seconds), then shrink the communicator without
    the blamed rank and return (rank, size, an exact sum right?) on it too."""
    import signal
    import threading
    import time

    tensor = np.full(count, comm.rank + 1.0, dtype=np.float32)
    if comm.rank == victim:
        threading.Timer(die_after_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        comm.allreduce(tensor, loss_budget=0.0, deadline=deadline)
        error = None
    except ud_transport.TransportError as caught:
        error = caught
    elapsed = time.monotonic() - start
    shrunk = None
    if isinstance(error, ud_transport.PeerTimeout):
        with comm.shrink([error.rank]) as survivors:
            ones = np.full(1 << 16, comm.rank + 1.0, dtype=np.float32)
            survivors.allreduce(ones, loss_budget=0.0, deadline=deadline)
            expected = sum(rank + 1.0 for rank in range(comm.world_size) if rank != error.rank)
            shrunk = (survivors.rank, survivors.world_size, bool(np.all(ones == expected)))
    return (type(error).__name__ if error else "OK", getattr(error, "rank", None),
            bool(np.all(tensor == comm.rank + 1.0)), elapsed, shrunk)


def test_a_rank_whose_qp_dies_mid_call_is_named_alike_by_the_survivors():
    """Issue 38's verbs case: 3 ranks, rank 2 killed 0.15 s into a 16 MiB allreduce. Verbs has no
    ICMP: the survivors learn it from its silence, both raise PeerTimeout naming rank 2 within
    the deadline and its slack, tensors unchanged. (At 4 MiB and 0.3 s a fast run of the guest
    finished the call before the kill: rank 0 returned OK, the death landing after rank 2's
    verdict.) Then the survivors shrink the communicator without it (issue 39 on verbs) and sum
    exactly on the two of them."""
    deadline = 8.0
    results = run_ranks(range(3), 3, store_directory(), allreduce_with_a_death, 2, 4 << 20, 0.15, deadline,
                        transport="verbs", dying=(2,), **RIG_TIMING)
    for rank, (name, blamed, unchanged, elapsed, shrunk) in enumerate(results[:2]):
        assert (name, blamed) == ("PeerTimeout", 2), (rank, name, blamed)
        assert unchanged, f"rank {rank}: tensor changed on error"
        assert elapsed < deadline + 0.3 + 3.0, f"rank {rank} took {elapsed:.1f} s"
        assert shrunk == (rank, 2, True), f"rank {rank}: on the shrunk communicator {shrunk}"


def describe(comm):
    return comm.transport_name, comm.chunk_bytes


def test_verbs_ranks_on_one_machine_split_its_cache():
    """The verbs rendezvous counts the ranks on a machine as UDP's does (without LOCAL_WORLD_SIZE):
    each of two sums in place from its half of the guest's cache up, and not 4 bytes below."""
    for ranks_here, at_the_share, below_it in run_ranks(range(2), 2, store_directory(), in_place_at_cache_share,
                                                        transport="verbs", **RIG_TIMING):
        assert (ranks_here, at_the_share, below_it) == (2, True, False)


def test_auto_picks_verbs_when_an_rdma_device_is_active():
    results = run_ranks(range(2), 2, store_directory(), describe, transport="auto", **SMALL)
    assert [transport for transport, _ in results] == ["verbs", "verbs"]


def test_device_and_gid_index_from_the_environment(monkeypatch):
    endpoint = verbs.choose_endpoint()
    monkeypatch.setenv("UD_DEVICE", endpoint["device"])
    monkeypatch.setenv("UD_GID_INDEX", str(endpoint["gid_index"]))
    assert run_ranks(range(2), 2, store_directory(), describe, transport="verbs", **SMALL)[0][0] == "verbs"
    monkeypatch.setenv("UD_GID_INDEX", "200")
    with pytest.raises(RuntimeError, match=rf"TransportError: verbs transport: ibv_query_gid_ex failed: \w+ \(\d+\) "
                                           rf"\[dev={endpoint['device']} port=1 gid_index=200\]"):
        run_ranks([0], 1, store_directory(), describe, transport="verbs", timeout_s=60, **SMALL)


def test_bad_device_option_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"ibv_open_device failed: ENODEV \(19\) \[dev=no_such_dev0\]"):
        run_ranks([0], 1, store_directory(), describe, transport="verbs", device="no_such_dev0", **SMALL)


def injected_loss_calls(comm, calls):
    fractions = []
    for _ in range(calls):
        tensor = np.full(20_000, 1.0, dtype=np.float32)
        stats = comm.allreduce(tensor, loss_budget=1.0, deadline=30.0)
        fractions.append(stats.delivered_fraction)
    return fractions


def test_loss_injection_wraps_the_verbs_transport():
    results = run_ranks(range(3), 3, store_directory(), injected_loss_calls, 3, transport="verbs",
                        inject=ud_transport.Bernoulli(0.1, seed=5), **SMALL)
    fractions = [f for rank in results for f in rank]
    assert all(0.5 < f < 1.0 for f in fractions), fractions


def all_to_all_cases(comm, loss):
    """all_to_all of pieces that name their sender, receiver and position: per case (dtype, block,
    output, chunk mask, chunks_stale, the old value), exact without loss, stale-retaining with it."""
    out = []
    n = comm.world_size
    for dtype in ("float32", "int32", "float16"):
        for block in (0, 1, 333, 5000):
            tensor = np.concatenate([(np.arange(block) % 97 + 100 * comm.rank + 10 * q).astype(dtype) for q in range(n)])
            output = np.full(n * block, -1, dtype=dtype)
            mask = comm.chunk_mask("all_to_all", output)
            stats = comm.all_to_all(tensor, output, loss_budget=1.0 if loss else 0.0, deadline=30.0, chunk_mask=mask)
            out.append((dtype, block, output, mask, stats.chunks_stale))
    return out, comm.chunk_bytes


@pytest.mark.parametrize("world, loss", [(2, 0.0), (3, 0.0), (3, 0.1)])
def test_all_to_all_over_verbs(world, loss):
    """Each piece straight to its receiver over RDMA UD: exact without loss; under injected loss a
    chunk that did not arrive keeps the output's old value and the chunk mask names it."""
    extra = {"inject": ud_transport.Bernoulli(loss, seed=3)} if loss else {}
    results = run_ranks(range(world), world, store_directory(), all_to_all_cases, loss, transport="verbs",
                        **SMALL, **extra)
    stale_seen = 0
    for rank, (cases, chunk_bytes) in enumerate(results):
        for dtype, block, output, mask, stale in cases:
            want = np.concatenate([(np.arange(block) % 97 + 100 * p + 10 * rank).astype(dtype) for p in range(world)])
            step = chunk_bytes // np.dtype(dtype).itemsize
            fresh = np.concatenate([np.repeat(mask[b * -(-block // step):(b + 1) * -(-block // step)], step)[:block]
                                    for b in range(world)]).astype(bool) if block else np.zeros(0, dtype=bool)
            where = f"rank {rank} {dtype} block {block}"
            np.testing.assert_array_equal(output[fresh], want[fresh], err_msg=where)
            np.testing.assert_array_equal(output[~fresh], np.full((~fresh).sum(), -1, dtype=dtype), err_msg=where)
            assert int((mask == 0).sum()) == stale, where
            assert loss or stale == 0, where
            stale_seen += stale
    chunks = sum(len(mask) for cases, _ in results for _, _, _, mask, _ in cases)
    assert (0 < stale_seen < 0.3 * chunks) if loss else stale_seen == 0, (stale_seen, chunks)  # 10%: most arrive


def verbs_resources():
    """This process's verbs objects by kind, as the kernel's resource tracking lists them."""
    counts = {}
    for kind in ("qp", "cq", "mr", "pd"):
        listed = subprocess.run(["rdma", "-j", "resource", "show", kind], capture_output=True, text=True, check=True)
        counts[kind] = sum(entry.get("pid") == os.getpid() for entry in json.loads(listed.stdout or "[]"))
    return counts


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def soak(comm, calls, cycles):
    """`calls` allreduces under injected loss, then `cycles` communicators opened, used and
    closed. Returns the verbs objects and descriptors held at each point."""
    tensor = np.empty(20_000, dtype=np.float32)
    before = (verbs_resources(), open_descriptors())
    for _ in range(calls):
        tensor.fill(comm.rank + 1)
        comm.allreduce(tensor, loss_budget=1.0, deadline=30.0)
    after_calls = (verbs_resources(), open_descriptors())
    during_cycle = None
    for cycle in range(cycles):
        with ud_transport.Communicator(comm.rank, comm.world_size, comm.store, "verbs", comm.options,
                                       name=f"soak-{cycle}") as extra:
            extra.allreduce(np.full(1000, comm.rank + 1, dtype=np.float32), loss_budget=1.0, deadline=30.0)
            during_cycle = during_cycle or (verbs_resources(), open_descriptors())
    after_cycles = (verbs_resources(), open_descriptors())
    return before, after_calls, during_cycle, after_cycles


def test_a_soak_leaves_no_verbs_objects_behind():
    """Issue 10's soak on verbs: 200 allreduces at 5% injected loss hold the same QP, CQ, MR,
    PD and descriptor counts throughout, and 10 communicators opened and closed beside the
    first give back everything they took (each held one QP more while open)."""
    results = run_ranks(range(2), 2, store_directory(), soak, 200, 10, transport="verbs",
                        inject=ud_transport.Bernoulli(0.05, seed=3), **SMALL)
    for rank, (before, after_calls, during_cycle, after_cycles) in enumerate(results):
        assert before[0]["qp"] == 1 and min(before[0].values()) >= 1, (rank, before)
        assert after_calls == before, (rank, before, after_calls)
        assert during_cycle[0]["qp"] == before[0]["qp"] + 1, (rank, before, during_cycle)
        assert after_cycles == before, (rank, before, after_cycles)
