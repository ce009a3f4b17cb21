"""Which settings `diloco bench quality` runs a task at: its own H, and the run's defaults over enough rounds."""

from __future__ import annotations

import argparse
import signal
from types import SimpleNamespace

import pytest

from diloco.infra.bench import quality, trial
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
    assert [(b.label, b.steps) for b in quality.budgets(args("--at", "defaults"), "late", odd)] == [("late", 1030)]


def test_one_h_given_runs_one_setting_and_unknown_settings_are_refused() -> None:
    assert [(b.label, b.sync_every) for b in quality.budgets(args("--sync-every", "25"), "fast", TASKS["fast"])] == [
        ("fast", 25)]
    with pytest.raises(SystemExit, match="unknown setting"):
        quality.budgets(args("--at", "own,fastest"), "fast", TASKS["fast"])


def test_the_straggler_arm_adds_one_slow_learner_to_the_fleet_without_it_all_paced_alike() -> None:
    """The straggler arm is the decoupled arm with its last learner 5x slower per step, training a
    fifth of the steps (its schedule spans what it does in the others' time); `without` is the
    others alone; both at the same pace, so both end together, whatever shares the cores."""
    a = args("--learners", "4")
    b = quality.Budget("fast@H50", 1000, 50)
    decoupled = quality.our_arms(a, b)["decoupled"]
    arms = quality.paced_arms(a, b, decoupled, pace_s=0.2)
    slow = arms["straggler"].learners[-1]
    assert (slow.name, slow.slowdown, slow.steps, slow.data_seed) == ("learner-3", 5.0, 200, 3)
    assert arms["straggler"].learners[:3] == arms["without"].learners == decoupled.learners[:3]
    assert {t.step_time_s for t in arms.values()} == {0.2}
    # The restarted arm: learner 1 killed 40% into the others' 200 s, back 10 s later.
    assert [p.outages for p in arms["restarted"].learners] == [(), ((80.0, 10.0),), (), ()]
    # The preempted arms: learner 1 preempted (SIGTERM) at the same time, without and with its state
    # saved; their reference is the same fleet paced, without the outage.
    assert arms["paced"].learners == decoupled.learners and arms["paced"].step_time_s == 0.2
    for name, own_args in (("preempted", ()), ("preempted_cold", ("--no-save-state",))):
        plans = arms[name].learners
        assert [p.outages for p in plans] == [(), ((80.0, 10.0, signal.SIGTERM),), (), ()]
        assert [p.args for p in plans] == [(), own_args, (), ()]
    assert arms["straggler"].run_args == decoupled.run_args and arms["without"].coordinator_args == decoupled.coordinator_args
    # The pace fits 3.2 learners' steps on the cores given, with headroom; never below one step.
    assert quality.fleet_pace(0.1, 4, cores=1) == round(0.1 * 3.2 * quality.HEADROOM, 3)
    assert quality.fleet_pace(0.1, 4, cores=2) == round(0.1 * 1.6 * quality.HEADROOM, 3)
    assert quality.fleet_pace(0.1, 4, cores=64) == round(0.1 * quality.HEADROOM, 3)
    assert quality.pace(TASKS["fast"].task, 4, cores=64, steps=2) > 0


def test_a_learners_work_reached_the_model_when_the_last_version_holding_a_piece_of_it_committed() -> None:
    def manifest(at: float, *learners: str) -> SimpleNamespace:
        return SimpleNamespace(committed_at=at, inputs=[SimpleNamespace(learner=name) for name in learners])

    manifests = {0: [manifest(100.0), manifest(105.0, "a", "b"), manifest(112.0, "a")],
                 1: [manifest(100.0), manifest(108.0, "b"), manifest(111.0, "a")]}
    assert trial.last_merged_s(manifests, 100.0) == {"a": 12.0, "b": 8.0}


def test_repeats_take_the_arms_in_turn_each_starting_one_further_along() -> None:
    assert trial.turns(["decoupled", "waiting", "torchft"], 4) == [
        ["decoupled", "waiting", "torchft"], ["waiting", "torchft", "decoupled"],
        ["torchft", "decoupled", "waiting"], ["decoupled", "waiting", "torchft"]]
    assert trial.turns(["straggler"], 2) == [["straggler"], ["straggler"]] and trial.turns([], 2) == [[], []]
    # The waiting arm trains the same bits every run: it runs in the first repeat only.
    assert quality.repeat_turns(["decoupled", "waiting", "torchft"], 3) == [
        ["decoupled", "waiting", "torchft"], ["torchft", "decoupled"], ["torchft", "decoupled"]]
    with pytest.raises(SystemExit):
        args("--repeats", "0")
