"""Rendezvous through a torch.distributed Store: we do not run our own."""
import datetime
import ipaddress
import logging
import math
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


# What a round's keys hold once the round is given up: whoever waits on them wakes and moves on.
ABANDONED = "abandoned"
_COMPLETE, _ABANDONED, _DISPLACED = "complete", "abandoned", "displaced"


def meet(store, prefix, rank, world_size, identity, timeout_s):
    """Meet the other ranks of this communicator under `prefix` and return the prefix of the round
    they met in (keys under it are this meeting's alone: the session, the addresses).

    Every rank publishes what it believes (`identity_record`); a rank that disagrees is named
    with both values as soon as it is known to be there (polled, so a rank that believes in a
    larger world does not wait out the timeout for ranks that do not exist); on the timeout the
    ranks that never arrived are named.

    Why rounds and not a count of arrivals: a rank that restarts and tries alone counts itself
    once more than its peers, and a count shared by every attempt then puts the ranks of every
    later try in different places for good. Here ranks meet in the first round of `prefix` that
    is not closed. A rank takes its place in a round by being the first to claim it (store.add
    gives 1 to one claimer only); it has met the others when every rank has published its
    identity and then said it saw everyone (`ready`). An attempt that dies part way (killed,
    or timed out alone) never says ready, so no one completes a round on its keys: a rank that
    gives up abandons its round (closes it and fills its keys with ABANDONED, which wakes whoever
    waits on them), and a restarted rank that finds its place held by another process (an attempt
    that died without a word) closes that round too; everyone then moves to the next round.
    Needs only set, get, check, wait and add(key, 1) of the store."""
    deadline = time.monotonic() + timeout_s
    displaced = 0
    round_ = _open_round(store, prefix, 0)
    while True:
        base = f"{prefix}/{round_}"
        try:
            outcome = _try_round(store, base, rank, world_size, identity, deadline, timeout_s, displaced)
        except BaseException:
            _abandon(store, prefix, round_, world_size)
            raise
        if outcome == _COMPLETE:
            _close(store, prefix, round_)
            return base
        if outcome == _DISPLACED:
            displaced += 1
            log.info("rank %d: rendezvous %s: another process holds this rank's place; moving to the next round",
                     rank, base)
            if store.check([f"{base}/ready/{r}" for r in range(world_size)]):
                _close(store, prefix, round_)  # met without this process: leave it be (a duplicate rank)
            else:
                _abandon(store, prefix, round_, world_size)
        if time.monotonic() >= deadline:
            raise TransportError(f"rank {rank}: rendezvous {base}: the ranks did not meet within {timeout_s:.0f} s"
                                 + _displaced_note(rank, displaced))
        round_ = _open_round(store, prefix, round_ + 1)


def _open_round(store, prefix, at_least):
    """The first round from `at_least` on that is not closed (the hint saves walking the closed ones)."""
    hint = f"{prefix}/round"
    round_ = at_least
    if store.check([hint]):
        round_ = max(round_, int(bytes(store.get(hint)).decode()))
    while store.check([f"{prefix}/{round_}/closed"]):
        round_ += 1
    return round_


def _close(store, prefix, round_):
    store.set(f"{prefix}/{round_}/closed", "1")
    store.set(f"{prefix}/round", str(round_ + 1))


def _abandon(store, prefix, round_, world_size):
    """Give up round `round_` for everyone: mark it, close it, and fill the keys ranks may be
    waiting on (those not yet written) so their waits end now. Best effort: the store may be what
    failed."""
    base = f"{prefix}/{round_}"
    try:
        store.set(f"{base}/abandoned", "1")  # before the fills: whoever sees a fill finds the mark
        _close(store, prefix, round_)
        for r in range(world_size):
            for key in (f"{base}/identity/{r}", f"{base}/ready/{r}"):
                if not store.check([key]):
                    store.set(key, ABANDONED)
    except Exception as error:  # the store itself failed: the caller's error says more
        log.debug("rendezvous %s: could not mark the round abandoned: %s", base, error)


def _displaced_note(rank, displaced):
    if not displaced:
        return ""
    return (f" (another process held rank {rank}'s place in {displaced} round(s): a second process started "
            f"as rank {rank}, or an attempt that died)")


# A wait of "forever" (an infinite or huge timeout) is this long: timedelta and the stores take it.
LONGEST_WAIT_S = 1e7


def wait_for(store, keys, seconds):
    """store.wait that returns whether the keys are all there (stores raise on the timeout)."""
    seconds = min(max(seconds, 0.01), LONGEST_WAIT_S) if math.isfinite(seconds) else LONGEST_WAIT_S
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
        return True
    except Exception:
        return store.check(keys)


def _try_round(store, base, rank, world_size, identity, deadline, timeout_s, displaced):
    identity_keys = [f"{base}/identity/{r}" for r in range(world_size)]
    ready_keys = [f"{base}/ready/{r}" for r in range(world_size)]
    abandoned = f"{base}/abandoned"

    def missing_error(missing):
        return TransportError(f"rank {rank}: rendezvous {base}: rank(s) {', '.join(map(str, missing))} of "
                              f"{world_size} did not arrive within {timeout_s:.0f} s" + _displaced_note(rank, displaced))

    if int(store.add(f"{base}/claim/{rank}", 1)) != 1:
        return _DISPLACED
    store.set(identity_keys[rank], identity)
    # 1. Every rank's identity, compared as it comes.
    seen, disagreeing, interval = {rank}, None, 0.25
    while len(seen) < world_size and disagreeing is None:
        unseen = [r for r in range(world_size) if r not in seen]
        wait_for(store, [identity_keys[r] for r in unseen], min(interval, deadline - time.monotonic()))
        interval = min(interval * 2, 4.0)  # returns as soon as all are there; else look at who is, less often
        for r in unseen:
            if store.check([identity_keys[r]]):
                theirs = bytes(store.get(identity_keys[r])).decode()
                if theirs == ABANDONED:
                    return _ABANDONED
                seen.add(r)
                if theirs != identity:
                    disagreeing = (r, theirs)
                    break
        if disagreeing is None and len(seen) < world_size:
            if store.check([abandoned]):
                return _ABANDONED
            if time.monotonic() >= deadline:
                raise missing_error(sorted(set(range(world_size)) - seen))
    # 2. Say so, and wait for the others to say so: an identity whose rank never does is a dead
    # attempt's, which neither passes nor fails the check.
    store.set(ready_keys[rank], "1")
    waiting_for = [disagreeing[0]] if disagreeing else range(world_size)
    if not wait_for(store, [ready_keys[r] for r in waiting_for], deadline - time.monotonic()):
        if store.check([abandoned]):
            return _ABANDONED
        raise missing_error([r for r in waiting_for if not store.check([ready_keys[r]])])
    if disagreeing and bytes(store.get(ready_keys[disagreeing[0]])).decode() != ABANDONED:
        r, theirs = disagreeing  # it is there (it may have raised and abandoned the round already)
        raise TransportError(f"rank {rank}: rank {r} disagrees on the job: it has {theirs!r}, this rank "
                             f"{identity!r} (world size/library and wire versions/stripes, UD_STRIPES, where "
                             "\"auto\" and a number differ/transport, UD_TRANSPORT: all must match)")
    if disagreeing or store.check([abandoned]):
        return _ABANDONED
    return _COMPLETE


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
