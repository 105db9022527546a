"""A rank dies and a replacement comes, on a bare Communicator with the two-stage step
(issue 39): the survivors shrink the communicator (Communicator.shrink) and re-shard the
optimizer over themselves (LossTolerantOptimizer.regroup); later the group grows by one
(Communicator.grow) and a new process joins it (Communicator.join, LossTolerantOptimizer(join=True)),
taking rank 0's parameters and its shard's optimizer state exactly.

What is checked, on real processes over UDP on loopback, the victim SIGKILLed:
- every survivor's step fails with the same PeerTimeout naming the victim;
- after each move every rank holds the same parameters bit for bit, each range's optimizer state
  is exactly what its previous owner held (the dead rank's range restarted, counted), and each
  piece keeps its parameter group's learning rate;
- training goes on to the end on every rank with the same parameters."""
import pytest
import torch

import elastic_tasks
from conftest import get_cluster, run_with_victims
from ud_transport import Communicator, TransportError, membership


def _by_position(held):
    """{(start, stop): (lr, state)} of a rank's shard_state()."""
    return {(start, stop): (lr, state) for start, stop, lr, state in held}


def _owner_of(position, before):
    """(lr, state) of the old piece holding [low, high), sliced to it; None where no rank held it."""
    low, high = position
    for held in before:
        for start, stop, lr, state in held:
            if start <= low and high <= stop:
                return lr, {name: value[low - start:high - start] if torch.is_tensor(value) and value.dim() == 1
                            else value for name, value in state.items()}
    return None


def check_move(before, after, what, count):
    """Every piece after the move carries its old owner's state bit for bit (or none, where the
    owner is gone, counted as restarted) and its group's learning rate; the shards tile the
    parameters with no gap or overlap."""
    restarted = 0
    for rank, (held, counted) in enumerate(after):
        for (low, high), (lr, state) in _by_position(held).items():
            owner = _owner_of((low, high), before)
            if owner is None:
                assert state == {}, f"{what}, rank {rank}: [{low}, {high}) had no owner but carries state"
                restarted += high - low
                continue
            old_lr, old_state = owner
            assert lr == old_lr, f"{what}, rank {rank}: [{low}, {high}) lr {lr} != {old_lr}"
            assert old_state.keys() == state.keys(), f"{what}, rank {rank}: {sorted(state)} != {sorted(old_state)}"
            for name in state:
                assert torch.equal(torch.as_tensor(state[name]), torch.as_tensor(old_state[name])), \
                    f"{what}, rank {rank}: [{low}, {high}) {name} is not its old owner's"
        assert counted == sum(high - low for (low, high), (_, state) in _by_position(held).items() if not state), \
            f"{what}, rank {rank}: restarted_elements {counted}"
    ranges = sorted((low, high) for held, _ in after for low, high, _, _ in held)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and ranges[0][0] == 0 and ranges[-1][1] == count, \
        f"{what}: {ranges} do not tile [0, {count})"
    return restarted


