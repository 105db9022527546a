"""A rank's death on a "ud" group, and torch.distributed.shrink_group after it (issue 39).

A rank SIGKILLed in the middle of a collective: every survivor's call ends with the same
PeerTimeout naming it, long before the group's 30 s timeout (UDP: its closed port answers with
ICMP port unreachable), its tensor unchanged; the survivors shrink the group without it (no
message from the dead rank is needed) and the shrunk group sums exactly. Also: shrinking twice,
a subgroup's global ranks, SHRINK_ABORT ending a call that waits on an excluded rank, what torch's
own validation refuses, and DDP re-wrapped on the shrunk group (docs/elastic.md's recipe).

The groups meet through a store this process hosts, as torchrun's agent hosts it: a store that
lives in a rank dies with it."""

import pytest
import shrink_tasks
import torch

from conftest import get_cluster, run_with_victims

DEADLINE = 5.0  # the groups' per-call deadline (shrink_tasks)
# a survivor's call: the victim comes JOIN_AFTER_S late and dies DIE_AFTER_S in; the survivors must
# decide within the deadline and its 1 s slack, far below the group timeout (30 s); 1 s more for a
# loaded 2-core machine
CALL_BOUND_S = shrink_tasks.JOIN_AFTER_S + shrink_tasks.DIE_AFTER_S + DEADLINE + 1.0 + 1.0
SHRINK_BOUND_S = 10.0  # the survivors' rendezvous: a store round trip or a few, not a timeout


def check_stages(by_rank, world, victims_by_stage):
    """Each stage's outcome on every survivor of it: one PeerTimeout naming the victim, within the
    bound, the tensor unchanged, a quick shrink, renumbered in order."""
    first_ranks = list(range(world))
    for stage, victim in enumerate(victims_by_stage):
        dead = first_ranks.pop(victim)
        survivors = [rank for rank in by_rank]
        outcomes = {rank: by_rank[rank]["stages"][stage] for rank in survivors}
        for rank, ((name, blamed, message), elapsed, unchanged, shrink_s, rank_after, size_after, (joined, times),
                   after_kill) in outcomes.items():
            assert (name, blamed) == ("PeerTimeout", victim), f"stage {stage}, rank {rank}: {name} {blamed} {message}"
            assert joined, f"stage {stage}, rank {rank}: the victim died before it joined the call: {times}"
            assert 0 < after_kill < DEADLINE + 1.0, f"stage {stage}, rank {rank}: the call ended {after_kill:.3f} s " \
                                                    "after the kill"
            assert "gone" in message, f"stage {stage}, rank {rank}: {message}"  # its port closed, not a timeout
            assert elapsed < CALL_BOUND_S, f"stage {stage}, rank {rank}: the call took {elapsed:.2f} s"
            assert unchanged, f"stage {stage}, rank {rank}: the tensor changed on error"
            assert shrink_s < SHRINK_BOUND_S, f"stage {stage}, rank {rank}: shrink_group took {shrink_s:.2f} s"
            assert (rank_after, size_after) == (first_ranks.index(rank), len(first_ranks)), \
                f"stage {stage}, first rank {rank} (rank {dead} died): now {rank_after} of {size_after}"
    for rank, result in by_rank.items():
        assert result["ranks"] == list(range(len(first_ranks))), f"rank {rank}: {result['ranks']}"
        assert result["sums"] == (True,) * 4, f"rank {rank}: exact sums on the shrunk group, then on a group made " \
                                              f"after it: {result['sums']}"
        assert result["backend"] == "ud"


@pytest.mark.parametrize("world, victim, algorithm, kind", [
    (3, 1, "ring", "lossy"), (3, 1, "direct", "lossy"),
    (4, 2, "ring", "lossy"), (4, 2, "direct", "lossy"),
    (3, 0, "ring", "exact"),  # rank 0, whose rendezvous role (the session) passes to the next
])
def test_survivors_of_a_sigkill_agree_then_shrink_and_sum_exactly(store_port, world, victim, algorithm, kind):
    by_rank = run_with_victims(world, [victim], shrink_tasks.kill_and_shrink, store_port, f"kill-{world}-{victim}",
                               [victim], algorithm, kind)
    check_stages(by_rank, world, [victim])


def test_shrink_twice_after_two_deaths(store_port):
    """4 ranks: first rank 3 dies (ring), the default group shrinks to 3; then rank 1 of those
    dies, and it shrinks to 2 (ranks 0 and 2 of the first group, now 0 and 1)."""
    by_rank = run_with_victims(4, [3, 1], shrink_tasks.kill_and_shrink, store_port, "twice", [3, 1], "ring", "lossy")
    assert sorted(by_rank) == [0, 2]
    check_stages(by_rank, 4, [3, 1])


