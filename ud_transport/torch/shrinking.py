"""torch.distributed.shrink_group on "ud" groups.

torch 2.13's shrink_group is written for C++ backends: it finds the group's backend with
``group._get_backend(device)`` and registers what ``backend.shrink(...)`` returns in a fresh
``ProcessGroup``. A "ud" group is a Python ProcessGroup with no C++ backend under it, so both
steps fail on it; torch's own ``new_group`` takes a Python ProcessGroup as the group itself, and
so do the two steps here, for "ud" groups only (every other group goes to torch's code as is).

torch also maps the survivors' global ranks wrongly where the group's ranks are not 0..n-1 (a
group shrunk before, or a subgroup): it removes the excluded *group* ranks from the list of
*global* ranks. For "ud" groups the mapping is corrected after torch builds it; the default
group's new ranks are the new global ranks (torch renumbers them: its other groups are destroyed),
so its mapping is the identity.

All of it leans on private names of torch.distributed.distributed_c10d; where they are missing
(another torch), nothing is changed and shrink_group refuses a "ud" group as torch would."""
import logging

from torch.distributed import distributed_c10d as c10d

from .backend import ProcessGroupUD

log = logging.getLogger("ud_transport")

_HOOKED = ("_validate_shrink_backend_requirements", "_create_shrunk_process_group", "_finalize_shrunk_group")


def install():
    """Let torch.distributed.shrink_group take "ud" groups; idempotent."""
    if getattr(c10d, "_ud_transport_shrinking", False):
        return
    if not all(hasattr(c10d, name) for name in _HOOKED):
        log.debug("torch %s has no shrink_group helpers to adapt: shrink_group refuses 'ud' groups", _torch_version())
        return
    find_backend, create_group, finalize = (getattr(c10d, name) for name in _HOOKED)

    def backend_of(group_info):
        group = group_info["process_group"]
        return group if isinstance(group, ProcessGroupUD) else find_backend(group_info)

    def group_of(new_backend, remaining_ranks, metadata, is_default_group):
        if not isinstance(new_backend, ProcessGroupUD):
            return create_group(new_backend, remaining_ranks, metadata, is_default_group)
        new_backend._set_group_name(metadata["new_group_name"])
        new_backend._set_group_desc("default:shrunken" if is_default_group else f"{metadata['original_group_name']}:shrunk")
        return new_backend

    def finalize_with_global_ranks(group_info, excluded_ranks_set, new_backend):
        if not isinstance(new_backend, ProcessGroupUD):
            return finalize(group_info, excluded_ranks_set, new_backend)
        old = group_info["process_group"]
        if group_info["is_default_group"]:
            survivors = list(range(new_backend.size()))
        else:  # read before torch destroys the old group
            survivors = [c10d.get_global_rank(old, rank) for rank in range(group_info["group_size"])
                         if rank not in excluded_ranks_set]
        group = finalize(group_info, excluded_ranks_set, new_backend)
        c10d._world.pg_group_ranks[group] = {global_rank: rank for rank, global_rank in enumerate(survivors)}
        return group

    c10d._validate_shrink_backend_requirements = backend_of
    c10d._create_shrunk_process_group = group_of
    c10d._finalize_shrunk_group = finalize_with_global_ranks
    c10d._ud_transport_shrinking = True


def _torch_version():
    import torch

    return torch.__version__
