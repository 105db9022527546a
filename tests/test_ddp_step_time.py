"""scripts/ddp_step_time.py runs DDP on Gloo and on "ud" groups of the stripe counts asked for (and
FSDP2 on both, and the two-stage step on "ud"), in the same processes, and reports each arm. A small model and a few steps: the figures are not
judged here (no timing assertions), only that every arm ran, the stripes are the ones asked for,
and DDP on "ud" ended on the parameters DDP on Gloo did (no loss, 2 ranks: the same sums)."""
import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "ddp_step_time.py"


def test_every_arm_runs_and_ud_ends_where_gloo_does():
    result = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--warmup", "1", "--width", "256", "--layers", "2",
                             "--batch", "8", "--stripes", "1,2", "--threads", "1", "--fsdp", "--two-stage"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if re.match(r"\| (compute|gloo|ud-\w+|fsdp-\w+|two-stage) \|", line)}
    assert list(rows) == ["compute", "gloo", "ud-1", "ud-2", "fsdp-gloo", "fsdp-ud", "two-stage"], result.stdout
    assert rows["ud-1"][0] == "1" and rows["ud-2"][0] == "2"
    for arm in ("ud-1", "ud-2", "fsdp-ud"):
        assert rows[arm][-2] == "0.0e+00", rows[arm]  # the largest parameter difference from DDP on Gloo
        assert re.fullmatch(r"\d+\.\d+ \(\d+\.\d+x\)", rows[arm][-1]), rows[arm]  # all steps, and against Gloo's
        assert re.fullmatch(r"\d+\.\d+x, \d+\.\d+x", rows[arm][3]), rows[arm]
        assert rows[arm][4] == "1.0000", rows[arm]  # the least share of gradients delivered, over ranks
    assert rows["fsdp-gloo"][-2] == "0.0e+00"  # FSDP2 on Gloo ends where DDP on Gloo does
    # the two-stage step: every gradient delivered, near Gloo's parameters (another summation order)
    assert rows["two-stage"][0] == "1" and rows["two-stage"][4] == "1.0000", rows["two-stage"]
    assert float(rows["two-stage"][-2]) < 1e-5, rows["two-stage"]
    assert re.fullmatch(r"\d+\.\d+ \(\d+\.\d+x\)", rows["two-stage"][-1]), rows["two-stage"]
    assert "0.1 M parameters, 0.5 MiB of gradients" in result.stdout


def test_only_keeps_compute_and_the_arms_named():
    result = subprocess.run([sys.executable, str(SCRIPT), "--steps", "2", "--warmup", "1", "--width", "64", "--layers", "1",
                             "--batch", "4", "--stripes", "1", "--threads", "1", "--only", "ud-1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    arms = [line.split("|")[1].strip() for line in result.stdout.splitlines() if re.match(r"\| (compute|gloo|ud-\w+) \|", line)]
    assert arms == ["compute", "ud-1"], result.stdout
    wrong = subprocess.run([sys.executable, str(SCRIPT), "--only", "nccl"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "no such arm nccl" in wrong.stderr, wrong.stderr
