"""What the two-stage step can do about the chunks a lossy call lost, beyond the seed paper's
rescaling and stale retention (both measured in docs/performance/training_under_loss.md):

- ErrorFeedback (reduce-scatter half): a contribution that did not reach its owner is not
  rescaled away but kept by its sender and added to its next gradient, as error-feedback
  compression keeps what it did not send. The owner sums what arrived (zero fill) and every
  sender learns from the owners' chunk masks, gathered exactly, which of its pieces missed.
  Over steps every gradient arrives: late, never lost, never counted twice.
- Extrapolation (all-gather half): a parameter chunk that did not arrive takes its old value
  plus the last update the owner sent for it, instead of the old value alone. Optimizers with
  momentum move a parameter by similar amounts on consecutive steps, so this is closer to the
  owner's value; the next chunk that arrives replaces it exactly, so drift stays bounded.

Both work chunk by chunk from the engine's chunk masks (Communicator.chunk_mask)."""
import numpy as np
import torch

from .. import exact


def chunk_index_of_elements(comm, flat):
    """For every element of `flat`, the index of its chunk in a gather mask
    (chunks block by block, as Communicator.chunk_ranges lists them)."""
    starts, stops = comm.chunk_bounds(flat.numel(), flat.dtype)  # the chunks tile the tensor in order
    return torch.from_numpy(np.repeat(np.arange(starts.size), stops - starts))


class ErrorFeedback:
    """Keeps this rank's contributions that missed their owners and adds them to the next step."""

    def __init__(self, comm, flat, algorithm, chunk_of_element):
        self.comm = comm
        self.algorithm = algorithm
        self.residual = torch.zeros_like(flat)
        self.mask = comm.chunk_mask("reduce_scatter", flat, algorithm=algorithm)  # (senders, chunks of my shard)
        self.rows = [len(comm.chunk_ranges(flat.numel(), flat.dtype, block=owner)) for owner in range(comm.world_size)]
        self.widest = max(self.rows)
        self.chunk_of_element = chunk_of_element
        self.missed_contributions = 0  # this rank's pieces that missed an owner and were sent again later

    def add_residual(self, grads):
        """The gradient to send: this step's plus what missed before."""
        grads += self.residual

    def reduce_scatter(self, grads, shard, *, loss_budget, deadline, copies=1, on_miss="raise"):
        """The lossy reduce-scatter with the owner's sum of what arrived (mean over all ranks)."""
        return self.comm.reduce_scatter(grads, shard, op="mean", loss_budget=loss_budget, deadline=deadline,
                                        estimator="zero_fill", algorithm=self.algorithm, chunk_mask=self.mask,
                                        copies=copies, on_miss=on_miss)

    def settle(self, grads, *, deadline):
        """After the reduce-scatter: learn exactly which of this rank's pieces reached their owners
        (every owner's mask, gathered exactly) and keep the others for the next step."""
        n = self.comm.world_size
        mine = torch.zeros((n, self.widest), dtype=torch.uint8)
        mine[:, :self.mask.shape[1]] = torch.from_numpy(self.mask)
        everyone = torch.empty((n, n, self.widest), dtype=torch.uint8)  # owner, sender, chunk
        exact.all_gather(self.comm, mine.reshape(-1), everyone.reshape(-1), deadline=deadline)
        arrived = torch.cat([everyone[owner, self.comm.rank, :self.rows[owner]] for owner in range(n)]).bool()
        self.missed_contributions += int((~arrived).sum())
        missed = ~arrived[self.chunk_of_element]
        self.residual.zero_()
        self.residual[missed] = grads[missed]

    def drop(self):
        """Forget what missed (an exact step delivered everything)."""
        self.residual.zero_()


class Extrapolation:
    """Fills a stale parameter chunk with its old value plus the owner's last update to it."""

    def __init__(self, comm, flat, algorithm, chunk_of_element):
        self.comm = comm
        self.mask = comm.chunk_mask("all_gather", flat, algorithm=algorithm)
        self.chunk_of_element = chunk_of_element
        self.last_update = torch.zeros_like(flat)
        self.fresh_before = torch.ones(flat.numel(), dtype=torch.bool)  # the last call's fresh elements
        self.extrapolated_chunks = 0

    def apply(self, before, after):
        """`after` is what the all-gather left (stale chunks hold `before`'s values)."""
        fresh = torch.from_numpy(self.mask.astype(bool))[self.chunk_of_element]
        self.extrapolated_chunks += int((self.mask == 0).sum())
        # an update is the owner's step only between two fresh values (not a correction of a guess)
        measured = fresh & self.fresh_before
        self.last_update[measured] = after[measured] - before[measured]
        stale = ~fresh
        after[stale] += self.last_update[stale]
        self.fresh_before = fresh

    def reset(self):
        """After an exact all-gather every element is the owner's: nothing to extrapolate from yet."""
        self.fresh_before.fill_(False)
