"""Boot guests with qemu (TCG), stream their consoles, and read back the command's status."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from . import markers
from .cpio import CpioWriter
from .initscript import HOST_ROOT_TAG, GuestSetup, render_init, render_stage2
from .kit import Kit

log = logging.getLogger("ud_transport.rig")

QEMU = "qemu-system-x86_64"
STATUS_TIMEOUT = 124   # like timeout(1)
STATUS_RIG_FAILURE = 125  # the rig, not the command, failed (like env(1)/docker)
KERNEL_CMDLINE = "console=ttyS0 panic=-1 random.trust_cpu=on"


@dataclasses.dataclass
class QemuOptions:
    accel: str = "tcg"        # KVM does not boot a standard guest on the build machines
    memory: str = "2G"
    smp: int = 2
    cpu: str = ""             # default: "max" under TCG (AVX2 for numpy/torch), "host" under KVM
    qemu: str = QEMU
    quiet: bool = True        # False shows the kernel's boot messages (with --verbose)


@dataclasses.dataclass
class Nic:
    """One end of the unix-socket link between two guests."""
    socket_path: str
    server: bool
    mac: str


def qemu_argv(kit: Kit, initrd: Path, shares: list[tuple[str, str]], options: QemuOptions,
              nic: Nic | None = None) -> list[str]:
    cpu = options.cpu or ("host" if options.accel == "kvm" else "max")
    accel = "tcg,thread=multi" if options.accel == "tcg" else options.accel
    argv = [
        options.qemu, "-accel", accel, "-cpu", cpu, "-m", options.memory, "-smp", str(options.smp),
        "-nodefaults", "-no-user-config", "-display", "none", "-monitor", "none",
        "-serial", "stdio", "-no-reboot",
        "-kernel", str(kit.vmlinuz), "-initrd", str(initrd),
        "-append", KERNEL_CMDLINE + (" quiet" if options.quiet else ""),
        "-virtfs", f"local,path=/,mount_tag={HOST_ROOT_TAG},security_model=none,readonly=on,multidevs=remap",
    ]
    for tag, path in shares:
        argv += ["-virtfs", f"local,path={path},mount_tag={tag},security_model=none,multidevs=remap"]
    if nic is None:
        argv += ["-nic", "none"]   # never a NIC on the host's network
    else:
        role = "on" if nic.server else "off"
        argv += ["-device", f"virtio-net-pci,netdev=n0,mac={nic.mac}",
                 "-netdev", f"stream,id=n0,server={role},addr.type=unix,addr.path={nic.socket_path}"]
    return argv


def build_initrd(kit: Kit, setup: GuestSetup, path: Path) -> None:
    """The kit's initramfs with this run's /init and stage 2 appended as a second archive.

    The kernel unpacks concatenated archives in order, so the cached kit never changes.
    """
    run_part = CpioWriter()
    run_part.add_file("init", render_init(setup).encode(), 0o755)
    run_part.add_file("rig/stage2.sh", render_stage2(setup).encode(), 0o755)
    path.write_bytes(kit.base_initramfs.read_bytes() + run_part.to_gzip())


@dataclasses.dataclass
class GuestResult:
    node: int
    status: int = STATUS_RIG_FAILURE
    failure: str = ""               # why the rig failed, empty when the command ran
    boot_s: float | None = None     # qemu start -> command start
    command_s: float | None = None  # command start -> exit marker
    console_tail: list[str] = dataclasses.field(default_factory=list)


class _Guest:
    def __init__(self, setup: GuestSetup, argv: list[str], output: TextIO, lock: threading.Lock,
                 prefix: str, echo_boot: bool) -> None:
        self.setup, self.argv, self.output, self.lock = setup, argv, output, lock
        self.prefix, self.echo_boot = prefix, echo_boot
        self.result = GuestResult(node=setup.node)
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.stderr_text = ""
        self.proc: subprocess.Popen | None = None
        self.done = threading.Event()
        self.stopped_by_host = ""   # set when the host kills qemu before its exit marker

    def start(self) -> None:
        log.debug("node %d: %s", self.setup.node, " ".join(self.argv))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._read_console, daemon=True).start()

    def _read_stderr(self) -> None:
        assert self.proc and self.proc.stderr
        self.stderr_text = self.proc.stderr.read().decode(errors="replace")

    def _emit(self, text: str) -> None:
        with self.lock:
            self.output.write(self.prefix + text + "\n")
            self.output.flush()

    def _read_console(self) -> None:
        assert self.proc and self.proc.stdout
        running = False
        command_started = 0.0
        try:
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                marker = markers.parse_line(line, self.setup.nonce)
                if marker is None:
                    self.tail.append(line)
                    if running or self.echo_boot:
                        self._emit(line)
                    else:
                        log.debug("node %d boot: %s", self.setup.node, line)
                    continue
                if marker.before and (running or self.echo_boot):
                    self._emit(marker.before)
                if marker.kind == "START":
                    running = True
                    command_started = time.monotonic()
                    self.result.boot_s = command_started - self.started
                elif marker.kind == "EXIT":
                    self.result.status = marker.status if marker.status is not None else STATUS_RIG_FAILURE
                    if running:
                        self.result.command_s = time.monotonic() - command_started
                    else:
                        self.result.failure = "the guest ended before the command started"
                        self.result.status = STATUS_RIG_FAILURE
                    break
                else:  # FAIL
                    self.result.failure = f"guest setup failed: {marker.message}"
                    self.result.status = STATUS_RIG_FAILURE
                    break
            else:
                self.proc.wait()
                if running:
                    self.result.command_s = time.monotonic() - command_started
                self.result.failure = self.stopped_by_host or (
                    f"qemu exited with status {self.proc.returncode} before the guest printed an exit marker")
        finally:
            self.result.console_tail = list(self.tail)
            self.stop()
            self.done.set()

    def stop(self) -> None:
        """Power the guest off from outside: everything it printed has been read already."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc:
            self.proc.wait()


