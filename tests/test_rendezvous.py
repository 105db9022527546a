"""Rendezvous failures raise within the store timeout, naming the rank and
the cause: a rank out of range (at once, before any network activity), a
store nobody listens on, a rank that never arrives, and ranks that disagree
on the world size or the library version; and ranks meet again after one of
them restarted and tried alone, or died part way. Ranks here are threads of
one process sharing a real TCPStore on loopback (and a real process where one
is killed)."""
import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

import support
import ud_transport
from ud_transport import options as options_module, rendezvous
from ud_transport.communicator import Communicator
from ud_transport.lab.local_cluster import free_tcp_port

TIMEOUT = 2.0
SLACK = 3.0  # thread start, socket setup, torch's retry rounding


def store():
    return dist.TCPStore("127.0.0.1", free_tcp_port(), is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=TIMEOUT))


def client_of(master):
    """A rank's own connection to the store (one shared client would serialise the ranks' waits)."""
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))


def create(rank, world_size, shared, name):
    return Communicator(rank, world_size, shared, "udp", options_module.build(store_timeout_s=TIMEOUT), name=name)


@pytest.mark.parametrize("rank, world_size", [(2, 2), (-1, 2), (0, 0), ("0", 2)])
def test_a_rank_out_of_range_fails_at_once(rank, world_size, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_tcp_port()))  # nobody listens: reaching it would hang or time out
    start = time.monotonic()
    with pytest.raises(ValueError, match="is not in a world of"):
        ud_transport.init(rank, world_size, store_timeout_s=60)
    assert time.monotonic() - start < 1.0


def test_an_unreachable_store_fails_within_the_timeout_naming_it(monkeypatch):
    port = free_tcp_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    with pytest.raises(ud_transport.TransportError, match=f"rank 1: cannot reach the rendezvous store at .*127.0.0.1:{port}"):
        ud_transport.init(1, 2, store_timeout_s=TIMEOUT)
    assert time.monotonic() - start <= TIMEOUT + SLACK


def test_a_rank_that_never_arrives_is_named():
    start = time.monotonic()
    with pytest.raises(ud_transport.TransportError, match=r"rank 0: rendezvous .*rank\(s\) 1, 2 of 3 did not arrive"):
        create(0, 3, store(), "alone")
    assert time.monotonic() - start <= TIMEOUT + SLACK


