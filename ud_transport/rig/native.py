"""Host mode: when the host kernel itself has rxe, put it on a veth pair here and run directly.

The build machines' kernels have no RDMA, so this is tested inside the rig's own guest, whose
kernel has rdma_rxe (tests/test_rig.py::test_host_mode_runs_in_a_kernel_with_rxe); kept small.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from .initscript import NET_PREFIX_LEN, node_ip

log = logging.getLogger("ud_transport.rig")

VETH, VETH_PEER, RXE = "udrig0", "udrig1", "rxe_udrig0"


def host_has_rxe() -> bool:
    """True when rdma_rxe is built in or loaded, or modprobe can load it."""
    if os.path.isdir("/sys/module/rdma_rxe"):
        return True
    if not os.path.exists("/proc/modules"):   # no loadable modules at all
        return False
    probe = subprocess.run(["modprobe", "-q", "rdma_rxe"], capture_output=True)
    return probe.returncode == 0 and os.path.isdir("/sys/module/rdma_rxe")


def _sh(*argv: str, check: bool = True) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _wait_until_active(device: str, seconds: float) -> None:
    """Like the guest's stage 2: start the command only once the port is ACTIVE."""
    state = Path(f"/sys/class/infiniband/{device}/ports/1/state")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if state.exists() and "ACTIVE" in state.read_text():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{device} port 1 did not become ACTIVE within {seconds:.0f} s")


def run_on_host(argv: list[str], cwd: str | os.PathLike | None, env: Mapping[str, str],
                timeout: float | None, output: TextIO | None = None) -> int:
    """Same contract as the guest: the command sees UD_RIG_* and an rxe device on a veth pair."""
    for module in ("veth", "crc32_generic"):
        _sh("modprobe", "-q", module, check=False)   # may be built in
    _sh("ip", "link", "del", VETH, check=False)       # leftovers from an interrupted run
    try:
        _sh("ip", "link", "add", VETH, "mtu", "9000", "type", "veth", "peer", "name", VETH_PEER, "mtu", "9000")
        _sh("ip", "addr", "add", f"{node_ip(0)}/{NET_PREFIX_LEN}", "dev", VETH)
        _sh("ip", "addr", "add", f"{node_ip(1)}/{NET_PREFIX_LEN}", "dev", VETH_PEER)
        _sh("ip", "link", "set", VETH_PEER, "up")
        _sh("ip", "link", "set", VETH, "up")
        _sh("rdma", "link", "add", RXE, "type", "rxe", "netdev", VETH)
        _wait_until_active(RXE, seconds=20)
        command_env = dict(env, UD_RIG="1", UD_RIG_NODE="0", UD_RIG_NODES="1", UD_RIG_IP=node_ip(0),
                           UD_RIG_PEER_IP=node_ip(0), UD_RIG_NETDEV=VETH, UD_RIG_RDMA_DEV=RXE)
        out = output or sys.stdout
        try:
            result = subprocess.run(argv, cwd=cwd, env=command_env, timeout=timeout, stdin=subprocess.DEVNULL,
                                    stdout=None if out is sys.stdout else subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            log.error("host mode: command timed out after %s s", timeout)
            return 124
        if result.stdout:
            out.write(result.stdout)
        return result.returncode
    except RuntimeError as error:  # the setup failed: the rig's own failure status, as in guest mode
        log.error("host mode: %s", error)
        return 125
    finally:
        _sh("rdma", "link", "delete", RXE, check=False)
        _sh("ip", "link", "del", VETH, check=False)
