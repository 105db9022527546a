"""The c10d backend "ud": torch.distributed.init_process_group(backend="ud").

One Communicator per process group. Gradient traffic (allreduce and
reduce_scatter of floating tensors with SUM or AVG, by default) is lossy with
the configured budget; everything else (DDP's construction broadcasts and
shape checks, barriers, integer and MAX/MIN reductions, all-gathers of
parameters) is exact: the call is repeated until every rank holds the same
complete result (ud_transport.exact). Collectives run in issue order on one
thread per group; Work.wait() raises a collective's error. send and recv run
on channels of their own (ud_transport.torch.point_to_point).

Configuration: pg_options=ud_transport.torch.BackendOptions(...), else the
environment (see BackendOptions.from_environment)."""
import contextlib
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import environment, exact, loss_models, membership
from .. import options as options_module
from ..communicator import Communicator
from ..staging import Staged
from ..errors import LossBudgetExceeded, TransportError
from ..tensors import op_name, refuse_unsupported_torch
from . import _common, composite, point_to_point, policy
from ._worker import SerialWorker

LOSSY_KINDS = ("allreduce", "reduce_scatter")
# An allreduce or broadcast of at most this many bytes (all its tensors), and a barrier, run on the
# thread that waits for them when the group has nothing else pending (SerialWorker.submit's
# inline): the hand-over to the worker and back cost ~0.5 ms, as much as such a call
# (scripts/exact_calls.py --only allreduce,barrier)
INLINE_MAX_BYTES = 64 << 10
# torch.distributed.shrink_group's flags (distributed_c10d.SHRINK_DEFAULT / SHRINK_ABORT in torch 2.13)
SHRINK_DEFAULT, SHRINK_ABORT = 0x00, 0x01
LOSSY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# BackendOptions field -> environment variable (the table is ud_transport.environment)
ENVIRONMENT = environment.fields_of("backend")


@dataclass(frozen=True)
class BackendOptions:
    """Options of the c10d backend "ud", given as ``pg_options`` or read from the environment.

    Parameters
    ----------
    loss_budget : float in [0, 1], default 0.1
        The most of a lossy call's result that may be missing (agreed across ranks).
    on_budget_miss : {"use", "skip", "raise"}, default "use"
        "use" applies the unbiased estimate and counts the miss; "raise" makes the Work raise
        LossBudgetExceeded with the tensor unchanged (not for DDP, whose reducer cannot
        recover); "skip" is "use" for callers that check ``take_budget_misses()`` before stepping.
    lossy : tuple of {"allreduce", "reduce_scatter"}, default both
        Which collectives may lose data; empty makes every collective exact.
    deadline : float, optional
        Seconds per call; None adapts.
    algorithm : {"auto", "ring", "direct"}, optional
    transport : {"auto", "udp", "verbs"}, default "auto"
    communicator : dict
        Keyword options of ``ud_transport.init()`` (Options fields).

    Raises
    ------
    ValueError
        From ``validate()``, which the backend calls: a field out of range.

    Examples
    --------
    >>> dist.init_process_group("ud", pg_options=BackendOptions(loss_budget=0.05))  # doctest: +SKIP
    """
    loss_budget: float = 0.1
    on_budget_miss: str = policy.USE
    lossy: tuple = LOSSY_KINDS
    deadline: float = None
    algorithm: str = None
    transport: str = "auto"
    communicator: dict = field(default_factory=dict)

    def validate(self):
        """Returns self, or raises ValueError naming the field out of range."""
        if not 0.0 <= self.loss_budget <= 1.0:
            raise ValueError(f"loss_budget must be in [0, 1], got {self.loss_budget!r}")
        policy.check(self.on_budget_miss)
        unknown = set(self.lossy) - set(LOSSY_KINDS)
        if unknown:
            raise ValueError(f"lossy may name {LOSSY_KINDS}, got {sorted(unknown)}")
        return self

    @classmethod
    def from_environment(cls, **overrides):
        """BackendOptions from the environment variables that set its fields (the
        "backend" rows of ud_transport.environment), then `overrides`; validated."""
        values = {}
        for name, variable in ENVIRONMENT.items():
            if variable in os.environ:
                raw = environment.read(variable)
                if name == "lossy":  # empty is meaningful here: no collective is lossy
                    values[name] = tuple(k for k in raw.replace(" ", "").split(",") if k)
                elif not raw.strip():
                    continue  # an empty choice or number is as if unset, as for the communicator's options
                elif name == "loss_budget":
                    values[name] = options_module.from_text("default_loss_budget", variable, raw)
                else:
                    values[name] = raw
        values.update(overrides)
        return cls(**values).validate()


