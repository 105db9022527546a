"""An exact call cut short part way through its repair rounds (issue 38, "also check"): a rank
killed, or a rank's communicator interrupted (what the "ud" group's abort() does). The other
ranks' exact call ends with the same PeerTimeout naming that rank, within the per-call deadline
and its slack for each engine call left, and every rank's tensor keeps its values."""
import exact_fault_tasks
import pytest

import ud_transport
from ud_transport.lab.local_cluster import LocalCluster

WORLD, VICTIM = 3, 2
COUNT = 1 << 18   # int32: 1 MiB a rank, 1024 chunks at chunk_bytes 1024, so an incomplete call is repaired
DEADLINE = 2.0    # per engine call
LOSS = 0.05       # injected: the first call of the exact all-gather comes back incomplete
JOIN_TIMEOUT = 5.0


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_an_exact_allreduce_cut_short_in_its_repair_fails_alike_and_keeps_every_tensor(how):
    survivors = [rank for rank in range(WORLD) if rank != VICTIM]
    with LocalCluster(WORLD, chunk_bytes=1024, join_timeout_s=JOIN_TIMEOUT,
                      inject=ud_transport.Bernoulli(LOSS, seed=21)) as cluster:
        ranks = survivors if how == "kill" else list(range(WORLD))
        if how == "kill":
            cluster.connections[VICTIM].send((exact_fault_tasks.exact_allreduce_cut_short,
                                              (COUNT, VICTIM, how, DEADLINE)))
        outcomes = cluster.run(exact_fault_tasks.exact_allreduce_cut_short, COUNT, VICTIM, how, DEADLINE, ranks=ranks,
                               timeout_s=120)
        if how == "kill":
            cluster.processes[VICTIM].join(10)
            assert not cluster.processes[VICTIM].is_alive(), "the victim outlived its call: it was never killed"
    by_rank = dict(zip(ranks, outcomes))
    for rank in survivors:
        name, blamed, unchanged, elapsed, message = by_rank[rank]
        assert (name, blamed) == ("PeerTimeout", VICTIM), f"rank {rank}: {by_rank[rank]}"
        assert unchanged, f"rank {rank}: tensor changed on error"
        # the first call, then the engine call the victim left (deadline and its slack) or the one it
        # never came to (the join timeout: an interrupted rank is one that does not come)
        assert elapsed < JOIN_TIMEOUT + 2 * (DEADLINE + 1.0), f"rank {rank} took {elapsed:.1f} s"
    if how == "interrupt":
        name, _, unchanged, _, message = by_rank[VICTIM]
        assert name == "TransportError" and "interrupted" in message, by_rank[VICTIM]
        assert unchanged, "the interrupted rank's tensor changed"


def test_calls_of_another_layout_end_at_once_not_at_the_deadline():
    """Ranks that called with another layout see it in each other's JOIN and data: before, each
    waited out the data deadline (its datagrams dropped as mismatched, the layouts compared only
    in the verdict round); now the data phase ends as soon as one is seen. 3 ranks, rank 0 with
    half the elements, a 30 s deadline: LayoutMismatch naming rank 0 on every rank, long before it."""
    with LocalCluster(3, chunk_bytes=1024, join_timeout_s=60.0) as cluster:
        outcomes = cluster.run(exact_fault_tasks.allreduce_of_another_size, 30.0, timeout_s=120)
    for rank, (name, blamed, elapsed) in enumerate(outcomes):
        assert (name, blamed) == ("LayoutMismatch", 0), (rank, name, blamed)
        assert elapsed < 10.0, f"rank {rank} waited {elapsed:.1f} s of the 30 s deadline"
