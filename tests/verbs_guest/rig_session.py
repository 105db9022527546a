"""Host side of the verbs tests: boot the SoftRoCE guest once and run every guest-side file.

TCG boots take ~10 s and every Python start in the guest costs seconds, so the host tests
(tests/test_verbs_bindings.py, test_verbs_allreduce.py, test_verbs_interop.py) share ONE guest
run of pytest over guest_bindings.py, guest_allreduce.py and guest_interop.py, and each checks
its own file's results from the JUnit report. The two-guest loss test boots separately, and so
does guest_torch_shrink.py (tests/test_verbs_torch.py), whose torch import takes a minute or more
under TCG.
"""
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import IN_CI, skip_or_fail
from support import child_pythonpath

REPO_ROOT = Path(__file__).resolve().parents[2]
GUEST_DIR = Path(__file__).resolve().parent
GUEST_FILES = ("guest_bindings.py", "guest_allreduce.py", "guest_interop.py")
SINGLE_GUEST_TIMEOUT_S = 900


def require_rig():
    """Skip (fail under CI) unless the rig can boot a guest here."""
    from ud_transport.rig import guest, kit

    if shutil.which(guest.QEMU) is None:
        skip_or_fail(f"{guest.QEMU} is not installed (apt-get install qemu-system-x86, "
                     "or python -m ud_transport.rig deps): the verbs tests run in a SoftRoCE guest")
    if not IN_CI and not kit.cached_kits():
        pytest.skip(f"no SoftRoCE guest kit cached in {kit.cache_root()}: build it with "
                    "`python -m ud_transport.rig kit` (CI builds it)")
    kit.get_kit()  # under CI this downloads and builds the kit when needed


@dataclass
class GuestRun:
    status: int
    seconds: float
    output: str
    cases: dict = field(default_factory=dict)  # (file, test name) -> (outcome, message)

    def check_file(self, name, minimum_tests):
        """Assert that every test of one guest file ran and passed (none skipped)."""
        mine = {test: result for (file, test), result in self.cases.items() if file == name}
        bad = {test: result for test, result in mine.items() if result[0] != "passed"}
        tail = "\n".join(self.output.splitlines()[-60:])
        assert mine, f"no results for {name} from the guest (status {self.status}):\n{tail}"
        assert not bad, "\n".join(f"{test}: {outcome}: {message}" for test, (outcome, message) in bad.items())
        assert len(mine) >= minimum_tests, f"{name}: only {len(mine)} tests ran in the guest:\n{tail}"


def parse_junit(path):
    cases = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1] + ".py"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "") + "\n" + (child.text or "")[-2000:]
        cases[(module, case.get("name"))] = (outcome, message)
    return cases


_single_guest = None


def single_guest_run():
    """Run every single-guest file in one boot (once per pytest session)."""
    global _single_guest
    if _single_guest is None:
        _single_guest = guest_files_run(GUEST_FILES, SINGLE_GUEST_TIMEOUT_S)
    return _single_guest


def guest_files_run(files, timeout):
    """Boot one guest and run pytest over `files` (names in tests/verbs_guest) in it."""
    require_rig()
    from ud_transport.rig import run_detailed

    scratch = tempfile.mkdtemp(prefix="udt-verbs-")
    junit = os.path.join(scratch, "junit.xml")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", f"--junitxml={junit}",
            *(str(GUEST_DIR / f) for f in files)]
    output = io.StringIO()
    started = time.monotonic()
    results = run_detailed(argv, cwd=REPO_ROOT, shares=[scratch], timeout=timeout, output=output)
    run = GuestRun(status=max(r.status for r in results), seconds=time.monotonic() - started, output=output.getvalue())
    if os.path.exists(junit):
        run.cases = parse_junit(junit)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"SoftRoCE guest: {len(run.cases)} guest tests, status {run.status}, {run.seconds:.1f} s", file=sys.stderr)
    return run


def two_guest_run(trials, netem_loss="10%", timeout=600):
    """Two guests x two ranks over rxe with netem loss; returns ({rank: result}, seconds, output)."""
    require_rig()
    import json

    from ud_transport.rig import run_detailed

    scratch = tempfile.mkdtemp(prefix="udt-verbs2-")
    argv = [sys.executable, "-m", "verbs_guest.two_node", "--store", os.path.join(scratch, "store"),
            "--out", scratch, "--trials", str(trials)]
    output = io.StringIO()
    started = time.monotonic()
    results = run_detailed(argv, cwd=REPO_ROOT, env={"PYTHONPATH": child_pythonpath()}, nodes=2, netem_loss=netem_loss,
                           shares=[scratch], timeout=timeout, output=output)
    seconds = time.monotonic() - started
    ranks = {}
    for rank in range(4):
        path = os.path.join(scratch, f"rank-{rank}.json")
        if os.path.exists(path):
            with open(path) as source:
                ranks[rank] = json.load(source)
    shutil.rmtree(scratch, ignore_errors=True)
    return ranks, [r.status for r in results], seconds, output.getvalue()


def system_has_pyverbs():
    return subprocess.run(["/usr/bin/python3", "-c", "import pyverbs.qp"], capture_output=True).returncode == 0
