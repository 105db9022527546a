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
import torch

from ..errors import LossBudgetExceeded, TransportError
from ..options import check_copies
from ..staging import Staged
from . import policy
from ._common import communicator_of, worker_of


class LossyHookState:
    """State of ``lossy_allreduce_hook``: where gradients go and what a budget miss does.

    Parameters
    ----------
    communicator : Communicator or a "ud" ProcessGroup, optional
        None takes the default communicator (``ud_transport.init()``).
    loss_budget : float in [0, 1], default 0.1
        What each bucket's allreduce may miss (the agreed fraction).
    deadline : float, optional
        Seconds per bucket; None adapts.
    on_budget_miss : {"use", "skip", "raise"}, default "use"
        Acted on in ``step()``, the same on every rank.
    algorithm : {"auto", "ring", "direct"}, optional
    copies : int, optional
        Times each datagram is sent, 1 to 4; None takes the communicator's ``Options.copies``
        (see ``Communicator.allreduce``).

    Raises
    ------
    ValueError
        A budget outside [0, 1] or an unknown policy.

    Examples
    --------
    >>> state = LossyHookState(comm, loss_budget=0.1, on_budget_miss="skip")  # doctest: +SKIP
    >>> model.register_comm_hook(state, lossy_allreduce_hook)                 # doctest: +SKIP
    >>> loss.backward(); state.step(optimizer); optimizer.zero_grad()        # doctest: +SKIP
    """

    def __init__(self, communicator=None, *, loss_budget=0.1, deadline=None, on_budget_miss=policy.USE, algorithm=None,
                 copies=None):
        if not 0.0 <= loss_budget <= 1.0:
            raise ValueError(f"loss_budget must be in [0, 1], got {loss_budget!r}")
        if copies is not None:
            check_copies(copies)
        self.communicator = communicator_of(communicator)
        self._worker = worker_of(communicator if communicator is not None else self.communicator)
        self.loss_budget = loss_budget
        self.deadline = deadline
        self.algorithm = algorithm
        self.copies = copies
        self.on_budget_miss = policy.check(on_budget_miss)
        self.counters = policy.StepCounters()
        self.last_stats = None
        self._missed = 0
        self._error = None
        self._pending = []

    def _allreduce(self, buffer):
        try:
            stats = self.communicator.allreduce(buffer, op="mean", loss_budget=self.loss_budget, deadline=self.deadline,
                                                algorithm=self.algorithm, copies=self.copies, on_miss="return")
        except TransportError as error:  # the buffer keeps its values; step() acts on it
            self._error = self._error or error
            return
        except BaseException as error:  # a bug must not break DDP either: report it in step()
            self._error = self._error or TransportError(f"lossy_allreduce_hook failed: {error!r}")
            return
        self.counters.record(stats)
        self.last_stats = stats
        if stats.budget_missed:
            self._missed += 1

    def step(self, optimizer, *args, **kwargs):
        """After backward: ``optimizer.step()`` unless this iteration's buckets missed the budget.

        Parameters
        ----------
        optimizer : torch.optim.Optimizer
        *args, **kwargs
            Passed to ``optimizer.step``.

        Returns
        -------
        bool
            True if the optimizer stepped, False if the policy "skip" skipped it (on every rank).

        Raises
        ------
        LossBudgetExceeded
            A bucket missed the budget and the policy is "raise".
        TransportError
            A bucket's allreduce failed (a rank not heard from, ...); the hook never raises
            inside backward, so it raises here.

        Examples
        --------
        >>> if not state.step(optimizer): print("skipped on every rank")  # doctest: +SKIP
        """
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
    """A DDP comm hook: average the bucket's gradients over ud_transport (lossy, unbiased).

    Runs on the communicator's worker thread, so backward goes on meanwhile. Never raises:
    errors and budget misses are acted on in ``state.step()``.

    Parameters
    ----------
    state : LossyHookState
    bucket : torch.distributed.GradBucket

    Returns
    -------
    torch.futures.Future
        Completes with the averaged bucket.

    Raises
    ------
    Nothing
        Errors and budget misses are recorded and raised by ``LossyHookState.step``.

    Examples
    --------
    >>> model.register_comm_hook(LossyHookState(comm), lossy_allreduce_hook)  # doctest: +SKIP
    """
    buffer = bucket.buffer()
    try:
        staged = Staged(writes=[buffer])  # a CUDA bucket: its host twin is copied here, after backward's kernels
    except BaseException as error:  # (pinned memory exhausted, ...): never raised inside backward
        state._error = state._error or TransportError(f"lossy_allreduce_hook could not stage the bucket: {error!r}")
        unchanged = torch.futures.Future()
        unchanged.set_result(buffer)
        return unchanged
    work = state._worker.submit(lambda: state._allreduce(staged.host(buffer)), buffer, staged=staged)
    state._pending = [w for w in state._pending if not w.is_completed()]  # bounded even if step() is never called
    state._pending.append(work)
    return work.get_future()
