"""Small pieces the torch-layer modules share: which communicator, which
worker, a store connection of one's own, and flat views of parameter lists."""
import weakref

import torch

from .. import get_default
from ..communicator import Communicator
from ._worker import SerialWorker

_workers = weakref.WeakKeyDictionary()


def own_connection(store):
    """`store` over a connection of its own where it has one (TCPStore): a TCPStore client runs one
    request at a time, so channels that meet their peers at once on one connection wait on each
    other's waits (two ranks each waiting on the channel the other has not reached: until the
    timeout)."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):  # a store with no clone serves its callers as it is
        return store


def communicator_of(target):
    """A Communicator from a Communicator, a "ud" process group (or None:
    the one ud_transport.init() made)."""
    if target is None:
        return get_default()
    if isinstance(target, Communicator):
        return target
    inner = getattr(target, "communicator", None)
    if isinstance(inner, Communicator):
        return inner
    raise TypeError(f"expected a ud_transport Communicator or a 'ud' process group, got {type(target).__name__}")


def worker_of(target):
    """The one worker thread that runs `target`'s collectives in order."""
    worker = getattr(target, "_worker", None)
    if isinstance(worker, SerialWorker):
        return worker
    comm = communicator_of(target)
    if comm not in _workers:
        _workers[comm] = SerialWorker(f"ud-rank{comm.rank}")
    return _workers[comm]


def adopt_worker(comm, worker):
    _workers[comm] = worker


def parameters_of(source):
    """A list of tensors from a module, an optimizer, or an iterable."""
    if isinstance(source, torch.nn.Module):
        return [p for p in source.parameters()]
    groups = getattr(source, "param_groups", None)
    if groups is not None:
        return [p for g in groups for p in g["params"]]
    return list(source)


def flatten(tensors, dtype=None):
    """One contiguous vector holding `tensors` (detached) in order."""
    if not tensors:
        return torch.zeros(0, dtype=dtype or torch.float32)
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


@torch.no_grad()
def flatten_into(tensors, out):
    """flatten(tensors) written into `out` (no new vector per call)."""
    if tensors:
        torch.cat([t.detach().reshape(-1) for t in tensors], out=out)
    return out


@torch.no_grad()
def unflatten_into(flat, tensors):
    """Copy consecutive pieces of `flat` into `tensors`."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
