"""The verbs bindings (ud_transport._verbs, from cython/verbs_*.pxi) and the choices ud_transport makes for verbs.

Here, on any machine: error types and messages, the Q_Key, the address format, GID preference,
settings from options and environment, receive-queue sizing, and what happens without RDMA.
On a real (soft) RDMA device: tests/verbs_guest/guest_bindings.py, run in the SoftRoCE guest by
test_bindings_in_the_softroce_guest (one boot shared with the other verbs test files).
"""
import errno
import os
import pickle
import subprocess
import sys

import pytest

from ud_transport import transports, verbs_extension
from ud_transport.errors import TransportError
from verbs_guest import rig_session

verbs = verbs_extension.load()
if verbs is None:  # a UDP-only build; tests/test_optional_verbs.py covers that case
    pytest.skip(verbs_extension.problem(), allow_module_level=True)

HAS_RDMA = verbs.verbs_active_device_count() > 0


# ---- errors --------------------------------------------------------------------------------

def test_errors_name_the_verb_the_errno_and_the_object():
    error = verbs.verbs_error("ibv_create_ah", errno.EINVAL, "dev=rxe0 port=1 gid_index=1")
    assert str(error) == "ibv_create_ah failed: EINVAL (22) [dev=rxe0 port=1 gid_index=1]"
    assert isinstance(error, verbs.VerbsError) and isinstance(error, OSError) and error.errno == errno.EINVAL
    assert (error.verb, error.object) == ("ibv_create_ah", "dev=rxe0 port=1 gid_index=1")
    detailed = verbs.verbs_error("ibv_open_device", errno.ENODEV, "dev=mlx5_9", "no such device; devices here: rxe0")
    assert str(detailed) == "ibv_open_device failed: ENODEV (19) [dev=mlx5_9]: no such device; devices here: rxe0"


def test_a_missing_feature_has_its_own_type():
    error = verbs.verbs_error("ibv_alloc_dm", errno.EOPNOTSUPP, "dev=rxe0")
    assert type(error) is verbs.VerbsNotSupported and isinstance(error, verbs.VerbsError)
    assert str(error) == "ibv_alloc_dm failed: EOPNOTSUPP (95) [dev=rxe0]"
    assert type(verbs.verbs_error("ibv_post_send", errno.ENOMEM, "qpn=0x1a")) is verbs.VerbsError


def test_errors_survive_pickling_between_processes():
    error = verbs.verbs_error("ibv_post_send", errno.ENOMEM, "dev=rxe0 qpn=0x1a")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is verbs.VerbsError and str(copy) == str(error) and copy.errno == errno.ENOMEM


def test_errors_of_the_c_transport_arrive_as_values():
    # the C transport fills verb, errno and object as fields (native/error.h); nothing parses its text
    with pytest.raises(verbs.VerbsError) as caught:
        verbs.VerbsTransport.open("no_such_dev0", 1, 1, 0x1234)
    error = caught.value
    if HAS_RDMA:
        assert (error.call, error.errno) == ("ibv_open_device", errno.ENODEV)
        assert error.detail.startswith("no such device; devices here: ")
    else:  # no RDMA in this kernel, or RDMA without a device
        assert (error.call, error.errno) in (("ibv_get_device_list", errno.ENOSYS), ("ibv_open_device", errno.ENODEV))
    assert error.verb == error.call and error.object == "dev=no_such_dev0"
    assert str(error).startswith(f"{error.call} failed: {errno.errorcode[error.errno]} ({error.errno}) [dev=no_such_dev0]")
    with pytest.raises(OSError) as caught:  # a check of the transport itself: no verb, no errno
        verbs.VerbsTransport.open("rxe0", 1, 1, 0x80000001)
    assert type(caught.value) is OSError and caught.value.errno is None and "high bit" in str(caught.value)


# ---- with or without RDMA on this machine -------------------------------------------------

def test_transport_choice_follows_the_machine(monkeypatch):
    monkeypatch.delenv("UD_TRANSPORT", raising=False)
    if HAS_RDMA:  # e.g. a machine with RoCE NICs, or the rig's guest
        assert transports.choose("auto") == "verbs" and transports.choose("verbs") == "verbs"
        return
    with pytest.raises(verbs.VerbsError, match=r"^(ibv_get_device_list failed: ENOSYS \(38\)|ibv_open_device failed: ENODEV \(19\))"):
        verbs.Context()  # no RDMA in the kernel, or RDMA but no device
    with pytest.raises(verbs.VerbsError, match=r"\[dev=rxe0\]"):
        verbs.VerbsTransport.open("rxe0", 1, 1, 0x1234)
    with pytest.raises(TransportError, match="transport='verbs' needs an RDMA device with an active port"):
        transports.choose("verbs")
    assert transports.choose("auto") == "udp"


def test_info_says_what_it_would_use_or_why_not():
    environment = {k: v for k, v in os.environ.items() if k != "UD_TRANSPORT"}
    result = subprocess.run([sys.executable, "-m", "ud_transport", "info"], capture_output=True, text=True, env=environment)
    if HAS_RDMA:
        assert result.returncode == 0 and "ud_transport would use:" in result.stdout
        assert "transport='auto' resolves to: verbs" in result.stdout
    else:  # UDP works, so info succeeds and says why verbs does not
        assert result.returncode == 0
        assert "no RDMA devices: ibv_get_device_list failed" in result.stdout or "ibv_open_device failed" in result.stdout
        assert "transport='auto' resolves to: udp" in result.stdout


# ---- on a real device, in the guest ------------------------------------------------------------

@pytest.mark.rig
def test_bindings_in_the_softroce_guest():
    rig_session.single_guest_run().check_file("guest_bindings.py", minimum_tests=18)