@pytest.mark.parametrize("world, victim", [(3, 1), (4, 0)])
def test_the_two_stage_step_survives_a_death_and_takes_a_replacement(store_port, world, victim):
    kill_at, rejoin_at, steps = 3, 6, 9
    by_rank = run_with_victims(world + 1, [victim], elastic_tasks.die_shrink_rejoin, store_port, f"elastic-{world}",
                               world, victim, kill_at, rejoin_at, steps)
    survivors = [rank for rank in range(world) if rank != victim]
    newcomer = by_rank[world]
    for rank in survivors:
        result = by_rank[rank]
        name, blamed, message = result["error"]
        assert (name, blamed, result["failed_at"]) == ("PeerTimeout", victim, kill_at), f"rank {rank}: {result['error']}"
        assert result["late_errors"] == (None, None), f"rank {rank}: {result['late_errors']}"
        assert result["after_shrink"]["rank"] == survivors.index(rank)
        assert (result["after_grow"]["rank"], result["after_grow"]["world_size"]) == (survivors.index(rank), world)
    # the shrink: each survivor's new shard carries the old owners' state; the victim's is restarted
    ordered = sorted(survivors, key=lambda rank: by_rank[rank]["after_shrink"]["rank"])
    before = [by_rank[rank]["before_shrink"] for rank in ordered]
    after = [(by_rank[rank]["after_shrink"]["state"], by_rank[rank]["after_shrink"]["restarted"]) for rank in ordered]
    count = by_rank[survivors[0]]["flat"].numel()
    restarted = check_move(before, after, "shrink", count)
    assert 0 < restarted, "the victim's shard had state, and no survivor held it: some range must restart"
    flat = by_rank[ordered[0]]["after_shrink"]["flat"]
    for rank in ordered:
        assert torch.equal(by_rank[rank]["after_shrink"]["flat"], flat), f"rank {rank}: parameters differ after shrink"
    # the grow: the newcomer's shard comes from the survivors exactly; nothing restarts
    assert (newcomer["joined"]["rank"], newcomer["joined"]["world_size"]) == (world - 1, world)
    before = [by_rank[rank]["before_grow"] for rank in ordered]
    after = [(by_rank[rank]["after_grow"]["state"], by_rank[rank]["after_grow"]["restarted"]) for rank in ordered]
    after.append((newcomer["joined"]["state"], newcomer["joined"]["restarted"]))
    assert check_move(before, after, "grow", count) == 0
    assert newcomer["joined"]["state"] and all(state for _, _, _, state in newcomer["joined"]["state"]), \
        "the newcomer's shard must carry the survivors' state"
    flat = by_rank[ordered[0]]["after_grow"]["flat"]
    assert torch.equal(newcomer["joined"]["flat"], flat), "the newcomer's parameters are not the group's"
    for rank in ordered:
        assert torch.equal(by_rank[rank]["after_grow"]["flat"], flat), f"rank {rank}: parameters differ after grow"
    # training went on, the same on every rank
    assert newcomer["error"] is None
    for rank in ordered:
        assert torch.equal(by_rank[rank]["flat"], newcomer["flat"]), f"rank {rank}: parameters differ at the end"


@pytest.mark.parametrize("world, victim", [(3, 1), (4, 3)])
def test_a_dead_ranks_optimizer_state_comes_back_from_its_neighbours_copy(store_port, tmp_path, world, victim):
    """With replicate_every=1 the next rank (rank 0 after the last) holds a copy of each shard's
    state as of the last step: after a death and a shrink, the dead rank's range carries exactly
    the state the dead rank had (it left it in a file before dying), nothing restarts, and
    training goes on alike on every survivor."""
    kill_at, steps = 3, 6
    will = str(tmp_path / "victim.pt")
    by_rank = run_with_victims(world, [victim], elastic_tasks.die_with_a_replica, store_port, f"replica-{world}",
                               world, victim, kill_at, steps, will)
    dead = torch.load(will, weights_only=True)
    survivors = sorted(by_rank, key=lambda rank: by_rank[rank]["after_shrink"]["rank"])
    for rank in survivors:
        result = by_rank[rank]
        assert (result["failed_at"], result["blamed"], result["late_error"]) == (kill_at, victim, None), result
        assert result["refreshed"] == (kill_at, 0), f"rank {rank}: refreshes, failures {result['refreshed']}"
        # the new group's ring is refreshed at each step after the move
        assert result["copies_after"] == (steps - result["resumed_at"], 0), f"rank {rank}: {result['copies_after']}"
    before = [by_rank[rank]["before_shrink"] for rank in survivors] + [dead]
    after = [(by_rank[rank]["after_shrink"]["state"], by_rank[rank]["after_shrink"]["restarted"]) for rank in survivors]
    count = by_rank[survivors[0]]["flat"].numel()
    assert check_move(before, after, "shrink with a replica", count) == 0
    assert all(state for _, _, _, state in dead), "the victim had stepped: its shard had state to copy"
    assert sum(by_rank[rank]["after_shrink"]["copied"] for rank in survivors) == \
        sum(stop - start for start, stop, _, _ in dead)
    for rank in survivors:
        assert torch.equal(by_rank[rank]["flat"], by_rank[survivors[0]]["flat"]), f"rank {rank}: parameters differ"


