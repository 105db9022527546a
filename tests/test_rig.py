"""Tests of the SoftRoCE rig (ud_transport.rig).

The pure parts (module ordering, cpio, markers, generated scripts, qemu command line) run
everywhere. Two integration tests boot a guest each: one checks that rxe0 is there and ACTIVE,
the other runs host mode (native.py) inside the guest, whose kernel has rxe. They skip with the
reason when qemu or the cached kit is missing, except under CI, where the kit is built and they
must run.
"""

from __future__ import annotations

import gzip
import io
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IN_CI, skip_or_fail

from ud_transport.rig import apt, cpio, guest, initscript, kit, markers, modules, native, runner

REPO_ROOT = Path(__file__).resolve().parents[1]

# A slice of a real 6.1 modules.dep (paths shortened), deliberately listed out of order.
MODULES_DEP = """\
kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko: kernel/net/ipv6/ip6_udp_tunnel.ko kernel/net/ipv4/udp_tunnel.ko kernel/drivers/infiniband/core/ib_uverbs.ko kernel/drivers/infiniband/core/ib_core.ko
kernel/drivers/infiniband/core/ib_uverbs.ko: kernel/drivers/infiniband/core/ib_core.ko
kernel/drivers/infiniband/core/ib_core.ko:
kernel/net/ipv4/udp_tunnel.ko:
kernel/net/ipv6/ip6_udp_tunnel.ko:
kernel/crypto/crc32_generic.ko:
kernel/net/9p/9pnet_virtio.ko.xz: kernel/net/9p/9pnet.ko.xz kernel/drivers/virtio/virtio_ring.ko
kernel/net/9p/9pnet.ko.xz:
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/net/net-failover.ko: kernel/net/core/failover.ko
kernel/net/core/failover.ko:
"""


# ---- module ordering -------------------------------------------------------------------

def test_module_name_normalises_paths_and_dashes():
    assert modules.module_name("kernel/drivers/net/net-failover.ko") == "net_failover"
    assert modules.module_name("kernel/net/9p/9pnet_virtio.ko.xz") == "9pnet_virtio"


def test_load_order_puts_dependencies_first():
    table = modules.parse_modules_dep(MODULES_DEP)
    order = modules.load_order(["rdma_rxe", "crc32_generic"], table)
    assert order[-2:] == ["rdma_rxe", "crc32_generic"]
    assert set(order) == {"ip6_udp_tunnel", "udp_tunnel", "ib_core", "ib_uverbs", "rdma_rxe", "crc32_generic"}
    assert order.index("ib_core") < order.index("ib_uverbs") < order.index("rdma_rxe")
    assert len(order) == len(set(order))


def test_load_order_accepts_dashed_names_and_keeps_each_module_once():
    table = modules.parse_modules_dep(MODULES_DEP)
    assert modules.load_order(["net-failover", "failover", "9pnet_virtio"], table) == [
        "failover", "net_failover", "9pnet", "virtio_ring", "9pnet_virtio"]


def test_load_order_skips_builtins_and_names_missing_modules():
    table = modules.parse_modules_dep(MODULES_DEP)
    assert modules.load_order(["virtio", "ib_core"], table, builtin={"virtio"}) == ["ib_core"]
    with pytest.raises(modules.MissingModule, match="no_such_module"):
        modules.load_order(["no_such_module"], table)


def test_load_order_rejects_cycles():
    table = modules.parse_modules_dep("a.ko: b.ko\nb.ko: a.ko\n")
    with pytest.raises(ValueError, match="cycle"):
        modules.load_order(["a"], table)


def test_guest_module_list_covers_rxe_and_its_hidden_needs():
    # crc32_generic is requested at runtime, sch_netem and veth on demand: no modprobe in the guest
    for name in ("rdma_rxe", "crc32_generic", "sch_netem", "veth", "9p", "virtio_net", "overlay"):
        assert name in modules.GUEST_MODULES


# ---- cpio --------------------------------------------------------------------------------

