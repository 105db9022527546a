"""Run under torchrun by test_torch_integration: the last rank of the default "ud" group leaves
the job (it exits, status 0, as a process whose work is done does); the others' next call names
it (PeerTimeout), they shrink the default group without it (torch.distributed.shrink_group, the
store being torchrun's agent's) and sum on the group left. Writes this rank's results as JSON to
the directory given as argv[1]."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import ud_transport
import ud_transport.torch  # noqa: F401  registers backend="ud"


def main(out_dir):
    dist.init_process_group(backend="ud", pg_options=ud_transport.torch.BackendOptions(deadline=5.0))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    if rank == world - 1:
        sys.stdout.flush()
        os._exit(0)  # gone, its port closed, no goodbye
    tensor = torch.full((1 << 20,), float(rank + 1))
    try:
        dist.all_reduce(tensor)
        outcome = ("OK", None)
    except ud_transport.PeerTimeout as error:
        outcome = ("PeerTimeout", error.rank)
    unchanged = bool(torch.equal(tensor, torch.full((1 << 20,), float(rank + 1))))
    dist.shrink_group([world - 1], shrink_flags=c10d.SHRINK_ABORT)
    after = torch.tensor([float(rank + 1)])
    dist.all_reduce(after)
    result = {"total": total.item(), "outcome": outcome, "unchanged": unchanged, "after": after.item(),
              "rank_after": dist.get_rank(), "size_after": dist.get_world_size()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
