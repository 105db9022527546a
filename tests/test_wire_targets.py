"""scripts/wire_targets.py judges its rows as docs/performance/wire_targets.md says: ratios of the
same runs, the tail target's two halves, and the loss-growth check (1% loss over one in a million
on one path).
Pure arithmetic on made-up rows and runs: the benchmark runs themselves are not repeated here."""
import numpy as np
import pytest

from support import load_script


def load():
    return load_script("wire_targets")


def row(backend, p50, p99, delivered=100.0):
    return {"backend": backend, "p50_ms": p50, "p99_ms": p99, "delivered_percent": delivered}


def test_p50_target_compares_rows_of_the_same_run():
    targets = load()
    lines = targets.verdicts("veth1500", "p50", 1.0, [row("ud-auto", 99.0, 120.0), row("gloo", 100.0, 150.0)])
    assert lines == ["| veth1500 | ud-auto | 99.0 / 120.0 | 100.0 / 150.0 | 0.99x, 0.80x | 100.000 | p50 <= 1.0x: met |"]
    slower = targets.verdicts("veth1500", "p50", 1.0, [row("ud-auto", 101.0, 120.0), row("gloo", 100.0, 150.0)])
    assert slower[0].endswith("p50 <= 1.0x: not met |")


def test_tail_target_needs_both_halves():
    targets = load()
    both = targets.verdicts("loss", "tail", None, [row("ud-auto", 100.0, 140.0, 99.2), row("gloo", 150.0, 450.0)])
    assert "ud p99/p50 1.40 (<= 1.5), Gloo p99/ud p99 3.21 (>= 3.0): met" in both[0]
    gloo_lucky = targets.verdicts("loss", "tail", None, [row("ud-auto", 100.0, 140.0), row("gloo", 150.0, 400.0)])
    assert gloo_lucky[0].endswith(": not met |")
    own_tail = targets.verdicts("loss", "tail", None, [row("ud-auto", 100.0, 160.0), row("gloo", 150.0, 900.0)])
    assert own_tail[0].endswith(": not met |")


def test_loss_growth_is_each_backend_over_its_own_baseline():
    targets = load()
    lossy = [row("ud-auto", 210.0, 250.0), row("gloo", 290.0, 700.0)]
    baseline = [row("ud-auto", 210.0, 230.0), row("gloo", 230.0, 280.0)]
    line = targets.loss_growth("loss_veth1500", lossy, baseline)
    assert "ud-auto p50 1.00x, p99 1.09x (p99 <= 1.1: met)" in line
    assert "gloo p50 1.26x, p99 2.50x" in line and "gloo p50 1.26x, p99 2.50x (" not in line
    grown = targets.loss_growth("loss_veth1500", [row("ud-auto", 210.0, 254.0)], baseline)
    assert "(p99 <= 1.1: not met)" in grown


def test_the_loss_pair_is_one_path_at_two_losses():
    targets = load()
    lossy, baseline = targets.CASES["loss_veth1500"][0], targets.CASES["rules_veth1500"][0]
    assert lossy.replace("--kernel-loss 0.01", "--kernel-loss 0.000001") == baseline


def test_each_round_runs_every_case_so_the_loss_pair_interleaves():
    targets = load()
    pair = {name: targets.CASES[name] for name in ("loss_veth1500", "rules_veth1500")}
    order = [(round_index, name) for round_index, name, _, _ in targets.schedule(pair, [""], 3)]
    assert order == [(0, "loss_veth1500"), (0, "rules_veth1500"), (1, "loss_veth1500"), (1, "rules_veth1500"),
                     (2, "loss_veth1500"), (2, "rules_veth1500")]
    striped = [name for _, name, _, _ in targets.schedule({"loopback": targets.CASES["loopback"]}, ["1", "2"], 2)]
    assert striped == ["loopback/s1", "loopback/s2", "loopback/s1", "loopback/s2"]