def test_cpio_round_trip_and_alignment():
    writer = cpio.CpioWriter()
    writer.add_file("etc/ud_rig/modules", b"a\nb\n")
    writer.add_file("bin/busybox", b"\x7fELF" + b"x" * 13, 0o755)
    writer.add_symlink("bin/sh", "busybox")
    writer.add_chardev("dev/console", 5, 1)
    data = writer.to_bytes()
    assert len(data) % 4 == 0
    entries = cpio.read_newc(data)
    assert entries["etc/ud_rig/modules"] == (stat.S_IFREG | 0o644, b"a\nb\n")
    assert entries["bin/busybox"][0] == stat.S_IFREG | 0o755
    assert entries["bin/sh"] == (stat.S_IFLNK | 0o777, b"busybox")
    assert stat.S_ISCHR(entries["dev/console"][0])
    assert stat.S_ISDIR(entries["etc/ud_rig"][0]) and stat.S_ISDIR(entries["etc"][0])
    assert gzip.decompress(writer.to_gzip()) == data
    assert writer.to_gzip() == writer.to_gzip()   # reproducible


def test_cpio_is_readable_by_gnu_cpio():
    if shutil.which("cpio") is None:
        skip_or_fail("cpio(1) not installed (scripts/setup.sh installs it): cross-check skipped")
    writer = cpio.CpioWriter()
    writer.add_file("a/b.txt", b"hello")
    listing = subprocess.run(["cpio", "-t", "--quiet"], input=writer.to_bytes(), capture_output=True, check=True)
    assert listing.stdout.decode().split() == ["a", "a/b.txt"]


# ---- markers -------------------------------------------------------------------------------

NONCE = "0123456789abcdef"


def test_markers_parse_round_trip():
    assert markers.parse_line(markers.start_marker(NONCE), NONCE).kind == "START"
    exit_marker = markers.parse_line(markers.exit_marker(NONCE, 3), NONCE)
    assert (exit_marker.kind, exit_marker.status, exit_marker.before) == ("EXIT", 3, "")
    fail = markers.parse_line(markers.fail_marker(NONCE, "stage2: rdma link add rxe0 on veth0"), NONCE)
    assert (fail.kind, fail.message) == ("FAIL", "stage2: rdma link add rxe0 on veth0")


def test_markers_ignore_other_nonces_and_plain_text():
    assert markers.parse_line(markers.exit_marker("f" * 16, 0), NONCE) is None
    assert markers.parse_line("@@UD_RIG EXIT not-a-nonce 0@@", NONCE) is None
    assert markers.parse_line("ordinary output", NONCE) is None


def test_marker_after_output_without_newline_keeps_the_output():
    line = "partial line" + markers.exit_marker(NONCE, 0) + "\r"
    marker = markers.parse_line(line, NONCE)
    assert (marker.kind, marker.status, marker.before) == ("EXIT", 0, "partial line")


def test_unreadable_status_is_a_failure():
    marker = markers.parse_line(f"@@UD_RIG EXIT {NONCE} x@@", NONCE)
    assert marker.kind == "FAIL" and marker.status is None


def test_nonces_differ():
    assert markers.new_nonce() != markers.new_nonce()
    assert len(markers.new_nonce()) == 16


# ---- generated scripts -----------------------------------------------------------------------

def _setup(**overrides) -> initscript.GuestSetup:
    values = dict(nonce=NONCE, argv=["python3", "-c", "print('it''s ok')", "$HOME"],
                  cwd="/work/my repo", env={"PATH": "/usr/bin:/bin", "X": "a b;c"},
                  shares=[("share0", "/work/my repo")])
    values.update(overrides)
    return initscript.GuestSetup(**values)


def _syntax_ok(script: str) -> None:
    result = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_init_script_loads_modules_mounts_and_reports():
    script = initscript.render_init(_setup())
    _syntax_ok(script)
    assert script.startswith("#!/bin/busybox sh\n")
    assert f"done < /{kit.MODULES_LIST}" in script and "insmod /lib/modules/$module.ko" in script
    assert "mount_tag" not in script and "hostroot /mnt/lower" in script
    assert "mount -t overlay" in script
    assert "share0 \"$R\"'/work/my repo'" in script           # paths are quoted
    assert f"NONCE={NONCE}" in script and markers.exit_marker("$NONCE", "$status") in script
    assert script.rstrip().endswith("poweroff -f")
    # the share is mounted after the tmpfs on /tmp, so a share below /tmp stays visible
    assert script.index("$R/tmp") < script.index("share0")


