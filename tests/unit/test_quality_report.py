"""The quality benchmark's figures: the end of a run, the ratios and the verdict against the targets."""

from __future__ import annotations

import pytest

from diloco.infra.bench.quality_report import ArmCurve, TaskReport, end_of_run, loss_at, recovered, rejoin, table


def one_run(task: str, steps: int, h: int, floor: float | None, arms: dict[str, ArmCurve],
           skipped: dict[str, str]) -> TaskReport:
    """A report of one run per arm."""
    return TaskReport(task, steps, h, floor, {name: [arm] for name, arm in arms.items()}, skipped)


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
    report = one_run("demo", 100, 10, 1.0, arms, {})
    assert report.ratio("decoupled", "torchft") == pytest.approx(1.505 / 1.49)
    assert report.verdict() == {"to_torchft": False, "to_baseline": True, "to_waiting": None, "end_of_run": True,
                                "straggler": None, "restarted_end": None, "restore_recovers": None}
    assert "NOT met" in report.verdict_line()
    rows = {row[1]: row for row in report.rows()}
    assert rows["decoupled"][9] == pytest.approx(0.505) and rows["decoupled"][10] == 3  # gap to floor, points
    partial = one_run("gpt2", 100, 10, None, {"decoupled": arms["decoupled"]}, {"torchft": "not installed"})
    assert partial.verdict() == {"to_torchft": None, "to_baseline": None, "to_waiting": None, "end_of_run": True,
                                 "straggler": None, "restarted_end": None, "restore_recovers": None}
    text = table([report, partial], 4)
    assert "torchft skipped: not installed" in text and "floor unknown" in text
    assert report.to_json()["arms"]["decoupled"]["gap_to_floor"] == pytest.approx(0.505)


def test_never_waiting_is_held_to_the_same_run_with_waiting_learners() -> None:
    arms = {"decoupled": ArmCurve("decoupled", curve(2.0, 1.506), 10.0),
            "waiting": ArmCurve("waiting", curve(2.0, 1.50), 12.0)}
    assert one_run("fast", 100, 50, 1.0, arms, {}).verdict()["to_waiting"] is True  # 1.004
    arms["decoupled"] = ArmCurve("decoupled", curve(2.0, 1.509), 10.0)
    report = one_run("fast", 100, 50, 1.0, arms, {})
    assert report.verdict()["to_waiting"] is False and "/ waiting 1.0060" in report.verdict_line()


def test_a_straggler_is_held_to_the_better_fleet_without_it() -> None:
    """The straggler arm's final against ours and torchft's fleets of the fast learners alone: the
    worse of its ratios to those that ran must be <= 1 (adding a slow learner never leaves the model
    worse)."""
    arms = {"straggler": ArmCurve("straggler", curve(2.0, 1.20), 10.0),
            "without": ArmCurve("without", curve(2.0, 1.21), 10.0),
            "torchft_without": ArmCurve("torchft_without", curve(2.0, 1.22), 10.0)}
    report = one_run("fast", 100, 50, 1.0, arms, {})
    assert report.straggler_ratio() == pytest.approx(1.20 / 1.21) and report.verdict()["straggler"] is True
    assert "straggler / without it 0.9917 (<= 1.0: met)" in table([report], 4)
    arms["torchft_without"] = ArmCurve("torchft_without", curve(2.0, 1.19), 10.0)
    report = one_run("fast", 100, 50, 1.0, arms, {})
    assert report.straggler_ratio() == pytest.approx(1.20 / 1.19) and report.verdict()["straggler"] is False
    del arms["without"]  # held to the fleet without it that ran
    assert one_run("fast", 100, 50, 1.0, arms, {}).verdict()["straggler"] is False
    del arms["torchft_without"]
    assert one_run("fast", 100, 50, 1.0, arms, {}).verdict()["straggler"] is None


def test_a_rejoin_is_measured_against_the_paced_arm_at_the_others_end_and_over_its_curve() -> None:
    """At the others' end both rejoined learners computed as long; the bump is the worst excess over
    the paced arm's curve (its loss at the same time) from the restart to the others' end."""
    paced = [(0.0, 4.0), (10.0, 2.0), (20.0, 1.5), (30.0, 1.3), (40.0, 1.2), (41.0, 1.19)]
    assert (loss_at(paced, 25.0), loss_at(paced, 30.0), loss_at(paced, -1.0)) == (1.5, 1.3, 4.0)
    # The same fleet, slower by 1/40 (shared cores): compared at the same share of the way to the others' end.
    warm = [(0.0, 4.0), (10.25, 2.1), (22.0, 1.55), (31.0, 1.31), (42.0, 1.205), (44.0, 1.195)]
    r = rejoin(warm, paced, preempt_s=12.0, restart_s=15.0, others_end_s=42.0, paced_others_end_s=41.0)
    assert r.at_others_end == 1.205 and r.cost == pytest.approx(0.015) and r.final_cost == pytest.approx(0.005)
    # 22 s is 0.524 of the way (paced: 21.5 s, 1.5), 31 s 0.738 (30.2 s: 1.3), 42 s the end (41 s: 1.19).
    assert r.bump == pytest.approx(0.05) and r.mean_excess == pytest.approx((0.05 + 0.01 + 0.015) / 3)
    assert r.bump_before == pytest.approx(0.1)  # 10.25 s is 10 s of the paced arm's: 2.1 against 2.0
    assert recovered(0.015, 0.06) == pytest.approx(0.75) and recovered(0.01, 0.0) is None
    assert recovered(0.02, 0.01) == pytest.approx(-1.0)  # the restore cost more than a cold start