def test_a_copy_is_as_old_as_its_last_refresh(store_port, tmp_path):
    """replicate_every=2, the victim killed at the start of step 3: the last refresh was after
    step 2 of 3 taken (steps 0 and 1), so the dead range comes back with AdamW's step count at 2
    where the victim's own was 3, and nothing restarts."""
    world, victim, kill_at, steps = 3, 2, 3, 5
    will = str(tmp_path / "victim.pt")
    by_rank = run_with_victims(world, [victim], elastic_tasks.die_with_a_replica, store_port, "replica-every-2",
                               world, victim, kill_at, steps, will, 2)
    dead = torch.load(will, weights_only=True)
    assert {float(state["step"]) for _, _, _, state in dead} == {3.0}
    dead_ranges = [(start, stop) for start, stop, _, _ in dead]
    copied = 0
    for rank, result in by_rank.items():
        assert result["refreshed"] == (1, 0) and result["late_error"] is None, result
        assert result["after_shrink"]["restarted"] == 0
        for low, high, _, state in result["after_shrink"]["state"]:
            if any(start <= low and high <= stop for start, stop in dead_ranges):
                assert float(state["step"]) == 2.0, f"rank {rank}: [{low}, {high}) step {state['step']}"
                copied += high - low
        copied -= result["after_shrink"]["copied"]
    assert copied == 0 and sum(stop - start for start, stop in dead_ranges) == \
        sum(result["after_shrink"]["copied"] for result in by_rank.values())


def test_a_copy_cut_short_by_its_senders_death_leaves_the_one_before(store_port):
    """A rank that dies in the middle of its refresh after step 2 of 3 (its sizes sent, its
    state not; a refresh runs beside the next step, where a death cuts it short) leaves the next
    rank the copy of the refresh before: its range comes back with AdamW's step count at 2,
    that next rank counts the failed refresh, and nothing restarts."""
    world, victim, kill_at, steps = 3, 1, 3, 5
    by_rank = run_with_victims(world, [victim], elastic_tasks.die_with_a_replica, store_port, "replica-cut",
                               world, victim, kill_at, steps, None)
    following = by_rank[(victim + 1) % world]
    assert following["refreshed"][1] == 1, f"the next rank's refreshes, failures: {following['refreshed']}"
    dead_ranges = [_unowned([r["before_shrink"] for r in by_rank.values()], following["flat"].numel())]
    for rank, result in by_rank.items():
        assert result["failed_at"] == kill_at and result["blamed"] == victim and result["late_error"] is None, result
        assert result["after_shrink"]["restarted"] == 0, f"rank {rank}"
    copied = [(low, high, float(state["step"])) for result in by_rank.values()
              for low, high, _, state in result["after_shrink"]["state"]
              if any(start <= low and high <= stop for start, stop in dead_ranges)]
    assert copied and {step for _, _, step in copied} == {2.0}, copied
    assert sum(high - low for low, high, _ in copied) == sum(r["after_shrink"]["copied"] for r in by_rank.values())


def _unowned(shards, count):
    """The one [start, stop) of [0, count) that none of the survivors' `shards` (shard_state()s) covers."""
    owned = sorted((start, stop) for shard in shards for start, stop, _, _ in shard)
    gaps = [(a_stop, b_start) for (_, a_stop), (b_start, _) in zip([(0, 0)] + owned, owned + [(count, count)])
            if a_stop < b_start]
    assert len(gaps) == 1, (owned, count)
    return gaps[0]


