"""Which settings `diloco bench quality` runs a task at: its own H, and the run's defaults over enough rounds."""

from __future__ import annotations

import argparse

import pytest

from diloco.infra.bench import quality
from diloco.infra.bench.quality_tasks import TASKS, BenchTask


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    quality.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_task_runs_at_its_own_h_and_at_the_run_default_over_twenty_rounds() -> None:
    fast, vision = TASKS["fast"], TASKS["vision"]
    own, defaults = quality.budgets(args(), "fast", fast)
    assert (own.label, own.steps, own.sync_every) == ("fast", fast.steps, fast.sync_every)
    assert (defaults.label, defaults.sync_every) == ("fast@H50", 50)
    assert defaults.steps == 1000  # 600 steps are 12 rounds of 50: raised to 20
    at_defaults = quality.budgets(args("--at", "defaults"), "vision", vision)
    assert [(b.label, b.steps) for b in at_defaults] == [("vision@H50", 1500)]  # 30 rounds already
    odd = BenchTask(fast.task, steps=1030, sync_every=50)  # a task whose own H is the default runs once
    assert [(b.label, b.steps) for b in quality.budgets(args(), "late", odd)] == [("late", 1030)]


def test_one_h_given_runs_one_setting_and_unknown_settings_are_refused() -> None:
    assert [(b.label, b.sync_every) for b in quality.budgets(args("--sync-every", "25"), "fast", TASKS["fast"])] == [
        ("fast", 25)]
    with pytest.raises(SystemExit, match="unknown setting"):
        quality.budgets(args("--at", "own,fastest"), "fast", TASKS["fast"])
