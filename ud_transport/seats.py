"""Seating newcomers when a group grows: which newcomer gets which new rank, through the job's
store, so that neither side is left holding a place the other gave up.

Newcomers take tickets in the order they arrive; each grow seats the next tickets. Both sides may
give up (a newcomer that waited too long, a grow whose newcomers did not come), so each seat is
settled by two races on store counters, the first ``add`` to reach 1 winning:

- ``offer``: the grow offering ticket t against its newcomer having given up before any grow came.
  A grow that loses takes the next ticket instead.
- ``taken``: the seated newcomer confirming against the grow withdrawing the seat at its timeout.
  A newcomer that loses takes a new ticket and waits for the next grow. The winner then sets
  ``confirmed``, which the grow waits on (an ``add`` does not wake a HashStore's ``wait``).

The grow's rank 0 settles the seats; the outcome is decided by a third race (rank 0 when the
seats are settled, against a rank that gave up waiting for rank 0) and written by the winner; the
other ranks, and every seated newcomer, wait for it. A newcomer that took its seat is committed:
it waits for the outcome as long as any rank of the grow may (the seat carries the grow's
timeout), however little of its own time is left.

Only a grow whose seats were all taken goes on to meet; one that was not raises on every rank
before anything is torn down, so the group stays as it was. A newcomer's seat names the grow (the
old group's session and the ranks' count of grows tried on it), so a failed grow's keys are never
met in. Not covered: rank 0 dying between taking a ticket and writing its seat (the newcomer that
draws that ticket waits out its own time), and a seated newcomer dying before the meeting (the
grow then fails at the meeting).

Needs only set, get, check, wait and add(key, 1) of the store, as the rendezvous does."""
import time

from .errors import TransportError
from .rendezvous import wait_for as _wait

# The ranks other than rank 0 wait this many times the grow's timeout for its outcome: rank 0
# may reach the grow later than they do and then waits its full timeout for the newcomers.
OUTCOME_WAIT_FACTOR = 2
# Whoever decides a grow's outcome writes it right after: this bounds the others' wait for it.
DECIDED_WRITE_S = 30.0
OK = "ok"


class Seat:
    """A newcomer's place in a grown group: its rank, the group's size, and where it meets the
    ranks already there."""

    def __init__(self, ticket, record):
        session, attempt, world_size, newcomers, timeout_s, index = record.split(":")
        self.ticket = ticket
        self.grow_timeout_s = float(timeout_s)  # how long the grow waits for its newcomers
        self.session_id = int(session, 16)
        self.attempt = int(attempt)
        self.old_world_size = int(world_size)
        self.newcomers = int(newcomers)
        self.rank = self.old_world_size + int(index)
        self.world_size = self.old_world_size + self.newcomers
        self.key = meeting_key(self.session_id, self.attempt, self.newcomers)


def meeting_key(session_id, attempt, newcomers):
    """Where the ranks of the group with `session_id` and its newcomers meet after a grow whose
    seats were all taken (`attempt`: the ranks' count of grows tried before on that group)."""
    return f"grow/{session_id:016x}/{attempt}/{newcomers}"


def _base(family):
    return f"ud_transport/{family}/elastic"


def _seat(family, ticket):
    return f"{_base(family)}/seat/{ticket}"


def _outcome(family, session_id, attempt):
    return f"{_base(family)}/grow/{session_id:016x}/{attempt}/outcome"


