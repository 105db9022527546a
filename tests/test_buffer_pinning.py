"""Issue 10, findings 2 and 13: the engine writes the caller's memory through
a raw address with the GIL released, so the call pins that memory, and a torch
tensor written in place has its autograd version counter bumped."""
import pytest

import tasks
from conftest import get_cluster

WORLD = 2


@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
def test_autograd_refuses_backward_through_a_tensor_a_collective_changed(collective):
    """Every rank's tensor is changed by an allreduce, and every rank's but the root's by a
    broadcast: the root's is only read, so backward through it goes on (send on a "ud" group is a
    broadcast from the sender, and a pipeline sends what its backward needs)."""
    for rank, (before, after, error) in enumerate(get_cluster(WORLD).run(tasks.autograd_sees_in_place_collective,
                                                                         collective)):
        if collective == "broadcast" and rank == 0:
            assert after == before and error is None, (after, before, error)
        else:
            assert after > before
            assert error is not None and "modified by an inplace operation" in error, error


def test_numpy_array_is_pinned_for_the_whole_call():
    """Another thread takes the only other reference, tries to resize the array
    and drops it while the call waits for a late peer: the resize is refused,
    the array stays alive to the end, the result is exact."""
    per_rank = get_cluster(WORLD).run(tasks.resize_during_call, 1, 1.5, "numpy")
    outcome = per_rank[0][0]
    assert outcome == {"resize": "refused", "alive_after_drop": True, "raised": None}, outcome
    assert per_rank[1][1:] == (1.0, True)


def test_torch_tensor_given_other_storage_during_a_call_is_reported():
    """`tensor.data = other` in another thread during a call: the old storage is
    held until the call ends (no write to freed memory), and the call raises on
    that rank instead of returning as if the tensor held the result."""
    per_rank = get_cluster(WORLD).run(tasks.resize_during_call, 1, 1.5, "torch")
    outcome = per_rank[0][0]
    assert outcome["alive_after_drop"] is True
    assert outcome["raised"] and "given other storage" in outcome["raised"], outcome
    assert per_rank[1][1:] == (1.0, True)
