"""Rendezvous through a torch.distributed Store: we do not run our own."""
import datetime
import ipaddress
import logging
import os
import secrets
import socket
import time

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
    # torch's client tries to connect twice, each try up to its timeout: half each keeps the whole
    # attempt within timeout_s (measured with torch 2.13: 6.5 s for a 3 s timeout).
    connect = datetime.timedelta(seconds=max(timeout_s / 2, 0.5))
    try:
        store = dist.TCPStore(host, int(port), world_size, is_master=(rank == 0 and not agent_hosts), timeout=connect)
    except Exception as error:
        raise TransportError(f"rank {rank}: cannot reach the rendezvous store at MASTER_ADDR:MASTER_PORT = {host}:{port} "
                             f"within {timeout_s:.0f} s ({type(error).__name__}: {str(error).splitlines()[0]})") from error
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


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


def _missing(store, keys):
    return [r for r, key in enumerate(keys) if not store.check([key])]


def incarnation(store, prefix, world_size):
    """Which communicator of this name on this store this is (0, 1, ...), the same on every rank:
    each rank counts itself in, and the ranks of one communicator are all counted before any rank
    of the next (that one starts after this one's rendezvous, which needs them all). Keys under
    it are fresh, so a group made again on the same store (init_process_group twice) does not
    read the session and addresses of the one before."""
    return (store.add(f"{prefix}/ranks counted", 1) - 1) // world_size


def exchange(store, prefix, rank, world_size, value, timeout_s):
    """Publish `value` (bytes) and return every rank's, in rank order."""
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as error:
        missing = _missing(store, keys)
        raise TransportError(f"rank {rank}: rendezvous {prefix}: rank(s) {', '.join(map(str, missing)) or '?'} of "
                             f"{world_size} did not arrive within {timeout_s:.0f} s") from error
    return [bytes(store.get(k)) for k in keys]


def identity_record(world_size, library_version, wire_version, stripes=1, transport="udp"):
    """What a rank publishes about the job it believes it is in; ranks must publish the same
    (Options.stripes too, "auto" included, and the transport: ranks must open the same kind and
    number of sockets and split calls alike)."""
    return f"{world_size}/ud_transport {library_version} wire {wire_version} stripes {stripes} transport {transport}"


def check_identity(store, prefix, rank, world_size, mine, timeout_s):
    """Every rank publishes what it believes (`identity_record`); the first rank that disagrees
    with this one is named, with both values, as soon as it has published (polled, so a rank that
    believes in a larger world does not wait out the timeout for ranks that do not exist); on the
    timeout the ranks that never arrived are named."""
    keys = [f"{prefix}/identity/{r}" for r in range(world_size)]
    store.set(keys[rank], mine)
    deadline = time.monotonic() + timeout_s
    seen, interval = {rank}, 0.25
    while True:
        unseen = [keys[r] for r in range(world_size) if r not in seen]
        try:  # returns as soon as all are there; else look at who is, less often as time goes on
            store.wait(unseen, datetime.timedelta(seconds=max(min(interval, deadline - time.monotonic()), 0.01)))
        except Exception:
            pass
        interval = min(interval * 2, 4.0)
        for r in range(world_size):
            if r not in seen and store.check([keys[r]]):
                seen.add(r)
                theirs = bytes(store.get(keys[r])).decode()
                if theirs != mine:
                    raise TransportError(f"rank {rank}: rank {r} disagrees on the job: it has {theirs!r}, this rank "
                                         f"{mine!r} (world size/library and wire versions/stripes, UD_STRIPES, where "
                                         "\"auto\" and a number differ/transport, UD_TRANSPORT: all must match)")
        if len(seen) == world_size:
            return
        if time.monotonic() >= deadline:
            missing = sorted(set(range(world_size)) - seen)
            raise TransportError(f"rank {rank}: rendezvous {prefix}: rank(s) {', '.join(map(str, missing))} of "
                                 f"{world_size} did not arrive within {timeout_s:.0f} s")


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
