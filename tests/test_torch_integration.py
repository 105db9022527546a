"""The torch layer: backend "ud", the DDP comm hook, the two-stage optimizer,
exact collectives, drift and re-alignment; every rank checked."""
import itertools
import threading

import pytest
import torch

import torch_tasks
import ud_transport
from ud_transport.torch import composite
from conftest import get_cluster

_tags = itertools.count()


def tag():
    return f"t{next(_tags)}"


@pytest.mark.parametrize("world", [2, 4])
def test_at_no_loss_ddp_on_ud_the_hook_and_two_stage_equal_ddp_on_gloo(world):
    """20 AdamW steps from different random inits per rank: DDP on backend
    "ud", DDP on Gloo with the lossy hook over ud, and the two-stage step
    (the last two also with every datagram sent twice) reach the parameters
    DDP on Gloo reaches (1e-5), identical on all ranks."""
    per_rank = get_cluster(world, chunk_bytes=256).run(torch_tasks.four_ways_at_no_loss, tag())
    reference = per_rank[0]["gloo"]
    for rank, results in enumerate(per_rank):
        for way, parameters in results.items():
            torch.testing.assert_close(parameters, reference, rtol=0, atol=1e-5, msg=f"rank {rank} {way}")
        assert len(results) == 6
    assert not torch.equal(reference, torch_tasks.flat_parameters(torch_tasks.small_model(0))), "training moved nothing"


def test_c10d_collectives_on_ud_match_gloo():
    """all_gather_into_tensor, reduce_scatter_tensor, all_gather,
    reduce_scatter, all_reduce (SUM/AVG/MAX, float and int64), broadcast,
    barrier, and the composite ones (reduce, gather, scatter, all_to_all_single
    with even and uneven splits, all_to_all, gather_object, scatter_object_list)
    on a "ud" group give what Gloo gives, on every rank, tensors of no elements
    too (the exact calls refused them before)."""
    per_rank = get_cluster(3, chunk_bytes=256).run(torch_tasks.c10d_collectives, tag())
    for rank, results in enumerate(per_rank):
        for name, (ud, gloo) in results.items():
            torch.testing.assert_close(ud, gloo, rtol=0, atol=1e-6, msg=f"rank {rank} {name}")


def test_the_edges_a_user_met_on_a_ud_group():
    """Each case was found by probing the backend as a user would (each failed before its fix):
    a collective into a Parameter or a view of one raised autograd's in-place error after the
    call had run; wrong all-gather outputs were accepted (one rank's shard dropped); the exact
    allreduce dropped the imaginary part and wrote into read-only numpy arrays (a broadcast's
    source is only read, so a read-only one is fine); UD_INJECT was
    ignored by the c10d backend; a destroyed group's collective waited forever, and the group
    kept its store (checked here only as the reference let go: the helper's reproducer, the next
    group's rendezvous reading the old one's addresses, is not run). Also all-to-all's split
    sizes: a disagreement between ranks, seen only in the exchanged table, is the same error on
    every rank (none waits for a call the others left); rows that do not split evenly are refused
    before anything is sent. A reduce leaves the tensors of ranks other than the root as they were
    (Gloo's leave partial sums there). An all_to_all of tensor lists queued behind an all_reduce read
    its inputs when called, before the all_reduce wrote them (a helper's review found it)."""
    for rank, out in enumerate(get_cluster(2, chunk_bytes=256).run(torch_tasks.c10d_edges, tag())):
        torch.testing.assert_close(out["MAX into a Parameter"], torch.tensor([2.0, 0.0]), rtol=0, atol=0)
        torch.testing.assert_close(out["SUM then broadcast into a view of a Parameter"],
                                   torch.arange(6.0).reshape(2, 3) * 3 + 1, rtol=0, atol=1e-6)
        assert "all_gather_into_tensor on 'ud': the output has 7 elements" in out["all_gather_into_tensor, an output of 7 for 2 x 3"]
        assert "all_gather on 'ud' needs 2 outputs" in out["all_gather, one output for 2 ranks"]
        assert out["all_to_all_single, splits that disagree"] == composite.SPLITS_DISAGREE
        assert "input has 5 rows, not a multiple of 2 ranks" in out["all_to_all_single, 5 rows for 2 ranks"]
        torch.testing.assert_close(out["all_to_all queued behind an all_reduce"], torch.tensor([2.0, 2.0]), rtol=0, atol=0)
        expected = torch.tensor([3.0, 6.0]) if rank == 0 else torch.tensor([2.0, 4.0])
        torch.testing.assert_close(out["reduce: the root's sum, the others' own"], expected, rtol=0, atol=0)
        torch.testing.assert_close(out["exact complex sum"], torch.tensor([3 + 6j, 9 - 3j], dtype=torch.complex64))
        assert "read-only" in out["exact.allreduce of a read-only array"]
        assert "read-only" in out["exact.all_gather into a read-only array"]
        assert out["read-only array unchanged"]
        assert out["broadcast from a read-only source"].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert out["UD_INJECT drops"] > 0, f"rank {rank}: UD_INJECT injected nothing on the c10d backend"
        assert "shut down" in out["all_reduce on a destroyed group"], out["all_reduce on a destroyed group"]
        assert out["destroyed group let go of its store"]


def test_backend_policy_raise_makes_wait_raise_and_keeps_the_tensor():
    cluster = get_cluster(3, chunk_bytes=64, inject=ud_transport.Bernoulli(0.3, seed=5))
    for name, unchanged, misses in cluster.run(torch_tasks.backend_wait_raises, tag(), 0.01):
        assert name == "LossBudgetExceeded" and unchanged and misses == 1


