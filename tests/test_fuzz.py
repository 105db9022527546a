"""The engine's receive path under libFuzzer with ASan and UBSan
(scripts/fuzz.sh: one rank runs real calls while the fuzz input arrives as
datagrams from its peers; a first harness with a fixed call shape, a second
where the input picks the shape and the communicator's history too), for a
bounded time each: no sanitizer report, no crash, no call that fails to end."""
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
                              timeout=2 * FUZZ_SECONDS + 600)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-4000:]
    executed = [int(count) for count in re.findall(r"stat::number_of_executed_units:\s*(\d+)", output)]
    assert len(executed) == 2 and min(executed) > 1000, output[-2000:]  # both harnesses really fuzzed
