"""send and recv for backend "ud": every (sender, receiver, tag) is a channel of
its own, a communicator of those two ranks on which each message is an exact
broadcast from the sender (repeated and repaired until whole, never
retransmitted per datagram; ``ud_transport.exact``).

Why channels and not the group's worker: the group's collectives run in issue
order on one worker, and every rank issues the same ones; a message is issued
by two ranks only. One channel per direction lets two ranks send to each other
at once (isend and irecv both ways, as a pipeline does), and one per tag
matches messages by tag, as Gloo does; on one channel messages are received in
the order they were sent. A channel is opened by its first message, on its
own thread (its rendezvous waits for the other rank, which a caller of isend
must not), and lives as long as the group.
"""
import datetime
import threading
import time

import torch.distributed as dist

from .. import exact
from ..communicator import Communicator
from ..errors import TransportError
from ._worker import SerialWorker

SENDER, RECEIVER = 0, 1  # the two ranks of a channel
MEETING_POLL_S = 0.1  # how often a channel waiting for its peer looks whether it was interrupted


def _own_connection(store):
    """`store` over a connection of its own where it has one (TCPStore): a TCPStore client runs one
    request at a time, so channels that meet their peers at once on one connection wait on each
    other's waits (two ranks each waiting on the channel the other has not reached: until the
    timeout)."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):  # a store with no clone serves its callers as it is
        return store


def _meet(store, me, timeout_s, interrupted, what):
    """Wait until the channel's other rank has come too, up to timeout_s, looking every
    MEETING_POLL_S whether the channel was interrupted. The communicator's own rendezvous, after
    it, then finds both ranks there: its timeout (the store's, at most 60 s) is not the wait for
    a late sender, which may load a checkpoint for minutes first."""
    store.set(f"here/{me}", "1")
    deadline = time.monotonic() + timeout_s
    while True:
        if interrupted():
            raise TransportError(f"{what}: interrupted while waiting for the other rank's first message")
        try:
            store.wait([f"here/{1 - me}"], datetime.timedelta(seconds=MEETING_POLL_S))
            return
        except Exception as error:  # the store's timeout (DistStoreError), or its connection lost
            if store.check([f"here/{1 - me}"]):
                return
            if time.monotonic() >= deadline:
                raise TransportError(f"{what}: the other rank did not come within {timeout_s:.0f} s") from error


class Channel:
    """Messages from one rank to another under one tag, in issue order, on a thread of their own."""

    def __init__(self, name, connect):
        self._connect = connect  # (interrupted: () -> bool) -> Communicator; it waits for the other rank
        self._failed = None
        self._interrupted = False
        self.communicator = None
        self._worker = SerialWorker(name)

    def submit(self, message, tensor):
        """Queue message(communicator); returns the Work, whose result is [tensor]."""
        def run():
            if self._failed is not None:  # its rendezvous keys are spent: a second try would read them
                raise self._failed
            if self.communicator is None:
                try:
                    self.communicator = self._connect(lambda: self._interrupted)
                except BaseException as error:
                    self._failed = error
                    raise
                if self._interrupted:  # while it met its peer
                    self.communicator.interrupt()
            message(self.communicator)
        return self._worker.submit(run, [tensor])

    def interrupt(self):
        """End the message in progress and every queued one (TransportError), a channel still
        waiting for its peer's first message too (within MEETING_POLL_S)."""
        self._interrupted = True
        communicator = self.communicator
        if communicator is not None:
            communicator.interrupt()

    def close(self):
        self._worker.close()
        if self.communicator is not None:
            self.communicator.close()
            self.communicator.store = None  # and its connection to the store


class Channels:
    """A group's channels, opened as its messages need them.

    Parameters
    ----------
    store : torch.distributed.Store
        The group's store (c10d's, prefixed for the group).
    rank : int
        This rank in the group.
    transport : str
    options : ud_transport.Options
        The group's communicator options (loss injection included); a receive waits for its
        sender's first message up to join_timeout_s, as a collective waits for a late rank.
    deadline : float or None
        Each message's deadline, as the group's collectives.
    incarnation : int
        Names this group's channels in the store (the group communicator's session id): a group
        made again on the same store must not read the keys of the one before.
    """

    def __init__(self, store, rank, transport, options, deadline, incarnation):
        self._store = store
        self._incarnation = incarnation  # the same on every rank of this group, and new with each group
        self._rank = rank
        self._transport = transport
        self._options = options
        self._deadline = deadline
        self._channels = {}
        self._lock = threading.Lock()  # isend may be called from several threads
        self._closed = False
        self.calls = 0  # the broadcasts the messages took (more than one where one was repaired or repeated)
        self.injected_drops = 0  # what Options.inject dropped of them, on this rank

    def send(self, tensor, destination, tag):
        """Queue tensor's bytes to `destination`; the Work completes when it holds them."""
        return self._message(tensor, (self._rank, destination, tag))

    def recv(self, tensor, source, tag):
        """Queue the receipt of `source`'s next message under `tag` into `tensor` (its bytes, in
        place; on failure tensor keeps its values)."""
        return self._message(tensor, (source, self._rank, tag))

    def _message(self, tensor, key):
        """Both ends make the same call: a broadcast from the channel's sender."""
        def move(comm):
            stats = exact.broadcast(comm, tensor, SENDER, deadline=self._deadline)
            with self._lock:
                self.calls += len(stats)
                self.injected_drops += sum(s.injected_drops for s in stats)
        return self._channel(*key).submit(move, tensor)

    def _channel(self, sender, receiver, tag):
        key = (sender, receiver, tag)
        with self._lock:
            if self._closed:
                raise TransportError("this 'ud' group is shut down (destroy_process_group): no message goes on it")
            channel = self._channels.get(key)
            if channel is None:
                channel = self._channels[key] = Channel(f"ud-p2p-{sender}-{receiver}-{tag}",
                                                        lambda interrupted: self._connect(sender, receiver, tag,
                                                                                          interrupted))
            return channel

    def _connect(self, sender, receiver, tag, interrupted):
        name = f"p2p/{self._incarnation:x}/{sender}-{receiver}/{tag}"
        me = SENDER if self._rank == sender else RECEIVER
        store = dist.PrefixStore(name, _own_connection(self._store))
        _meet(store, me, self._options.join_timeout_s, interrupted, f"rank {self._rank}: channel {name}")
        return Communicator(me, 2, store, self._transport, self._options, name=name)

    def close(self, interrupt=False):
        """Finish what is queued on every channel, then close them; `interrupt`: end it instead."""
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
        for channel in channels:
            if interrupt:
                channel.interrupt()
        for channel in channels:
            channel.close()