def test_ranks_that_disagree_on_the_world_size_name_each_other():
    """Rank 0 believes in a world of 2, rank 1 in a world of 3: both raise
    within the timeout, each naming the other and both world sizes."""
    shared = store()
    errors = {}

    def run(rank, world_size):
        try:
            create(rank, world_size, client_of(shared), "mismatch").close()
        except ud_transport.TransportError as error:
            errors[rank] = str(error)

    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(0, 2)), threading.Thread(target=run, args=(1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - start <= TIMEOUT + SLACK
    assert "rank 0: rank 1 disagrees" in errors[0] and "'3/" in errors[0] and "'2/" in errors[0], errors
    assert "rank 1: rank 0 disagrees" in errors[1], errors


def together(*attempts):
    """Run each attempt (a function of no arguments) on a thread of its own, all at once; returns
    {index: result or the TransportError it raised}."""
    outcomes = {}

    def run(index, attempt):
        try:
            outcomes[index] = attempt()
        except ud_transport.TransportError as error:
            outcomes[index] = error

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(attempts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def session_of(rank, shared, name, **options):
    """Make rank's communicator on its own connection to `shared`; its session id (the same on
    every rank that met in one round), the communicator closed."""
    comm = Communicator(rank, 2, client_of(shared), "udp", options_module.build(store_timeout_s=TIMEOUT, **options),
                        name=name)
    with comm:
        return comm.session_id


def test_a_rank_of_another_version_is_named():
    """A peer that publishes another wire version is named, with both records, before any
    datagram is sent; it names this rank too."""
    shared = store()
    theirs = rendezvous.identity_record(2, ud_transport.__version__, 2)
    outcomes = together(lambda: create(0, 2, client_of(shared), "versions"),
                        lambda: rendezvous.meet(client_of(shared), "ud_transport/versions", 1, 2, theirs, TIMEOUT))
    assert "rank 0: rank 1 disagrees on the job" in str(outcomes[0]) and "wire 2 " in str(outcomes[0]), outcomes
    assert "all must match" in str(outcomes[0])
    assert "rank 1: rank 0 disagrees on the job" in str(outcomes[1]), outcomes


def test_a_rank_on_another_transport_is_named_at_once():
    """A peer that chose verbs (an RDMA port where this rank has none, or UD_TRANSPORT set on it
    alone) is named at the identity check, not after a store timeout at a later exchange."""
    shared = store()
    theirs = rendezvous.identity_record(2, ud_transport.__version__, ud_transport._native.WIRE_VERSION, "auto", "verbs")
    start = time.monotonic()
    outcomes = together(lambda: create(0, 2, client_of(shared), "transports"),
                        lambda: rendezvous.meet(client_of(shared), "ud_transport/transports", 1, 2, theirs, TIMEOUT))
    assert time.monotonic() - start < TIMEOUT
    assert isinstance(outcomes[0], ud_transport.TransportError), outcomes
    assert "rank 0: rank 1 disagrees on the job" in str(outcomes[0]), outcomes
    assert "transport verbs'" in str(outcomes[0]) and "transport udp'" in str(outcomes[0])


def test_a_communicator_made_again_under_one_name_meets_in_a_new_round():
    """Three ranks meet under one name twice: each time all in one round, the second a new one
    (its keys fresh: a group made again on the same store does not read the one before's)."""
    shared = store()
    record = rendezvous.identity_record(3, ud_transport.__version__, ud_transport._native.WIRE_VERSION)

    def meeting(name):
        return together(*[lambda r=r: rendezvous.meet(client_of(shared), name, r, 3, record, TIMEOUT) for r in range(3)])

    first, second = meeting("ud_transport/again"), meeting("ud_transport/again")
    assert len(set(first.values())) == 1 and len(set(second.values())) == 1, (first, second)
    assert first[0] != second[0] and all(isinstance(v, str) for v in first.values()), (first, second)
    assert meeting("ud_transport/other")[0] != first[0]


def test_ranks_meet_again_after_one_restarted_and_tried_alone():
    """Issue 38 (5): two ranks made a communicator; rank 1 "restarts" and tries alone (it times
    out, as it must); then rank 0 tries alone; then both try together, three times. Before, the
    store counted every try of every rank and divided by the world size: the lone try shifted
    the count for good, each later try put the two ranks in different incarnations and they never
    met; and rank 0's lone try read the dead try's identity (here one with other stripes, so it
    raised "rank 1 disagrees"; with the same one it passed the check on it)."""
    shared = store()
    first = together(lambda: session_of(0, shared, "restart"), lambda: session_of(1, shared, "restart"))
    assert first[0] == first[1], first
    lone = together(lambda: session_of(1, shared, "restart", stripes=2))[0]
    assert isinstance(lone, ud_transport.TransportError) and "rank(s) 0 of 2 did not arrive" in str(lone), lone
    alone = together(lambda: session_of(0, shared, "restart"))[0]
    assert isinstance(alone, ud_transport.TransportError), alone
    assert "rank(s) 1 of 2 did not arrive" in str(alone) and "disagrees" not in str(alone), alone
    for attempt in range(3):
        again = together(lambda: session_of(0, shared, "restart"), lambda: session_of(1, shared, "restart"))
        assert all(isinstance(v, int) for v in again.values()), (attempt, again)
        assert again[0] == again[1], (attempt, again)


# A rank that dies part way through its rendezvous: a process of its own, killed once its identity
# is in the store (under round/incarnation 1: the second meeting of the name, the same key both ways).
DIES_PART_WAY = """
import datetime, sys, torch.distributed as dist
from ud_transport import options
from ud_transport.communicator import Communicator
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=60))
Communicator(1, 2, store, "udp", options.build(store_timeout_s=60, stripes=2), name="crash")
"""


@pytest.mark.parametrize("rank_0_alone_first", [True, False])
def test_an_attempt_killed_part_way_is_not_met(rank_0_alone_first):
    """Rank 1 is killed (SIGKILL: no word to anyone) while it waits for rank 0 in the rendezvous,
    its identity (other stripes) in the store. Rank 0 trying alone is told rank 1 did not arrive
    (before, it compared the dead attempt's identity and raised "rank 1 disagrees"); rank 0 and a
    new rank 1 together meet (before, they counted different incarnations; now the new rank 1
    finds its place held, closes that round, and both meet in the next)."""
    shared = store()
    first = together(lambda: session_of(0, shared, "crash"), lambda: session_of(1, shared, "crash"))
    assert first[0] == first[1], first
    dying = subprocess.Popen([sys.executable, "-c", DIES_PART_WAY, str(shared.port)], env=support.child_environment())
    try:
        shared.wait(["ud_transport/crash/1/identity/1"], datetime.timedelta(seconds=60))
    finally:
        dying.kill()
        dying.wait()
    if rank_0_alone_first:
        alone = together(lambda: session_of(0, shared, "crash"))[0]
        assert isinstance(alone, ud_transport.TransportError), alone
        assert "rank(s) 1 of 2 did not arrive" in str(alone) and "disagrees" not in str(alone), alone
    again = together(lambda: session_of(0, shared, "crash"), lambda: session_of(1, shared, "crash"))
    assert all(isinstance(v, int) for v in again.values()) and again[0] == again[1], again