def test_stage2_one_node_uses_veth_and_quotes_the_command():
    script = initscript.render_stage2(_setup())
    _syntax_ok(script)
    assert "ip link add veth0 mtu 9000 type veth peer name veth1 mtu 9000" in script
    assert "rdma link add rxe0 type rxe netdev veth0" in script
    assert "ping" not in script and "netem" not in script
    assert "cd '/work/my repo'" in script
    assert "'X=a b;c'" in script and " UD_RIG_NODE=0 " in script and " UD_RIG_PEER_IP=198.18.0.1 " in script
    assert "env -i " in script and "python3 -c '" in script and "'$HOME'" in script
    # the rxe device exists before the address that tells a peer we are ready
    assert script.index("rdma link add") < script.index("ip addr add 198.18.0.1/24 dev veth0")


def test_stage2_command_runs_as_written(tmp_path):
    # Run the generated command line through a real shell with the network part cut away.
    setup = _setup(cwd=str(tmp_path), argv=[sys.executable, "-c",
                                            "import os,sys; print(os.environ['X'], sys.argv[1:])", "$HOME", "a'b"])
    script = initscript.render_stage2(setup)
    command = f"NONCE={NONCE}\n" + script[script.index("\ncd "):]
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "a b;c ['$HOME', \"a'b\"]"
    assert markers.parse_line(result.stdout.splitlines()[0], NONCE).kind == "START"


def test_stage2_two_nodes_use_eth0_netem_and_wait_for_the_peer():
    script = initscript.render_stage2(_setup(node=1, nodes=2, netem_loss="10%"))
    _syntax_ok(script)
    assert "tc qdisc add dev eth0 root netem loss 10%" in script
    assert "rdma link add rxe0 type rxe netdev eth0" in script
    assert "ip addr add 198.18.0.2/24 dev eth0" in script
    assert "ping -c 1 -W 1 198.18.0.1" in script
    assert " UD_RIG_PEER_IP=198.18.0.1 " in script and " UD_RIG_NODE=1 " in script
    assert "veth" not in script


# ---- host side -----------------------------------------------------------------------------

def _fake_kit(tmp_path: Path) -> kit.Kit:
    (tmp_path / "vmlinuz").write_bytes(b"kernel")
    base = cpio.CpioWriter()
    base.add_file("bin/busybox", b"bb", 0o755)
    (tmp_path / "base.cpio.gz").write_bytes(base.to_gzip())
    return kit.Kit("6.1.0-test-amd64", tmp_path, ("rdma_rxe",))


def test_qemu_argv_single_guest_has_no_nic_and_a_read_only_root(tmp_path):
    argv = guest.qemu_argv(_fake_kit(tmp_path), tmp_path / "initrd", [("share0", "/work")], guest.QemuOptions())
    joined = " ".join(argv)
    assert argv[0] == "qemu-system-x86_64" and "-accel tcg,thread=multi" in joined
    assert "-nic none" in joined and "-no-reboot" in joined and "-smp 2" in joined and "-m 2G" in joined
    assert "path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" in joined
    assert "path=/work,mount_tag=share0,security_model=none,multidevs=remap" in joined
    append = argv[argv.index("-append") + 1]
    assert {"panic=-1", "console=ttyS0", "quiet"} <= set(append.split())


def test_qemu_argv_linked_guest_uses_a_unix_socket_not_the_host_network(tmp_path):
    nic = guest.Nic("/tmp/x/link.sock", server=False, mac="52:54:00:d5:00:02")
    joined = " ".join(guest.qemu_argv(_fake_kit(tmp_path), tmp_path / "i", [], guest.QemuOptions(), nic))
    assert "stream,id=n0,server=off,addr.type=unix,addr.path=/tmp/x/link.sock" in joined
    assert "-nic none" not in joined
    assert not any(word in joined for word in ("-netdev user", "-netdev tap", "-nic user", "bridge"))


def test_initrd_is_the_kit_plus_this_runs_scripts(tmp_path):
    fake = _fake_kit(tmp_path)
    path = tmp_path / "initrd.img"
    guest.build_initrd(fake, _setup(), path)
    entries = cpio.read_newc(gzip.decompress(path.read_bytes()))   # two gzip members
    assert entries["bin/busybox"][1] == b"bb"
    assert entries["init"][0] == stat.S_IFREG | 0o755
    assert entries["init"][1].decode() == initscript.render_init(_setup())
    assert entries["rig/stage2.sh"][1].decode() == initscript.render_stage2(_setup())


