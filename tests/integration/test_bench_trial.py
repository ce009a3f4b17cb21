"""A benchmark trial: real learners and coordinator under a kill schedule, measured from S3 and Redis."""

from __future__ import annotations

import math

import pytest

from diloco.infra.bench.failures import ideal_tokens
from diloco.infra.bench.trial import LearnerPlan, Trial, run_args, run_trial
from harness import TASK

pytestmark = pytest.mark.slow  # a benchmark's harness: `make test-all`


def test_a_trial_kills_and_restarts_on_schedule_and_measures_what_reached_the_model(stack, tmp_path):
    plans = (LearnerPlan("a", data_seed=0, outages=((8.0, 3.0),)), LearnerPlan("b", slowdown=2.0, data_seed=1))
    trial = Trial("t", plans, budget_s=25.0, run_args=run_args(2, 10, 3, "int8"), step_time_s=0.05)
    result = run_trial(stack, trial, TASK, tmp_path, curve_points=4)

    assert result.restarts == 1
    assert result.counters.get("versions_committed", 0) >= 4 and result.heads
    assert len(result.curve) == 4 and all(math.isfinite(loss) for _, loss in result.curve)
    assert result.eval_loss < 3.4  # the global model learnt something (a fresh one is at ~ln(32))
    assert 25.0 <= result.wall_s < 25.0 + 20.0  # learners leave at the budget, counting start-up
    ideal = ideal_tokens(plans, 25.0, 0.05, TASK.tokens_per_step())
    assert 0 < result.merged_tokens < ideal  # a kill, start-up and joining all cost something
    b = result.learners["b"]
    assert b["step"] < 25.0 / (0.05 * 2.0)  # paced: the slow learner cannot exceed its speed
    assert 0 <= b["sync_s"] < b["wall_s"]
