"""scripts/rig_ab.py's arithmetic: builds take turns so neither always runs first, and the summary
pairs each round's before with the same round's after. The guest runs themselves are not repeated
here (they need the rig and minutes of TCG)."""
import pytest

from support import load_script


def load():
    return load_script("rig_ab")


def test_builds_take_turns_going_first():
    rig_ab = load()
    orders = [rig_ab.turn_order(["before", "after"], r) for r in range(4)]
    assert orders == [["before", "after"], ["after", "before"], ["before", "after"], ["after", "before"]]


def test_summary_pairs_rounds_and_counts_slower_pairs():
    rig_ab = load()
    medians = {"before": {"verbs8": [0.100, 0.200, 0.150]}, "after": {"verbs8": [0.110, 0.190, 0.160]}}
    header, rule, line = rig_ab.summary(medians, ["verbs8"])
    assert header.startswith("| row | before:") and rule.startswith("|---")
    # medians 150 and 160 ms; paired +10, -10, +10 ms: median +10, two of three slower after
    assert line == "| verbs8 | 150.0 (100.0-200.0) | 160.0 (110.0-190.0) | +10.0 | 2 of 3 |"


def test_unknown_rows_are_refused(monkeypatch, capsys):
    rig_ab = load()
    monkeypatch.setattr("sys.argv", ["rig_ab.py", "HEAD", "HEAD", "--rows", "verbs8,tcp"])
    with pytest.raises(SystemExit) as exit_:
        rig_ab.main()
    assert exit_.value.code == 2 and "unknown rows ['tcp']" in capsys.readouterr().err
