"""The short version of scripts/train_through_death.py (3 ranks, 60 steps of the small model):
rank 1 is SIGKILLed before step 30 in each arm that kills (in "ud leave" it leaves on purpose,
handing its optimizer shard over, and nothing restarts). On "ud" the survivors agree on it,
shrink, re-shard the two-stage optimizer (the dead rank's shard restarts, or with "+copy" takes
its state from the copy its next rank kept) and train on; a new process joins at step 40. On Gloo every rank restarts from the checkpoint of step 20 and redoes
10 steps. Every arm ends with a model that learned. No timing is asserted: the seconds are
measured and printed, not tested."""
import json
import math
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "train_through_death.py"


def test_training_goes_on_through_a_death_and_a_rejoin(tmp_path):
    out = tmp_path / "results.json"
    finished = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--ranks", "3", "--steps", "60",
                               "--kill-at-step", "30", "--rejoin-at-step", "40", "--checkpoint-every", "20",
                               "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["gloo", "gloo kill+restart", "ud", "ud kill", "ud kill+copy", "ud kill+rejoin",
                               "ud kill+rejoin+copy", "ud leave"]
    for name, result in results.items():
        steps, perplexities = zip(*result["curve"])
        assert steps[-1] == 60 and list(steps) == sorted(set(steps)), f"{name}: evaluated at {steps}"
        assert all(math.isfinite(p) for p in perplexities) and perplexities[-1] < 0.5 * 256, f"{name}: {perplexities}"
    [restart] = results["gloo kill+restart"]["events"]
    assert (restart["step"], restart["steps_redone"]) == (30, 10) and restart["resumed_after_s"] > 0, restart
    assert results["gloo kill+restart"]["curve"] == results["gloo"]["curve"], \
        "Gloo restarted from its checkpoint must train exactly as without the death"
    for name in ("ud kill", "ud kill+rejoin", "ud kill+copy", "ud kill+rejoin+copy"):
        kill = next(e for e in results[name]["events"] if e["event"] == "kill")
        copied = name.endswith("+copy")
        assert kill["step"] == 30 and (kill["restarted_elements"] > 0) != copied, f"{name}: {kill}"
        assert (kill["copied_elements"] > 0) == copied, f"{name}: {kill}"
        assert 0 < kill["error_after_s"] <= kill["resumed_after_s"], f"{name}: {kill}"
    [leave] = results["ud leave"]["events"]
    assert (leave["event"], leave["step"], leave["restarted_elements"]) == ("leave", 30, 0), \
        f"a rank that hands its shard over leaves nothing to restart: {leave}"
    for name in ("ud kill+rejoin", "ud kill+rejoin+copy"):
        [rejoin] = [e for e in results[name]["events"] if e["event"] == "rejoin"]
        assert rejoin["step"] == 40, f"{name}: {rejoin}"
    # before the death the arms are the same run (up to the order of float additions, which varies)
    for (step, killed), (_, whole) in zip(results["ud kill"]["curve"][:2], results["ud"]["curve"][:2]):
        assert abs(killed / whole - 1) < 1e-4, f"step {step}: {killed} against {whole}"
