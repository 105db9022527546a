"""The engine's receive path under libFuzzer with ASan and UBSan
(scripts/fuzz.sh: one rank of three runs real calls while the fuzz input
arrives as datagrams from its peers), for a bounded time: no sanitizer
report, no crash, no call that fails to end."""
import os
import pathlib
import re
import shutil
import subprocess

from conftest import skip_or_fail

ROOT = pathlib.Path(__file__).resolve().parent.parent
FUZZ_SECONDS = int(os.environ.get("UD_TEST_FUZZ_SECONDS", "90"))


def test_engine_receive_path_survives_fuzzing(tmp_path):
    if shutil.which("clang") is None:
        skip_or_fail("clang with libFuzzer is not installed (apt-get install clang libclang-rt-14-dev; scripts/setup.sh does)")
    finished = subprocess.run(["bash", str(ROOT / "scripts" / "fuzz.sh")], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "FUZZ_SECONDS": str(FUZZ_SECONDS), "FUZZ_WORK": str(tmp_path)},
                              timeout=FUZZ_SECONDS + 600)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-4000:]
    executed = re.search(r"stat::number_of_executed_units:\s*(\d+)", output)
    assert executed and int(executed.group(1)) > 1000, output[-2000:]  # it really fuzzed
