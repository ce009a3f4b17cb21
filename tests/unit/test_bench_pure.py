"""The pure parts of the benchmarks: the kill schedule, time to a target loss, tables."""

from __future__ import annotations

from diloco.infra.bench.failures import outage_schedule
from diloco.infra.output import figures_table
from diloco.infra.bench.trial import time_to


def test_time_to_interpolates_between_the_last_point_above_and_the_first_below():
    curve = [(10.0, 3.0), (20.0, 2.0), (30.0, 1.0)]
    assert time_to(curve, 1.5) == 25.0
    assert time_to(curve, 2.0) == 20.0
    assert time_to(curve, 3.5) == 10.0  # already below at the first evaluation
    assert time_to(curve, 0.5) is None
    assert time_to([], 1.0) is None


def test_outage_schedule_is_seeded_and_stays_inside_the_budget():
    a = outage_schedule(3, learners=4, budget_s=300, mtbf_s=40, down_s=10)
    assert a == outage_schedule(3, learners=4, budget_s=300, mtbf_s=40, down_s=10)
    assert a != outage_schedule(4, learners=4, budget_s=300, mtbf_s=40, down_s=10)
    assert len(a) == 4 and sum(len(k) for k in a) > 4
    for kills in a:
        times = [t for t, _ in kills]
        assert times == sorted(times)
        assert all(t + 10 < 300 for t in times)
        assert all(later - earlier >= 10 for earlier, later in zip(times, times[1:]))  # down, then up again


def test_figures_table_aligns_numbers_right_and_marks_missing_values():
    text = figures_table(["arm", "loss"], [["decoupled", 1.23456], ["sync", None]])
    lines = text.splitlines()
    assert lines[0].startswith("arm") and lines[2].endswith("1.235") and lines[3].endswith("-")
    assert len({len(line) for line in lines[:3]}) == 1
