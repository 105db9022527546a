"""How far replicas have drifted apart, and putting them back together.
Both are exact (ud_transport.exact) and off the training path."""
import torch

from .. import exact
from ._common import communicator_of, flatten, parameters_of, unflatten_into


@torch.no_grad()
def replica_drift(parameters, communicator=None, *, deadline=None):
    """Distance of each replica's parameters from the mean replica, relative to the mean's norm.

    Gathers every rank's full parameters exactly (N x the model), so call it every so often,
    not every step.

    Parameters
    ----------
    parameters : torch.nn.Module or iterable of torch.Tensor
    communicator : Communicator or a "ud" ProcessGroup, optional
        None takes the default communicator.
    deadline : float, optional
        Seconds per attempt of the exact all-gather.

    Returns
    -------
    dict
        {"max": worst rank, "mean": over ranks, "per_rank": [...]}, the same on every rank.

    Raises
    ------
    TransportError
        The exact all-gather could not complete.

    Examples
    --------
    >>> replica_drift(model)["max"]  # doctest: +SKIP
    0.0004
    """
    comm = communicator_of(communicator)
    mine = flatten(parameters_of(parameters), torch.float64)
    everyone = torch.empty((comm.world_size, mine.numel()), dtype=torch.float64)
    exact.all_gather(comm, mine, everyone, deadline=deadline)
    mean = everyone.mean(dim=0)
    scale = mean.norm().item() or 1.0
    per_rank = [(row - mean).norm().item() / scale for row in everyone]
    return {"max": max(per_rank), "mean": sum(per_rank) / len(per_rank), "per_rank": per_rank}


class ParameterSync:
    """Re-aligns replicas every `every` steps: call it once per step.

    Parameters
    ----------
    parameters : torch.nn.Module or iterable of torch.Tensor
    communicator : Communicator or a "ud" ProcessGroup, optional
    every : int
        Steps between re-alignments, at least 1.
    source : {"rank0", "owners"}, default "rank0"
        "rank0": exact broadcast of rank 0's parameters (for plain lossy allreduce training,
        where no rank's copy is more right than another's). "owners": each shard comes exactly
        from its owner, whose copy is the one the LossTolerantOptimizer stepped.
    optimizer : LossTolerantOptimizer, optional
        Needed for source="owners".
    deadline : float, optional

    Raises
    ------
    ValueError
        every < 1, an unknown source, or "owners" without the optimizer.

    Examples
    --------
    >>> sync = ParameterSync(model, every=100)  # doctest: +SKIP
    >>> for batch in data: train_step(batch); sync()  # doctest: +SKIP
    """

    def __init__(self, parameters, communicator=None, *, every, source="rank0", optimizer=None, deadline=None):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every!r}")
        if source not in ("rank0", "owners"):
            raise ValueError(f"source must be 'rank0' or 'owners', got {source!r}")
        if source == "owners" and optimizer is None:
            raise ValueError("source='owners' needs the LossTolerantOptimizer whose shards own the values")
        self.parameters = parameters_of(parameters)
        self.communicator = communicator_of(communicator)
        self.every = every
        self.source = source
        self.optimizer = optimizer
        self.deadline = deadline
        self.steps = 0
        self.syncs = 0

    @torch.no_grad()
    def __call__(self):
        """Count a step; re-align if it is the every-th. Returns whether it did."""
        self.steps += 1
        if self.steps % self.every:
            return False
        flat = flatten(self.parameters)
        if self.source == "rank0":
            exact.broadcast(self.communicator, flat, 0, deadline=self.deadline)
        else:
            exact.all_gather(self.communicator, self.optimizer.owner_values(), flat, deadline=self.deadline)
        unflatten_into(flat, self.parameters)
        self.syncs += 1
        return True