@pytest.mark.parametrize("policy", ["skip", "raise", "use"])
def test_two_stage_every_rank_takes_the_same_branch_under_loss(policy):
    """4 ranks, 10% loss, a budget set where the reduce half's missing share
    sits, 200 steps: every rank takes the same branch every step, both
    branches happen, and a skipped or raised step changes neither the
    parameters nor the optimizer state."""
    cluster = get_cluster(4, chunk_bytes=64, inject=ud_transport.Bernoulli(0.1, seed=7))
    per_rank = cluster.run(torch_tasks.two_stage_branches, 200, 0.1, policy)
    branches = [[took for took, _ in rows] for rows, _ in per_rank]
    assert all(b == branches[0] for b in branches), "ranks took different branches"
    missed_name = {"skip": "skipped", "raise": "raised", "use": "stepped"}[policy]
    assert "stepped" in branches[0] and (missed_name in branches[0])
    if policy != "use":
        assert 0 < branches[0].count(missed_name) < len(branches[0]), branches[0]
        for rows, _ in per_rank:
            assert all(unchanged for took, unchanged in rows if took != "stepped")
    counters = per_rank[0][1]
    assert counters["steps"] == 200
    if policy == "use":
        assert counters["used_short"] > 0 and counters["stepped"] + counters["used_short"] == 200, counters
    assert 0.8 < counters["mean_reduce_fraction"] < 1.0 and 0.8 < counters["mean_gather_fraction"] < 1.0, counters


def test_error_feedback_delivers_every_gradient_late_never_twice():
    """Error feedback's invariant at 10% loss: what the owners applied plus what the senders still
    hold back (over N) is exactly the sum of every rank's gradients, so nothing is lost and nothing
    counted twice. The rescaling step (the paper's) does not keep it: its negative control."""
    world, steps = 4, 30
    cluster = get_cluster(world, chunk_bytes=64, inject=ud_transport.Bernoulli(0.1, seed=9))
    pattern = 1.0 + torch.arange(300) % 7
    applied_in_full = -sum((r + 1) for r in range(world)) / world * pattern * sum(s + 1 for s in range(steps))
    per_rank = cluster.run(torch_tasks.feedback_conservation, steps, True)
    held_back = sum(residual for _, residual, _ in per_rank) / world
    assert sum(missed for _, _, missed in per_rank) > 0, "10% loss must make some pieces miss"
    for rank, (parameters, _, _) in enumerate(per_rank):
        torch.testing.assert_close(parameters - held_back, applied_in_full, rtol=1e-6, atol=1e-3, msg=f"rank {rank}")
    rescaled = cluster.run(torch_tasks.feedback_conservation, steps, False)
    assert not torch.allclose(rescaled[0][0], applied_in_full, rtol=1e-6, atol=1e-3)


def test_extrapolated_stale_chunks_follow_a_steady_owner():
    """Every owner moves its shard by the same amount each step: a chunk the all-gather lost,
    filled with its old value plus the owner's last update, equals the owner's value; kept at its
    old value (the paper's rule), it lags by one update."""
    cluster = get_cluster(4, chunk_bytes=64, inject=ud_transport.Bernoulli(0.1, seed=13))
    for distances in cluster.run(torch_tasks.extrapolated_replicas, 30, "extrapolate"):
        assert max(distances[5:]) < 1e-4, distances
    kept = cluster.run(torch_tasks.extrapolated_replicas, 30, "keep")
    assert max(max(d) for d in kept) >= 0.1 * 0.9, kept  # one update of lr x gradient >= 0.1 behind


def test_hook_skips_on_every_rank_together_under_loss():
    cluster = get_cluster(4, chunk_bytes=64, inject=ud_transport.Bernoulli(0.1, seed=7))
    per_rank = cluster.run(torch_tasks.hook_branches, tag(), 200, 0.1)
    taken = [t for t, _ in per_rank]
    assert all(t == taken[0] for t in taken), "ranks took different branches"
    assert True in taken[0] and False in taken[0], taken[0]
    counters = per_rank[0][1]
    assert counters["skipped"] == taken[0].count(False) and counters["stepped"] == taken[0].count(True)


@pytest.mark.parametrize("loss", [0.1, 0.3])
def test_exact_collectives_are_exact_under_loss(loss):
    world, count = 4, 3000
    cluster = get_cluster(world, chunk_bytes=64, inject=ud_transport.Bernoulli(loss, seed=9))
    per_rank = cluster.run(torch_tasks.exact_under_loss, count)
    base = torch.arange(count)
    for rank, out in enumerate(per_rank):
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
            assert torch.equal(out[f"broadcast_{dtype}"], (base * world % 97).to(dtype)), (rank, dtype)
            expected = torch.cat([(base + r).to(dtype) % 50 for r in range(world)])
            assert torch.equal(out[f"all_gather_{dtype}"], expected), (rank, dtype)
        assert torch.equal(out["allreduce_sum"], base.float() * sum(range(1, world + 1))), rank
        assert out["allreduce_max"].tolist() == [world - 1, 0], rank
        assert torch.equal(out["allreduce_sum"], per_rank[0]["allreduce_sum"])


