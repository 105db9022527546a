"""Phase-aware loss budgets (after the DBLP 2026 paper on phase-aware loss
tolerance): training has critical phases, where the gradient's scale is on
the move and lost information costs most, and long stable stretches that
tolerate loss.

The detector compares a fast and a slow moving average of the gradient norm:
a step is critical while they differ by more than `threshold` (relative to
the slow one), during the first `warmup` steps, and for `hold` steps after
the last such step (so a phase does not flap on per-batch noise). Critical
steps get `critical_budget` (0.0 = exact collectives), the others
`stable_budget`. The norm used is agreed (the largest rank's, in fixed point,
one agreement round per step), so every rank picks the same budget and takes
the same path: a budget of 0 switches both halves of the step to exact
collectives on every rank at once. Measured on the training experiment
(scripts/train_under_loss.py): the defaults flag about a fifth of the steps,
in a dozen runs, most of them early in training.
"""
import logging
import math

import torch

from ._common import communicator_of

NORM_FIXED_POINT = 1 << 16  # the agreed norm's resolution
log = logging.getLogger("ud_transport.phase")


class PhaseAwareBudget:
    """Loss budgets by training phase: exact (or tight) in critical phases, loose when stable.

    Parameters
    ----------
    stable_budget : float in [0, 1], default 0.1
    critical_budget : float in [0, 1], default 0.0
        0 makes a critical step's collectives exact.
    threshold : float, default 0.2
        Relative gap between the fast and slow averages of the agreed gradient norm that
        marks a step critical.
    fast, slow : float, defaults 0.2 and 0.02
        Moving-average weights, 0 < slow < fast <= 1.
    warmup : int, default 20
        The first steps are critical.
    hold : int, default 10
        Steps a phase stays critical after the last critical step.
    communicator : Communicator or a "ud" ProcessGroup, optional

    Raises
    ------
    ValueError
        A budget outside [0, 1] or weights out of order.

    Examples
    --------
    >>> opt = LossTolerantOptimizer(adamw, phase_budget=PhaseAwareBudget(stable_budget=0.1))  # doctest: +SKIP
    """

    def __init__(self, *, stable_budget=0.1, critical_budget=0.0, threshold=0.2, fast=0.2, slow=0.02, warmup=20,
                 hold=10, communicator=None):
        for name, value in (("stable_budget", stable_budget), ("critical_budget", critical_budget)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not 0.0 < slow < fast <= 1.0:
            raise ValueError(f"need 0 < slow < fast <= 1 (moving-average weights), got slow={slow!r}, fast={fast!r}")
        self.stable_budget = stable_budget
        self.critical_budget = critical_budget
        self.threshold = threshold
        self.fast = fast
        self.slow = slow
        self.warmup = warmup
        self.hold = hold
        self.communicator = communicator
        self.step = 0
        self._fast_norm = self._slow_norm = None
        self._critical_until = 0
        self.schedule = []  # (step, agreed gradient norm, relative gap of the averages, budget)

    def budget(self, flat_gradient):
        """The budget for this step, the same on every rank (one agreement round).

        Parameters
        ----------
        flat_gradient : torch.Tensor
            This rank's gradient of this step, flattened.

        Returns
        -------
        float
            `critical_budget` or `stable_budget`.

        Raises
        ------
        PeerTimeout
            The agreement on the gradient norm failed.

        Examples
        --------
        >>> budget = phase.budget(grads)  # doctest: +SKIP
        """
        comm = communicator_of(self.communicator)
        local = float(torch.linalg.vector_norm(flat_gradient.double()))
        fixed = min(int(local * NORM_FIXED_POINT), 2**32 - 1) if math.isfinite(local) else 2**32 - 1
        norm = comm.agree(fixed) / NORM_FIXED_POINT  # the largest rank's norm, the same everywhere
        if self._fast_norm is None:
            self._fast_norm = self._slow_norm = norm
        self._fast_norm += self.fast * (norm - self._fast_norm)
        self._slow_norm += self.slow * (norm - self._slow_norm)
        gap = abs(self._fast_norm - self._slow_norm) / self._slow_norm if self._slow_norm > 0 else 0.0
        if self.step < self.warmup or gap > self.threshold:
            self._critical_until = self.step + self.hold
        critical = self.step < self._critical_until
        chosen = self.critical_budget if critical else self.stable_budget
        if self.schedule and self.schedule[-1][3] != chosen:
            log.info("step %d: %s phase, loss budget %g (gradient norm %.4g, averages %.3f apart)", self.step,
                     "critical" if critical else "stable", chosen, norm, gap)
        self.schedule.append((self.step, norm, gap, chosen))
        self.step += 1
        return chosen

    def critical_fraction(self):
        """Share of the steps so far that were critical."""
        return sum(row[3] == self.critical_budget for row in self.schedule) / max(len(self.schedule), 1)
