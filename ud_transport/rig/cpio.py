"""A minimal writer for the cpio "newc" format the kernel unpacks as an initramfs.

Written here rather than calling cpio(1) so the host needs one tool less and the
archive is byte-for-byte reproducible (fixed inode numbers, mtime 0).
"""

from __future__ import annotations

import gzip
import stat

_MAGIC = b"070701"


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


class CpioWriter:
    """Collects entries in memory; ``to_bytes()`` returns the archive with its trailer."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._next_ino = 1
        self._dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        name_bytes = name.encode() + b"\0"
        fields = (
            self._next_ino, mode, 0, 0,          # ino, mode, uid, gid
            2 if stat.S_ISDIR(mode) else 1,      # nlink
            0, len(data),                        # mtime, filesize
            0, 0, rdev[0], rdev[1],              # dev major/minor, rdev major/minor
            len(name_bytes), 0,                  # namesize, check
        )
        self._next_ino += 1
        header = _MAGIC + b"".join(b"%08X" % f for f in fields)
        self._parts.append(header + name_bytes + _pad4(len(header) + len(name_bytes)))
        self._parts.append(data + _pad4(len(data)))

    def add_dir(self, name: str, mode: int = 0o755) -> None:
        name = name.strip("/")
        if not name or name in self._dirs:
            return
        parent = name.rpartition("/")[0]
        if parent:
            self.add_dir(parent)
        self._dirs.add(name)
        self._entry(name, stat.S_IFDIR | mode)

    def _add_parent(self, name: str) -> str:
        name = name.strip("/")
        parent = name.rpartition("/")[0]
        if parent:
            self.add_dir(parent)
        return name

    def add_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(self._add_parent(name), stat.S_IFREG | mode, data)

    def add_symlink(self, name: str, target: str) -> None:
        self._entry(self._add_parent(name), stat.S_IFLNK | 0o777, target.encode())

    def add_chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._entry(self._add_parent(name), stat.S_IFCHR | mode, rdev=(major, minor))

    def to_bytes(self) -> bytes:
        trailer = CpioWriter()
        trailer._entry("TRAILER!!!", 0)
        return b"".join(self._parts + trailer._parts)

    def to_gzip(self) -> bytes:
        # mtime=0 keeps the gzip header reproducible too
        return gzip.compress(self.to_bytes(), compresslevel=6, mtime=0)


def read_newc(archive: bytes) -> dict[str, tuple[int, bytes]]:
    """Parse (concatenated) newc archives into {name: (mode, data)}; for tests and inspection."""
    entries: dict[str, tuple[int, bytes]] = {}
    pos = 0
    while pos < len(archive):
        if archive[pos:pos + 6] != _MAGIC:
            raise ValueError(f"bad cpio magic at offset {pos}")
        fields = [int(archive[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        mode, filesize, namesize = fields[1], fields[6], fields[11]
        name_start = pos + 110
        name = archive[name_start:name_start + namesize - 1].decode()
        data_start = name_start + namesize
        data_start += -data_start % 4
        data = archive[data_start:data_start + filesize]
        pos = data_start + filesize
        pos += -pos % 4
        if name == "TRAILER!!!":
            # the kernel accepts several archives back to back, with NUL padding between
            while pos < len(archive) and archive[pos] == 0:
                pos += 1
            continue
        entries[name] = (mode, data)   # a later archive overrides an earlier one, as in the kernel
    return entries
