"""Rendezvous through a torch.distributed Store: we do not run our own."""
import datetime
import ipaddress
import logging
import os
import secrets
import socket

from .errors import TransportError

log = logging.getLogger("ud_transport")


def store_from_environment(rank, world_size, timeout_s):
    """A TCPStore at MASTER_ADDR:MASTER_PORT, the way torch's env:// does it."""
    try:
        import torch.distributed as dist
    except ImportError as error:  # pragma: no cover - depends on the machine
        raise TransportError("ud_transport rendezvous needs torch (pip install torch==<your version>)") from error
    if dist.is_available() and dist.is_initialized():
        # Share the process group's store instead of opening a second server on the same port.
        from torch.distributed import distributed_c10d

        return dist.PrefixStore("ud_transport", distributed_c10d._get_default_store())
    host = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not host or not port:
        raise TransportError("init() needs MASTER_ADDR and MASTER_PORT (as torchrun sets), or store=")
    # Under torchrun the agent hosts the store; workers only connect.
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(host, int(port), world_size, is_master=(rank == 0 and not agent_hosts),
                         timeout=datetime.timedelta(seconds=timeout_s))


def local_address_towards(host):
    """The local IPv4 address the kernel would use to reach `host` (no packet is sent)."""
    resolved = socket.gethostbyname(host)
    if ipaddress.ip_address(resolved).is_loopback:
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((resolved, 9))
        return probe.getsockname()[0]
    finally:
        probe.close()


def exchange(store, prefix, rank, world_size, value, timeout_s):
    """Publish `value` (bytes) and return every rank's, in rank order."""
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as error:
        raise TransportError(f"rendezvous {prefix}: not every rank arrived within {timeout_s:.0f} s: {error}") from error
    return [bytes(store.get(k)) for k in keys]


def agree_session_id(store, prefix, rank, timeout_s):
    """Rank 0 draws a random session id that tags every datagram of this communicator."""
    key = f"{prefix}/session"
    if rank == 0:
        store.set(key, secrets.token_hex(8))
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as error:
        raise TransportError(f"rendezvous {prefix}: rank 0 did not publish a session within {timeout_s:.0f} s") from error
    return int(bytes(store.get(key)).decode(), 16)
