"""Run commands where an rxe (SoftRoCE) device exists: in qemu guests, or on the host if it has rxe."""

from __future__ import annotations

import argparse
import logging
import sys

from ..lab.arguments import ArgumentParser, checked_by, integer, matching, positive_number
from . import apt, checks
from . import kit as kit_module
from .guest import QemuOptions
from .runner import check_netem_loss, run_in_guest, shell_command

log = logging.getLogger("ud_transport.rig")


def _add_guest_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=positive_number, default=None,
                        help="kill the guest(s) after S seconds, status 124 (default: no limit)")
    parser.add_argument("--accel", choices=("tcg", "kvm"), default="tcg", help="kvm does not boot here; tcg does")
    parser.add_argument("--memory", type=matching(r"\d+(\.\d+)?[KMGTkmgt]?", "2G or 512M"), default="2G",
                        help="guest memory, as qemu -m takes it")
    parser.add_argument("--smp", type=integer(1), default=None, help="vCPUs per guest (default: 2, or 1 with --nodes 2)")
    parser.add_argument("--verbose", "-v", action="store_true", help="show boot messages and debug logs")
    parser.add_argument("--install-deps", action="store_true", help="apt-get install missing host packages first")


def _options(args: argparse.Namespace, nodes: int) -> QemuOptions:
    smp = args.smp or (2 if nodes == 1 else 1)
    return QemuOptions(accel=args.accel, memory=args.memory, smp=smp, quiet=not args.verbose)


def environment_pair(text: str) -> tuple[str, str]:
    """type= for --env: "K=V" as (K, V)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"wants K=V, not {text!r}")
    return key, value


def _add_subcommand(sub, name: str, summary: str, **kwargs) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=summary, **kwargs)


def build_parser(prog: str = "python -m ud_transport rig") -> argparse.ArgumentParser:
    """prog: how the user reached the rig (`python -m ud_transport.rig` names itself)."""
    parser = ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)

    deps = _add_subcommand(sub, "deps", "apt-get install the host packages the rig needs")
    deps.add_argument("--no-check-tools", action="store_true", help="skip ibverbs-utils and perftest")
    deps.add_argument("--list", action="store_true", help="only print the missing packages")

    kit = _add_subcommand(sub, "kit", "build (or verify) the cached guest kit")
    kit.add_argument("--rebuild", action="store_true", help="build the kit even when a cached one exists")
    kit.add_argument("--install-deps", action="store_true", help="apt-get install missing host packages first")
    kit.add_argument("--verbose", "-v", action="store_true", help="show debug logs")

    check = _add_subcommand(sub, "check", "boot a guest and show ibv_devices / ibv_devinfo / rdma link")
    _add_guest_options(check)
    check.add_argument("--perf", action="store_true",
                       help="also run ibv_ud_pingpong and ib_send_bw -c UD inside the guest (perftest)")
    check.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                       help="2: ibv_ud_pingpong across two linked guests")
    check.add_argument("--netem-loss", type=checked_by(check_netem_loss), default=None, metavar="P%",
                       help="with --nodes 2: loss on each NIC (default: none)")

    run = _add_subcommand(sub, "run", "run a command in the guest(s)", usage="%(prog)s [options] -- COMMAND [ARG...]")
    _add_guest_options(run)
    run.add_argument("--cwd", default=None, help="working directory (default: the current one)")
    run.add_argument("--env", type=environment_pair, action="append", default=[], metavar="K=V",
                     help="extra environment variable (repeatable)")
    run.add_argument("--share", action="append", default=None, metavar="DIR",
                     help="writable directory shared with the guest at the same path, repeatable "
                          "(default: the working directory)")
    run.add_argument("--no-share", action="store_true", help="share nothing writable")
    run.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    run.add_argument("--netem-loss", type=checked_by(check_netem_loss), default=None, metavar="P%",
                     help="tc netem loss on each guest's NIC (default: none)")
    run.add_argument("--cmd-node0", default=None, metavar="SHELL", help="node 0's command (sh -c)")
    run.add_argument("--cmd-node1", default=None, metavar="SHELL", help="node 1's command (sh -c)")
    run.add_argument("--mode", choices=("auto", "guest", "host"), default="auto",
                     help="host: use rxe in the host kernel; auto: host if it has rxe, else guest")
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(usage_error=run.error)  # check_run_arguments' errors then name `rig run`, not `rig`
    return parser


def check_run_arguments(args: argparse.Namespace) -> None:
    """What `run` needs beyond single values: a command, one way or the other."""
    if args.cmd_node0 or args.cmd_node1:
        if args.nodes != 2 or not (args.cmd_node0 and args.cmd_node1):
            args.usage_error("--cmd-node0/--cmd-node1 need --nodes 2 and both commands")
    elif not _command(args):
        args.usage_error("nothing to run: give -- COMMAND or --cmd-node0/--cmd-node1")


def _command(args: argparse.Namespace) -> list[str]:
    return args.command[1:] if args.command[:1] == ["--"] else args.command


def main(argv: list[str] | None = None, prog: str = "python -m ud_transport rig") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.action == "run":  # before any slow or lasting step (--install-deps)
        check_run_arguments(args)
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="rig: %(message)s", stream=sys.stderr)

    if args.action == "deps":
        wanted = list(apt.REQUIRED_PACKAGES) + ([] if args.no_check_tools else list(apt.CHECK_PACKAGES))
        missing = apt.missing_packages(wanted)
        if args.list:
            print(" ".join(missing))
            return 0
        apt.install_packages(missing)
        print("installed: " + (" ".join(missing) or "nothing (all present)"))
        return 0

    if getattr(args, "install_deps", False):
        apt.ensure_host_packages(with_check_tools=args.action == "check")

    if args.action == "kit":
        kit = kit_module.get_kit(rebuild=args.rebuild)
        print(f"kit {kit.kernel_version}: {kit.directory}")
        print(f"  modules: {' '.join(kit.modules)}")
        return 0

    if args.action == "check":
        script = checks.DEVICE
        if args.nodes == 2:
            script = checks.PINGPONG_TWO_GUESTS
        elif args.perf:
            script += "; " + checks.PERF_ONE_GUEST
        return run_in_guest(shell_command(script), timeout=args.timeout, mode="guest", nodes=args.nodes,
                            netem_loss=args.netem_loss, options=_options(args, args.nodes), shares=[],
                            echo_boot=verbose)

    node_commands = None
    if args.cmd_node0:  # check_run_arguments made sure both are there
        node_commands = [shell_command(args.cmd_node0), shell_command(args.cmd_node1)]
    shares = [] if args.no_share else args.share
    kwargs = dict(nodes=args.nodes, netem_loss=args.netem_loss, shares=shares, echo_boot=verbose)
    if node_commands:
        kwargs["node_commands"] = node_commands
    if args.mode != "host":
        kwargs["options"] = _options(args, args.nodes)
    return run_in_guest(_command(args), cwd=args.cwd, env=dict(args.env), timeout=args.timeout,
                        mode=args.mode, **kwargs)