def _wait_for_socket(path: str, guest: _Guest, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if guest.done.is_set() or time.monotonic() > deadline:
            raise RuntimeError(f"qemu (node 0) did not create its link socket {path}")
        time.sleep(0.05)


def run_guests(kit: Kit, setups: list[GuestSetup], options: QemuOptions, shares: list[str],
               timeout: float | None = None, output: TextIO | None = None,
               echo_boot: bool = False) -> list[GuestResult]:
    """Boot one guest per setup (two are linked by a unix-socket NIC) and wait for all of them."""
    qemu = shutil.which(options.qemu)
    if not qemu:
        raise FileNotFoundError(f"{options.qemu} not found: install the host package qemu-system-x86")
    output = output or sys.stdout
    lock = threading.Lock()
    share_tags = [(f"share{i}", path) for i, path in enumerate(shares)]
    guests: list[_Guest] = []
    with tempfile.TemporaryDirectory(prefix="ud_rig-") as scratch:
        socket_path = os.path.join(scratch, "link.sock")
        for setup in setups:
            setup.shares = share_tags
            initrd = Path(scratch) / f"initrd-node{setup.node}.img"
            build_initrd(kit, setup, initrd)
            nic = None
            if len(setups) > 1:
                nic = Nic(socket_path, server=setup.node == 0, mac=f"52:54:00:d5:00:{setup.node + 1:02x}")
            argv = qemu_argv(kit, initrd, share_tags, options, nic)
            prefix = f"[node{setup.node}] " if len(setups) > 1 else ""
            guests.append(_Guest(setup, argv, output, lock, prefix, echo_boot))

        deadline = None if timeout is None else time.monotonic() + timeout
        reason = ""
        try:
            for index, guest in enumerate(guests):
                guest.start()
                if index == 0 and len(guests) > 1:
                    _wait_for_socket(socket_path, guest)  # the client needs the server's socket
            while not all(guest.done.is_set() for guest in guests):
                if deadline is not None and time.monotonic() > deadline:
                    reason = f"timed out after {timeout:g} s; qemu killed"
                    break
                broken = [g for g in guests if g.done.is_set() and g.result.failure]
                if broken:
                    # a peer whose partner never came up would only wait for its own timeout
                    reason = f"stopped because node {broken[0].setup.node} failed"
                    break
                time.sleep(0.05)
        except (RuntimeError, KeyboardInterrupt) as error:
            reason = str(error) or "interrupted"
        finally:
            for guest in guests:
                if guest.proc is None:      # never started
                    guest.result.failure = reason or "not started"
                    guest.done.set()
                elif not guest.done.is_set():
                    guest.stopped_by_host = reason or "stopped"
                    guest.stop()
            for guest in guests:
                guest.done.wait(10)
                if guest.stopped_by_host and guest.result.failure == guest.stopped_by_host:
                    guest.result.status = STATUS_TIMEOUT if reason.startswith("timed out") else STATUS_RIG_FAILURE

    for guest in guests:
        result = guest.result
        if result.failure:
            tail = "\n".join("    " + line for line in result.console_tail[-25:]) or "    (none)"
            stderr = guest.stderr_text.strip()
            log.error("node %d: %s\n  last console lines:\n%s%s%s", result.node, result.failure, tail,
                      f"\n  qemu stderr:\n    {stderr}" if stderr else "",
                      "" if result.boot_s else "\n  (--verbose shows the whole boot console)")
        log.info("node %d: status %s, boot %s s, command %s s", result.node, result.status,
                 _fmt(result.boot_s), _fmt(result.command_s))
    return [guest.result for guest in guests]


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"