class ProcessGroupUD(dist.ProcessGroup):
    """The c10d process group of backend "ud": made by ``dist.init_process_group("ud")`` or
    ``dist.new_group(backend="ud")``, not by hand.

    allreduce and reduce_scatter of floating SUM/AVG tensors are lossy within
    ``BackendOptions.loss_budget``; broadcast, allgather, all_gather_into_tensor, integer and
    MAX/MIN reductions and barrier are exact (repeated until complete, never retransmitted per
    datagram). reduce, gather, scatter and all-to-all are exact too, built from those
    (``ud_transport.torch.composite``: every rank receives the bytes of a gather or all-to-all, not
    only their addressee). Collectives run in issue order on a worker thread; ``Work.wait()``
    raises a collective's error. send and recv are exact too, each (sender, receiver, tag) on a
    channel of its own (``ud_transport.torch.point_to_point``); a receive from any source takes the
    oldest message no receive has claimed (``recv_anysource``; ``work._source_rank()`` names it).
    ``torch.distributed.shrink_group`` makes a group of the survivors after a rank dies
    (``shrink``; docs/elastic.md).

    Parameters
    ----------
    store : torch.distributed.Store
        c10d's store, already prefixed for this group.
    rank, world_size : int
    timeout : datetime.timedelta
        The group's timeout: how long a collective waits for a late rank (and, capped at 60 s,
        the rendezvous).
    options : BackendOptions, optional
        None reads them from the environment (``UD_LOSS_BUDGET``, ...).
    group_name : str

    Attributes
    ----------
    last_error : Exception or None
        The error of the last collective that failed on this group (the same on every rank:
        a ``PeerTimeout``'s ``.rank`` names the rank to exclude when shrinking). DDP raises a
        collective's error as a RuntimeError that carries only its text; this keeps the error.

    Raises
    ------
    TransportError
        The rendezvous or the transport failed.
    ValueError
        Options out of range.

    Examples
    --------
    >>> import ud_transport.torch  # registers "ud"             # doctest: +SKIP
    >>> dist.init_process_group("ud")  # under torchrun         # doctest: +SKIP
    >>> dist.all_reduce(gradient)      # lossy within the budget # doctest: +SKIP
    """

    def __init__(self, store, rank, world_size, timeout, options=None, group_name=""):
        super().__init__(rank, world_size)
        self._ud_group_name = group_name
        self._timeout = timeout  # kept for the groups shrink() makes from this one
        self.grows_tried = 0  # grow_group calls on this group, the same count on every rank: names each grow's keys
        self.config = (options or BackendOptions.from_environment()).validate()
        overrides = dict(self.config.communicator)
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
        if seconds and "store_timeout_s" not in overrides:
            overrides["store_timeout_s"] = min(seconds, options_module.Options.store_timeout_s)
        if seconds and "join_timeout_s" not in overrides:
            overrides["join_timeout_s"] = seconds  # the group's timeout: how long a collective waits for a late rank
        if "inject" not in overrides:  # UD_INJECT, as ud_transport.init() reads it
            overrides["inject"] = loss_models.from_environment()
        resolved = options_module.build(**overrides)
        # the store c10d hands us is already prefixed for this group
        self.communicator = Communicator(rank, world_size, store, self.config.transport, resolved, name="c10d")
        self._channels = point_to_point.Channels(store, rank, self.config.transport, resolved, self.config.deadline,
                                                 self.communicator.session_id)
        self._worker = SerialWorker(f"ud-{group_name or 'group'}")
        _common.adopt_worker(self.communicator, self._worker)  # hooks on this communicator queue behind c10d's calls
        self.counters = policy.StepCounters()
        self.exact_calls = 0
        self.budget_misses = 0
        self._misses_since_taken = 0
        self.last_stats = None
        self.last_error = None

    # -- identity -----------------------------------------------------------

    # c10d keeps a group's name in its C++ backends, which a Python group
    # has none of; DeviceMesh (FSDP2) reads it
    def _set_group_name(self, name):
        self._ud_group_name = name

    @property
    def group_name(self):
        return self._ud_group_name

    def getBackendName(self):
        """ "ud" (what torch.distributed.get_backend reports)."""
        return "ud"

    def name(self):
        return "ud"

    # -- what callers may read ------------------------------------------------

    def take_budget_misses(self):
        """Lossy calls that missed the budget since the last take (the same
        number on every rank: misses are judged on agreed fractions). Waits
        for queued collectives first."""
        self._worker.submit(lambda: None, None).wait()  # rank-local: no call
        missed, self._misses_since_taken = self._misses_since_taken, 0
        return missed

    # -- one tensor at a time, on the worker ------------------------------------

    def _lossy(self, kind, tensor, op):
        return (kind in self.config.lossy and self.config.loss_budget > 0 and tensor.dtype in LOSSY_DTYPES
                and op_name(op) in ("sum", "avg"))

    def _lossy_call(self, call):
        """call(on_miss) makes the lossy call with the group's budget: "raise" fails it on a miss,
        "return" writes the estimate and reports the miss in its stats (the engine judges)."""
        try:
            stats = call(policy.on_miss(self.config.on_budget_miss))
        except LossBudgetExceeded as error:
            self._count_miss(error.stats)
            raise
        self.counters.record(stats)
        if stats.budget_missed:
            self._count_miss(stats)
        self.last_stats = stats
        return stats

    def _count_miss(self, stats):
        self.budget_misses += 1
        self._misses_since_taken += 1
        self.last_stats = stats

    def _allreduce_one(self, tensor, op, claim):
        comm = self.communicator
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self._lossy("allreduce", tensor, op):
            self._lossy_call(lambda on_miss: comm.allreduce(work, op=op_name(op), loss_budget=self.config.loss_budget,
                                                            deadline=self.config.deadline, algorithm=self.config.algorithm,
                                                            on_miss=on_miss))
        else:
            self.exact_calls += 1
            exact.allreduce(comm, work, op_name(op), deadline=self.config.deadline, collective=claim)
        if work is not tensor:
            tensor.copy_(work)

    def _reduce_scatter_one(self, output, flat_input, op, claim):
        comm = self.communicator
        target = output if output.is_contiguous() else output.contiguous()
        if self._lossy("reduce_scatter", flat_input, op):
            self._lossy_call(lambda on_miss: comm.reduce_scatter(flat_input, target, op=op_name(op),
                                                                 loss_budget=self.config.loss_budget,
                                                                 deadline=self.config.deadline,
                                                                 algorithm=self.config.algorithm, on_miss=on_miss))
        else:
            self.exact_calls += 1
            exact.reduce_scatter(comm, flat_input, target.view(-1), op_name(op), deadline=self.config.deadline,
                                 collective=claim)
        if target.data_ptr() != output.data_ptr():
            output.copy_(target.view(output.shape))

    def _submit(self, run, result, inline=False, staged=None, opts=None):
        """Queue run() on the group's worker so that every rank starts at least one engine call
        for it: where it starts none here (a list of no tensors, or an argument this rank refused
        before the engine), an agreement round goes in its place (an exact call of no elements
        starts one of its own, carrying what it is). The other ranks' call then always has one to
        pair with: where theirs differs it ends at once (LayoutMismatch naming this rank), and the
        group stays in step. A rank that made no call left the others waiting until the group's
        deadline (30 minutes by default), or paired their call with its next one."""
        def in_step():
            before = self.communicator.sequence
            try:
                run()
            except BaseException as error:
                self.last_error = error
                if self._started_nothing_since(before):
                    try:
                        exact.barrier(self.communicator, deadline=self.config.deadline)
                    except TransportError:  # the others called with data: their call ended, ours is the error
                        pass
                raise
            if self._started_nothing_since(before):
                exact.barrier(self.communicator, deadline=self.config.deadline)
        # a small call the caller waits for at once (c10d's synchronous calls) runs on its thread now
        return self._worker.submit(in_step, result, inline=inline, staged=staged, now=inline and _synchronous(opts))

    def _started_nothing_since(self, sequence):
        try:
            return self.communicator.sequence == sequence
        except TransportError:  # closed: no call can start
            return False

    @contextlib.contextmanager
    def _refusing(self):
        """Around the argument checks this rank makes alone before it queues a collective (a
        gather's or scatter's root checks lists the others never see): a failed check raises
        here at once, and an agreement round is queued in the refused call's place (_submit)."""
        try:
            yield
        except (ValueError, TypeError):
            try:
                self._submit(lambda: None, [])
            except TransportError:  # the group is shut down: nobody waits
                pass
            raise

    def _staged(self, reads=(), writes=(), overwrites=()):
        """The call's CUDA tensors staged (ud_transport.staging.Staged), made on the caller's
        thread; a refusal (tensors on two devices) is in step as _refusing's are."""
        with self._refusing():
            return Staged(reads, writes, overwrites)

    def _gather_one(self, output_flat, shard, claim):
        self.exact_calls += 1
        exact.all_gather(self.communicator, shard.contiguous(), output_flat, deadline=self.config.deadline,
                         collective=claim)

    # -- c10d's entry points -----------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        with self._refusing():
            _check_tensors("allreduce", tensors)
            _check_op("allreduce", op)
        op = op_name(op)  # named once, not by each layer below

        staged = self._staged(writes=tensors)

        def run():
            for index, tensor in enumerate(staged.hosts(tensors)):
                self._allreduce_one(tensor, op, _claim("allreduce", index, tensors, typed=True))
        return self._submit(run, tensors, inline=_small(tensors), staged=staged, opts=opts)

    def _sparse_allreduce(self, tensors, op):
        """Sparse COO tensors (SUM, as Gloo), exact: composite.sparse_allreduce, one after another."""
        with self._refusing():
            if any(t.device.type != "cpu" for t in tensors):
                raise ValueError(f"a sparse allreduce on 'ud' takes CPU tensors, got one on "
                                 f"{[t.device for t in tensors if t.device.type != 'cpu'][0]}")
            if op != dist.ReduceOp.SUM or not all(t.is_sparse for t in tensors):
                raise ValueError("a sparse allreduce on 'ud' takes sparse COO tensors only, and ReduceOp.SUM, "
                                 f"got {op} over {[t.layout for t in tensors]}")

        def run():
            for index, tensor in enumerate(tensors):
                self.exact_calls += 1
                composite.sparse_allreduce(self.communicator, tensor, self.config.deadline,
                                           ("sparse allreduce", index, len(tensors)))
        return self._submit(run, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = opts.rootRank if opts is not None else 0
        with self._refusing():
            _check_tensors("broadcast", tensors)

        staged = self._staged(reads=tensors if root == self.rank() else (),  # the root's tensor is only read
                               overwrites=tensors if root != self.rank() else ())

        def run():
            for index, tensor in enumerate(staged.hosts(tensors)):
                self.exact_calls += 1
                exact.small_broadcast(self.communicator, tensor, root, deadline=self.config.deadline,
                                      collective=_claim("broadcast", index, tensors))
        return self._submit(run, tensors, inline=_small(tensors), staged=staged, opts=opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._gather_into_lists("all_gather", output_tensors, input_tensors, opts=opts)

    def _gather_into_lists(self, what, output_lists, input_tensors, root=None, result=None, opts=None):
        """all_gather (root None: every rank's lists) or gather (only the root's lists: an exact
        gather, each shard sent once, to the root); output_lists[input][rank]. `result`: what the
        Work's future carries, if not the outputs in that order."""
        keeps = root is None or self.rank() == root
        with self._refusing():
            _check_tensors(what, list(input_tensors) + [t for outputs in (output_lists if keeps else ()) for t in outputs])
            for outputs, shard in zip(output_lists if keeps else (), input_tensors):
                if len(outputs) != self.size() or any(output.numel() != shard.numel() for output in outputs):
                    raise ValueError(f"{what} on 'ud' needs {self.size()} outputs of {shard.numel()} elements each "
                                     f"(one per rank, the input's size), got {[output.numel() for output in outputs]}")

        outputs_kept = [t for outputs in (output_lists if keeps else ()) for t in outputs]
        staged = self._staged(reads=input_tensors, overwrites=outputs_kept)

        def run():
            for index, shard in enumerate(staged.hosts(list(input_tensors))):
                gathered = torch.empty((self.size(), shard.numel()), dtype=shard.dtype, device="cpu") if keeps else None
                if root is None:
                    self._gather_one(gathered, shard, _claim(what, index, input_tensors))
                else:
                    self.exact_calls += 1
                    exact.gather(self.communicator, shard.contiguous(), gathered, root, deadline=self.config.deadline,
                                 collective=_claim(what, index, input_tensors))
                for rank, output in enumerate(staged.hosts(list(output_lists[index])) if keeps else ()):
                    output.copy_(gathered[rank].view(output.shape))
        if result is None:
            result = outputs_kept if keeps else list(input_tensors)
        return self._submit(run, result, inline=_small(outputs_kept + list(input_tensors)), staged=staged, opts=opts)

    def _allgather_base(self, output, shard, opts=None):
        with self._refusing():
            _check_tensors("all_gather_into_tensor", [output, shard])
            _check_gather_output(output, shard, self.size())

        staged = self._staged(reads=[shard], overwrites=[output])

        def run():  # pairs with an all_gather of one input: the same call
            self._gather_one(staged.host(output), staged.host(shard), _claim("all_gather", 0, [shard]))
        return self._submit(run, output, inline=_small([output]), staged=staged, opts=opts)

    def allgather_into_tensor_coalesced(self, outputs, shards, opts=None):
        with self._refusing():
            _check_tensors("all_gather_into_tensor", list(outputs) + list(shards))
            for output, shard in zip(outputs, shards):
                _check_gather_output(output, shard, self.size())

        staged = self._staged(reads=shards, overwrites=outputs)

        def run():
            for index, (output, shard) in enumerate(zip(staged.hosts(list(outputs)), staged.hosts(list(shards)))):
                self._gather_one(output, shard, _claim("all_gather", index, shards))
        return self._submit(run, outputs, inline=_small(outputs), staged=staged, opts=opts)

    # torch 2.13 calls these for all_gather_into_tensor / reduce_scatter_tensor / their coalesced forms
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """c10d's lists are output_lists[rank][input]; allgather's are [input][rank]."""
        with self._refusing():
            if len(output_lists) != self.size() or any(len(outputs) != len(input_list) for outputs in output_lists):
                raise ValueError(f"all_gather_coalesced on 'ud' needs {self.size()} output lists (one per rank) of "
                                 f"{len(input_list)} tensors (one per input), got {[len(o) for o in output_lists]}")
        by_input = [[output_lists[rank][index] for rank in range(self.size())] for index in range(len(input_list))]
        return self._gather_into_lists("all_gather", by_input, input_list,
                                       result=[t for outputs in output_lists for t in outputs], opts=opts)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        with self._refusing():
            _check_tensors("reduce_scatter", list(output_tensors) + [p for pieces in input_lists for p in pieces])
            _check_op("reduce_scatter", op)
            for output, pieces in zip(output_tensors, input_lists):
                if len(pieces) != self.size() or len({p.numel() for p in pieces}) != 1 or pieces[0].numel() != output.numel():
                    raise ValueError(f"reduce_scatter on 'ud' needs {self.size()} inputs (one per rank), each the size "
                                     f"of the output ({output.numel()} elements), got {[p.numel() for p in pieces]}")

        staged = self._staged(reads=[p for pieces in input_lists for p in pieces], overwrites=output_tensors)

        def run():
            for index, (output, pieces) in enumerate(zip(staged.hosts(list(output_tensors)), staged.hosts(list(input_lists)))):
                self._reduce_scatter_one(output, torch.cat([p.reshape(-1) for p in pieces]), op,
                                         _claim("reduce_scatter", index, output_tensors, typed=True))
        return self._submit(run, output_tensors, inline=_small([p for pieces in input_lists for p in pieces]),
                            staged=staged, opts=opts)

    def _reduce_scatter_base(self, output, flat_input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        with self._refusing():
            _check_tensors("reduce_scatter_tensor", [output, flat_input])
            _check_op("reduce_scatter_tensor", op)
            self._check_reduce_scatter_sizes(output, flat_input)

        staged = self._staged(reads=[flat_input], overwrites=[output])

        def run():
            self._reduce_scatter_one(staged.host(output), staged.host(flat_input).reshape(-1).contiguous(), op,
                                     _claim("reduce_scatter", 0, [output], typed=True))
        return self._submit(run, output, inline=_small([flat_input]), staged=staged, opts=opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        with self._refusing():  # all before the first call: one refused later would leave its calls one short
            _check_tensors("reduce_scatter_tensor", list(outputs) + list(inputs))
            _check_op("reduce_scatter_tensor", op)
            for output, flat_input in zip(outputs, inputs):
                self._check_reduce_scatter_sizes(output, flat_input)
                if flat_input.dtype != output.dtype:
                    raise TypeError(f"reduce_scatter_tensor on 'ud': input {flat_input.dtype}, output {output.dtype}")

        staged = self._staged(reads=inputs, overwrites=outputs)

        def run():
            for index, (output, flat_input) in enumerate(zip(staged.hosts(list(outputs)), staged.hosts(list(inputs)))):
                self._reduce_scatter_one(output, flat_input.reshape(-1).contiguous(), op,
                                         _claim("reduce_scatter", index, outputs, typed=True))
        return self._submit(run, outputs, inline=_small(inputs), staged=staged, opts=opts)

    def _check_reduce_scatter_sizes(self, output, flat_input):
        if flat_input.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter_tensor: input has {flat_input.numel()} elements, "
                             f"output {output.numel()} x {self.size()} ranks")

    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None):
        return self._submit(lambda: exact.barrier(self.communicator, deadline=self.config.deadline), [], inline=True,
                            opts=opts)

    # -- built from the exact collectives (composite.py) ------

    def reduce(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = op_name(opts.reduceOp) if opts is not None else "sum"
        root = opts.rootRank if opts is not None else 0
        with self._refusing():
            _check_tensors("reduce", tensors)
            _check_op("reduce", op)

        staged = self._staged(writes=tensors)

        def run():
            for index, tensor in enumerate(staged.hosts(tensors)):
                self.exact_calls += 1
                composite.reduce(self.communicator, tensor, op, root, self.config.deadline,
                                 _claim("reduce", index, tensors, typed=True))
        return self._submit(run, tensors, inline=_small(tensors), staged=staged, opts=opts)

    def gather(self, output_lists, input_tensors, opts=None):
        return self._gather_into_lists("gather", output_lists, input_tensors, opts.rootRank if opts is not None else 0,
                                       opts=opts)

    def scatter(self, output_tensors, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0
        on_root = self.rank() == root
        with self._refusing():
            _check_tensors("scatter", list(output_tensors) + ([p for pieces in input_lists for p in pieces] if on_root else []))
            for output, pieces in zip(output_tensors, input_lists if on_root else ()):
                composite.check_scatter_pieces(pieces, output, self.size())

        staged = self._staged(reads=[p for pieces in input_lists for p in pieces] if on_root else [], overwrites=output_tensors)

        def run():
            for index, output in enumerate(staged.hosts(list(output_tensors))):
                self.exact_calls += 1
                composite.scatter(self.communicator, output, staged.hosts(list(input_lists[index])) if on_root else [],
                                  root, self.config.deadline, _claim("scatter", index, output_tensors))
        pieces = [p for pieces in input_lists for p in pieces] if on_root else []
        return self._submit(run, output_tensors, inline=_small(list(output_tensors) + pieces), staged=staged, opts=opts)

    def alltoall_base(self, output, source, output_splits, input_splits, opts=None):
        with self._refusing():
            _check_tensors("all_to_all_single", [output, source])
            composite.plan_all_to_all(output, source, output_splits, input_splits, self.size())

        staged = self._staged(reads=[source], overwrites=[output])

        def run():
            self.exact_calls += 1
            composite.all_to_all(self.communicator, staged.host(output), staged.host(source), output_splits, input_splits,
                                 self.config.deadline)
        return self._submit(run, output, inline=_small([source, output]), staged=staged, opts=opts)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        with self._refusing():
            _check_tensors("all_to_all", list(output_tensors) + list(input_tensors))
            if len(output_tensors) != self.size() or len(input_tensors) != self.size():
                raise ValueError(f"all_to_all on 'ud' needs {self.size()} inputs and {self.size()} outputs, "
                                 f"got {len(input_tensors)} and {len(output_tensors)}")
            dtypes = {t.dtype for t in list(output_tensors) + list(input_tensors)}
            if len(dtypes) != 1:
                raise ValueError(f"all_to_all on 'ud' needs one dtype, got {sorted(map(str, dtypes))}")
        output_splits, input_splits = [t.numel() for t in output_tensors], [t.numel() for t in input_tensors]

        staged = self._staged(reads=input_tensors, overwrites=output_tensors)

        def run():  # reads the inputs here, in issue order, as every other call does
            self.exact_calls += 1
            source = torch.cat([t.reshape(-1) for t in staged.hosts(list(input_tensors))])
            received = torch.empty(sum(output_splits), dtype=source.dtype, device="cpu")
            composite.all_to_all(self.communicator, received, source, output_splits, input_splits, self.config.deadline)
            for output, piece in zip(staged.hosts(list(output_tensors)), received.split(output_splits)):
                output.copy_(piece.view(output.shape))
        return self._submit(run, output_tensors, inline=_small(list(output_tensors) + list(input_tensors)), staged=staged,
                            opts=opts)

    def send(self, tensors, dstRank, tag=0):
        tensor = self._message_tensor("send", tensors, dstRank)
        return self._channels.send(tensor, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        tensor = self._message_tensor("recv", tensors, srcRank)
        return self._channels.recv(tensor, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        """dist.recv/irecv without src: the next message under `tag` from any other rank (the
        Work's _source_rank() names it); see point_to_point.Channels.recv_anysource."""
        if len(tensors) != 1:
            raise ValueError(f"recv on 'ud' takes one tensor, got {len(tensors)}")
        _check_tensors("recv", tensors)
        if self.size() < 2:
            raise ValueError("recv from any source on 'ud': a group of one rank has no other rank to receive from")
        return self._channels.recv_anysource(tensors[0], tag, self.size())

    def _message_tensor(self, what, tensors, peer):
        if len(tensors) != 1:
            raise ValueError(f"{what} on 'ud' takes one tensor, got {len(tensors)}")
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"{what} on 'ud': peer rank {peer} is not another rank of this group of {self.size()}")
        _check_tensors(what, tensors)
        return tensors[0]

    # -- shrinking: torch.distributed.shrink_group (ud_transport.torch.shrinking) -------------

    @property
    def supports_shrinking(self):
        """True: ``torch.distributed.shrink_group`` makes a "ud" group of the survivors (``shrink``)."""
        return True

    def shrink(self, ranks_to_exclude, shrink_flags=SHRINK_DEFAULT, pg_options=None):
        """A new "ud" group of this group's ranks but `ranks_to_exclude`, renumbered in order (the
        survivor of lowest rank becomes rank 0); what ``torch.distributed.shrink_group`` calls.

        Only the survivors take part, and they meet through this group's store alone: nothing is
        asked of the excluded ranks, which may be dead. The meeting's keys are named by this
        group's session and the exclusion, so survivors that exclude the same ranks meet and a
        group made again on the same store reads nothing of another.

        Parameters
        ----------
        ranks_to_exclude : list of int
            Ranks of this group, none twice, not this rank, not every rank.
        shrink_flags : {SHRINK_DEFAULT, SHRINK_ABORT}
            SHRINK_ABORT first ends what runs and what is queued on this group (each Work raises
            TransportError, "interrupted") and closes it; SHRINK_DEFAULT leaves this group as it
            is (torch's shrink_group destroys it next, which waits for what is queued).
        pg_options : BackendOptions, optional
            The new group's options; None keeps this group's.

        Returns
        -------
        ProcessGroupUD

        Raises
        ------
        TypeError, ValueError
            An exclusion or option torch's own validation refuses (non-integers, out of range,
            duplicates, empty, every rank); a flag other than the two.
        RuntimeError
            This rank is among those excluded, or this group is shut down.
        TransportError
            The survivors did not all meet within the store timeout (a survivor that did not
            call shrink, or the store is gone: it must outlive the dead ranks).

        Examples
        --------
        >>> group = dist.shrink_group([dead_rank])  # the default "ud" group  # doctest: +SKIP
        """
        excluded = membership.exclusion(ranks_to_exclude, self.rank(), self.size())
        if shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
            raise ValueError(f"shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT}), "
                             f"got {shrink_flags!r}")
        if pg_options is not None and not isinstance(pg_options, BackendOptions):
            raise TypeError(f"pg_options for backend 'ud' must be ud_transport.torch.BackendOptions, "
                            f"got {type(pg_options).__name__}")
        store = self.communicator.store
        if store is None or self.communicator.closed:
            raise RuntimeError("this 'ud' group is shut down (destroyed or shrunk with SHRINK_ABORT): it cannot shrink")
        session = self.communicator.session_id  # the same on every rank of this group, new with each group
        if shrink_flags == SHRINK_ABORT:
            self.abort()
        survivors = membership.survivors(excluded, self.size())
        meeting = dist.PrefixStore(membership.shrink_key(session, excluded) + "/", store)
        return ProcessGroupUD(meeting, survivors.index(self.rank()), len(survivors), self._timeout,
                              pg_options or self.config, f"{self._ud_group_name}:shrunk")

    def shutdown(self):
        """destroy_process_group: finish what is queued (a receive whose sender never comes waits
        up to the group's timeout: abort() ends it), then close."""
        self._close(interrupt=False)

    def abort(self):
        """End what runs and what is queued at once (each Work raises TransportError,
        "interrupted"; tensors keep their values), then close: for a group whose peers may be gone."""
        self._close(interrupt=True)

    def _close(self, interrupt):
        if interrupt:
            self.communicator.interrupt()
        self._channels.close(interrupt)
        self._worker.close()
        self.communicator.close()
        # c10d's store, let go with the group: kept by a handle to a destroyed group, rank 0's
        # store server stayed up and the next group's rendezvous read the old one's addresses
        self.communicator.store = None


def _claim(collective, index, items, typed=False):
    """What item `index` of a c10d call over `items` is, for the exact layer to check across
    ranks: the collective, the item's place, and every item's byte count (with its dtype where
    `typed`: a reduction reads it). A list that differs anywhere then mismatches at its first
    call, with no tensor written, instead of at the item that differs, or one call later."""
    return collective, index, tuple((t.nbytes, str(t.dtype)) if typed else t.nbytes for t in items)


def _check_gather_output(output, shard, world_size):
    if output.dtype != shard.dtype:  # (the exact all-gather moves bytes: another dtype filled part of the output)
        raise TypeError(f"all_gather_into_tensor on 'ud': the output is {output.dtype}, the input {shard.dtype}")
    if output.numel() != shard.numel() * world_size:
        raise ValueError(f"all_gather_into_tensor on 'ud': the output has {output.numel()} elements, "
                         f"{world_size} ranks x {shard.numel()} need {world_size * shard.numel()}")


def _synchronous(opts):
    """Whether c10d waits for the call as soon as it is made (torch sets asyncOp False in the
    options of a call made without async_op; its default, for callers that set nothing, is True)."""
    return opts is not None and getattr(opts, "asyncOp", True) is False


def _small(tensors):
    return sum(t.numel() * t.element_size() for t in tensors) <= INLINE_MAX_BYTES


# What the exact path reduces with (exact.allreduce): ReduceOp's names as op_name gives them
EXACT_OPS = ("sum", "avg", "mean", "max", "min", "product", "prod")


def _check_tensors(what, tensors):
    """The tensors of a call, checked on the caller's thread (as ProcessGroupGloo's asserts are):
    the worker then never refuses one, and the refused call never reaches the other ranks'
    engines unannounced (_refusing queues the agreement round in its place)."""
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} on 'ud' takes torch tensors, got {type(tensor).__name__}")
        refuse_unsupported_torch(tensor, f"{what} on 'ud'", staged=True)


def _check_op(what, op):
    if op_name(op) not in EXACT_OPS:
        raise ValueError(f"{what} on 'ud' reduces with SUM, AVG, MAX, MIN or PRODUCT, got {op_name(op).upper()}")


def _create(backend_options, pg_options):
    """c10d's creator (extended API): one communicator per group."""
    if pg_options is not None and not isinstance(pg_options, BackendOptions):
        raise TypeError(f"pg_options for backend 'ud' must be ud_transport.torch.BackendOptions, got {type(pg_options).__name__}")
    return ProcessGroupUD(backend_options.store, backend_options.group_rank, backend_options.group_size,
                          backend_options.timeout, pg_options, str(backend_options.group_id))


def register():
    """Make backend="ud" known to torch.distributed, for CPU and CUDA tensors (CUDA ones are
    staged through pinned host memory: ud_transport.staging).

    Importing ud_transport.torch already does it; safe to call again.

    Examples
    --------
    >>> import ud_transport.torch                      # registers "ud"  # doctest: +SKIP
    >>> ud_transport.torch.register()                  # a no-op now     # doctest: +SKIP
    >>> torch.distributed.init_process_group("ud")     # under torchrun  # doctest: +SKIP
    """
    if "UD" not in dist.Backend._plugins:
        dist.Backend.register_backend("ud", _create, extended_api=True, devices=["cpu", "cuda"])