def test_parse_kernel_depends():
    text = "linux-image-amd64\n  Depends: linux-image-6.1.0-56-amd64\n"
    assert apt.parse_kernel_depends(text) == ("linux-image-6.1.0-56-amd64", "6.1.0-56-amd64")
    with pytest.raises(apt.AptError):
        apt.parse_kernel_depends("linux-image-amd64\n")


def test_shares_default_to_the_working_directory_but_never_root(tmp_path):
    assert runner.choose_shares(str(tmp_path), None) == [str(tmp_path)]
    assert runner.choose_shares("/", None) == []
    assert runner.choose_shares("/work/repo", []) == []
    # a directory the guest hides under its own tmpfs (a clone in /tmp) is shared regardless
    assert runner.choose_shares("/tmp/clone", []) == ["/tmp/clone"]
    assert runner.choose_shares("/tmp/clone/tests", ["/tmp/clone"]) == ["/tmp/clone"]


def test_guest_env_passes_the_python_setup_and_extras(monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", "/venv")
    monkeypatch.setenv("UD_RIG_NODE", "7")          # the rig's own variables are set in the guest
    monkeypatch.setenv("SECRET_TOKEN", "x")
    env = runner.guest_env({"K": "V"})
    assert env["VIRTUAL_ENV"] == "/venv" and env["K"] == "V" and env["TERM"] == "dumb"
    assert "UD_RIG_NODE" not in env and "SECRET_TOKEN" not in env


def test_netem_loss_is_validated():
    with pytest.raises(ValueError, match="netem"):
        runner.run_detailed(["true"], netem_loss="10", nodes=2)


# ---- integration: one boot each -------------------------------------------------------------

def _kit_for_test() -> kit.Kit:
    if shutil.which(guest.QEMU) is None:
        skip_or_fail(f"{guest.QEMU} not installed (apt: qemu-system-x86; or `python -m ud_transport.rig deps`)")
    if not IN_CI and not kit.cached_kits():
        skip_or_fail(f"no guest kit cached in {kit.cache_root()} "
                     "(build it with `python -m ud_transport.rig kit`; CI builds it)")
    return kit.get_kit()   # under CI this downloads and builds when needed


@pytest.mark.rig
def test_guest_has_an_active_rxe0_with_mtu_4096():
    _kit_for_test()
    output = io.StringIO()
    results = runner.run_detailed([sys.executable, "-m", "ud_transport.rig.probe"], cwd=REPO_ROOT,
                                  env={"PYTHONPATH": str(REPO_ROOT)}, shares=[], timeout=300, output=output)
    text = output.getvalue()
    assert [r.status for r in results] == [0], (results, text)
    assert "rxe0 state=4 active_mtu=4096" in text, text   # 4 = IBV_PORT_ACTIVE


@pytest.mark.rig
def test_host_mode_runs_in_a_kernel_with_rxe():
    """Host mode (native.py) for real: the guest's kernel has rdma_rxe, so `rig run` inside it
    must take host mode (rxe_udrig0 on a veth pair, no nested qemu), pass the exit status
    through, and remove its devices afterwards."""
    _kit_for_test()
    python = shlex.quote(sys.executable)
    # probe.py is standard library only: run it as a file without site, so that it imports
    # neither site-packages nor the ud_transport package (seconds under TCG)
    probe = f"{python} -S {shlex.quote(str(REPO_ROOT / 'ud_transport' / 'rig' / 'probe.py'))}"
    inner = f"echo dev=$UD_RIG_RDMA_DEV; {probe} && exit 7"
    script = (f"{python} -m ud_transport.rig run --timeout 120 -- sh -c {shlex.quote(inner)}; status=$?; "
              "echo after: $(ls /sys/class/infiniband) $(ip -o link show | grep -c udrig) udrig; exit $status")
    output = io.StringIO()
    results = runner.run_detailed(["sh", "-c", script], cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT)},
                                  shares=[], timeout=300, output=output)
    text = output.getvalue()
    assert [r.status for r in results] == [7], (results, text)   # the command's own status, through both
    assert f"dev={native.RXE}" in text, text
    assert f"{native.RXE} state=4 active_mtu=4096" in text, text   # 4 = IBV_PORT_ACTIVE
    assert "rig: node" not in text, text     # guest mode would log its node status: no nested qemu
    assert "after: rxe0 0 udrig" in text, text   # rxe_udrig0 and the veth pair are gone again
