"""The seed paper's two-stage step (Weintraub et al. 2025), as an optimizer
wrapper in the spirit of ZeroRedundancyOptimizer:

    opt = LossTolerantOptimizer(torch.optim.AdamW(model.parameters(), lr=2e-3), loss_budget=0.1)
    loss.backward(); opt.step(); opt.zero_grad()

step() (1) reduce-scatters the flat gradient, lossy, each shard's owner
rescaling what reached it (unbiased); (2) the owner steps its shard with the
wrapped optimizer, whose state lives only there; (3) all-gathers the updated
parameters, where a chunk that does not arrive keeps its previous value. So
every replica is pulled back to the owners' values whenever a chunk arrives:
drift between replicas stays bounded, instead of growing as it does when
each replica applies its own estimate of the gradient.

Equal to plain data parallel at no loss for elementwise optimizers (SGD,
Adam, AdamW, ...): an optimizer that looks at whole tensors (LAMB, Shampoo)
would see shard pieces instead. Use it on a plain model, not inside DDP (it
does the gradient communication itself)."""
import collections

import torch

from .. import exact
from .._native import MAX_COPIES
from ..errors import LossBudgetExceeded
from ..options import check_copies
from . import policy, resharding, shard_replica
from ._common import communicator_of, flatten, flatten_into, unflatten_into
from .chunk_repair import ErrorFeedback, Extrapolation, chunk_index_of_elements
from .copies_choice import CopiesChooser

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
REPLICATE_EVERY_LIMIT = 2**31 - 1  # what the ranks' agreement on it carries


