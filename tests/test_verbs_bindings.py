"""The verbs bindings (ud_transport._verbs, from cython/verbs_*.pxi) and the choices ud_transport makes for verbs.

Here, on any machine: error types and messages, the Q_Key, the address format, GID preference,
settings from options and environment, receive-queue sizing, and what happens without RDMA.
On a real (soft) RDMA device: tests/verbs_guest/guest_bindings.py, run in the SoftRoCE guest by
test_bindings_in_the_softroce_guest (one boot shared with the other verbs test files).
"""
import errno
import logging
import os
import pickle
import subprocess
import sys

import pytest

from ud_transport import options, transports, verbs_extension
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


def test_errors_of_the_c_transport_become_the_same_exceptions():
    error = verbs.error_from_native("ibv_query_gid_ex failed: ENODATA (61) [dev=rxe0 port=1 gid_index=9]: no such GID")
    assert type(error) is verbs.VerbsError and error.errno == errno.ENODATA and error.object == "dev=rxe0 port=1 gid_index=9"
    assert type(verbs.error_from_native("ibv_x failed: EOPNOTSUPP (95) [dev=rxe0]")) is verbs.VerbsNotSupported
    plain = verbs.error_from_native("verbs: Q_Key 0x80000001 has the high bit set")
    assert type(plain) is OSError and "high bit" in str(plain)


# ---- session, address, GID choice ---------------------------------------------------------

def test_qkey_is_below_0x80000000_nonzero_and_the_same_for_a_session():
    sessions = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**64 - 1, 0x0123456789ABCDEF, 0xFEDCBA9876543210]
    keys = [verbs.qkey_for_session(s) for s in sessions]
    assert all(0 < k < 0x80000000 for k in keys)
    assert verbs.qkey_for_session(0x0123456789ABCDEF) == verbs.qkey_for_session(0x0123456789ABCDEF)
    assert len({verbs.qkey_for_session(s) for s in range(1, 1000)}) == 999


def test_address_is_gid_qpn_lid_qkey_little_endian():
    gid = bytes(10) + b"\xff\xff" + bytes([198, 18, 0, 1])
    address = verbs.pack_verbs_address(gid, 0x11, 0, 0x1234)
    assert len(address) == verbs.VERBS_ADDRESS_BYTES == 26
    assert address == gid + b"\x11\x00\x00\x00" + b"\x00\x00" + b"\x34\x12\x00\x00"
    assert verbs.unpack_verbs_address(address) == {"gid": gid, "qpn": 0x11, "lid": 0, "qkey": 0x1234}


def test_gids_as_text():
    mapped = bytes(10) + b"\xff\xff" + bytes([198, 18, 0, 1])
    assert verbs.format_gid(mapped) == "::ffff:198.18.0.1" and verbs.gid_ipv4(mapped) == "198.18.0.1"
    link_local = bytes.fromhex("fe80000000000000505400fffed50001")
    assert verbs.format_gid(link_local) == "fe80::5054:ff:fed5:1" and verbs.gid_ipv4(link_local) is None


def test_gid_preference_prefers_roce_v2_ipv4_on_the_interface_that_reaches_the_peers():
    def entry(index, gid, kind):
        return {"index": index, "gid": gid, "type": kind}

    v4 = entry(1, bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 5]), "RoCEv2")
    v4_other = entry(5, bytes(10) + b"\xff\xff" + bytes([192, 168, 1, 5]), "RoCEv2")
    v6 = entry(3, bytes.fromhex("20010db8000000000000000000000005"), "RoCEv2")
    link_local = entry(0, bytes.fromhex("fe80000000000000505400fffed50001"), "RoCEv2")
    v1 = entry(2, v4["gid"], "RoCEv1")
    empty = entry(4, bytes(16), "RoCEv2")
    score = lambda e, prefer=None: verbs.gid_preference(e, "Ethernet", prefer)  # noqa: E731
    assert score(v4) > score(v6) > score(link_local) > score(v1) > score(empty) == 0
    assert score(v4_other, "192.168.1.5") > score(v4, "192.168.1.5")
    ib_port_gid = entry(0, bytes.fromhex("fe80000000000000248a070300a1b2c3"), "IB")
    assert verbs.gid_preference(ib_port_gid, "InfiniBand") > verbs.gid_preference(dict(ib_port_gid, index=1), "InfiniBand")


# ---- settings ------------------------------------------------------------------------------

def test_settings_come_from_options_then_the_environment(monkeypatch):
    monkeypatch.delenv("UD_DEVICE", raising=False)
    monkeypatch.delenv("UD_PORT", raising=False)
    monkeypatch.delenv("UD_GID_INDEX", raising=False)
    assert transports.verbs_settings(options.build()) == (None, 0, -1)
    monkeypatch.setenv("UD_DEVICE", "mlx5_1")
    monkeypatch.setenv("UD_PORT", "2")
    monkeypatch.setenv("UD_GID_INDEX", "3")
    assert transports.verbs_settings(options.build()) == ("mlx5_1", 2, 3)
    assert transports.verbs_settings(options.build(device="rxe0", port=1, gid_index=0)) == ("rxe0", 1, 0)


def test_receive_queue_covers_the_window(caplog):
    default = options.build()
    # 8 MiB of 4048-byte chunks, plus slack for control datagrams
    assert transports.receive_depth(default, 4096, 32767) == default.window_bytes // 4048 + transports.RECEIVE_SLACK
    small = options.build(chunk_bytes=256, window_bytes=256 << 10)
    assert transports.receive_depth(small, 300, 32767) == 1024 + transports.RECEIVE_SLACK
    assert transports.receive_depth(options.build(receive_depth=777), 4096, 32767) == 777
    with caplog.at_level(logging.WARNING, logger="ud_transport"):
        assert transports.receive_depth(options.build(chunk_bytes=64), 108, 16384) == 16384
    assert "lower window_bytes" in caplog.text


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
    rig_session.single_guest_run().check_file("guest_bindings.py", minimum_tests=19)
