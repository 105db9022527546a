"""A copy of each rank's shard of the two-stage step's optimizer state, kept by the next rank of
the group (rank r's by rank r + 1, the last rank's by rank 0) and refreshed every few steps.
When a rank dies, the survivors' ``regroup`` takes its shard's state from that copy, as old as
the last refresh, instead of restarting it (Adam: moments zero, step 0).

The copies travel on two communicators of two ranks each, opened beside the group's, on the
same store, transport and options: one to the next rank (this rank sends) and one from the
previous rank (this rank receives). A refresh copies the state into one buffer on the caller's
thread (``pack``), then sends it and takes the previous rank's on threads of its own, beside the
caller's next forward and backward: an exact broadcast on each pair, the sizes first. Per rank
that is the shard's state once: for Adam, two values per element of the shard. A step moves
about two values per element of the whole model, so at one refresh per step the copy adds
1/(n - 1) of a step's bytes.

A refresh that fails keeps the copy held before it, and is counted in ``failures``. That happens
when a neighbour died during it (a pair waits PAIR_JOIN_TIMEOUT_S for a neighbour, not the
group's join timeout), and the group's next collective then names the death. A refresh never
raises: the step it follows has already changed the parameters.

A copy is as old as the last refresh that completed. With a refresh after every step, that is
the dead rank's state when it died at a step's start with its last refresh through. It is one
refresh older when the death cut that refresh short (it runs during the next step's forward and
backward), or cut a step's parameter all-gather short after the owners stepped. Nothing is
copied until the first refresh after the group was made."""
import dataclasses
import logging
import math
import threading

import torch

from .. import exact
from ..communicator import Communicator
from ._common import own_connection
from .resharding import from_bytes, to_bytes

log = logging.getLogger("ud_transport")

SENDER, RECEIVER = 0, 1  # the two ranks of a pair
# How long a refresh waits for a neighbour that has not come (at most half the group's join
# timeout): every rank reaches the refresh right after the same all-gather, so a neighbour that
# is not there within seconds died after it. Waiting the group's join timeout would leave the
# two neighbours late to the group's next call, by as long as the others wait there for the dead
# rank, and a neighbour that came after they gave up would blame itself.
PAIR_JOIN_TIMEOUT_S = 10.0


class NeighbourReplica:
    """This rank's two pairs in the ring of copies over `comm`, and the previous rank's last copy.

    Every rank of `comm` constructs one at the same point (it meets its two neighbours, then the
    group agrees that every rank did). Where some rank could not open its pairs, no rank keeps a
    replica (``active`` is False) and ``refresh`` does nothing.

    Attributes
    ----------
    held : list or None
        The previous rank's pieces at the last refresh that reached this rank, or None.
    refreshes, failures : int
        Refreshes started, and those that failed.
    """

    def __init__(self, comm, deadline=None):
        self.deadline, self.rank = deadline, comm.rank
        self._held, self._exchange = None, None
        self.refreshes = self._failures = 0
        self._to_next = self._from_previous = None
        n, me = comm.world_size, comm.rank
        if n < 2:
            return
        following, previous = (me + 1) % n, (me - 1) % n
        options = dataclasses.replace(comm.options,
                                      join_timeout_s=min(PAIR_JOIN_TIMEOUT_S, comm.options.join_timeout_s / 2))
        opened = {}

        def open_pair(role, sender, receiver):
            try:  # each pair meets on a store connection of its own (one TCPStore connection serves one
                # wait at a time), under a name of the group's session and the two ranks
                opened[role] = Communicator(role, 2, own_connection(comm.store), comm.transport_name, options,
                                            name=f"{comm.family}/replica/{comm.session_id:x}/{sender}-{receiver}")
            except Exception as error:  # a neighbour that did not come: no replica, agreed below
                opened[role] = error

        # on two threads: every rank waits for its next rank in one pair and its previous in the
        # other, and the ring of those waits would never end if each opened one pair first
        sending = threading.Thread(target=open_pair, args=(SENDER, me, following), name="ud-replica-open", daemon=True)
        sending.start()
        open_pair(RECEIVER, previous, me)
        sending.join()
        failed = [error for error in opened.values() if isinstance(error, Exception)]
        if failed:
            log.warning("rank %d: no replica of the optimizer state: a neighbour's pair did not open: %s", me, failed[0])
        pairs = [pair for pair in opened.values() if isinstance(pair, Communicator)]
        keep = False
        try:
            keep = not comm.agree(int(bool(failed)), deadline=deadline)  # any rank without its pairs: none keeps one
        finally:
            if not keep:
                for pair in pairs:
                    pair.close()
        if keep:
            self._to_next, self._from_previous = opened[SENDER], opened[RECEIVER]

    @property
    def active(self):
        return self._to_next is not None

    def refresh(self, pieces):
        """Send this rank's `pieces` ((start, stop, group, {state name: value}), ...) to the next
        rank and take the previous rank's into ``held``; every rank of the group calls it at the
        same step. The state is copied here, on the caller's thread; the exchange runs on a
        thread of its own and overlaps what the caller does next (the next step's forward and
        backward), after the refresh before it has ended. Returns False where there is no replica."""
        if not self.active:
            return False
        self.wait()  # one exchange at a time on each pair
        self.refreshes += 1
        try:
            payload, sizes = pack(pieces)
        except Exception as error:  # a state this cannot copy: the pairs still take their turn
            log.warning("rank %d: the optimizer state could not be copied for its replica: %s", self.rank, error)
            payload, sizes = None, torch.tensor([-1, 0], dtype=torch.int64)
        self._exchange = threading.Thread(target=self._run_exchange, args=(payload, sizes), name="ud-replica-refresh",
                                          daemon=True)
        self._exchange.start()
        return True

    def wait(self):
        """Until the refresh in flight, if any, has ended (at most the deadline of its calls)."""
        exchange = self._exchange
        if exchange is not None:
            exchange.join()
            if self._exchange is exchange:  # not one a refresh on another thread started since
                self._exchange = None

    @property
    def held(self):
        """The previous rank's pieces at the last refresh that reached this rank, their tensors
        each of its own (``owned``), or None; waits for the refresh in flight."""
        self.wait()
        return None if self._held is None else owned(self._held)

    @property
    def failures(self):
        """Refreshes that failed (the copy held before each was kept); waits for the one in flight."""
        self.wait()
        return self._failures

    def _run_exchange(self, payload, sizes):
        """Send `payload` (None: this rank could not pack its state, and `sizes` says so) on the
        pair to the next rank and take the previous rank's, on two threads."""
        errors = [] if payload is not None else [RuntimeError("this rank's state could not be packed")]

        def send():
            try:
                exact.broadcast(self._to_next, sizes, SENDER, deadline=self.deadline, collective="replica length")
                if payload is not None:
                    exact.broadcast(self._to_next, payload, SENDER, deadline=self.deadline, collective="replica")
            except Exception as error:  # reported below
                errors.append(error)

        sending = threading.Thread(target=send, name="ud-replica-send", daemon=True)
        sending.start()
        try:
            theirs = torch.zeros(2, dtype=torch.int64)
            exact.broadcast(self._from_previous, theirs, SENDER, deadline=self.deadline, collective="replica length")
            if int(theirs[0]) < 0:
                raise RuntimeError("the previous rank could not pack its state")
            received = torch.empty(padded(int(theirs.sum())), dtype=torch.uint8)
            exact.broadcast(self._from_previous, received, SENDER, deadline=self.deadline, collective="replica")
            self._held = unpack(received, int(theirs[0]), int(theirs[1]))
        except Exception as error:  # the step that started this stands whatever a copy does
            errors.append(error)
        finally:
            sending.join()
        if errors:
            self._failures += 1
            log.warning("rank %d: a refresh of the optimizer state's replica failed (the copy held is kept): %s",
                        self.rank, errors[0])

    def close(self):
        self.wait()
        for pair in (self._to_next, self._from_previous):
            if pair is not None:
                pair.close()
                pair.store = None  # and its connection to the store
        self._to_next = self._from_previous = None