def test_a_subgroup_shrunk_twice_keeps_its_global_ranks(store_port):
    """torch maps the survivors' global ranks by removing group ranks from global ones (a
    subgroup of global 1, 2, 3 that excludes its rank 1 would be 2, 3); the "ud" path maps them
    right: 1, 3, then 1. A broadcast from a global rank, and exact sums, on each."""
    per_rank = get_cluster(4).run(shrink_tasks.shrink_a_subgroup_twice, store_port, "subgroup", timeout_s=240)
    first, second = per_rank[1]["after"]
    assert first[:3] == ([1, 3], 2, 3.0) and first[3] == (True, True), first
    assert second[:3] == ([1], 1, 1.0) and second[3] == (True, True), second
    assert per_rank[3]["after"] == [first]
    for rank in (2, 3):
        [refusal] = per_rank[rank]["excluded"]
        assert "exclusion list" in refusal or "ranks_to_exclude" in refusal, refusal
    assert per_rank[0] == {"after": [], "excluded": []}


def test_shrink_abort_ends_a_call_waiting_on_an_excluded_rank(store_port):
    """Rank 2 is alive and never comes to the call ranks 0 and 1 wait in (group timeout 30 s):
    SHRINK_ABORT ends their Work at once with "interrupted", and the new group of two sums
    exactly; rank 2's own shrink_group([2]) is refused."""
    per_rank = get_cluster(3).run(shrink_tasks.abort_what_waits, store_port, "abort", timeout_s=240)
    assert "exclusion list" in per_rank[2], per_rank[2]
    for rank in (0, 1):
        ended, ended_s, shrink_s, sums = per_rank[rank]
        assert "interrupted" in ended, f"rank {rank}: {ended}"
        assert ended_s < SHRINK_BOUND_S and shrink_s < SHRINK_BOUND_S, (rank, ended_s, shrink_s)
        assert sums == (True, True), f"rank {rank}: {sums}"


def test_what_shrink_group_refuses_on_a_ud_group(store_port):
    """torch's own validation, reached on a "ud" group (before, every case raised "Cannot access
    device backend": torch found no backend in it), the backend's own check of pg_options, and a
    group shrunk once and shrunk again (torch destroyed it: RuntimeError, "shut down")."""
    per_rank = get_cluster(3).run(shrink_tasks.refusals, store_port, "refusals", timeout_s=240)
    for rank, out in enumerate(per_rank):
        assert out["every rank"][0] == "ValueError" and "Cannot exclude all 3 ranks" in out["every rank"][1], out
        assert out["nobody"][0] == "ValueError" and "cannot be empty" in out["nobody"][1]
        assert out["a rank twice"][0] == "ValueError" and "Duplicate rank 1" in out["a rank twice"][1]
        assert out["out of range"][0] == "ValueError" and "out of bounds" in out["out of range"][1]
        assert out["a flag torch does not know"][0] == "ValueError"
        assert out["this rank"][0] == "RuntimeError" and "exclusion list" in out["this rank"][1]
        if rank == 0:
            assert out["a group of one"][0] == "ValueError" and "size 1" in out["a group of one"][1]
        if rank != 2:
            assert out["a group already shrunk"][0] == "RuntimeError" and "shut down" in out["a group already shrunk"][1]
        assert out["still works"] == (True, True)
        assert "BackendOptions" in out["backend refuses pg_options of another kind"]


def test_ddp_rewrapped_on_the_shrunk_group_trains_on(store_port):
    """docs/elastic.md's recipe: 3 ranks train a small model under DDP on the default "ud"
    group; rank 2 dies before step 4. Both survivors fail at step 4 with the same PeerTimeout
    naming rank 2, shrink, re-wrap the module in DDP on the shrunk group and finish 10 steps
    with the same parameters, bit for bit."""
    by_rank = run_with_victims(3, [2], shrink_tasks.ddp_recipe, store_port, "ddp", 2, 10, 4)
    (failed_0, outcome_0, flat_0, loss_0), (failed_1, outcome_1, flat_1, loss_1) = by_rank[0], by_rank[1]
    assert failed_0 == failed_1 == 4, (failed_0, failed_1)
    assert outcome_0[0][:2] == outcome_1[0][:2] == ("PeerTimeout", 2), (outcome_0, outcome_1)
    assert outcome_0[1] == outcome_1[1] == "RuntimeError", "DDP raised the collective's error as is"
    assert torch.equal(flat_0, flat_1), "the survivors' parameters differ after re-wrapping"
    assert loss_0 == loss_0 and loss_1 == loss_1  # not NaN