def arm(name: str, points: list[tuple[float, float]], **details: float) -> ArmCurve:
    details |= {"preempt_s": details["restart_s"] - 1} if "restart_s" in details else {}
    return ArmCurve(name, points, points[-1][0], details={"others_end_s": points[-1][0], **details})


def test_the_state_restore_must_recover_half_of_what_a_cold_rejoin_loses() -> None:
    arms = {"paced": arm("paced", [(0.0, 4.0), (10.0, 1.5), (20.0, 1.20)]),
            "preempted": arm("preempted", [(0.0, 4.0), (10.0, 1.5), (20.0, 1.21)], restart_s=5.0),
            "preempted_cold": arm("preempted_cold", [(0.0, 4.0), (10.0, 1.6), (20.0, 1.24), (30.0, 1.19)],
                                  restart_s=5.0)}
    arms["preempted_cold"].details["others_end_s"] = 20.0  # it trains on alone after the others
    report = one_run("demo@H50", 1000, 50, 1.0, arms, {})
    cold = report.rejoins()["preempted_cold"]
    assert cold.cost == pytest.approx(0.04) and cold.final_cost == pytest.approx(-0.01) and cold.bump == pytest.approx(0.1)
    assert report.recovered() == pytest.approx(0.75) and report.verdict()["restore_recovers"] is True
    text = table([report], 4)
    assert "cold - warm +0.0300); the state restore recovers 0.75 of the cold cost (>= 0.5: met)" in text
    assert report.to_json()["recovered"] == pytest.approx(0.75)
    arms["preempted"] = arm("preempted", [(0.0, 4.0), (10.0, 1.5), (20.0, 1.23)], restart_s=5.0)
    assert one_run("demo@H50", 1000, 50, 1.0, arms, {}).verdict()["restore_recovers"] is False
    del arms["paced"]
    assert one_run("demo@H50", 1000, 50, 1.0, arms, {}).verdict()["restore_recovers"] is None


def test_repeats_are_held_to_their_means_and_say_their_spread() -> None:
    """With several runs per arm the ratios are of the means of the finals, the spread is (max - min) /
    mean, the damage is the worst run's, and a rejoin is measured run by run against the paced arm's
    run of the same repeat, then averaged."""
    arms = {"decoupled": [ArmCurve("decoupled", curve(2.0, 1.50), 10.0),
                          ArmCurve("decoupled", curve(*[1.6] * 9, 1.40, 1.52), 12.0)],
            "torchft": [ArmCurve("torchft", curve(2.0, 1.49), 10.0), ArmCurve("torchft", curve(2.0, 1.51), 10.0)]}
    r = TaskReport("fast", 100, 50, 1.0, arms, {})
    assert r.final("decoupled") == pytest.approx(1.51) and r.ratio("decoupled", "torchft") == pytest.approx(1.51 / 1.50)
    assert r.spread("decoupled") == pytest.approx(0.02 / 1.51) and r.spread("torchft") == pytest.approx(0.02 / 1.50)
    assert r.damage("decoupled") == pytest.approx(0.12 / 1.40)  # the second run's end undid it
    assert r.verdict()["to_torchft"] is True and r.verdict()["end_of_run"] is False
    assert "fast (means of 2 runs): decoupled / torchft 1.0067" in r.verdict_line()
    row = {row[1]: row for row in r.rows()}["decoupled"]
    assert row[2:5] == [2, pytest.approx(1.51), pytest.approx(100 * 0.02 / 1.51)] and row[11] == 11.0
    out = r.to_json()["arms"]["decoupled"]
    assert out["finals"] == [1.50, 1.52] and len(out["runs"]) == 2 and out["runs"][1]["final"] == 1.52

    paced = [arm("paced", [(0.0, 4.0), (10.0, 1.5), (20.0, 1.20)]),
             arm("paced", [(0.0, 4.0), (10.0, 1.5), (20.0, 1.30)])]
    warm = [arm("preempted", [(0.0, 4.0), (10.0, 1.5), (20.0, 1.21)], restart_s=5.0),
            arm("preempted", [(0.0, 4.0), (10.0, 1.5), (20.0, 1.33)], restart_s=5.0)]
    r = TaskReport("demo", 100, 50, 1.0, {"paced": paced, "preempted": warm}, {})
    assert r.rejoins()["preempted"].cost == pytest.approx((0.01 + 0.03) / 2)  # each against its own repeat's