def bench_result(times_by_rank, failures=0, peak=100):
    """A bench JSON result with one ud row: per rank, the seconds of each call."""
    return {"per_rank": [{"results": [{"backend": "ud-auto", "bytes": 1024, "count": 256, "times": times,
                                       "delivered": [1.0] * len(times), "max_relative_error": 1e-8,
                                       "rms_relative_error": 1e-9, "failures": failures, "peak_extra_kib": peak}]}
                         for times in times_by_rank]}


def test_rounds_are_pooled_call_by_call_as_one_run():
    targets = load()
    first = bench_result([[0.010, 0.030], [0.020, 0.010]], failures=1)
    second = bench_result([[0.050, 0.040], [0.060, 0.010]], peak=None)
    [pooled] = targets.pooled_rows([first, second])
    slowest_rank_per_call = np.array([0.020, 0.030, 0.060, 0.040])
    assert pooled["p50_ms"] == pytest.approx(np.percentile(slowest_rank_per_call, 50) * 1e3)
    assert pooled["p99_ms"] == pytest.approx(np.percentile(slowest_rank_per_call, 99) * 1e3)
    assert pooled["failures"] == 2  # one per rank in the first run
    assert np.isnan(pooled["peak_extra_mib"])  # a run that could not measure it leaves the pool unmeasured
    [alone] = targets.pooled_rows([first])
    assert alone["p50_ms"] == pytest.approx(25.0)


def test_loss_growth_shows_each_round_beside_the_pooled_verdict():
    targets = load()
    rounds = [([row("ud-auto", 210.0, 250.0)], [row("ud-auto", 210.0, 230.0)]),
              ([row("ud-auto", 200.0, 240.0)], [row("ud-auto", 190.0, 240.0)])]
    line = targets.loss_growth("loss_veth1500", [row("ud-auto", 206.0, 248.0)], [row("ud-auto", 200.0, 236.0)], rounds)
    assert "ud-auto p50 1.03x, p99 1.05x (p99 <= 1.1: met) [p99 by round: 1.09x, 1.00x]" in line


def test_each_round_p50_ratio_shows_beside_the_pooled_one():
    targets = load()
    pooled = [row("ud-auto", 99.0, 120.0), row("gloo", 100.0, 150.0)]
    rounds = [[row("ud-auto", 90.0, 100.0), row("gloo", 100.0, 150.0)], [row("ud-auto", 110.0, 120.0), row("gloo", 100.0, 150.0)]]
    [line] = targets.verdicts("veth1500", "p50", 1.0, pooled, rounds)
    assert "| 0.99x, 0.80x (p50 by round: 0.90x, 1.10x) |" in line and line.endswith("p50 <= 1.0x: met |")
    [alone] = targets.verdicts("veth1500", "p50", 1.0, pooled, rounds[:1])
    assert "by round" not in alone  # one round has no spread to show


def test_the_calls_of_a_case_add_up_over_its_rounds():
    targets = load()
    for iterations, rounds in ((100, 2), (101, 2), (7, 3), (5, 5), (100, 1)):
        calls = [targets.calls_in_round(iterations, rounds, i) for i in range(rounds)]
        assert sum(calls) == iterations and max(calls) - min(calls) <= 1 and min(calls) >= 1, (iterations, rounds, calls)


def test_a_run_that_writes_no_json_is_not_read_from_an_earlier_file(tmp_path, monkeypatch):
    """With --keep the directory outlives the script, and a bench that skips (no root) exits 0
    without writing its JSON: the earlier invocation's file must not pass for this run's.
    subprocess.run is replaced by a stand-in for such a bench (a mock: the real one needs root)."""
    targets = load()
    stale = tmp_path / "loopback-r1.json"
    stale.write_text('{"rows": [], "per_rank": [], "copy_64mib_ms": 9.0}')

    class Skipped:
        returncode, stdout = 0, "# ud_transport bench --hosts veth: skipped: not root"

    monkeypatch.setattr(targets.subprocess, "run", lambda *args, **kwargs: Skipped())
    assert targets.run_case("loopback-r1", "--sizes 64M", 10, str(tmp_path), "") == (None, None)
    assert not stale.exists()
