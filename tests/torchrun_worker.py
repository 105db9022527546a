"""Run under torchrun by test_torch_integration: backend="ud" as the default
group, a "ud" subgroup and a Gloo group beside it, messages around the ring
(send and recv through the agent's store), and a few DDP steps.
Writes this rank's results as JSON to the directory given as argv[1]."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ud_transport.torch  # noqa: F401  registers backend="ud"


def main(out_dir):
    dist.init_process_group(backend="ud")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    pair = dist.new_group(ranks=[0, 1], backend="ud")
    gloo = dist.new_group(backend="gloo")
    pair_total = torch.tensor([float(rank + 1)])
    if rank in (0, 1):
        dist.all_reduce(pair_total, group=pair)
    gloo_total = torch.tensor([float(rank + 1)])
    dist.all_reduce(gloo_total, group=gloo)
    received = torch.zeros(3)
    works = [dist.isend(torch.full((3,), float(rank)), (rank + 1) % world), dist.irecv(received, (rank - 1) % world)]
    for work in works:
        work.wait()
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(5):
        model(torch.randn(3, 4, generator=generator)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"world": world, "backend": dist.get_backend(), "total": total.item(), "pair_total": pair_total.item(),
                   "gloo_total": gloo_total.item(), "parameters": parameters,
                   "received": received.tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
