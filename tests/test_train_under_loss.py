"""The short version of scripts/train_under_loss.py (4 ranks, 200 steps, a
1-layer byte-level transformer on Shakespeare, 10% i.i.d. loss): the paper's
two-stage step ends closer to reliable Gloo than the plain lossy allreduce,
and keeps replicas together while the plain one lets them drift."""
import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "train_under_loss.py"


def test_two_stage_beats_plain_allreduce_at_10_percent_loss(tmp_path):
    out = tmp_path / "results.json"
    finished = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True,
                              text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    final = {name: r["curve"][-1][1] for name, r in results.items()}
    drift = {name: r["drift"][-1][1] for name, r in results.items()}
    assert drift["gloo"] == 0.0
    assert final["gloo"] < 20, "the model did not learn (byte-level perplexity starts near 256)"
    gap_two_stage = final["two_stage 10%"] / final["gloo"] - 1
    gap_plain = final["plain 10%"] / final["gloo"] - 1
    assert gap_two_stage < gap_plain, (final, drift)
    assert drift["two_stage 10%"] < 5e-3 and drift["plain 10%"] > 2 * drift["two_stage 10%"], drift
    # loss was really injected and absorbed
    assert results["two_stage 10%"]["mean_reduce_fraction"] < 0.97
    assert all(r["arm"]["loss"] == "0" or r["fractions"][0] < 1.0 for r in results.values())
