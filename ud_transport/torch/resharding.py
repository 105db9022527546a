"""Moving the two-stage step's sharded optimizer to a new group: after a rank died (the group
shrank) or new ranks came (it grew), each rank owns a different range of the flat parameters,
and the state of that range must come from whoever owned it before.

Every rank of the new group sends one record: the pieces it owned (their absolute range, the
owner's values and the optimizer state of each) and the settings of the parameter groups they
belong to. The records are all-gathered exactly, so every rank builds the same picture; a
newcomer sends an empty one. A record may also carry the copy of its previous rank's state
that the ring of replicas left it (shard_replica). A range no owner's record covers belonged to a
rank that is gone: its state comes from such a copy where one covers it (as old as the copy's
last refresh), and otherwise starts afresh (for Adam: moments zero, step 0: the first update is as
large as a new run's first). The owners' values are the truth for the ranges they owned (a replica's copy of
a chunk the lossy all-gather missed is stale); the rest comes from the new rank 0's replica."""
import io

import torch

from .. import exact


class Piece:
    """A range [start, stop) of the flat parameters with one parameter group's settings, and
    the optimizer state the range carried (None: fresh)."""

    def __init__(self, start, stop, group, state, copied=False):
        self.start, self.stop, self.group, self.state = start, stop, group, state
        self.copied = copied  # the state came from a replica, its owner being gone


def encode(pieces, settings, replica=()):
    """This rank's record: `pieces` as (start, stop, group, values, state), `settings`
    {group index: its settings now}, and `replica`, the copy of another rank's pieces this rank
    holds as (start, stop, group, state), as bytes."""
    return to_bytes({"pieces": pieces, "settings": settings, "replica": list(replica)})


def to_bytes(value):
    """`value` (tensors, numbers, containers of them) as bytes, torch.save's."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data):
    """What `to_bytes` wrote, its tensors on the host: a rank's record holds tensors of the device
    it saved them on (cuda:r on rank r), which this rank may not have."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def gather_records(comm, record, deadline):
    """Every rank's record (bytes), in rank order, exactly: the lengths first, then the records
    padded to the longest."""
    lengths = torch.zeros(comm.world_size, dtype=torch.int64)
    exact.all_gather(comm, torch.tensor([len(record)], dtype=torch.int64), lengths, deadline=deadline,
                     collective="reshard lengths")
    longest = max(int(lengths.max()), 1)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8) if record else mine[:0]
    everyone = torch.empty(comm.world_size * longest, dtype=torch.uint8)
    exact.all_gather(comm, mine, everyone, deadline=deadline, collective="reshard records")
    rows = everyone.view(comm.world_size, longest)
    # on the host (from_bytes); _shard_optimizer moves the state to its parameters' device
    return [from_bytes(rows[rank, :int(lengths[rank])].numpy().tobytes()) for rank in range(comm.world_size)]


def owners_values(records, flat):
    """Write each record's pieces' values (the owners' truth) into `flat`."""
    for record in records:
        for start, stop, _, values, _ in record["pieces"]:
            flat[start:stop] = values


def settings_of(records, groups):
    """Each parameter group's settings: from the first record that has the group (a learning rate
    a scheduler changed is the owners' now), else as the optimizer was constructed."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    taken = set()
    for record in records:
        for index, values in record["settings"].items():
            if index not in taken:
                settings[index] = values
                taken.add(index)
    return settings


def new_pieces(records, shard, group_ranges):
    """The pieces of the new shard [start, stop): split at the parameter groups' bounds and at the
    old owners' and the replicas' bounds, each with the state its old owner kept for it (sliced),
    else the state a replica kept of it (``copied``), or None where no record covers it."""
    start, stop = shard
    old = [(p_start, p_stop, state) for record in records for p_start, p_stop, _, _, state in record["pieces"]]
    copies = [(p_start, p_stop, state) for record in records for p_start, p_stop, _, state in record.get("replica", ())]
    cuts = {start, stop}
    for low, high in group_ranges:
        cuts.update(x for x in (low, high) if start < x < stop)
    for p_start, p_stop, _ in old + copies:
        cuts.update(x for x in (p_start, p_stop) if start < x < stop)
    bounds = sorted(cuts)
    pieces = []
    for low, high in zip(bounds, bounds[1:]):
        group = next(index for index, (g_low, g_high) in enumerate(group_ranges) if g_low <= low < g_high)
        state = _covering(old, low, high)
        copied = state is None and (state := _covering(copies, low, high)) is not None
        pieces.append(Piece(low, high, group, state, copied))
    return pieces


def _covering(held, low, high):
    """The state of the first of `held` ((start, stop, state), ...) that covers [low, high), sliced
    to it; None where none does."""
    return next((_sliced(state, low - p_start, high - low, p_stop - p_start)
                 for p_start, p_stop, state in held if p_start <= low and high <= p_stop), None)


def _sliced(state, offset, length, owned):
    """A piece's optimizer state for `length` elements from `offset`: tensors of one value per
    element are sliced, the rest (a step count, ...) copied."""
    sliced = {}
    for name, value in state.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == owned:
            sliced[name] = value[offset:offset + length].clone()
        else:
            sliced[name] = value.clone() if torch.is_tensor(value) else value
    return sliced