def settle_grow(store, family, session_id, attempt, rank, world_size, newcomers, timeout_s):
    """Seat `newcomers` newcomers of `family` for a grow of the group with `session_id` (every rank
    calls it, at the same point): rank 0 offers the seats and waits up to `timeout_s` for them to
    be taken; the others wait for the outcome. Returns the meeting key when every seat was taken.

    The outcome is decided once, by a race: rank 0 when its seats are settled, or a rank that gave
    up waiting for rank 0 (OUTCOME_WAIT_FACTOR times `timeout_s`: rank 0 late, or dead). The first
    to ``add`` the decision key writes the outcome, and every rank and seated newcomer reads it.

    Raises
    ------
    TransportError
        A newcomer did not take its seat in time (the unclaimed seats are withdrawn: newcomers that
        come later wait for the next grow), or rank 0 did not settle the seats in time. Nothing of
        the group has changed.
    """
    outcome_key = _outcome(family, session_id, attempt)
    decided = store.check([outcome_key]) or store.check([f"{outcome_key}/decided"])
    if rank == 0 and not decided:  # decided already: the others gave up on this rank, offer nothing
        grow = f"{session_id:016x}:{attempt}:{world_size}:{newcomers}:{float(timeout_s)!r}"
        tickets = _offer(store, family, grow, newcomers)
        withdrawn = []
        if not _wait(store, [f"{_seat(family, ticket)}/confirmed" for ticket in tickets], timeout_s):
            withdrawn = [ticket for ticket in tickets if store.add(f"{_seat(family, ticket)}/taken", 1) == 1]
        if _decide(store, outcome_key):
            store.set(outcome_key, OK if not withdrawn else (
                f"{len(withdrawn)} of the {newcomers} newcomers did not take their seats (tickets "
                f"{', '.join(map(str, withdrawn))}) within {timeout_s:g} s; their seats are withdrawn"))
    elif rank != 0 and not _wait(store, [outcome_key], OUTCOME_WAIT_FACTOR * timeout_s) and _decide(store, outcome_key):
        store.set(outcome_key, f"rank 0 did not settle the grow's seats within {OUTCOME_WAIT_FACTOR * timeout_s:g} s")
    outcome = _read_outcome(store, outcome_key)
    if outcome != OK:
        raise TransportError(f"grow by {newcomers}: {outcome}. The group is as it was")
    return meeting_key(session_id, attempt, newcomers)


def _decide(store, outcome_key):
    """True for the first caller, which then writes the outcome."""
    return store.add(f"{outcome_key}/decided", 1) == 1


def _read_outcome(store, outcome_key):
    """The outcome, once the caller that decided it has written it (right after it won)."""
    if not _wait(store, [outcome_key], DECIDED_WRITE_S):
        return f"the outcome was decided but not written within {DECIDED_WRITE_S:g} s"
    return bytes(store.get(outcome_key)).decode()


def _offer(store, family, grow, newcomers):
    """The tickets of the next `newcomers` newcomers that have not given up, each offered its seat."""
    tickets = []
    while len(tickets) < newcomers:
        ticket = store.add(f"{_base(family)}/seated", 1)
        store.set(_seat(family, ticket), f"{grow}:{len(tickets)}")  # before the race: the winner reads it
        if store.add(f"{_seat(family, ticket)}/offer", 1) == 1:
            tickets.append(ticket)
    return tickets


def take_seat(store, family, timeout_s):
    """A newcomer's Seat in the next grow of `family` whose seats all get taken, waiting up to
    `timeout_s` in all.

    Raises
    ------
    TransportError
        No grow seated it in time. Its ticket is given up: a grow that comes later seats the next
        newcomer instead.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        ticket = store.add(f"{_base(family)}/arrived", 1)
        seat_key = _seat(family, ticket)
        if not _wait(store, [seat_key], deadline - time.monotonic()) and store.add(f"{seat_key}/offer", 1) == 1:
            raise TransportError(f"no group of '{family}' grew to seat this newcomer (ticket {ticket}) within "
                                 f"{timeout_s:g} s")
        seat = Seat(ticket, bytes(store.get(seat_key)).decode())
        if store.add(f"{seat_key}/taken", 1) != 1:
            continue  # the grow withdrew it at its timeout: wait for the next one
        store.set(f"{seat_key}/confirmed", "1")  # what the grow waits on: a store's add need not wake a wait
        # Taken: this newcomer is in unless the grow fails, so it waits as long as any rank of the grow may
        outcome_key = _outcome(family, seat.session_id, seat.attempt)
        if _wait(store, [outcome_key], OUTCOME_WAIT_FACTOR * seat.grow_timeout_s + DECIDED_WRITE_S) and \
                _read_outcome(store, outcome_key) == OK:
            return seat
        # failed, or no outcome at all (whoever decided it died before writing it): the next grow, if time is left
        if time.monotonic() >= deadline:
            raise TransportError(f"no group of '{family}' grew to seat this newcomer within {timeout_s:g} s (the last "
                                 "grow that seated it failed or gave no outcome: a newcomer or a rank did not come)")
