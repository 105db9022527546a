"""A DDP comm hook for models that keep Gloo (or NCCL) as their backend and
send only gradients over ud_transport:

    state = LossyHookState(communicator, loss_budget=0.1, on_budget_miss="skip")
    model.register_comm_hook(state, lossy_allreduce_hook)
    ...
    loss.backward()
    state.step(optimizer)       # steps, or skips on every rank, or raises
    optimizer.zero_grad()

The hook never raises inside backward (that would leave DDP broken): a
budget miss or an error is recorded and acted on in state.step(), after
backward, where every rank takes the same branch (misses are judged on the
fractions all ranks agreed on; errors are agreed verdicts too)."""
from ..errors import LossBudgetExceeded, TransportError
from . import policy
from ._common import communicator_of, worker_of


class LossyHookState:
    def __init__(self, communicator=None, *, loss_budget=0.1, deadline=None, on_budget_miss=policy.USE, algorithm=None):
        """communicator: a Communicator, a "ud" process group, or None (the
        default one). loss_budget bounds what each bucket's allreduce may miss
        (agreed fraction); on_budget_miss: "use", "skip" or "raise"."""
        if not 0.0 <= loss_budget <= 1.0:
            raise ValueError(f"loss_budget must be in [0, 1], got {loss_budget!r}")
        self.communicator = communicator_of(communicator)
        self._worker = worker_of(communicator if communicator is not None else self.communicator)
        self.loss_budget = loss_budget
        self.deadline = deadline
        self.algorithm = algorithm
        self.on_budget_miss = policy.check(on_budget_miss)
        self.counters = policy.StepCounters()
        self.last_stats = None
        self._missed = 0
        self._error = None
        self._pending = []

    def _allreduce(self, buffer):
        try:
            stats = self.communicator.allreduce(buffer, op="mean", loss_budget=1.0, deadline=self.deadline,
                                                algorithm=self.algorithm)
        except TransportError as error:  # the buffer keeps its values; step() acts on it
            self._error = self._error or error
            return
        except BaseException as error:  # a bug must not break DDP either: report it in step()
            self._error = self._error or TransportError(f"lossy_allreduce_hook failed: {error!r}")
            return
        self.counters.record(stats)
        self.last_stats = stats
        if policy.missed(stats, self.loss_budget):
            self._missed += 1

    def step(self, optimizer, *args, **kwargs):
        """After backward: optimizer.step() unless this iteration's buckets
        missed the budget and the policy says skip (returns False) or raise.
        A transport error (a rank not heard from) raises here."""
        for work in self._pending:
            work.wait()
        self._pending.clear()
        missed, error = self._missed, self._error
        self._missed, self._error = 0, None
        self.counters.steps += 1
        if error is not None:
            self.counters.raised += 1
            raise error
        if missed:
            if self.on_budget_miss == policy.SKIP:
                self.counters.skipped += 1
                return False
            if self.on_budget_miss == policy.RAISE:
                self.counters.raised += 1
                raise LossBudgetExceeded(f"rank {self.communicator.rank}: {missed} gradient bucket(s) missed the "
                                         f"loss budget {self.loss_budget}", self.last_stats)
            self.counters.used_short += 1
        else:
            self.counters.stepped += 1
        optimizer.step(*args, **kwargs)
        return True


def lossy_allreduce_hook(state, bucket):
    """Average the bucket's gradients over ud_transport (lossy, unbiased).
    Runs on the communicator's worker thread, so backward goes on meanwhile."""
    buffer = bucket.buffer()
    work = state._worker.submit(lambda: state._allreduce(buffer), buffer)
    state._pending = [w for w in state._pending if not w.is_completed()]  # bounded even if step() is never called
    state._pending.append(work)
    return work.get_future()
