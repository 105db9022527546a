"""Finding 11 of issue 10: who sent a verbs datagram is read from the 40 bytes in front of
it, which the device writes only in part (RoCEv2 over IPv4) or not at all (no GRH). The
transport clears them before each receive is posted, and never names a RoCE sender by its
QPN alone. Checked on the transport's own C code (tests/native/grh_sender.c includes it), so
no RDMA device is needed; the rig's tests run the same code on rxe."""
import pathlib
import shutil
import subprocess

from conftest import skip_or_fail

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_stale_header_in_a_receive_slot_does_not_name_the_sender(tmp_path):
    compiler = shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        skip_or_fail("no C compiler (gcc or clang) to build the harness")
    if not pathlib.Path("/usr/include/infiniband/verbs.h").exists():
        skip_or_fail("the libibverbs headers (libibverbs-dev) are not installed")
    binary = tmp_path / "grh_sender"
    build = subprocess.run([compiler, "-O1", "-g", "-Wall", "-Werror", "-I", str(ROOT / "native"),
                            str(ROOT / "tests" / "native" / "grh_sender.c"), "-libverbs", "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