class LossTolerantOptimizer:
    """The two-stage step: lossy reduce-scatter of gradients, the owner steps its shard,
    stale-retaining all-gather of parameters (see the module's docstring).

    Construction broadcasts rank 0's parameters exactly, so every replica starts equal.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Constructed over the model's CPU parameters (one floating dtype); its class and
        per-group settings are reused for this rank's shard, its state (if any) is dropped.
    communicator : Communicator or a "ud" ProcessGroup, optional
        None takes the default communicator.
    loss_budget : float in [0, 1], default 0.1
        The most of either half that may be missing; 0 makes the step's collectives exact.
    on_budget_miss : {"use", "skip", "raise"}, default "use"
    deadline : float, optional
        Seconds per collective; None adapts.
    algorithm : {"auto", "ring", "direct"}, optional
    phase_budget : PhaseAwareBudget, optional
        Chooses the budget per step instead of `loss_budget`.
    exact_gather : bool, default False
        Make the parameter all-gather exact on every step (only gradients are lost; costs
        repeated all-gathers and agreement rounds when one is incomplete).
    error_feedback : bool, default False
        A gradient piece that misses its owner is kept by its sender and sent with the next
        step's gradient instead of being rescaled away (the owner sums what arrived); costs an
        exact all-gather of the owners' chunk masks per step. Needs the direct schedule (the
        default above two ranks).
    stale_fill : {"keep", "extrapolate"}, default "keep"
        What a parameter chunk the all-gather lost holds: its old value (the seed paper's
        rule), or its old value plus the owner's last update to it.
    copies : int or "auto", default "auto"
        Times each datagram of the step's lossy collectives is sent (1 to 4): a chunk is lost
        only if every copy is, so i.i.d. loss p costs what loss p**copies would, for copies
        times the bytes (see ``Communicator.allreduce``). "auto" starts at 1 and, after every
        lossy step, takes the fewest copies that keep the chunk loss the reduce-scatter
        measured (over its last ~4000 contributions) at or below 1.5%; every rank chooses the same, from the
        agreed fraction. ``copies_used`` counts the lossy steps by the copies they sent.
    replicate_every : int, optional
        Every this many steps, each rank's shard of the optimizer state is copied to the next
        rank of the group (``ud_transport.torch.shard_replica``); when a rank dies, ``regroup``
        takes its shard's state from that copy (as old as the last refresh) instead of
        restarting it. Costs, for Adam at every step, 1/(n - 1) of a step's bytes; the
        exchange runs beside the next step's forward and backward. Every rank must pass the
        same (agreed: a ValueError on every rank otherwise). None (the default): no copy.
    join : bool, default False
        This rank is new to a group that grew (``Communicator.grow`` / ``ud_transport.torch.
        grow_group``): it takes rank 0's parameters and its shard's optimizer state from the
        ranks that held it, exactly, while they call ``regroup`` on the same group. After a
        rank dies, the survivors call ``regroup`` on the shrunk group (docs/elastic.md).

    Attributes
    ----------
    restarted_elements : int
        Elements of this rank's shard whose optimizer state started afresh at the last
        ``regroup`` or join (their owner was gone, and no replica held them); 0 otherwise.
    copied_elements : int
        Elements of this rank's shard whose optimizer state came from a replica at the last
        ``regroup`` (their owner was gone); 0 otherwise.
    replica : NeighbourReplica or None
        The ring of copies over the current group (``replicate_every``): its ``refreshes`` and
        ``failures``.
    shards_stepped : bool
        Whether the last ``step()`` updated the owners' shards, also when it then failed (in
        the parameters' all-gather): a step that failed with this True must not be retried.

    Raises
    ------
    TypeError
        Parameters of several dtypes, or not floating.
    ValueError
        Parameters on several devices (or off the CPU with error feedback or extrapolation), a
        budget outside [0, 1], or ``replicate_every`` out of range or not the same on every rank.

    Examples
    --------
    >>> opt = LossTolerantOptimizer(torch.optim.AdamW(model.parameters(), lr=2e-3))  # doctest: +SKIP
    >>> loss.backward(); opt.step(); opt.zero_grad()                                  # doctest: +SKIP
    """

    def __init__(self, optimizer, *, communicator=None, loss_budget=0.1, on_budget_miss=policy.USE, deadline=None,
                 algorithm=None, phase_budget=None, exact_gather=False, error_feedback=False, stale_fill="keep",
                 copies="auto", replicate_every=None, join=False):
        if not 0.0 <= loss_budget <= 1.0:
            raise ValueError(f"loss_budget must be in [0, 1], got {loss_budget!r}")
        if stale_fill not in ("keep", "extrapolate"):
            raise ValueError(f"stale_fill must be 'keep' or 'extrapolate', got {stale_fill!r}")
        self.copies = copies if copies == "auto" else check_copies(copies)
        if replicate_every is not None and (isinstance(replicate_every, bool) or not isinstance(replicate_every, int)
                                            or not 1 <= replicate_every <= REPLICATE_EVERY_LIMIT):
            raise ValueError(f"replicate_every must be None or an int from 1 to {REPLICATE_EVERY_LIMIT}, "
                             f"got {replicate_every!r}")
        self.replicate_every = replicate_every
        self.replica = None
        self._steps_since_copy = 0
        self.communicator = communicator_of(communicator)
        self.loss_budget = loss_budget
        self.on_budget_miss = policy.check(on_budget_miss)
        self.deadline = deadline
        self.algorithm = algorithm
        self.phase_budget = phase_budget
        self.exact_gather = exact_gather
        self.counters = policy.StepCounters()
        self.last_stats = None
        self.budgets = []  # the budget each step used
        self._groups = [dict(g) for g in optimizer.param_groups]
        self._params = [p for g in self._groups for p in g["params"]]
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES:
            raise TypeError(f"LossTolerantOptimizer needs parameters of one floating dtype, got {sorted(map(str, dtypes))}")
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"LossTolerantOptimizer needs its parameters on one device, got {sorted(map(str, devices))}")
        if devices and next(iter(devices)).type != "cpu" and (error_feedback or stale_fill != "keep"):
            raise ValueError("error_feedback and stale_fill='extrapolate' take CPU parameters (their chunk masks are "
                             f"host arrays), got parameters on {next(iter(devices))}")
        self.dtype = next(iter(dtypes))
        self._optimizer_class = type(optimizer)
        self._error_feedback, self._stale_fill = error_feedback, stale_fill
        self._group_ranges, offset = [], 0  # each parameter group's [start, stop) in the flat vector
        for group in self._groups:
            size = sum(p.numel() for p in group["params"])
            self._group_ranges.append((offset, offset + size))
            offset += size
        self._flat = flatten(self._params)
        self._grads = torch.empty_like(self._flat)
        self.count = self._flat.numel()
        self.copies_used = collections.Counter()  # lossy steps by the copies they sent
        self._handed = None  # what hand_over() gathered, for the next regroup
        # every replica starts from rank 0's parameters, exactly; a joining rank also takes its
        # shard's optimizer state from the ranks that held it
        self.shards_stepped = False
        self._settle_on(self.communicator,
                        self._records_over(self.communicator, resharding.encode([], {})) if join else None)

    def regroup(self, communicator):
        """Go on over `communicator`, a group made from this optimizer's after ranks died
        (``shrink``) or came (``grow``): every rank of it calls this at the same step boundary
        (a newcomer constructs its optimizer with ``join=True`` there instead).

        Ownership is re-sharded over the new group. Each range keeps the optimizer state its
        owner had; a range whose owner is gone takes the state its replica held (with
        ``replicate_every``: counted in ``copied_elements``), and otherwise starts afresh (Adam:
        moments zero, step 0), counted in ``restarted_elements``. The parameters become the owners'
        values where an owner survives and the new rank 0's elsewhere, on every rank alike.
        Error feedback's residuals and the extrapolation's last updates start afresh too.

        Parameters
        ----------
        communicator : Communicator or a "ud" ProcessGroup
            The new group, which this rank is in.

        Raises
        ------
        TransportError
            A collective of the move failed (the group's ranks did not all call it, ...); this
            optimizer then still holds the old group's shard and should not step.

        Examples
        --------
        >>> comm = comm.shrink([error.rank]); opt.regroup(comm)  # doctest: +SKIP
        """
        comm = communicator_of(communicator)
        self._settle_on(comm, self._records_over(comm, self._record()))
        self._handed = None

    def _records_over(self, comm, record):
        """Every rank's record over `comm`: what hand_over() gathered where every rank of `comm`
        holds it (a newcomer does not; nor a rank whose hand_over failed): all alike, or none."""
        if not comm.agree(self._handed is None, deadline=self.deadline):
            return self._handed
        return resharding.gather_records(comm, record, self.deadline)

    def hand_over(self):
        """Share every rank's shard of the optimizer state before ranks leave on purpose (a planned
        scale-down): every rank of the group calls it; then the leavers go, and the ranks that stay
        shrink and call ``regroup``, which takes the leavers' state from what was handed over
        instead of restarting it. Every rank holds the whole optimizer state until ``regroup``.

        Raises
        ------
        TransportError
            The exchange failed (a rank did not call it, or died first).

        Examples
        --------
        >>> opt.hand_over()                                          # doctest: +SKIP
        >>> if leaving: exit()                                       # doctest: +SKIP
        >>> comm = comm.shrink(leavers); opt.regroup(comm)           # doctest: +SKIP
        """
        self._handed = None
        self._handed = resharding.gather_records(self.communicator, self._record(), self.deadline)

    def close(self):
        """Close what this optimizer opened beside its group: the pairs of ``replicate_every``'s
        copies (their sockets and store connections), after the refresh in flight. Idempotent;
        the group's communicator is the caller's to close. Call it before the process ends: a
        refresh cut short there counts as failed on the neighbours."""
        if self.replica is not None:
            self.replica.close()
            self.replica = None

    def _record(self):
        """This rank's shard as resharding's record: its pieces' ranges, values and state, and
        the settings of their parameter groups."""
        start = self.shard[0]
        inner_groups = self._inner.param_groups if self._inner is not None else []
        pieces, settings = [], {}
        for (piece, low, high, group), inner_group in zip(self._pieces, inner_groups):
            state = {name: value for name, value in self._inner.state.get(piece, {}).items()}
            pieces.append((start + low, start + high, group, piece.detach().clone(), state))
            settings.setdefault(group, {k: v for k, v in inner_group.items() if k != "params"})
        held = self.replica.held if self.replica is not None else None
        return resharding.encode(pieces, settings, held or ())

    def _state_pieces(self):
        """This rank's shard's optimizer state as shard_replica copies it: (start, stop, group, state)."""
        start = self.shard[0]
        return [(start + low, start + high, group, dict(self._inner.state.get(piece, {})))
                for piece, low, high, group in self._pieces] if self._inner is not None else []

    def _settle_on(self, comm, records):
        """Take rank 0's parameters exactly and this rank's shard of `comm`, with the state that
        `records` (resharding's, every rank's alike; None: a new optimizer) carry. Nothing of this
        optimizer changes unless every step succeeds."""
        if self.replica is not None:
            self.replica.wait()  # its pairs are closed below, once the new group's are open
        self._agree_on_replicas(comm)
        flatten_into(self._params, self._flat)
        exact.broadcast(comm, self._flat, 0, deadline=self.deadline)
        if records is not None:
            resharding.owners_values(records, self._flat)
        shard = comm.shard_range(self.count)
        pieces = resharding.new_pieces(records or [], shard, self._group_ranges)
        inner, params = self._shard_optimizer(pieces, resharding.settings_of(records or [], self._groups), shard[0])
        # the ring of copies over the new group (every rank of it opens its pairs here)
        replica = shard_replica.NeighbourReplica(comm, self.deadline) if self.replicate_every else None
        unflatten_into(self._flat, self._params)
        if self.replica is not None:
            self.replica.close()
        self.communicator, self.shard, self._inner, self._pieces = comm, shard, inner, params
        self.replica, self._steps_since_copy = replica, 0
        self.restarted_elements = sum(p.stop - p.start for p in pieces if p.state is None) if records else 0
        self.copied_elements = sum(p.stop - p.start for p in pieces if p.copied)
        self._attach_repairs(comm)

    def _agree_on_replicas(self, comm):
        """Every rank of `comm` must copy its state every as many steps (the pairs' calls must
        match): the same ValueError on every rank otherwise, from the largest and smallest
        value agreed."""
        every = self.replicate_every or 0
        largest = comm.agree(every, deadline=self.deadline)
        smallest = REPLICATE_EVERY_LIMIT - comm.agree(REPLICATE_EVERY_LIMIT - every, deadline=self.deadline)
        if largest != smallest:
            raise ValueError(f"replicate_every differs across the group's ranks (from {smallest or None} to "
                             f"{largest or None}): every rank must pass the same")

    def _shard_optimizer(self, pieces, settings, start):
        """The wrapped optimizer's class over this rank's shard (from `start`): one parameter
        group per piece, with its group's settings and the state the piece carries."""
        groups, params = [], []
        for piece in pieces:
            param = torch.nn.Parameter(self._flat[piece.start:piece.stop].clone())
            params.append((param, piece.start - start, piece.stop - start, piece.group))
            groups.append({**settings[piece.group], "params": [param]})
        if not groups:
            return None, []
        inner = self._optimizer_class(groups)
        for piece, (param, _, _, _) in zip(pieces, params):
            if piece.state is not None:  # per-element state to the parameter's device; a step count stays where it was
                inner.state[param] = {name: value.to(param.device) if torch.is_tensor(value) and value.dim() else value
                                      for name, value in piece.state.items()}
        return inner, params

    def _attach_repairs(self, comm):
        """What depends on the group's chunk layout: error feedback, extrapolation, copies="auto"."""
        repairs = self._error_feedback or self._stale_fill == "extrapolate"
        chunk_of_element = chunk_index_of_elements(comm, self._flat) if repairs else None
        self.feedback = ErrorFeedback(comm, self._flat, self.algorithm, chunk_of_element) if self._error_feedback else None
        self._chooser = None
        if self.copies == "auto":
            chunks = len(comm.chunk_ranges(self.count, self.dtype))
            self._chooser = CopiesChooser(chunks, comm.world_size, MAX_COPIES)
        self.extrapolation = (Extrapolation(comm, self._flat, self.algorithm, chunk_of_element)
                              if self._stale_fill == "extrapolate" else None)

    # -- the optimizer interface --------------------------------------------------

    @property
    def param_groups(self):
        """The shard optimizer's groups (LR schedulers change them here)."""
        return self._inner.param_groups if self._inner is not None else []

    @property
    def state(self):
        """The shard optimizer's per-parameter state (this rank's shard only)."""
        return self._inner.state if self._inner is not None else {}

    def state_dict(self):
        """This rank's shard of the optimizer state (save one per rank)."""
        return self._inner.state_dict() if self._inner is not None else {}

    def load_state_dict(self, state):
        """Restore what ``state_dict()`` saved on this rank."""
        if self._inner is not None:
            self._inner.load_state_dict(state)

    def zero_grad(self, set_to_none=True):
        """Clear the model parameters' gradients (None, or zeros with set_to_none=False)."""
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        """One two-stage step over the model's gradients.

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model and returns the loss (as torch optimizers take it).

        Returns
        -------
        bool
            True if the parameters were updated, False if the step was skipped on every rank
            (policy "skip").

        Raises
        ------
        LossBudgetExceeded
            Policy "raise" and the gradients missed the budget.
        TransportError
            A collective failed (a ``PeerTimeout`` names a rank that is gone: see ``regroup``).
            The parameters are unchanged on any error. So is the optimizer state when the
            gradients' reduce-scatter failed (``shards_stepped`` is False: take the step again);
            when the parameters' all-gather failed, the owners had already stepped their shards
            (``shards_stepped`` is True, on every rank alike: the step stands, do not take it
            again; ``regroup`` re-bases every rank on the owners' values).

        Examples
        --------
        >>> loss.backward(); updated = opt.step()  # doctest: +SKIP
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        comm = self.communicator
        self._handed = None  # a hand_over() not followed by regroup is void: the state moved on
        self.shards_stepped = False
        grads = flatten_into([p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params], self._grads)
        budget = self.phase_budget.budget(grads) if self.phase_budget is not None else self.loss_budget
        if self.feedback is not None:
            self.feedback.add_residual(grads)
        self.budgets.append(budget)
        self.counters.steps += 1
        start, stop = self.shard
        shard_grad = torch.zeros(stop - start, dtype=self.dtype, device=self._flat.device)
        if budget == 0.0:  # a protected step: both halves exact
            self.counters.exact_steps += 1
            exact.allreduce(comm, grads, "mean", deadline=self.deadline)
            shard_grad.copy_(grads[start:stop])
            missed = False
            if self.feedback is not None:
                self.feedback.drop()
        else:
            on_miss = policy.on_miss(self.on_budget_miss)
            copies = self._step_copies()
            self.copies_used[copies] += 1
            try:
                if self.feedback is not None:
                    stats = self.feedback.reduce_scatter(grads, shard_grad, loss_budget=budget, deadline=self.deadline,
                                                         copies=copies, on_miss=on_miss)
                    self.feedback.settle(grads, deadline=self.deadline)
                else:
                    stats = comm.reduce_scatter(grads, shard_grad, op="mean", loss_budget=budget, deadline=self.deadline,
                                                algorithm=self.algorithm, copies=copies, on_miss=on_miss)
            except LossBudgetExceeded:
                self.counters.raised += 1
                raise
            self.counters.record(stats)
            self.last_stats = stats
            missed = stats.budget_missed
            if self._chooser is not None:
                self._chooser.record(stats.reduce_fraction)
        if missed and self.on_budget_miss == policy.SKIP:
            self.counters.skipped += 1
            return False
        if missed:
            self.counters.used_short += 1
        else:
            self.counters.stepped += 1
        if self._inner is not None:
            for piece, low, high, _ in self._pieces:
                piece.grad = shard_grad[low:high].clone()
            self._inner.step()
        self.shards_stepped = True  # from here an error leaves the step applied to the owners' shards
        own = self.owner_values()
        flatten_into(self._params, self._flat)  # where a chunk does not arrive, it keeps this replica's value
        if budget == 0.0 or self.exact_gather:
            exact.all_gather(comm, own, self._flat, deadline=self.deadline)
            if self.extrapolation is not None:
                self.extrapolation.reset()
        else:
            before = self._flat.clone() if self.extrapolation is not None else None
            mask = self.extrapolation.mask if self.extrapolation is not None else None
            stats = comm.all_gather(own, self._flat, loss_budget=1.0, deadline=self.deadline, algorithm=self.algorithm,
                                    chunk_mask=mask, copies=copies)
            self.counters.record(stats)
            if self.extrapolation is not None:
                self.extrapolation.apply(before, self._flat)
        unflatten_into(self._flat, self._params)
        self._copy_to_neighbour()
        return True

    def _copy_to_neighbour(self):
        """Every replicate_every steps that stepped the shards, the ring of copies is refreshed."""
        if self.replica is None:
            return
        self._steps_since_copy += 1
        if self._steps_since_copy >= self.replicate_every:
            self._steps_since_copy = 0
            self.replica.refresh(self._state_pieces())

    def _step_copies(self):
        return self._chooser.copies if self._chooser is not None else self.copies

    def owner_values(self):
        """This rank's shard as the owner holds it (for exact re-alignment)."""
        start, stop = self.shard
        own = torch.empty(stop - start, dtype=self.dtype, device=self._flat.device)
        for piece, low, high, _ in self._pieces:
            own[low:high] = piece.detach()
        return own
