"""Thin wrappers over apt/dpkg: which host packages exist, install the missing, download .debs."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

log = logging.getLogger("ud_transport.rig")

# Host packages the rig uses, and why.
#   qemu-system-x86  runs the guest (TCG)
#   kmod             depmod, to compute the guest kernel's modules.dep
#   iproute2         ip/tc/rdma, run inside the guest from the shared host root
#   libibverbs1, ibverbs-providers
#                    libibverbs and its rxe provider (librxe); without the provider
#                    libibverbs lists no rxe0 even when the kernel has one
REQUIRED_PACKAGES: tuple[str, ...] = (
    "qemu-system-x86", "kmod", "iproute2", "libibverbs1", "ibverbs-providers",
)
# Tools for `rig check` and the smoke tests: ibv_devices/ibv_devinfo/ibv_ud_pingpong, ib_send_bw.
CHECK_PACKAGES: tuple[str, ...] = ("ibverbs-utils", "perftest")


class AptError(RuntimeError):
    pass


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    log.debug("running %s", " ".join(argv))
    return subprocess.run(argv, text=True, capture_output=True, **kwargs)


def missing_packages(packages: tuple[str, ...] | list[str]) -> list[str]:
    """The packages of ``packages`` that dpkg does not report as installed."""
    missing = []
    for package in packages:
        result = _run(["dpkg-query", "-W", "-f", "${Status}", package])
        if result.returncode != 0 or not result.stdout.strip().endswith(" installed"):
            missing.append(package)
    return missing


def _not_found(stderr: str) -> bool:
    return "Unable to locate package" in stderr or "has no installation candidate" in stderr \
        or "Can't select" in stderr or "404" in stderr


def install_packages(packages: list[str]) -> None:
    """apt-get install ``packages``; refresh the package lists only if apt cannot find one."""
    if not packages:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    argv = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    log.info("installing host packages: %s", " ".join(packages))
    result = _run(argv, env=env)
    if result.returncode != 0 and _not_found(result.stderr):
        log.info("apt could not find a package; running apt-get update")
        update = _run(["apt-get", "update"], env=env)
        if update.returncode != 0:
            raise AptError(f"apt-get update failed: {update.stderr.strip()[-2000:]}")
        result = _run(argv, env=env)
    if result.returncode != 0:
        raise AptError(f"apt-get install {' '.join(packages)} failed "
                       f"(status {result.returncode}): {result.stderr.strip()[-2000:]}")


def ensure_host_packages(with_check_tools: bool = True) -> list[str]:
    """Install whatever is missing; returns the packages that were installed."""
    wanted = list(REQUIRED_PACKAGES) + (list(CHECK_PACKAGES) if with_check_tools else [])
    missing = missing_packages(wanted)
    install_packages(missing)
    return missing


def kernel_package(meta: str = "linux-image-amd64") -> tuple[str, str]:
    """(package, kernel version) that the meta package currently points at.

    Reads the local package lists only (no network), e.g.
    ('linux-image-6.1.0-56-amd64', '6.1.0-56-amd64').
    """
    result = _run(["apt-cache", "depends", meta])
    if result.returncode != 0:
        raise AptError(f"apt-cache depends {meta} failed: {result.stderr.strip()}")
    return parse_kernel_depends(result.stdout, meta)


def parse_kernel_depends(text: str, meta: str = "linux-image-amd64") -> tuple[str, str]:
    match = re.search(r"^\s*Depends:\s*(linux-image-(\S+?))\s*$", text, re.MULTILINE)
    if not match:
        raise AptError(f"no kernel image in `apt-cache depends {meta}`:\n{text}")
    return match.group(1), match.group(2)


def download(package: str, directory: Path) -> Path:
    """The .deb of ``package`` in ``directory``, downloading it only if absent."""
    directory.mkdir(parents=True, exist_ok=True)
    existing = sorted(directory.glob(f"{package}_*.deb"))
    if existing:
        return existing[-1]
    log.info("downloading %s", package)
    result = _run(["apt-get", "download", package], cwd=directory)
    if result.returncode != 0 and _not_found(result.stderr):
        log.info("apt could not find %s; running apt-get update", package)
        _run(["apt-get", "update"])
        result = _run(["apt-get", "download", package], cwd=directory)
    if result.returncode != 0:
        raise AptError(f"apt-get download {package} failed: {result.stderr.strip()[-2000:]}")
    found = sorted(directory.glob(f"{package}_*.deb"))
    if not found:
        raise AptError(f"apt-get download {package} left no .deb in {directory}")
    return found[-1]
