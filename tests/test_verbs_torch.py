"""torch.distributed.shrink_group on the "ud" backend over the verbs transport (issue 39), in a
SoftRoCE guest of its own: three ranks on rxe0, one SIGKILLed in an all-reduce, the survivors
agree on it, shrink and sum exactly on verbs (tests/verbs_guest/guest_torch_shrink.py). Its own
boot because importing torch under TCG takes a minute or more."""
import pytest

from verbs_guest import rig_session

TIMEOUT_S = 600


@pytest.mark.rig
def test_shrink_group_on_verbs_in_the_softroce_guest():
    pytest.importorskip("torch", reason="the guest runs this host's Python, and the test needs torch in it")
    rig_session.guest_files_run(["guest_torch_shrink.py"], TIMEOUT_S).check_file("guest_torch_shrink.py",
                                                                                 minimum_tests=1)
