"""The guest kit: a Debian kernel and a small initramfs with busybox and the modules rxe needs.

Built from Debian packages only and cached under ``$UD_RIG_CACHE`` (default
``~/.cache/ud_transport/rig``), keyed by kernel version, so a second run downloads nothing.
Layout::

    <cache>/debs/*.deb                  downloaded packages, kept for rebuilds
    <cache>/<kernel version>/vmlinuz
    <cache>/<kernel version>/base.cpio.gz   busybox + modules (no /init: that is per run)
    <cache>/<kernel version>/kit.json       manifest
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import lzma
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import environment
from . import apt
from .cpio import CpioWriter
from .modules import GUEST_MODULES, load_order, parse_modules_builtin, parse_modules_dep

log = logging.getLogger("ud_transport.rig")

# Bump when the kit's contents or layout change, so stale caches are rebuilt.
KIT_FORMAT = 1
BUSYBOX_PACKAGE = "busybox-static"
MODULES_LIST = "etc/ud_rig/modules"   # load order, one module name a line, inside the initramfs


class KitError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Kit:
    kernel_version: str
    directory: Path
    modules: tuple[str, ...]

    @property
    def vmlinuz(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def base_initramfs(self) -> Path:
        return self.directory / "base.cpio.gz"


def cache_root() -> Path:
    return Path(environment.read("UD_RIG_CACHE") or Path.home() / ".cache/ud_transport/rig")


def _load_manifest(directory: Path) -> Kit | None:
    try:
        manifest = json.loads((directory / "kit.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != KIT_FORMAT:
        return None
    kit = Kit(manifest["kernel_version"], directory, tuple(manifest["modules"]))
    for path, digest in ((kit.vmlinuz, manifest["vmlinuz_sha256"]),
                         (kit.base_initramfs, manifest["initramfs_sha256"])):
        if not path.is_file() or _sha256(path) != digest:
            log.warning("kit file %s is missing or corrupt; rebuilding", path)
            return None
    return kit


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_kits(root: Path | None = None) -> list[Kit]:
    root = root or cache_root()
    kits = []
    if root.is_dir():
        for directory in sorted(root.iterdir()):
            if directory.is_dir() and directory.name != "debs":
                kit = _load_manifest(directory)
                if kit:
                    kits.append(kit)
    return kits


def get_kit(rebuild: bool = False, root: Path | None = None) -> Kit:
    """The kit for the kernel that ``linux-image-amd64`` names, building it if needed."""
    root = root or cache_root()
    try:
        package, kernel_version = apt.kernel_package()
    except (apt.AptError, OSError) as error:
        # No usable apt (e.g. a container without lists): any cached kit will do.
        kits = cached_kits(root)
        if kits and not rebuild:
            log.info("apt-cache unavailable (%s); using cached kit %s", error, kits[-1].kernel_version)
            return kits[-1]
        raise KitError(f"cannot name the kernel package: {error}") from error
    directory = root / kernel_version
    if not rebuild:
        kit = _load_manifest(directory)
        if kit:
            log.debug("using cached kit %s", directory)
            return kit
    return build_kit(package, kernel_version, root)


def _dpkg_extract(deb: Path, target: Path) -> None:
    result = subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"dpkg-deb -x {deb} failed: {result.stderr.strip()}")


def _read_module(path: Path) -> bytes:
    """The raw ELF of a module; busybox insmod wants it uncompressed."""
    data = path.read_bytes()
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(data)
    if path.name.endswith(".ko.gz"):
        return gzip.decompress(data)
    if path.name.endswith(".ko"):
        return data
    raise KitError(f"cannot decompress {path.name} with the standard library")


def build_kit(package: str, kernel_version: str, root: Path) -> Kit:
    debs = root / "debs"
    kernel_deb = apt.download(package, debs)
    busybox_deb = apt.download(BUSYBOX_PACKAGE, debs)
    if not shutil.which("depmod"):
        raise KitError("depmod not found: install the host package kmod (rig deps)")

    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kit-", dir=root) as scratch:
        tree = Path(scratch) / "tree"
        log.info("unpacking %s", kernel_deb.name)
        _dpkg_extract(kernel_deb, tree)
        _dpkg_extract(busybox_deb, tree)

        # The Debian package runs depmod in its postinst; we never install it, so run it here.
        result = subprocess.run(["depmod", "-b", str(tree), kernel_version], capture_output=True, text=True)
        if result.returncode != 0:
            raise KitError(f"depmod -b {tree} {kernel_version} failed: {result.stderr.strip()}")
        moddir = _module_dir(tree, kernel_version)
        dep_table = parse_modules_dep((moddir / "modules.dep").read_text())
        builtin_file = moddir / "modules.builtin"
        builtin = parse_modules_builtin(builtin_file.read_text()) if builtin_file.exists() else set()
        order = load_order(GUEST_MODULES, dep_table, builtin)
        log.info("guest modules in load order: %s", " ".join(order))

        archive = CpioWriter()
        archive.add_chardev("dev/console", 5, 1)
        archive.add_file("bin/busybox", _find_busybox(tree).read_bytes(), 0o755)
        for name in order:
            archive.add_file(f"lib/modules/{name}.ko", _read_module(moddir / dep_table[name][0]))
        archive.add_file(MODULES_LIST, ("\n".join(order) + "\n").encode())

        staging = Path(scratch) / "kit"
        staging.mkdir()
        vmlinuz = _find_vmlinuz(tree, kernel_version)
        shutil.copyfile(vmlinuz, staging / "vmlinuz")
        (staging / "base.cpio.gz").write_bytes(archive.to_gzip())
        manifest = {
            "format": KIT_FORMAT,
            "kernel_version": kernel_version,
            "kernel_package": kernel_deb.name,
            "busybox_package": busybox_deb.name,
            "modules": order,
            "vmlinuz_sha256": _sha256(staging / "vmlinuz"),
            "initramfs_sha256": _sha256(staging / "base.cpio.gz"),
        }
        (staging / "kit.json").write_text(json.dumps(manifest, indent=2) + "\n")

        # Swap in atomically so a concurrent or interrupted build never leaves half a kit.
        target = root / kernel_version
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            # another process finished the same build first; its kit is as good as ours
            pass
    kit = _load_manifest(target)
    if kit is None:
        raise KitError(f"kit in {target} is unusable right after building it")
    log.info("kit ready: %s", target)
    return kit


def _module_dir(tree: Path, kernel_version: str) -> Path:
    for candidate in (tree / "lib/modules" / kernel_version, tree / "usr/lib/modules" / kernel_version):
        if (candidate / "modules.dep").exists():
            return candidate
    raise KitError(f"no modules.dep for {kernel_version} under {tree}")


def _find_vmlinuz(tree: Path, kernel_version: str) -> Path:
    path = tree / "boot" / f"vmlinuz-{kernel_version}"
    if not path.is_file():
        raise KitError(f"{path} not in the kernel package")
    return path


def _find_busybox(tree: Path) -> Path:
    for candidate in ("bin/busybox", "usr/bin/busybox"):
        if (tree / candidate).is_file():
            return tree / candidate
    raise KitError("busybox binary not found in busybox-static package")
