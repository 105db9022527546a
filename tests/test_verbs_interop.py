"""Interop of the verbs transport with Debian's pyverbs, an implementation nobody here wrote.

The work is in tests/verbs_guest/guest_interop.py (our engine and transport) and
tests/verbs_guest/pyverbs_peer.py (the peer, run by /usr/bin/python3 with python3-pyverbs);
both run in the SoftRoCE guest, in the one boot the verbs test files share.
"""
import pytest

from conftest import skip_or_fail
from verbs_guest import rig_session


@pytest.mark.rig
def test_interop_with_pyverbs_in_the_softroce_guest():
    if not rig_session.system_has_pyverbs():
        skip_or_fail("/usr/bin/python3 cannot import pyverbs: apt-get install python3-pyverbs")
    rig_session.single_guest_run().check_file("guest_interop.py", minimum_tests=2)
