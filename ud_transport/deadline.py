"""The default deadline of a call, learned from recent calls.

Expected time scales with bytes above a small size (bandwidth-bound) and is
flat below it (latency-bound). The default deadline is a multiple of the
expected time, between a floor and a cap; with no history it is the cap."""
import bisect
from collections import deque

LATENCY_BOUND_BYTES = 256 * 1024


class DeadlineEstimator:
    def __init__(self, multiplier, floor_s, cap_s, history=32):
        self.multiplier = multiplier
        self.floor_s = floor_s
        self.cap_s = cap_s
        self.samples = deque(maxlen=history)  # seconds per byte of the recent calls, oldest first
        self._ordered = []  # the same, smallest first: the median without a sort per call

    def record(self, nbytes, elapsed_s):
        """One call's time (not thread-safe: the Communicator records under its lock)."""
        rate = elapsed_s / max(nbytes, LATENCY_BOUND_BYTES)
        if not self.samples.maxlen:  # no history kept: the cap always
            return
        if len(self.samples) == self.samples.maxlen:
            del self._ordered[bisect.bisect_left(self._ordered, self.samples[0])]
        self.samples.append(rate)
        bisect.insort(self._ordered, rate)

    def expected_s(self, nbytes):
        ordered = self._ordered
        if not ordered:
            return None
        middle = len(ordered) // 2
        rate = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        return rate * max(nbytes, LATENCY_BOUND_BYTES)

    def deadline_s(self, nbytes):
        expected = self.expected_s(nbytes)
        if expected is None:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.multiplier * expected))
