"""Console marker lines: how the guest tells the host where the command starts and how it ended.

Every marker carries a per-run random nonce, so text the command prints can never be
mistaken for one, and a marker is found anywhere in a line (output without a trailing
newline, or a kernel message, may share its line).
"""

from __future__ import annotations

import dataclasses
import re
import secrets

_PATTERN = re.compile(r"@@UD_RIG (START|EXIT|FAIL) ([0-9a-f]{16})(?: ([^@]*))?@@")


def new_nonce() -> str:
    return secrets.token_hex(8)


def start_marker(nonce: str) -> str:
    return f"@@UD_RIG START {nonce}@@"


def exit_marker(nonce: str, status: int | str) -> str:
    # status is a shell expansion ("$status") when rendered into a script
    return f"@@UD_RIG EXIT {nonce} {status}@@"


def fail_marker(nonce: str, message: str) -> str:
    return f"@@UD_RIG FAIL {nonce} {message}@@"


@dataclasses.dataclass(frozen=True)
class Marker:
    kind: str          # "START", "EXIT" or "FAIL"
    status: int | None  # exit status for EXIT
    message: str       # reason for FAIL
    before: str        # text on the same line before the marker (command output)


def parse_line(line: str, nonce: str) -> Marker | None:
    """The marker for this run in ``line``, or None. Markers with another nonce are ignored."""
    for match in _PATTERN.finditer(line):
        kind, found_nonce, rest = match.group(1), match.group(2), match.group(3) or ""
        if found_nonce != nonce:
            continue
        before = line[:match.start()]
        if kind == "EXIT":
            try:
                status = int(rest.strip())
            except ValueError:
                return Marker("FAIL", None, f"unreadable exit status {rest!r}", before)
            return Marker("EXIT", status, "", before)
        return Marker(kind, None, rest.strip(), before)
    return None
