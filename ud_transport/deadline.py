"""The default deadline of a call, learned from recent calls.

Expected time scales with bytes above a small size (bandwidth-bound) and is
flat below it (latency-bound). The default deadline is a multiple of the
expected time, between a floor and a cap; with no history it is the cap."""
import statistics
from collections import deque

LATENCY_BOUND_BYTES = 256 * 1024


class DeadlineEstimator:
    def __init__(self, multiplier, floor_s, cap_s, history=32):
        self.multiplier = multiplier
        self.floor_s = floor_s
        self.cap_s = cap_s
        self.samples = deque(maxlen=history)

    def record(self, nbytes, elapsed_s):
        self.samples.append((max(nbytes, LATENCY_BOUND_BYTES), elapsed_s))

    def expected_s(self, nbytes):
        if not self.samples:
            return None
        size = max(nbytes, LATENCY_BOUND_BYTES)
        return statistics.median(elapsed * size / sample_bytes for sample_bytes, elapsed in self.samples)

    def deadline_s(self, nbytes):
        expected = self.expected_s(nbytes)
        if expected is None:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.multiplier * expected))
