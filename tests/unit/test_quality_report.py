"""The quality benchmark's figures: the end of a run, the ratios and the verdict against the targets."""

from __future__ import annotations

import pytest

from diloco.infra.bench.quality_report import ArmCurve, TaskReport, end_of_run, table


def test_end_of_run_is_the_best_of_the_last_tenth_of_the_points() -> None:
    losses = [3.0, 2.0, 1.5, 1.4, 1.3, 1.25, 1.2, 1.1, 1.0, 1.05, 1.04, 1.08]  # 12 points: the last 2 count
    end = end_of_run(losses)
    assert (end.final, end.best_last, end.points) == (1.08, 1.04, 2)
    assert end.damage == pytest.approx(0.04) and end.damage_share == pytest.approx(0.04 / 1.04)
    assert end_of_run([2.0]).damage == 0.0
    assert end_of_run(list(range(30, 0, -1))).damage == 0.0  # still improving at the end: no damage
    with pytest.raises(ValueError):
        end_of_run([])


def curve(*losses: float) -> list[tuple[float, float]]:
    return [(float(i), loss) for i, loss in enumerate((4.0, *losses))]  # the genesis first, not counted


def test_verdict_holds_the_decoupled_arm_to_torchft_the_baseline_and_its_own_end() -> None:
    arms = {"decoupled": ArmCurve("decoupled", curve(2.0, 1.50, 1.505), 10.0),
            "torchft": ArmCurve("torchft", curve(2.0, 1.49), 10.0),
            "baseline": ArmCurve("baseline", curve(1.48), 5.0, x_unit="steps")}
    report = TaskReport("demo", 100, 10, 1.0, arms, {})
    assert report.ratio("decoupled", "torchft") == pytest.approx(1.505 / 1.49)
    assert report.verdict() == {"to_torchft": False, "to_baseline": True, "to_waiting": None, "end_of_run": True,
                                "straggler": None, "restarted_end": None}
    assert "NOT met" in report.verdict_line()
    rows = {row[1]: row for row in report.rows()}
    assert rows["decoupled"][7] == pytest.approx(0.505) and rows["decoupled"][8] == 3  # gap to floor, points
    partial = TaskReport("gpt2", 100, 10, None, {"decoupled": arms["decoupled"]}, {"torchft": "not installed"})
    assert partial.verdict() == {"to_torchft": None, "to_baseline": None, "to_waiting": None, "end_of_run": True,
                                 "straggler": None, "restarted_end": None}
    text = table([report, partial], 4)
    assert "torchft skipped: not installed" in text and "floor unknown" in text
    assert report.to_json()["arms"]["decoupled"]["gap_to_floor"] == pytest.approx(0.505)


def test_never_waiting_is_held_to_the_same_run_with_waiting_learners() -> None:
    arms = {"decoupled": ArmCurve("decoupled", curve(2.0, 1.506), 10.0),
            "waiting": ArmCurve("waiting", curve(2.0, 1.50), 12.0)}
    assert TaskReport("fast", 100, 50, 1.0, arms, {}).verdict()["to_waiting"] is True  # 1.004
    arms["decoupled"] = ArmCurve("decoupled", curve(2.0, 1.509), 10.0)
    report = TaskReport("fast", 100, 50, 1.0, arms, {})
    assert report.verdict()["to_waiting"] is False and "/ waiting 1.0060" in report.verdict_line()


def test_a_straggler_is_held_to_the_better_fleet_without_it() -> None:
    """The straggler arm's final against ours and torchft's fleets of the fast learners alone: the
    worse of its two ratios must be <= 1 (adding a slow learner never leaves the model worse)."""
    arms = {"straggler": ArmCurve("straggler", curve(2.0, 1.20), 10.0),
            "without": ArmCurve("without", curve(2.0, 1.21), 10.0),
            "torchft_without": ArmCurve("torchft_without", curve(2.0, 1.22), 10.0)}
    report = TaskReport("fast", 100, 50, 1.0, arms, {})
    assert report.straggler_ratio() == pytest.approx(1.20 / 1.21) and report.verdict()["straggler"] is True
    assert "straggler / without it 0.9917 (<= 1.0: met)" in table([report], 4)
    arms["torchft_without"] = ArmCurve("torchft_without", curve(2.0, 1.19), 10.0)
    report = TaskReport("fast", 100, 50, 1.0, arms, {})
    assert report.straggler_ratio() == pytest.approx(1.20 / 1.19) and report.verdict()["straggler"] is False
    del arms["without"]
    assert TaskReport("fast", 100, 50, 1.0, arms, {}).verdict()["straggler"] is None
