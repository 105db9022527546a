"""Rendezvous failures raise within the store timeout, naming the rank and
the cause: a rank out of range (at once, before any network activity), a
store nobody listens on, a rank that never arrives, and ranks that disagree
on the world size or the library version. Ranks here are threads of one
process sharing a real TCPStore on loopback."""
import datetime
import threading
import time

import pytest
import torch.distributed as dist

import ud_transport
from ud_transport import options as options_module, rendezvous
from ud_transport.communicator import Communicator
from ud_transport.local_cluster import free_tcp_port

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


def test_a_rank_of_another_version_is_named():
    """A peer that published another wire version (written into the real store
    as that peer would) is named before any datagram is sent."""
    shared = store()
    # under 0: the first communicator of that name on this store
    shared.set("ud_transport/versions/0/identity/1", rendezvous.identity_record(2, ud_transport.__version__, 2))
    with pytest.raises(ud_transport.TransportError, match=r"rank 0: rank 1 disagrees on the job.*wire 2 .*all must match"):
        create(0, 2, shared, "versions")


def test_a_rank_on_another_transport_is_named_at_once():
    """A peer that chose verbs (an RDMA port where this rank has none, or UD_TRANSPORT set on it
    alone) is named at the identity check, not after a store timeout at a later exchange."""
    shared = store()
    shared.set("ud_transport/transports/0/identity/1",
               rendezvous.identity_record(2, ud_transport.__version__, ud_transport._native.WIRE_VERSION, "auto", "verbs"))
    start = time.monotonic()
    with pytest.raises(ud_transport.TransportError, match=r"rank 0: rank 1 disagrees on the job.*transport verbs'.*transport udp'"):
        create(0, 2, shared, "transports")
    assert time.monotonic() - start < TIMEOUT


def test_a_communicator_made_again_under_one_name_counts_a_new_incarnation():
    """Every rank of the first communicator of a name counts itself before any rank of the next
    (which starts after the first's rendezvous): all ranks read the same incarnation, and the
    next one's keys are fresh."""
    shared = store()
    first = [rendezvous.incarnation(shared, "ud_transport/again", 3) for _ in range(3)]
    second = [rendezvous.incarnation(shared, "ud_transport/again", 3) for _ in range(3)]
    assert first == [0, 0, 0] and second == [1, 1, 1]
    assert rendezvous.incarnation(shared, "ud_transport/other", 3) == 0
