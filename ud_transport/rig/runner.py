"""``run_in_guest``: run a command where an rxe device exists, and return its exit status.

On a host whose kernel has rxe the command runs right here (see native.py); everywhere
else it runs in one or two qemu guests built from the cached kit.
"""

from __future__ import annotations

import logging
import os
import sys
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from . import native
from .guest import STATUS_RIG_FAILURE, GuestResult, QemuOptions, run_guests
from .initscript import GuestSetup
from .kit import get_kit
from .markers import new_nonce

log = logging.getLogger("ud_transport.rig")

# Host variables a command needs to find the same Python, venv and project inside the guest.
PASSED_ENV = ("PATH", "HOME", "VIRTUAL_ENV", "PYTHONPATH", "PYENV_ROOT", "PYENV_VERSION",
              "LANG", "LC_ALL", "CI")
_LOSS = re.compile(r"^\d+(\.\d+)?%$")


def check_netem_loss(loss: str) -> str:
    """`loss` when tc netem takes it as a loss rate ("10%", "0.5%"); ValueError otherwise."""
    if not _LOSS.match(loss) or float(loss[:-1]) > 100:
        raise ValueError(f"netem loss must look like '10%' or '0.5%' (at most 100%), not {loss!r}")
    return loss


def guest_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
    # project settings (UD_*) travel too, except the rig's own, which the guest sets
    env.update({k: v for k, v in os.environ.items() if k.startswith("UD_") and not k.startswith("UD_RIG")})
    env.setdefault("TERM", "dumb")   # the console is a serial tty: no colour codes
    env.update(extra or {})
    return env


# The guest mounts fresh tmpfs here, hiding what the host has under them.
GUEST_TMPFS = ("/tmp", "/run", "/dev/shm")


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def choose_shares(cwd: str, shares: Sequence[str] | None, needed: Sequence[str] = ()) -> list[str]:
    """Writable shares: the given ones, or by default the working directory (never "/").
    The working directory and the `needed` paths (the Python environment) are
    shared regardless when they lie under a folder the guest covers with tmpfs
    (a clone or a venv in /tmp, say): the guest could not see them otherwise."""
    chosen = [str(Path(p).resolve()) for p in (shares if shares is not None else [cwd])]
    for path in [cwd, *needed]:
        hidden = any(_inside(path, folder) for folder in GUEST_TMPFS)
        if hidden and not any(_inside(path, share) for share in chosen):
            chosen.append(path)
    return [p for p in dict.fromkeys(chosen) if p != "/"]


def run_detailed(
    argv: Sequence[str] | None = None,
    *,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    nodes: int = 1,
    node_commands: Sequence[Sequence[str]] | None = None,
    netem_loss: str | None = None,
    shares: Sequence[str] | None = None,
    options: QemuOptions | None = None,
    output: TextIO | None = None,
    echo_boot: bool = False,
) -> list[GuestResult]:
    """Run in guests and return one result per node (status, timings, failure reason)."""
    if nodes not in (1, 2):
        raise ValueError("nodes must be 1 or 2")
    if netem_loss is not None:
        check_netem_loss(netem_loss)
    commands = [list(c) for c in node_commands] if node_commands else [list(argv or [])] * nodes
    if len(commands) != nodes or not all(commands):
        raise ValueError("give a command (argv) or one command per node")
    cwd = str(Path(cwd or os.getcwd()).resolve())
    options = options or QemuOptions(smp=2 if nodes == 1 else 1)
    kit = get_kit()
    base_env = guest_env(env)
    nonce = new_nonce()
    setups = [GuestSetup(nonce=nonce, argv=commands[n], cwd=cwd, env=base_env, node=n, nodes=nodes,
                         netem_loss=netem_loss) for n in range(nodes)]
    python_environment = [str(Path(sys.prefix).resolve())]
    return run_guests(kit, setups, options, choose_shares(cwd, shares, python_environment), timeout=timeout,
                      output=output, echo_boot=echo_boot)


def run_in_guest(
    argv: Sequence[str],
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    *,
    mode: str = "auto",
    **kwargs,
) -> int:
    """Run ``argv`` with an rxe device available; return its exit status (worst over nodes).

    mode: "guest" always boots qemu; "host" needs rxe in the host kernel; "auto" uses the
    host when it has rxe and the request is a single node without netem, else a guest.
    Rig failures return 125, a timeout 124; the reason is logged.
    """
    single = kwargs.get("nodes", 1) == 1 and not kwargs.get("netem_loss")
    if mode == "host" or (mode == "auto" and single and native.host_has_rxe()):
        if not single:
            raise ValueError("host mode runs a single node without netem")
        return native.run_on_host(list(argv), cwd=cwd, env=guest_env(env), timeout=timeout,
                                  output=kwargs.get("output"))
    if mode not in ("auto", "guest", "host"):
        raise ValueError(f"unknown mode {mode!r}")
    results = run_detailed(argv, cwd=cwd, env=env, timeout=timeout, **kwargs)
    return max(result.status for result in results) if results else STATUS_RIG_FAILURE


def shell_command(text: str) -> list[str]:
    """argv that runs ``text`` with the guest's /bin/sh (for per-node commands given as strings)."""
    return ["/bin/sh", "-c", text]


__all__ = ["run_in_guest", "run_detailed", "guest_env", "choose_shares", "shell_command"]
