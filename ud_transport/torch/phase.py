"""Phase-aware loss budgets (after the DBLP 2026 paper on phase-aware loss
tolerance): training has critical phases, where the gradient changes fast
and lost information costs most, and long stable ones that tolerate loss.

A step is critical while the relative change of the gradient norm, smoothed
over a few steps, is above `threshold` (and during the first `warmup` steps).
Critical steps get `critical_budget` (0.0 = exact collectives), the others
`stable_budget`. The norm used is agreed (the largest rank's, in fixed
point, one agreement round per step), so every rank picks the same budget
and takes the same path: a budget of 0 switches both halves of the step to
exact collectives on every rank at once."""
import logging
import math

import torch

from ._common import communicator_of

NORM_FIXED_POINT = 1 << 16  # the agreed norm's resolution
log = logging.getLogger("ud_transport.phase")


class PhaseAwareBudget:
    def __init__(self, *, stable_budget=0.1, critical_budget=0.0, threshold=0.2, smoothing=0.3, warmup=20,
                 communicator=None):
        for name, value in (("stable_budget", stable_budget), ("critical_budget", critical_budget)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.stable_budget = stable_budget
        self.critical_budget = critical_budget
        self.threshold = threshold
        self.smoothing = smoothing
        self.warmup = warmup
        self.communicator = communicator
        self.step = 0
        self._previous_norm = None
        self._change = None
        self.schedule = []  # (step, agreed gradient norm, smoothed relative change, budget)

    def budget(self, flat_gradient):
        """The budget for this step, from this step's local flat gradient."""
        comm = communicator_of(self.communicator)
        local = float(torch.linalg.vector_norm(flat_gradient.double()))
        fixed = min(int(local * NORM_FIXED_POINT), 2**32 - 1) if math.isfinite(local) else 2**32 - 1
        norm = comm.agree(fixed) / NORM_FIXED_POINT  # the largest rank's norm, the same everywhere
        if self._previous_norm:
            change = abs(norm - self._previous_norm) / self._previous_norm
            self._change = change if self._change is None else self.smoothing * change + (1 - self.smoothing) * self._change
        self._previous_norm = norm
        critical = self.step < self.warmup or (self._change is not None and self._change > self.threshold)
        chosen = self.critical_budget if critical else self.stable_budget
        if self.schedule and self.schedule[-1][3] != chosen:
            log.info("step %d: %s phase, loss budget %g (gradient norm %.4g, relative change %.3f)", self.step,
                     "critical" if critical else "stable", chosen, norm, self._change or 0.0)
        self.schedule.append((self.step, norm, self._change, chosen))
        self.step += 1
        return chosen
