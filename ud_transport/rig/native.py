"""Host mode: when the host kernel itself has rxe, put it on a veth pair here and run directly.

Untested on the project's build machines (their kernel has no RDMA); kept deliberately small.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping
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
    finally:
        _sh("rdma", "link", "delete", RXE, check=False)
        _sh("ip", "link", "del", VETH, check=False)
