"""A short soak (scripts/soak.py): 4 ranks, 1000 allreduces at 5% injected loss, then 20
communicators opened and closed. Descriptors must not change and must drop at close(); resident
memory must grow less than 10 MiB after the warm-up. The bound is the issue's for 10 000 calls:
the engine reuses its buffers, so a leak of even a few hundred bytes a call would show here as
well, while a tighter bound would catch the allocator's and torch's lazy page touches, not leaks."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_short_soak_leaks_nothing():
    finished = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--calls", "1000", "--cycles", "20",
                               "--json"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert finished.returncode in (0, 1), finished.stderr[-3000:]
    report = json.loads(finished.stdout)
    assert len(report["ranks"]) == 4
    for result in report["ranks"]:
        rank = result["rank"]
        assert report["problems"][str(rank)] == [], (rank, report["problems"][str(rank)], result)
        assert result["ok"] + result["budget_misses"] == 1000 and result["ok"] > 900, result
        assert result["fds_end"] == result["fds_start"] and result["fds_after_cycles"] == result["fds_before_cycles"]
        assert result["fds_after_close"] < result["fds_end"], result
        assert result["rss_growth_mib"] < 10 and result["rss_cycles_growth_mib"] < 10, result
    assert finished.returncode == 0