@pytest.mark.parametrize("exclusion, error", [
    ("not a list", TypeError), ([], ValueError), ([1, 1], ValueError), ([5], ValueError), ([0, 1, 2], ValueError),
    ([True], TypeError), ([0], RuntimeError),
])
def test_an_exclusion_is_refused_as_torch_refuses_it(exclusion, error):
    with pytest.raises(error):
        membership.exclusion(exclusion, 0, 3)


def test_a_closed_communicator_cannot_grow_and_a_bad_count_is_refused():
    import ud_transport

    comm = ud_transport.init(0, 1, store=_single_store(), transport="udp")
    with pytest.raises(ValueError, match="at least 1"):
        comm.grow(0)
    with pytest.raises(ValueError, match="cannot exclude all"):
        comm.shrink([0])
    ud_transport.close()
    with pytest.raises(ud_transport.TransportError, match="closed"):
        comm.grow(1)


def test_a_newcomer_no_group_seats_gives_up_with_its_ticket():
    with pytest.raises(TransportError, match="no group of 'nobody' grew"):
        Communicator.join(_single_store(), "nobody", timeout_s=0.5)


def _single_store():
    import datetime

    import torch.distributed as dist

    return dist.HashStore() if hasattr(dist, "HashStore") else dist.TCPStore("127.0.0.1", 0, is_master=True,
                                                                               timeout=datetime.timedelta(seconds=5))


def test_ddp_survives_a_death_and_takes_a_replacement_on_the_default_ud_group(store_port):
    """docs/elastic.md's recipe end to end: 3 ranks of DDP with AdamW on the default "ud" group;
    rank 1 dies before step 3, the survivors shrink_group and go on; at step 5 they grow_group(1)
    and a fresh process (other initial weights) joins; at the join every rank holds the same
    parameters and optimizer state bit for bit, and at step 8 the same parameters."""
    by_rank = run_with_victims(4, [1], elastic_tasks.ddp_shrink_rejoin, store_port, "ddp-rejoin", 3, 1, 3, 5, 8)
    survivors = [0, 2]
    for rank in survivors:
        failed_at, outcome, _, _ = by_rank[rank]
        assert failed_at == 3 and outcome[:2] == ("PeerTimeout", 1), f"rank {rank}: {failed_at} {outcome}"
    joined = {rank: by_rank[rank][2] for rank in by_rank}
    assert sorted((j["rank"], j["size"]) for j in joined.values()) == [(0, 3), (1, 3), (2, 3)], joined
    assert joined[3]["rank"] == 2, "the newcomer comes after the survivors"
    reference = joined[0]
    for rank, seen in joined.items():
        assert torch.equal(seen["flat"], reference["flat"]), f"rank {rank}: parameters differ at the join"
        assert seen["state"].keys() == reference["state"].keys() and reference["state"]
        for index, state in seen["state"].items():
            for name, value in state.items():
                assert torch.equal(value, reference["state"][index][name]), f"rank {rank}: {name} differs at the join"
    for rank in by_rank:
        assert torch.equal(by_rank[rank][3], by_rank[0][3]), f"rank {rank}: parameters differ at the end"


def test_a_rank_paused_past_the_deadline_fails_the_call_and_is_not_excluded(store_port):
    """A rank stopped (SIGSTOP) in the middle of a call for longer than the deadline is slow, not
    dead: the others' call fails with a PeerTimeout naming it ("went silent"), and its own call
    fails too when it runs again (no rank takes a result the others refused), every tensor
    unchanged; the library excludes nobody: the next calls on the same communicator, exact and
    lossy, succeed with all three ranks' contributions."""
    per_rank = get_cluster(3).run(elastic_tasks.paused_past_the_deadline, store_port, "paused",
                                  elastic_tasks.DEADLINE + 3.0, timeout_s=240)
    for rank, (outcome, unchanged, sums, size) in enumerate(per_rank):
        name, blamed, message = outcome
        assert name != "OK", f"rank {rank}: the call succeeded although rank 2 was stopped past the deadline"
        if rank != 2:
            assert (name, blamed) == ("PeerTimeout", 2) and "silent" in message, f"rank {rank}: {outcome}"
        assert unchanged, f"rank {rank}: the tensor changed on error"
        assert sums == (6, True) and size == 3, f"rank {rank}: after the pause {sums}, world {size}"


