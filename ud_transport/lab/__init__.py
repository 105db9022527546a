"""The lab: tools that run, measure, simulate and demonstrate the library, and that the tests and
scripts use; nothing a training job imports. The core (``ud_transport/*.py``) and
``ud_transport/torch/`` never import from here (tests/test_layers.py checks it).

    cli           python -m ud_transport {demo,bench,simulate,info,rig}: the command table
    arguments     what every command's parser shares (one-line errors, defaults in --help)
    demo          allreduce across local ranks, with injected loss
    bench         the benchmark against torch.distributed Gloo (nccl-tests' columns and ours)
    simulate      many engines in one process on a virtual clock: loss against world size
    info          which transports work here and why not, RDMA devices, what would be picked
    local_cluster rank processes on this machine (LocalCluster), as the tests run them
    hosts         several "hosts" on one machine: a network namespace per rank, veth or a bridge
    kernel_loss   real packet loss from the kernel (nftables in a network namespace)
"""
