"""PyTorch on ud_transport. Importing this module registers backend="ud".

    import ud_transport.torch
    dist.init_process_group(backend="ud")                  # c10d backend (torchrun)
    model.register_comm_hook(LossyHookState(comm), lossy_allreduce_hook)   # DDP on Gloo, gradients over ud
    opt = LossTolerantOptimizer(torch.optim.AdamW(model.parameters()))     # the two-stage step
    replica_drift(model), ParameterSync(model, every=100)                   # drift, re-alignment
    PhaseAwareBudget(stable_budget=0.1)                                     # budgets by training phase
    dist.shrink_group([dead]); grow_group(1) / join_group(store)            # a rank dies, a new one comes
"""
from . import policy, shrinking
from .backend import BackendOptions, ProcessGroupUD, register
from .drift import ParameterSync, replica_drift
from .growing import grow_group, join_group
from .hook import LossyHookState, lossy_allreduce_hook
from .phase import PhaseAwareBudget
from .two_stage import LossTolerantOptimizer

register()
shrinking.install()  # torch.distributed.shrink_group takes "ud" groups

__all__ = ["BackendOptions", "ProcessGroupUD", "register", "LossyHookState", "lossy_allreduce_hook",
           "LossTolerantOptimizer", "ParameterSync", "replica_drift", "PhaseAwareBudget", "policy", "grow_group", "join_group"]