def test_the_ddp_hook_on_gloo_survives_a_death(store_port):
    """docs/elastic.md's recipe for LossyHookState: 3 ranks, DDP on Gloo with the gradients over a
    Communicator; rank 2 dies before step 3; the survivors' state.step() raises the same
    PeerTimeout, they shrink the Communicator, make Gloo's group again and end step 8 with the
    same parameters bit for bit."""
    by_rank = run_with_victims(3, [2], elastic_tasks.hook_shrink, store_port, "hook", 3, 2, 3, 8)
    for rank, (failed_at, outcome, placed, _) in by_rank.items():
        assert failed_at == 3 and outcome[:2] == ("PeerTimeout", 2), f"rank {rank}: {failed_at} {outcome}"
        assert placed == (rank, 2), f"rank {rank}: {placed}"
    assert torch.equal(by_rank[0][3], by_rank[1][3]), "the survivors' parameters differ at the end"


def test_handed_over_state_is_used_only_where_every_rank_holds_it(store_port):
    """hand_over() on the two ranks of a group, then a grow instead of a leave: the newcomer holds
    no handed-over records, so every rank gathers the state afresh (agreed), and the newcomer's
    shard carries the old owners' state bit for bit, nothing restarted, parameters equal."""
    per_rank = get_cluster(3).run(elastic_tasks.hand_over_then_grow, store_port, "handed", timeout_s=240)
    before = [per_rank[0][0], per_rank[1][0]]
    after = [(state, restarted) for _, state, restarted, _ in per_rank]
    count = per_rank[0][3].numel()
    assert check_move(before, after, "grow after hand_over", count) == 0
    assert per_rank[2][1] and all(state for _, _, _, state in per_rank[2][1]), "the newcomer's shard has no state"
    for rank in (1, 2):
        assert torch.equal(per_rank[rank][3], per_rank[0][3]), f"rank {rank}: parameters differ"


def test_a_death_in_the_parameters_all_gather_leaves_the_step_standing(store_port):
    """The victim dies after the owners stepped, as the parameters' all-gather starts (issue 39):
    every survivor's step fails with the same PeerTimeout and shards_stepped True; after the
    shrink and regroup each survivor's updated shard is everyone's parameters there (the step
    stands, it is not taken again) and training goes on alike."""
    world, victim, kill_at, steps = 3, 1, 2, 5
    by_rank = run_with_victims(world, [victim], elastic_tasks.die_in_the_parameter_gather, store_port,
                               "elastic-gather-death", world, victim, kill_at, steps)
    survivors = [rank for rank in range(world) if rank != victim]
    for rank in survivors:
        result = by_rank[rank]
        assert (result["step"], result["error"], result["shards_stepped"]) == (kill_at, ("PeerTimeout", victim), True), \
            f"rank {rank}: {result.get('error')}"
        assert result["late_error"] is None, f"rank {rank}: {result['late_error']}"
        assert torch.equal(result["regrouped"], by_rank[survivors[0]]["regrouped"]), f"rank {rank}: parameters differ"
        assert torch.equal(result["flat"], by_rank[survivors[0]]["flat"]), f"rank {rank}: parameters differ at the end"
        start, stop = result["shard"]
        assert torch.equal(result["regrouped"][start:stop], result["owned"]), f"rank {rank}: its stepped shard was lost"
        assert not torch.equal(result["owned"], result["before"][start:stop]), f"rank {rank}: the owners did not step"
    # the dead owner's range: new rank 0's replica, which its failed all-gather did not write (the step's values there died)
    low, high = by_rank[survivors[0]]["victim_shard"]
    first = by_rank[survivors[0]]
    assert torch.equal(first["regrouped"][low:high], first["before"][low:high])
