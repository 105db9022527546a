"""SoftRoCE rig: run commands where an rxe (RDMA over UDP) device exists.

On machines whose kernel has no RDMA, commands run in a qemu (TCG) guest built from Debian
packages, with the host's root shared read-only, so the host's Python, venv and build run
unchanged. See docs/rig.md.
"""

from .guest import STATUS_RIG_FAILURE, STATUS_TIMEOUT, GuestResult, QemuOptions
from .runner import run_detailed, run_in_guest

__all__ = ["run_in_guest", "run_detailed", "QemuOptions", "GuestResult",
           "STATUS_TIMEOUT", "STATUS_RIG_FAILURE"]
