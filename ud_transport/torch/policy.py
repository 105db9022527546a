"""What happens when gradient traffic misses its loss budget. The budget
check uses the fractions every rank agreed on, so every rank takes the same
branch without another round."""
from dataclasses import asdict, dataclass

from .. import collectives

USE = "use"      # apply what arrived (unbiased, noisier); count it
SKIP = "skip"    # skip this optimizer step on every rank (like AMP's GradScaler on inf)
RAISE = "raise"  # raise LossBudgetExceeded after backward, where the caller can handle it
POLICIES = (USE, SKIP, RAISE)


def check(policy):
    if policy not in POLICIES:
        raise ValueError(f"on_budget_miss must be one of {POLICIES}, got {policy!r}")
    return policy


def on_miss(policy):
    """What the lossy call itself does on a miss under `policy` (Communicator's on_miss): only
    "raise" fails it; "use" and "skip" need the estimate written and the miss reported
    (stats.budget_missed, judged by the engine's one rule), and act on it after."""
    return "raise" if policy == RAISE else "return"


@dataclass
class StepCounters:
    """How often each branch was taken, and what the lossy traffic delivered."""
    steps: int = 0
    stepped: int = 0           # optimizer steps taken with everything within budget
    used_short: int = 0        # steps taken on a result that missed the budget (policy "use")
    skipped: int = 0           # steps skipped on every rank (policy "skip", or a peer timed out)
    raised: int = 0            # steps that raised (policy "raise")
    exact_steps: int = 0       # steps whose collectives were made exact (phase-aware budget 0)
    calls: int = 0             # lossy collectives
    reduce_calls: int = 0
    reduce_fraction_sum: float = 0.0
    gather_calls: int = 0
    gather_fraction_sum: float = 0.0

    def record(self, stats):
        """Count one lossy call's agreed fractions (the halves it has)."""
        self.calls += 1
        if collectives.reduces(stats.collective):
            self.reduce_calls += 1
            self.reduce_fraction_sum += stats.reduce_fraction
        if collectives.gathers(stats.collective):
            self.gather_calls += 1
            self.gather_fraction_sum += stats.gather_fraction

    def to_dict(self):
        values = asdict(self)
        values["mean_reduce_fraction"] = self.reduce_fraction_sum / self.reduce_calls if self.reduce_calls else 1.0
        values["mean_gather_fraction"] = self.gather_fraction_sum / self.gather_calls if self.gather_calls else 1.0
        return values
