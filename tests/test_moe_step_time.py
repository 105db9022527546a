"""scripts/moe_step_time.py trains an expert-parallel layer on Gloo and on a "ud" group in the same
processes: every all_to_all_single has split sizes the gate chose. A few small steps: the figures
are not judged (no timing assertions), only that both arms ran, routed the same tokens and, with
no loss at 2 ranks (the gate's gradient sums in one order either way), ended on the same
parameters and losses."""
import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "moe_step_time.py"


def test_both_arms_train_alike():
    result = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "2", "--steps", "4", "--warmup", "1", "--tokens", "64",
                             "--hidden", "32", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if re.match(r"\| (gloo|ud) \|", line)}
    assert list(rows) == ["gloo", "ud"], result.stdout
    assert re.fullmatch(r"\d+\.\d+x, \d+\.\d+x", rows["ud"][1]), rows["ud"]
    assert rows["ud"][-1] == rows["gloo"][-1], rows  # the final loss, to six places
    assert "largest parameter difference, ud against Gloo, over ranks: 0.00e+00" in result.stdout
    routed = re.search(r"tokens routed \(rank 0\): \{'gloo': (\d+), 'ud': (\d+)\}", result.stdout)
    assert routed and routed.group(1) == routed.group(2) and int(routed.group(1)) > 0, result.stdout
    assert "FutureWarning" not in result.stderr