ALIGN = 16  # each tensor's bytes start at a multiple of this in the payload (a dtype view needs it)


def padded(size):
    """`size` rounded up to a multiple of ALIGN: the payload's length on the wire (a length of
    whole words is sent from the buffer itself, not from a copy of it)."""
    return -(-size // ALIGN) * ALIGN


def pack(pieces):
    """`pieces` ((start, stop, group, {name: value}), ...) as one uint8 tensor and its two
    sizes (int64: the tensors' bytes, then the layout's). The tensors' bytes are copied once, in
    place, each at an aligned offset; the layout (ranges, names, dtypes, shapes, the values that
    are not tensors) follows them, as resharding.to_bytes writes it, and zeros pad the whole to
    ALIGN. Pickling the tensors with torch.save instead, then copying its bytes into a tensor and
    back out, took about four passes over the state per refresh on each side."""
    layout, tensors, offset = [], [], 0
    for start, stop, group, state in pieces:
        entries = []
        for name, value in state.items():
            if torch.is_tensor(value):
                entries.append((name, offset, value.dtype, tuple(value.shape)))
                tensors.append((offset, value))
                offset = padded(offset + value.numel() * value.element_size())
            else:
                entries.append((name, None, None, value))
        layout.append((start, stop, group, entries))
    described = to_bytes(layout)
    payload = torch.empty(padded(offset + len(described)), dtype=torch.uint8)
    for at, value in tensors:
        size = value.numel() * value.element_size()
        payload[at:at + size].view(value.dtype).view(value.shape).copy_(value.detach())  # from any device
        payload[at + size:padded(at + size)] = 0  # no stray heap bytes on the wire
    payload[offset:offset + len(described)] = torch.frombuffer(bytearray(described), dtype=torch.uint8)
    payload[offset + len(described):] = 0
    return payload, torch.tensor([offset, len(described)], dtype=torch.int64)


def unpack(payload, tensor_bytes, layout_bytes):
    """What `pack` made, given its two sizes, as (start, stop, group, {name: value}), ...; its
    tensors are views of `payload` (each refresh receives a payload of its own)."""
    layout = from_bytes(payload[tensor_bytes:tensor_bytes + layout_bytes].numpy().tobytes())
    return [(start, stop, group,
             {name: value if offset is None else
              payload[offset:offset + math.prod(value) * dtype.itemsize].view(dtype).view(value)
              for name, offset, dtype, value in entries})
            for start, stop, group, entries in layout]


def owned(pieces):
    """`unpack`'s pieces with each tensor copied out of the payload: a view would carry the whole
    payload into torch.save (the regroup's record), and its dtype view does not survive that.
    Done when the copy is read, not at every refresh."""
    return [(start, stop, group, {name: value.clone() if torch.is_tensor(value) else value
                                  for name, value in state.items()})
            for start, stop, group, state in pieces]
