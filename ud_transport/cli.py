"""python -m ud_transport {demo,bench,simulate,info,rig}"""
import sys

COMMANDS = {
    "demo": ("ud_transport.demo", "allreduce across local ranks, with injected loss"),
    "bench": ("ud_transport.bench", "benchmark against torch.distributed Gloo"),
    "simulate": ("ud_transport.simulate", "many engines in one process on a virtual clock: loss against world size"),
    "info": ("ud_transport.info", "RDMA devices, ports, GIDs, and the transport ud_transport would pick"),
    "rig": ("ud_transport.rig.cli", "the SoftRoCE rig: run commands in a qemu guest with rxe"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        for name, (_, summary) in COMMANDS.items():
            print(f"  {name:8} {summary}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
