"""The UDP transport's receive path against whatever recvmmsg may report (tests/native/gro_receive.c):
message lengths up to and past the slot, MSG_TRUNC, GRO segment sizes absent, zero, negative,
smaller than, equal to or larger than the message, drop counts; recvmmsg is replaced by a seeded
generator, the rest is native/transport_udp.c as built. Under ASan and UBSan every datagram handed
out lies inside its slot, a slot's datagrams tile its whole datagrams in order, a cut train ends
in one 0-byte item, each slot is handed out once whatever max_items asks, and the drop count adds up."""
import shutil
import subprocess
from pathlib import Path

from conftest import skip_or_fail

ROOT = Path(__file__).resolve().parent.parent


def test_every_reported_receive_is_split_inside_its_slot(tmp_path):
    compiler = shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        skip_or_fail("no C compiler (gcc or clang) to build the receive-path harness")
    binary = tmp_path / "gro_receive"
    build = subprocess.run([compiler, "-O1", "-g", "-std=gnu11", "-Wall", "-Werror", "-fsanitize=address,undefined",
                            "-fno-sanitize-recover=all", "-I", str(ROOT / "native"),
                            str(ROOT / "tests" / "native" / "gro_receive.c"), "-o", str(binary)],
                           capture_output=True, text=True)
    if build.returncode != 0:
        if "asan" in build.stderr.lower() or "ubsan" in build.stderr.lower():
            skip_or_fail(f"{compiler} cannot link the sanitizer runtimes: {build.stderr.strip()[-300:]}")
        raise AssertionError(build.stderr)
    run = subprocess.run([str(binary), "200000"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "runtime error" not in run.stderr, run.stderr
    assert run.stdout.startswith("200000 receives,") and "all inside their slots, in order" in run.stdout, run.stdout
    handed_out, split = (int(word) for word in run.stdout.replace(",", "").split()[2:7:4])
    assert handed_out > 200000 and split > 1000, run.stdout  # trains were really split, not only lone datagrams