@pytest.mark.parametrize("world, algorithm", [(2, "auto"), (4, "direct"), (4, "ring")])
def test_an_exact_all_gather_of_many_chunks_repairs_what_its_first_call_lost(world, algorithm):
    # 10% loss on 1000 chunks per shard: the first call is never complete; the repairs carry only
    # what some rank lacked (every rank gets a chunk any rank lacks: at 4 ranks about a quarter of
    # the first call's chunks, at 2 about a tenth) and end exact
    # (a ring forwards what it received: a chunk a rank lacks is fresh further on only if it
    # reached that rank some other way, which the masks must say truthfully)
    cluster = get_cluster(world, chunk_bytes=64, algorithm=algorithm, inject=ud_transport.Bernoulli(0.1, seed=11))
    count = 16000 // world
    per_rank = cluster.run(torch_tasks.exact_gather_repaired, count)
    expected = torch.cat([torch.arange(count, dtype=torch.float32) * (r + 1) for r in range(world)])
    for gathered, chunks in per_rank:
        assert torch.equal(gathered, expected)
        assert chunks == per_rank[0][1]  # every rank made the same calls
        first, repairs = chunks[0], chunks[1:]
        assert first == (world - 1) * count // 16 and repairs, chunks  # chunks_total: those a rank receives
        assert sum(repairs) < first / 2, chunks


@pytest.mark.parametrize("world, src", [(2, 1), (4, 2)])
def test_an_exact_broadcast_of_many_chunks_repairs_what_its_first_call_lost(world, src):
    # the root sends again, packed, only the chunks some rank lacks after the first call
    cluster = get_cluster(world, chunk_bytes=64, inject=ud_transport.Bernoulli(0.1, seed=13))
    count = 16000
    per_rank = cluster.run(torch_tasks.exact_broadcast_repaired, count, src)
    for tensor, chunks in per_rank:
        assert torch.equal(tensor, torch.arange(count, dtype=torch.float32) * (src + 1))
        assert len(chunks) >= 2 and len(chunks) == len(per_rank[0][1]), chunks  # incomplete at first, then repaired
    received = [chunks for rank, (_, chunks) in enumerate(per_rank) if rank != src]
    for chunks in received:
        assert sum(chunks[1:]) < chunks[0] / 2, chunks


def test_a_small_exact_all_gather_goes_once_on_a_clean_network_and_in_three_copies_after_a_miss():
    """A small exact all_gather's first call goes in one copy while such calls arrive whole, and
    after one missed in SMALL_CALL_COPIES for a while (exact._FirstCallCopies); its repeats always
    go in SMALL_CALL_COPIES. Every rank makes the same calls, and every result is exact."""
    from ud_transport import exact

    world, count = 3, 100  # 3 x 400 bytes gathered: 19 chunks of 64 bytes, a small call
    clean = get_cluster(world, chunk_bytes=64)
    for _ in range(3):
        for right, log in clean.run(torch_tasks.exact_call_log, "all_gather", count):
            assert right and log == [("all_gather", world * count, 1, 1.0)], log
    lossy = get_cluster(world, chunk_bytes=64, inject=ud_transport.Bernoulli(0.2, seed=23))
    firsts = []
    for _ in range(6):
        per_rank = lossy.run(torch_tasks.exact_call_log, "all_gather", count)
        log = per_rank[0][1]
        assert all(right and rank_log == log for right, rank_log in per_rank), per_rank
        assert all(copies == exact.SMALL_CALL_COPIES for name, _, copies, _ in log[1:] if name == "all_gather"), log
        firsts.append(log[0][2])
    assert firsts[0] == 1 and exact.SMALL_CALL_COPIES in firsts[1:], firsts


