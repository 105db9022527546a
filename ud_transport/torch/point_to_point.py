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

A receive from any source (``dist.recv(t)`` without ``src``) cannot name its
channel, and a channel's message moves only when both ends call it. So sends
are counted in the store, off the sender's path (a thread of the group's): a
counter per (sender, receiver, tag) of the messages sent, and a doorbell per
(receiver, tag) set after each count. Only toward a receiver that asked: its
first receive from any source sets a key that says so, which each sender looks
for every ASK_POLL_S while it has sends to that receiver it has not counted,
and then counts them all at once. Messages to a receiver that only names its
senders (a pipeline's) cost the store one look per ASK_POLL_S per sender, not
two store operations each, which were 0.2-0.4 ms of a 2 ms message on 2
cores. A receive claims its
sender's next message when it is posted (a receive that names its source at
once, as Gloo's does); one from any source, when the counts show a sender with
a message no receive has claimed (looked up again each time the doorbell
rings, taken round-robin so that no sender is starved). The claim order is the
order the receives are queued on each channel, so every message is received
exactly once and every channel stays in step with its sender. The store holds
a fixed number of keys (two per channel and tag, one per receiver), however
many messages pass.
"""
import collections
import datetime
import logging
import threading
import time

import torch.distributed as dist

from .. import exact
from ..communicator import Communicator
from ..errors import TransportError
from ..staging import Staged
from ._common import own_connection
from ._worker import SerialWorker, Work, through_host

log = logging.getLogger("ud_transport")

SENDER, RECEIVER = 0, 1  # the two ranks of a channel
MEETING_POLL_S = 0.1  # how often a channel waiting for its peer looks whether it was interrupted
# A receive from any source waits for its doorbell this long at a time: abort() rings the doorbell to
# end the wait at once, and each wait a TCPStore times out prints two warnings (not every 0.1 s, then).
ANY_SOURCE_WAIT_S = 5.0
# How often a sender with uncounted sends to a receiver looks whether that receiver asked for counts
# (it took a receive from any source): the most a first such receive waits for a message already sent.
ASK_POLL_S = 0.1


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

    def submit(self, message, tensor, finished=None, staged=None):
        """Queue message(communicator); returns the Work, whose result is [tensor]. `finished`,
        if given, is called on the channel's thread with the message's error or None when it ends
        (an any-source receive's own Work ends there), after a CUDA tensor's copy back is queued
        (`staged`: ud_transport.staging.Staged)."""
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

        if finished is None:
            return self._worker.submit(run, [tensor], staged=staged)
        through = through_host(run, staged) if staged else run

        def run_and_report():
            try:
                through()
            except BaseException as error:
                finished(error)
                raise
            finished(None)
        return self._worker.submit(run_and_report, [tensor])

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


class SourcedWork(Work):
    """An any-source receive's Work: `_source_rank()` is the rank whose message it took (in the
    group; dist.recv maps it to a global rank), -1 until one is chosen or where none was."""

    def __init__(self, result, staged=None):
        super().__init__(result, staged)
        self.source = -1

    def _source_rank(self):
        return self.source

    source_rank = _source_rank


class _Inbox:
    """This rank's any-source receives under one tag: queued in the order posted, each served
    on a thread of their own (it waits for a message to be announced, which a caller of irecv
    must not), with a store connection of their own (its waits would hold up the group's)."""

    def __init__(self, store, tag):
        self.store = own_connection(store)
        self.interrupted = False
        self.doorbell_deletable = True  # a store without delete_key is polled instead
        self.next_sender = 0  # where the next look starts: senders are taken round-robin
        self._worker = SerialWorker(f"ud-p2p-any-{tag}")

    def submit(self, run):
        return self._worker.submit(run, None)

    def close(self):
        self._worker.close()
        self.store = None


class _Announcer:
    """Counts this rank's sends in the store (see the module's docstring), on a thread of its own
    so that no message waits for the store. Sends to a receiver that asked for counts are counted
    as they come (what piled up while the thread was in the store goes in one addition per
    (receiver, tag)); the others are kept here, and counted all at once when the thread, looking
    every ASK_POLL_S, finds that their receiver asked. Cheaper than a SerialWorker: no Work per
    message."""

    def __init__(self, store, rank, sent_key, doorbell_key, asked_key):
        self._store = own_connection(store)
        self._rank = rank
        self._sent_key, self._doorbell_key, self._asked_key = sent_key, doorbell_key, asked_key
        self._asked = set()  # receivers that asked for counts
        self._pending = collections.Counter()  # (receiver, tag), its receiver asked -> sends not yet counted
        self._unasked = collections.Counter()  # (receiver, tag), not known to have asked -> sends so far
        self._condition = threading.Condition()
        self._closing = self._dropping = False
        self._thread = threading.Thread(target=self._loop, name="ud-p2p-announce", daemon=True)
        self._thread.start()

    def count(self, destination, tag):
        with self._condition:
            if destination in self._asked:
                self._pending[(destination, tag)] += 1
                self._condition.notify()
            else:  # looked at on the thread's next poll (the first such send starts its polls)
                if not self._unasked:
                    self._condition.notify()
                self._unasked[(destination, tag)] += 1

    def _loop(self):
        next_look = time.monotonic()
        while True:
            with self._condition:
                while not self._pending and not self._closing:
                    wait = next_look - time.monotonic() if self._unasked else None
                    if wait is not None and wait <= 0:
                        break
                    self._condition.wait(wait)
                if self._dropping or (self._closing and not self._pending):
                    return  # sends nobody asked for need no count: their channels have ended
                batch, self._pending = self._pending, collections.Counter()
                receivers = {destination for destination, _ in self._unasked} \
                    if self._unasked and time.monotonic() >= next_look else set()
            self._publish(batch)
            if receivers:
                next_look = time.monotonic() + ASK_POLL_S
                lump = collections.Counter()
                for receiver in sorted(receivers):
                    if self._receiver_asked(receiver):
                        with self._condition:  # every send so far is in the lump: later ones go to _pending
                            self._asked.add(receiver)
                            for key in [key for key in self._unasked if key[0] == receiver]:
                                lump[key] = self._unasked.pop(key)
                self._publish(lump)

    def _publish(self, counts):
        for (destination, tag), count in counts.items():
            try:  # the count first, then the doorbell: a receive that wakes on it reads the count
                self._store.add(self._sent_key(self._rank, destination, tag), count)
                self._store.set(self._doorbell_key(destination, tag), "1")
            except Exception as error:  # the message itself is unaffected; a receive naming its sender gets it
                log.warning("rank %d: could not count a message to rank %d (tag %d) in the store: %s; a "
                            "receive from any source there will not see it", self._rank, destination, tag, error)

    def _receiver_asked(self, receiver):
        try:
            return self._store.check([self._asked_key(receiver)])
        except Exception as error:  # looked at again on the next poll
            log.debug("rank %d: could not look whether rank %d asked for counts: %s", self._rank, receiver, error)
            return False

    def close(self, drop=False):
        """Count what is pending, then stop; `drop` (abort): stop now."""
        with self._condition:
            self._closing, self._dropping = True, drop
            self._condition.notify()
        self._thread.join()
        self._store = None


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
        sender's first message up to join_timeout_s, as a collective waits for a late rank (a
        receive from any source, for any sender's message, as long).
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
        self._closed = False  # to the caller: no new message
        self._inboxes_closed = False  # within: no any-source receive left to take a message
        self._claimed = collections.Counter()  # (sender, tag) -> this rank's receives of its messages so far
        self._inboxes = {}  # tag -> _Inbox
        self._announcer = None  # counts this rank's sends in the store (opened by the first)
        self._asked_for_counts = False  # this rank's key that asks senders to count is set
        self.calls = 0  # the broadcasts the messages took (more than one where one was repaired or repeated)
        self.injected_drops = 0  # what Options.inject dropped of them, on this rank

    def send(self, tensor, destination, tag):
        """Queue tensor's bytes to `destination`; the Work completes when it holds them."""
        with self._lock:
            work = self._message_locked(tensor, (self._rank, destination, tag), staged=Staged(reads=[tensor]))
            # counted in the store after it is queued (the count is all a receive from any source reads)
            if self._announcer is None:
                self._announcer = _Announcer(self._store, self._rank, self._sent_key, self._doorbell_key,
                                             self._asked_key)
            self._announcer.count(destination, tag)
        return work

    def recv(self, tensor, source, tag):
        """Queue the receipt of `source`'s next message under `tag` into `tensor` (its bytes, in
        place; on failure tensor keeps its values). It claims that message now: a receive from
        any source posted before it takes another."""
        with self._lock:
            work = self._message_locked(tensor, (source, self._rank, tag), staged=Staged(overwrites=[tensor]))
            self._claimed[(source, tag)] += 1  # in the order queued on the channel: the claim is that message
        return work

    def recv_anysource(self, tensor, tag, world_size):
        """Queue the receipt of the next message under `tag` from any other rank of the
        `world_size` into `tensor`: the first message no receive has claimed (any-source receives
        take them in the order they were posted). The Work's `_source_rank()` names its sender."""
        staged = Staged(overwrites=[tensor])
        work = SourcedWork([tensor], staged)
        with self._lock:
            if self._closed:
                raise TransportError("this 'ud' group is shut down (destroy_process_group): no message goes on it")
            inbox = self._inboxes.get(tag)
            if inbox is None:
                inbox = self._inboxes[tag] = _Inbox(self._store, tag)
            senders = [r for r in range(world_size) if r != self._rank]

            def take():
                try:
                    self._take_any(inbox, tensor, tag, senders, work, staged)
                except BaseException as error:  # nothing claimed: the Work says why
                    work._finish(error)
            inbox.submit(take)
        return work

    # -- keys of the counts in the store -------------------------------------------------------

    def _sent_key(self, sender, receiver, tag):
        return f"p2p/{self._incarnation:x}/sent/{sender}-{receiver}/{tag}"

    def _doorbell_key(self, receiver, tag):
        return f"p2p/{self._incarnation:x}/doorbell/{receiver}/{tag}"

    def _asked_key(self, receiver):
        return f"p2p/{self._incarnation:x}/asked/{receiver}"

    def _take_any(self, inbox, tensor, tag, senders, work, staged):
        """Wait until some sender has a message under `tag` that no receive has claimed, claim it
        for `work` and queue the receipt on its channel (`work` ends with it)."""
        store, doorbell = inbox.store, self._doorbell_key(self._rank, tag)
        timeout_s = self._options.join_timeout_s
        deadline = time.monotonic() + timeout_s
        if not self._asked_for_counts:  # senders count their sends here from now on (within ASK_POLL_S)
            store.set(self._asked_key(self._rank), "1")
            self._asked_for_counts = True
        while True:
            if inbox.interrupted:
                raise TransportError(f"rank {self._rank}: a receive from any source (tag {tag}) was interrupted "
                                     "while waiting for a message")
            # the doorbell is taken down before the counts are read: a count after the look rings again
            if inbox.doorbell_deletable:
                try:
                    store.delete_key(doorbell)
                except (RuntimeError, NotImplementedError):
                    inbox.doorbell_deletable = False
            sent = {sender: int(store.add(self._sent_key(sender, self._rank, tag), 0)) for sender in senders}
            order = senders[inbox.next_sender % len(senders):] + senders[:inbox.next_sender % len(senders)] \
                if senders else []
            with self._lock:
                for sender in order:
                    if sent[sender] > self._claimed[(sender, tag)]:
                        work.source = sender  # before the channel can end the Work
                        try:
                            self._message_locked(tensor, (sender, self._rank, tag), internal=True,
                                                 finished=work._finish, staged=staged)
                        except BaseException:
                            work.source = -1
                            raise
                        self._claimed[(sender, tag)] += 1
                        inbox.next_sender = senders.index(sender) + 1
                        return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"rank {self._rank}: no message under tag {tag} came from any rank within "
                                     f"{timeout_s:.0f} s (a receive from any source)")
            if inbox.doorbell_deletable:
                try:
                    store.wait([doorbell], datetime.timedelta(seconds=min(ANY_SOURCE_WAIT_S, left)))
                except Exception:  # the store's timeout: look whether it was interrupted, and wait again
                    pass
            else:
                time.sleep(min(MEETING_POLL_S, left))

    def _message_locked(self, tensor, key, internal=False, finished=None, staged=None):
        """Both ends make the same call: a broadcast from the channel's sender."""
        def move(comm):
            stats = exact.small_broadcast(comm, staged.host(tensor) if staged else tensor, SENDER, deadline=self._deadline)
            with self._lock:
                self.calls += len(stats)
                self.injected_drops += sum(s.injected_drops for s in stats)
        return self._channel_locked(*key, internal=internal).submit(move, tensor, finished, staged)

    def _channel_locked(self, sender, receiver, tag, internal=False):
        """The channel, opened if new. `internal`: for an any-source receive queued before the group
        was shut down, which may still take a message while the shutdown finishes it."""
        key = (sender, receiver, tag)
        if self._closed and not (internal and not self._inboxes_closed):
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
        store = dist.PrefixStore(name, own_connection(self._store))
        _meet(store, me, self._options.join_timeout_s, interrupted, f"rank {self._rank}: channel {name}")
        return Communicator(me, 2, store, self._transport, self._options, name=name)

    def close(self, interrupt=False):
        """Finish what is queued on every channel, then close them; `interrupt`: end it instead."""
        with self._lock:
            self._closed = True
            inboxes = dict(self._inboxes)
            channels = list(self._channels.values())
        if interrupt:
            for tag, inbox in inboxes.items():
                inbox.interrupted = True
                try:  # wakes its wait (on a connection of the group's: the inbox's own is in the wait)
                    self._store.set(self._doorbell_key(self._rank, tag), "1")
                except Exception as error:  # the store is gone: the wait ends within ANY_SOURCE_WAIT_S
                    log.debug("rank %d: could not ring the doorbell of tag %d: %s", self._rank, tag, error)
            for channel in channels:
                channel.interrupt()
        for inbox in inboxes.values():  # any-source receives queued still take their message (shutdown) or end
            inbox.close()
        with self._lock:
            self._inboxes_closed = True
            channels = list(self._channels.values())  # with those the inboxes opened
        for channel in channels:
            if interrupt:
                channel.interrupt()
        for channel in channels:
            channel.close()
        if self._announcer is not None:
            self._announcer.close(drop=interrupt)
