"""python -m ud_transport {demo,bench,simulate,info,rig}"""
import sys

COMMANDS = {
    "demo": ("ud_transport.lab.demo", "allreduce across local ranks, with injected loss"),
    "bench": ("ud_transport.lab.bench", "benchmark against torch.distributed Gloo"),
    "simulate": ("ud_transport.lab.simulate", "many engines in one process on a virtual clock: loss against world size"),
    "info": ("ud_transport.lab.info", "RDMA devices, ports, GIDs, and the transport ud_transport would pick"),
    "rig": ("ud_transport.rig.cli", "the SoftRoCE rig: run commands in a qemu guest with rxe"),
}


EXIT_CODES = """exit codes: 0 success; 1 the command ran and failed (a benchmark call failed, no transport
works); 2 usage error (unknown command or option, bad value)"""


def usage(stream):
    print(f"usage: {__doc__.strip()} [--help] [--version]", file=stream)
    for name, (_, summary) in COMMANDS.items():
        print(f"  {name:8} {summary}", file=stream)
    print("run 'python -m ud_transport COMMAND --help' for a command's options", file=stream)
    print(EXIT_CODES, file=stream)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        from .. import __version__

        print(f"ud_transport {__version__}")
        return 0
    if argv and argv[0] in ("-h", "--help"):
        usage(sys.stdout)
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"ud_transport: error: {problem} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        usage(sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