@pytest.mark.parametrize("collective", ["all_gather", "broadcast"])
def test_an_exact_repair_goes_out_in_copies_and_ends_when_it_arrives_whole(collective):
    """At 1% loss the first call of 2000 chunks lacks some; the masks are exchanged in 3 copies
    (a small call), the repair in the copies that make it cheapest (more than one for so few
    chunks; agreed from the first call's fraction: the same everywhere), and a repair every rank
    took whole is the last call: no mask exchange after it."""
    from ud_transport import _native, exact

    world = 4
    cluster = get_cluster(world, chunk_bytes=64, inject=ud_transport.Bernoulli(0.01, seed=17))
    per_rank = cluster.run(torch_tasks.exact_call_log, collective, 32000 // (world if collective == "all_gather" else 1))
    log = per_rank[0][1]
    assert all(exact_result for exact_result, _ in per_rank)
    assert all(rank_log == log for _, rank_log in per_rank)  # the same calls, copies and (agreed) fractions
    first = log[0]
    mask_words = world * -(-(-(-first[1] // 16) // 8) // 4)  # a bit per 64-byte chunk, packed, in int32 words
    masks = [call for call in log[1:] if call[:2] == ("all_gather", mask_words)]
    assert first[0] == collective and first[2] == 1 and first[3] < 1.0, log
    assert masks and all(copies == exact.SMALL_CALL_COPIES for _, _, copies, _ in masks), log
    repairs = [call for call in log[1:] if call not in masks and call[0] != "agree"]
    assert repairs and all(1 < copies <= _native.MAX_COPIES for _, _, copies, _ in repairs), log
    # no exchange after a repair every rank took whole (one that lost only padding or a chunk its
    # receiver held is followed by an exchange that finds nothing lacking)
    assert all(position == len(log) - 1 for position, call in enumerate(log) if call in repairs and call[3] == 1.0), log
    chunks = repairs[0][1] // 16  # 16 float32 to a 64-byte chunk; every rank but its sender takes each
    assert repairs[0][2] == exact._repair_copies(min(0.5, 1.0 - first[3]), chunks, chunks * (world - 1), first[1] // 16), log


def test_a_repair_takes_copies_while_its_chunks_are_few():
    from ud_transport import _native, exact

    assert exact._repair_copies(0.0, 50, 350, 10000) == 1  # nothing to lose: one copy
    # 8 ranks at MTU 1500, 1% loss: 900 of 11600 chunks lacked, 6300 receptions: 2 copies still lose
    # ~0.6 datagram (a round in half the calls), 3 copies ~0.006 for 8% more bytes
    assert exact._repair_copies(0.01, 900, 6300, 11600) == 3
    # the same at 10% loss: half the chunks lacked; a copy more costs half a call, more than a round
    assert exact._repair_copies(0.1, 6000, 42000, 11600) == 1
    assert exact._repair_copies(0.3, 10, 70, 11600) == _native.MAX_COPIES  # few chunks, heavy loss
    assert exact._repair_copies(0.0001, 5, 5, 11600) == 1  # a stray loss


def test_exact_working_buffers_are_kept_per_communicator_and_never_shared():
    from ud_transport import exact

    class Owner:  # stands for a communicator: the buffers are keyed by it, weakly
        pass

    owner = Owner()
    with exact._borrowed(owner, 1000) as outer:
        with exact._borrowed(owner, 10) as inner:  # an exact call inside another (a mask exchange)
            assert inner.numel() == 10 and outer.numel() == 1000
            assert inner.data_ptr() + 40 <= outer.data_ptr() or outer.data_ptr() + 4000 <= inner.data_ptr()
    with exact._borrowed(owner, 500) as again:
        assert again.data_ptr() == outer.data_ptr()  # the smallest kept buffer that fits, not a new one
    with exact._borrowed(owner, 5) as small:
        assert small.data_ptr() == inner.data_ptr()
    for count in (1, 2, 3, 4, 5):  # nested: each a buffer of its own
        stack = [exact._borrowed(owner, count) for _ in range(count)]
        [context.__enter__() for context in stack]
        [context.__exit__(None, None, None) for context in reversed(stack)]
    assert sorted(buffer.numel() for buffer in exact._buffers[owner]) == [5, 5, 10, 1000]  # the largest kept
    del owner
    assert not any(isinstance(key, Owner) for key in exact._buffers.keys())  # gone with its owner


@pytest.mark.parametrize("attempts, count, loss", [(1, 20000, 0.3), (2, 20000, 0.3), (1, 200, 0.6)])
def test_exact_gives_up_cleanly_after_its_attempts(attempts, count, loss):
    # 200 float32 at 4 ranks: a small broadcast, the flat form (one scatter of its copies); at 60%
    # loss a chunk loses all 3 copies with probability 0.22, so one attempt of 39 receptions is
    # whole with probability ~1e-4 (a second attempt could complete it: not asked here)
    cluster = get_cluster(4, chunk_bytes=64, inject=ud_transport.Bernoulli(loss, seed=9))
    outcomes = cluster.run(torch_tasks.exact_gives_up_cleanly, count, attempts)
    assert {name for name, _ in outcomes} == {"LossBudgetExceeded"}
    assert all(unchanged for _, unchanged in outcomes)


def test_drift_is_measured_and_parameter_sync_removes_it():
    per_rank = get_cluster(3, chunk_bytes=256).run(torch_tasks.drift_and_sync)
    for before, syncs, after, parameters in per_rank:
        assert before["max"] > 0.1 and len(before["per_rank"]) == 3
        assert before == per_rank[0][0]  # the same report everywhere
        assert syncs == (False, True)
        assert after["max"] == 0.0
        assert torch.equal(parameters, torch_tasks.flat_parameters(torch_tasks.small_model(0)))


def test_fsdp2_trains_on_backend_ud_as_on_gloo():
    """fully_shard over a default "ud" group (all-gather and reduce-scatter
    through the backend) reaches Gloo's parameters at no loss."""
    cluster = get_cluster(2, chunk_bytes=256)
    run_tag = tag()
    gloo = cluster.run(torch_tasks.fsdp2_steps, run_tag, "gloo")
    ud = cluster.run(torch_tasks.fsdp2_steps, run_tag, "ud")
    for rank in range(2):
        torch.testing.assert_close(ud[rank], gloo[rank], rtol=0, atol=1e-6, msg=f"rank {rank}")
    assert not torch.equal(gloo[0], torch_tasks.flat_parameters(torch_tasks.small_model(0)))


def test_backend_ud_with_two_stripes_matches_gloo():
    """A "ud" group whose communicator runs two stripes: all_reduce (SUM, AVG) and broadcast
    of 6 MiB tensors and 3 DDP steps over a 4 MiB gradient give what Gloo gives, on every
    rank; the all_reduces and DDP's bucket ran on two stripes and lost nothing."""
    per_rank = get_cluster(2, chunk_bytes=256).run(torch_tasks.striped_backend, tag())
    for rank, (results, calls) in enumerate(per_rank):
        assert calls == {name: (2, 1.0) for name in ("all_reduce_SUM", "all_reduce_AVG", "ddp")}, f"rank {rank}"
        for name, (ud, gloo) in results.items():
            torch.testing.assert_close(ud, gloo, rtol=0, atol=1e-6, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_launches_backend_ud_with_groups_beside_it(world, tmp_path):
    """torchrun starts `world` ranks with init_process_group(backend="ud"):
    allreduce on it, on a "ud" subgroup of ranks 0-1 and on a Gloo group
    beside it, each rank sends to the next around the ring (channels meet
    through the agent's store), then DDP steps leave every rank with the same
    parameters."""
    import json
    import pathlib
    import subprocess
    import sys

    from ud_transport.lab.local_cluster import free_tcp_port

    worker = pathlib.Path(__file__).with_name("torchrun_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
               f"--master-port={free_tcp_port()}", str(worker), str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, result in enumerate(results):
        assert result["world"] == world and result["backend"] == "ud"
        assert result["total"] == world * (world + 1) / 2 and result["gloo_total"] == result["total"]
        assert result["pair_total"] == (3.0 if rank < 2 else rank + 1.0)
        assert result["parameters"] == results[0]["parameters"]
        assert result["received"] == [float((rank - 1) % world)] * 3


def test_torchrun_job_shrinks_its_default_group_when_a_rank_leaves(tmp_path):
    """Issue 39's c10d group API under torchrun: 3 ranks; rank 2 exits (status 0) after a first
    allreduce; ranks 0 and 1 see their next allreduce end with the same PeerTimeout naming it,
    tensors unchanged, shrink the default group (torchrun's agent hosts the store, which outlives
    the rank) and sum on the two of them. (A rank SIGKILLed under torchrun makes the agent stop
    every worker: docs/elastic.md, "Requirements".)"""
    import json
    import pathlib
    import subprocess
    import sys

    from ud_transport.lab.local_cluster import free_tcp_port

    worker = pathlib.Path(__file__).with_name("torchrun_shrink_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--master-addr=127.0.0.1",
               f"--master-port={free_tcp_port()}", str(worker), str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert not (tmp_path / "rank2.json").exists()
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["total"] == 6.0
        assert result["outcome"] == ["PeerTimeout", 2] and result["unchanged"], f"rank {rank}: {result}"
        assert (result["after"], result["rank_after"], result["size_after"]) == (3.0, rank, 2), f"rank {rank}: {result}"


def test_phase_aware_budget_tightens_while_the_gradient_norm_moves_and_every_rank_agrees():
    """Warmup steps are critical; a steady norm is stable; a jump of the norm
    makes the following steps critical until the averages meet again (and
    for `hold` steps after); ranks whose local norms differ choose the same."""
    norms = [1.0] * 40 + [3.0] * 150
    per_rank = get_cluster(3, chunk_bytes=256).run(torch_tasks.phase_schedule, norms)
    budgets, fraction = per_rank[0]
    assert all(b == budgets for b, _ in per_rank), "ranks chose different budgets"
    assert budgets[:5] == [0.0] * 5 and budgets[10:40] == [0.1] * 30
    assert budgets[40:45] == [0.0] * 5, "the jump was not seen"
    assert budgets[-1] == 0.1, "the new level never became stable"
    assert 0 < fraction < 0.6


@pytest.mark.parametrize("loss, fewest, most", [(0.0, 1, 1), (0.05, 2, 3), (0.15, 3, 4), (0.45, 4, 4)])
def test_auto_copies_follow_the_measured_loss_the_same_on_every_rank(loss, fewest, most):
    """copies="auto": 1 while nothing is lost; under i.i.d. loss p it settles on the fewest
    copies k with p**k <= 1.5% (5% -> 2, 15% -> 3, 45% -> the most, 4; one more while the
    estimate runs high is allowed: more copies cost bytes, never data), and every rank
    sends the same on every step (the agreed fraction decides)."""
    inject = ud_transport.Bernoulli(loss, seed=37) if loss else None
    per_rank = get_cluster(4, chunk_bytes=64, inject=inject).run(torch_tasks.auto_copies, 120)
    sent = [copies for copies, _ in per_rank]
    assert all(s == sent[0] for s in sent), "ranks sent different copies"
    settled = sent[0][60:]
    assert fewest <= min(settled) and max(settled) <= most, sent[0]


def test_copies_out_of_range_are_refused_before_anything_is_sent():
    import ud_transport.torch as udt

    model = torch.nn.Linear(2, 2)
    for bad in (0, ud_transport._native.MAX_COPIES + 1, True, 2.0, "always"):
        with pytest.raises(ValueError, match="copies"):
            udt.LossTolerantOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), copies=bad)
        with pytest.raises(ValueError, match="copies"):
            udt.LossyHookState(None, copies=bad)


def test_replicate_every_out_of_range_is_refused_before_anything_is_sent():
    import ud_transport.torch as udt

    model = torch.nn.Linear(2, 2)
    for bad in (0, -1, True, 1.0, "1", 2**31):
        with pytest.raises(ValueError, match="replicate_every"):
            udt.LossTolerantOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), replicate_every=bad)


def test_ranks_that_pass_different_replicate_every_get_the_same_error():
    """replicate_every must match across the group (each pair's calls must): a mismatch, None
    against a number included, is the same ValueError on every rank at construction, before any
    pair is opened, and the parameters keep their values."""
    cluster = get_cluster(3)
    for every in ([1, None, 1], [2, 3, 2]):
        results = cluster.run(torch_tasks.replicate_every_mismatch, every)
        errors = {error for error, _ in results}
        assert len(errors) == 1 and None not in errors and "replicate_every differs" in errors.pop(), results
        assert all(kept for _, kept in results)
    for every in ([None] * 3, [2] * 3):  # alike: no error (the parameters become rank 0's)
        assert [error for error, _ in cluster.run(torch_tasks.replicate_every_mismatch, every)] == [None] * 3


def test_a_replica_fills_only_what_no_owner_holds():
    """resharding.new_pieces: an owner's state wins over a copy of the same range (a copy is as
    old as its last refresh); a copy fills a range no owner holds (``copied``); what neither
    holds restarts (None)."""
    from ud_transport.torch import resharding

    owner = {"exp_avg": torch.full((4,), 1.0), "step": torch.tensor(9.0)}
    copy_of_owner = {"exp_avg": torch.full((4,), -1.0), "step": torch.tensor(8.0)}
    copy_of_dead = {"exp_avg": torch.arange(4.0), "step": torch.tensor(8.0)}
    records = [{"pieces": [(0, 4, 0, torch.zeros(4), owner)], "replica": [(8, 12, 0, copy_of_dead)]},
               {"pieces": [], "replica": [(0, 4, 0, copy_of_owner)]},
               {"pieces": []}]  # a record without copies (a newcomer's, or no replicate_every)
    pieces = resharding.new_pieces(records, (2, 14), [(0, 16)])
    spans = [(p.start, p.stop, p.copied) for p in pieces]
    assert spans == [(2, 4, False), (4, 8, False), (8, 12, True), (12, 14, False)], spans
    assert torch.equal(pieces[0].state["exp_avg"], torch.full((2,), 1.0)), "the owner's state must win"
    assert pieces[1].state is None and pieces[3].state is None
    assert torch.equal(pieces[2].state["exp_avg"], torch.arange(4.0)) and float(pieces[2].state["step"]) == 8.0


def test_a_replica_payload_brings_back_every_state_value_bit_for_bit():
    """shard_replica.pack/unpack, the refresh's wire form: every dtype a state may hold, scalars,
    empty and non-contiguous tensors, odd byte lengths (alignment of the next tensor) and values
    that are not tensors come back equal, dtype and shape included."""
    from ud_transport.torch import resharding
    from ud_transport.torch.shard_replica import owned, pack, unpack

    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    pieces = [(0, 7, 0, {"exp_avg": torch.randn(7, generator=generator), "step": torch.tensor(12.0),
                         "flags": torch.tensor([True, False, True]), "bytes": torch.arange(5, dtype=torch.uint8)}),
              (7, 7, 1, {}),
              (7, 37, 1, {"transposed": wide.t(), "half": torch.randn(3, generator=generator).half(),
                          "empty": torch.empty(0, 4), "count": 3, "lr_scale": 0.5, "name": "x", "none": None,
                          "complex": torch.randn(2, dtype=torch.complex128, generator=generator),
                          "ints": torch.arange(-3, 4, dtype=torch.int64)})]
    payload, sizes = pack(pieces)
    assert payload.dtype == torch.uint8 and int(sizes.sum()) <= payload.numel() and payload.numel() % 16 == 0
    assert not payload[int(sizes.sum()):].any(), "padding is zeros"
    back = unpack(payload.clone(), int(sizes[0]), int(sizes[1]))  # as received: a buffer of its own
    back = resharding.from_bytes(resharding.to_bytes(owned(back)))  # as a regroup's record carries the copy on
    assert [(a, b, g) for a, b, g, _ in back] == [(a, b, g) for a, b, g, _ in pieces]
    for (_, _, _, sent), (_, _, _, got) in zip(pieces, back):
        assert list(got) == list(sent)
        for name, value in sent.items():
            if torch.is_tensor(value):
                assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
                assert torch.equal(got[name], value), name
            else:
                assert got[name] == value, name
    # the payload is a snapshot: a later change of the state does not reach it
    pieces[0][3]["exp_avg"].add_(1.0)
    assert not torch.equal(unpack(payload.clone(), int(sizes[0]), int(sizes[1]))[0][3]["exp_avg"],
                           pieces[0][3]["exp_avg"])


def _replica_on_stand_in_pairs(exchange):
    """A NeighbourReplica whose pairs are stand-ins (no communicator is opened) and whose exchange
    is `exchange`: what is under test is what runs on the caller's thread around the exchange."""
    from ud_transport.torch.shard_replica import NeighbourReplica

    replica = NeighbourReplica.__new__(NeighbourReplica)
    replica.rank, replica.deadline, replica.refreshes = 0, None, 0
    replica._held, replica._exchange, replica._failures = None, None, 0
    replica._to_next = replica._from_previous = object()
    replica._run_exchange = exchange
    return replica


def test_a_replicas_copy_and_counts_wait_for_the_refresh_in_flight():
    """refresh returns while its exchange runs; held and failures wait for it, and the next
    refresh starts only after it ended (one exchange at a time on each pair)."""
    release, begun, started = threading.Event(), threading.Event(), []

    def exchange(payload, sizes):
        started.append(int(sizes[0]))
        begun.set()
        release.wait(60)
        replica._held = [(0, 1, 0, {"landed": len(started)})]

    replica = _replica_on_stand_in_pairs(exchange)
    assert replica.refresh([(0, 1, 0, {"m": torch.ones(1)})]) and replica.refreshes == 1
    assert begun.wait(60)
    seen = []
    readers = [threading.Thread(target=lambda: seen.append(replica.held)),
               threading.Thread(target=lambda: seen.append(replica.failures)),
               threading.Thread(target=lambda: seen.append(replica.refresh([(0, 1, 0, {})])))]
    for reader in readers:
        reader.start()
    readers[0].join(0.3)
    assert all(reader.is_alive() for reader in readers) and seen == [] and len(started) == 1, \
        "held, failures and the next refresh must wait for the exchange in flight"
    release.set()
    for reader in readers:
        reader.join(60)
    assert [(0, 1, 0, {"landed": 1})] in seen or [(0, 1, 0, {"landed": 2})] in seen
    replica.wait()  # the second exchange, which the third reader started
    assert len(started) == 2 and replica.held == [(0, 1, 0, {"landed": 2})] and replica.refreshes == 2


def test_a_state_the_replica_cannot_copy_does_not_raise_and_keeps_the_pairs_in_step():
    """A refresh whose state cannot be packed (here a value torch.save cannot pickle) never raises
    into the step: its exchange still runs, and sends the sizes that say so (the next rank then
    skips the payload and counts a failure) instead of leaving the pairs a call apart."""
    sent = []
    replica = _replica_on_stand_in_pairs(lambda payload, sizes: sent.append((payload, sizes.tolist())))
    assert replica.refresh([(0, 1, 0, {"m": torch.ones(1), "f": lambda: 0})])
    replica.wait()
    assert sent == [(None, [-1, 0])]


@pytest.mark.parametrize("world, loss", [(3, 0.0), (4, 0.1)])
def test_send_and_recv_on_ud_deliver_what_gloo_delivers(world, loss):
    """Every rank sends to and receives from both ring neighbours at once (four dtypes), one
    channel carries four messages in order, tags are matched out of order, a receive lands in a
    transposed view, and batch_isend_irecv moves 300 000 floats (many chunks: repaired, not
    repeated): the "ud" group delivers what Gloo delivers, bit for bit, at 10% injected loss too."""
    inject = ud_transport.Bernoulli(loss, seed=11) if loss else None
    cluster = get_cluster(world, chunk_bytes=256, **({"inject": inject} if inject else {}))
    for rank, (results, drops) in enumerate(cluster.run(torch_tasks.point_to_point, tag(), bool(loss))):
        assert ("four in order" in results) == (rank == 1)
        assert (drops > 0) == bool(loss), f"rank {rank}: {drops} datagrams dropped at loss {loss}"
        for name, (ud, gloo) in results.items():
            torch.testing.assert_close(ud, gloo, rtol=0, atol=0, msg=f"rank {rank} {name}")


def test_send_and_recv_at_their_edges():
    """A receive waits for a sender later than its deadline and the store's timeout (the channel's first
    message failed its rendezvous after the store's timeout before, and the channel stayed broken: a reviewer's
    finding); sizes that differ raise on both ends and leave the
    receiver's tensor as it was, also where they pad to the same 32-bit words (3 int16 into 4, 7 bytes into 5
    and 5 into 7: before, cut or padded without an error; a reviewer's finding), and the channel carries the
    next message; a send of two tensors is refused; a destroyed group sends nothing. (A receive from any source
    works since issue 38: tests/test_point_to_point_any_source.py.)"""
    for rank, out in enumerate(get_cluster(2, chunk_bytes=256).run(torch_tasks.point_to_point_edges, tag())):
        if rank == 1:
            assert out["a message sent 4 s after its receive"].tolist() == [1.0, 2.0, 3.0]
            assert out["the next message on that channel"].tolist() == [8.0, 9.0]
        differ = {case: outcome for case, outcome in out.items() if case.startswith("sizes that differ")}
        assert len(differ) == 4 and set(differ.values()) == {"LayoutMismatch"}, differ
        assert all(kept for case, kept in out.items() if case.startswith("the receiver's tensor after it")), out
        assert "takes one tensor, got 2" in out["two tensors"]
        assert "shut down" in out["send on a destroyed group"]


def test_a_broadcast_marks_written_only_the_tensors_it_writes():
    """The root's tensor keeps its version (autograd refused the backward through a pipeline
    stage's output once send had bumped it); every other rank's is marked written."""
    steps = get_cluster(3, chunk_bytes=256).run(torch_tasks.broadcast_version_steps)
    assert steps == [(0, 0.0), (1, 0.0), (1, 0.0)]


@pytest.mark.parametrize("world, schedule", [(2, "ScheduleGPipe"), (3, "Schedule1F1B")])
def test_pipeline_parallel_training_on_ud_matches_gloo(world, schedule):
    """torch.distributed.pipelining trains a model split into one stage per rank on a "ud" group
    (activations and gradients by send and recv, shapes by send_object_list) to the parameters
    and losses it reaches on Gloo, bit for bit, on every stage."""
    per_rank = get_cluster(world, chunk_bytes=256).run(torch_tasks.pipeline_training, tag(), schedule)
    for rank, (ud, gloo, ud_losses, gloo_losses) in enumerate(per_rank):
        torch.testing.assert_close(ud, gloo, rtol=0, atol=0, msg=f"rank {rank}")
        assert ud_losses.numel() == (6 * 4 if rank == world - 1 else 0)
        torch.testing.assert_close(ud_losses, gloo_losses, rtol=0, atol=0, msg=f"rank {rank} losses")


def test_abort_ends_a_receive_and_a_collective_whose_peer_never_comes():
    """A group's timeout is 30 minutes by default; abort() (c10d's _abort_process_group) ends a
    receive whose sender sends no more, one whose channel the sender never opened (it waited out
    the store's timeout before) and an all_reduce its peer never joins within a second,
    each Work raising that it was interrupted, the tensors as they were (before, abort waited for
    them as shutdown does)."""
    _, (took, errors, inbox_kept, summed_kept, first) = get_cluster(2, chunk_bytes=256).run(
        torch_tasks.abort_ends_what_waits, tag())
    assert first == [1.0, 1.0]
    assert took < 5.0, f"abort took {took:.1f} s"
    for name, error in errors.items():
        assert "interrupted" in error, (name, error)
    assert inbox_kept and summed_kept


def test_a_group_made_again_on_the_same_store_meets_afresh():
    """The second init_process_group("ud") on one store finds its own session and addresses and
    its channels' (their keys carry the incarnation): the message of each round arrives, the
    receiver first in the second (a reviewer's finding: its first message timed out, the old
    group's port closed)."""
    per_rank = get_cluster(2, chunk_bytes=256).run(torch_tasks.group_made_again_on_one_store, tag())
    assert per_rank[1] == [[1.0, 1.0, 1.0], [2.0, 2.0, 1.0]], per_rank


def test_an_argument_error_one_rank_sees_ends_the_call_on_every_rank():
    """A root's wrong scatter or gather list raised there at once while the other ranks waited in
    the call for it until the group's deadline (30 minutes by default; 120 s here). Every call on
    a "ud" group now starts at least one engine call on every rank: a refused one, or one that
    moves nothing (no elements), an agreement round. The others' call then ends at once with
    LayoutMismatch naming the refusing rank (their call has another layout), or pairs with it
    where every rank made the round; either way the next all_reduce finds every rank in step.
    all_to_all_single exchanges every rank's splits, even ones too (a helper's review found that
    skipping the exchange for even splits let a rank whose output rows differed lose data, and
    one with splits beside ranks without fail)."""
    world = 3
    per_rank = get_cluster(world, chunk_bytes=256).run(torch_tasks.refusals_of_one_rank, tag())
    refusing = {"scatter, the root's pieces too short": {2}, "gather, the root's outputs too few": {2},
                "all_gather, one rank's outputs too few": {0}, "all_gather, every rank's outputs too few": {0, 1, 2},
                "reduce_scatter_tensor, one rank's input too long": {0},  # the others' call is lossy, of 2 elements
                "reduce_scatter_tensor, no input on one rank": {0},  # the refusing rank has nothing to send
                "all_reduce, BXOR on one rank": {0}, "broadcast, a tensor off the host on one rank": {0}}
    # found in the call's verdict (the sizes' checksum): the same ValueError everywhere (a rank with no rows made
    # no call at all before, and the others waited)
    everywhere = {"all_to_all_single, one rank's output rows differ", "all_to_all_single, no rows on one rank"}
    for case, refusers in refusing.items():
        for rank, out in enumerate(per_rank):
            if rank in refusers:
                assert out[case] == ("ValueError", None), (case, rank, out[case])
            else:
                assert out[case] == ("LayoutMismatch", min(refusers)), (case, rank, out[case])
    for rank, out in enumerate(per_rank):
        assert all(out[case] == ("ValueError", None) for case in everywhere), (rank, out)
        assert out["broadcast of no elements"] == ("no error", None)  # each rank's round pairs with the others'
        # rank 0 alone makes no data call (an exact call of no elements; a refusal inside the call)
        assert out["all_reduce of integers, no elements on one rank"] == ("LayoutMismatch", 0), (rank, out)
        assert out["reduce_scatter_tensor, a float64 output on one rank"] == (
            ("TypeError", None) if rank == 0 else ("LayoutMismatch", 0)), (rank, out)
        assert out["after"] == [[6.0] * 4] * (len(refusing) + len(everywhere) + 3)
        # the caller's thread refuses what it can see (as Gloo's asserts): the worker never does
        assert (out.get("BXOR refused by the call itself"), out.get("meta refused by the call itself")) == (
            (True, True) if rank == 0 else (None, None)), (rank, out)
        assert out["all_to_all_single, splits on one rank only"] == [10.0 * sender + rank for sender in range(world)]


def test_a_small_synchronous_call_runs_on_its_callers_thread_and_an_asynchronous_one_does_not():
    """c10d says which calls it waits for at once (asyncOp False in their options): a small one
    runs on the caller's thread, with no hand-over; an asynchronous call, and a large one, run on
    the group's thread, so an asynchronous call overlaps the caller's work (DDP's buckets)."""
    for out in get_cluster(2, chunk_bytes=256).run(torch_tasks.where_calls_run, tag()):
        assert out == {"small, synchronous": (True, True), "small, asynchronous": (False, True),
                       "large, synchronous": (False, True)}, out


@pytest.mark.parametrize("world, loss", [(2, 0.0), (3, 0.0), (3, 0.1)])
def test_every_all_to_all_single_is_one_engine_call_without_loss(world, loss):
    """Each rank passes the engine what it sends and what it takes, and nothing else travels: even
    or uneven, sizes given or not, narrow, wide or past 128 KiB, the first of a group or after a
    failure, a call is one engine call, unpadded, and every piece is right (under 10% injected
    loss too). A refusal on one rank (5 rows for 2 or more ranks) is its ValueError and the
    others' LayoutMismatch; a disagreement between two ranks' split sizes is the same ValueError
    on every rank, every output untouched; the next calls pair."""
    inject = ud_transport.Bernoulli(loss, seed=13) if loss else None
    for rank, out in enumerate(get_cluster(world, chunk_bytes=256).run(torch_tasks.all_to_all_calls, tag(), inject)):
        assert out.pop("refused on rank 0") == ("ValueError" if rank == 0 else "LayoutMismatch"), (rank, out)
        assert out.pop("the last rank sends rank 0 a row more than it takes") == (
            "ValueError", True, composite.SPLITS_DISAGREE), (rank, out)
        for case, (calls, right) in out.items():
            assert isinstance(calls, int) and right, (rank, case, out)  # an int: the call ended without error
            if not loss:
                assert calls == 1, (rank, case, calls)
        assert len(out) == 25, sorted(out)


def test_an_all_to_all_loop_of_changing_shapes_is_one_call_a_step():
    """Even and uneven calls in turn, and split sizes that change every call (a mixture of
    experts' routing), pieces near 128 KiB too: every call is one engine call."""
    for per_call in get_cluster(3, chunk_bytes=256).run(torch_tasks.all_to_all_loop_calls, tag(), 3, "EEEUWV"):
        assert per_call == [1] * 18, per_call
    for per_call in get_cluster(2, chunk_bytes=256).run(torch_tasks.all_to_all_loop_calls, tag(), 2, "X"):
        assert per_call == [1, 1], per_call
