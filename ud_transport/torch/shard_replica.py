"""A copy of each rank's shard of the two-stage step's optimizer state, kept by the next rank of
the group (rank r's by rank r + 1, the last rank's by rank 0) and refreshed every few steps.
When a rank dies, the survivors' ``regroup`` takes its shard's state from that copy, as old as
the last refresh, instead of restarting it (Adam: moments zero, step 0).

The copies travel on two communicators of two ranks each, opened beside the group's, on the
same store, transport and options: one to the next rank (this rank sends) and one from the
previous rank (this rank receives). Each refresh sends this rank's state and takes the previous
rank's, both at once, on two threads. It is an exact broadcast on each pair, its length first.
Per rank that is the shard's state once: for Adam, two values per element of the shard. A step
moves about two values per element of the whole model, so at one refresh per step the copy adds
1/(n - 1) of a step's bytes.

A refresh that fails keeps the copy held before it, and is counted in ``failures``. That happens
when a neighbour died during it (a pair waits PAIR_JOIN_TIMEOUT_S for a neighbour, not the
group's join timeout), and the group's next collective then names the death. A refresh never
raises: the step it follows has already changed the parameters.

A copy is as old as the last refresh that completed. With a refresh after every step, that is
the dead rank's state when it died at a step's start. If it died in a step's parameter
all-gather, after the owners stepped, the copy is one step older. Nothing is copied until the
first refresh after the group was made."""
import dataclasses
import logging
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
        The previous rank's pieces at the last refresh that reached this rank, as ``resharding.from_bytes``
        gives them, or None.
    refreshes, failures : int
        Refreshes made, and those that failed.
    """

    def __init__(self, comm, deadline=None):
        self.deadline, self.rank = deadline, comm.rank
        self.held = None
        self.refreshes = self.failures = 0
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
        """Send this rank's `pieces` ((start, stop, group, {state name: value}), ...) to the next rank and take the previous
        rank's into ``held``; every rank of the group calls it at the same step. Returns whether
        both went through."""
        if not self.active:
            return False
        self.refreshes += 1
        record = to_bytes(pieces)
        errors = []

        def send():
            try:
                length = torch.tensor([len(record)], dtype=torch.int64)
                exact.broadcast(self._to_next, length, SENDER, deadline=self.deadline, collective="replica length")
                exact.broadcast(self._to_next, torch.frombuffer(bytearray(record), dtype=torch.uint8), SENDER,
                                deadline=self.deadline, collective="replica")
            except Exception as error:  # reported below, on the caller's thread
                errors.append(error)

        sending = threading.Thread(target=send, name="ud-replica-send", daemon=True)
        sending.start()
        try:
            length = torch.zeros(1, dtype=torch.int64)
            exact.broadcast(self._from_previous, length, SENDER, deadline=self.deadline, collective="replica length")
            received = torch.empty(int(length), dtype=torch.uint8)
            exact.broadcast(self._from_previous, received, SENDER, deadline=self.deadline, collective="replica")
            self.held = from_bytes(received.numpy().tobytes())
        except Exception as error:  # the step that called this stands whatever a copy does
            errors.append(error)
        finally:
            sending.join()
        if errors:
            self.failures += 1
            log.warning("rank %d: a refresh of the optimizer state's replica failed (the copy held is kept): %s",
                        self.rank, errors[0])
        return not errors

    def close(self):
        for pair in (self._to_next, self._from_previous):
            if pair is not None:
                pair.close()
                pair.store = None  # and its connection to the store
        self._to_next = self._from_previous = None
