"""A run's life as processes see it: a learner waiting to join leaves on SIGTERM at once, says what
it waits for meanwhile; the coordinator exits 143 on SIGTERM while its run goes on and 0 once the
run is finished; a learner started after the end exits 0 saying so. Real `diloco` processes, real Redis and S3."""

from __future__ import annotations

import pytest

import signal
import time

from diloco.storage.bus import Bus
from diloco.workers.learner import PREEMPTED_EXIT
from harness import spawn_coordinator, spawn_learner, wait_all, wait_for


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_learner_waiting_to_join_says_so_and_leaves_on_sigterm_at_once(endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    learner = spawn_learner(run_id, env, tmp_path, "early", steps=10)  # no coordinator: the run never appears
    procs.append(learner)
    wait_for("a line saying what the learner waits for", lambda: "waiting for run" in learner.tail(5), [learner],
             timeout_s=30)
    sent = time.monotonic()
    learner.send(signal.SIGTERM)
    assert learner.wait(10) == PREEMPTED_EXIT, learner.tail(20)
    assert time.monotonic() - sent < 3.0
    assert "on SIGTERM while joining" in learner.tail(5)


@pytest.mark.slow  # make test stays under 8 minutes (17 s): make test-slow runs it
def test_the_coordinator_exits_0_once_the_run_is_finished_and_a_learner_started_later_exits_0(
        endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    stopped = spawn_coordinator(run_id, env, tmp_path)  # stopped (a node drained) while the run goes on
    procs.append(stopped)
    wait_for("the coordinator to hold the lease", lambda: Bus(endpoints, run_id).leadership()[1] is not None, [stopped],
             timeout_s=60)
    stopped.send(signal.SIGTERM)
    assert stopped.wait(30) == 143, stopped.tail(20)  # not 0: a Job counts it as stopped, not done
    coordinator = spawn_coordinator(run_id, env, tmp_path)
    procs.append(coordinator)
    learner = spawn_learner(run_id, env, tmp_path, "only", steps=30)
    procs.append(learner)
    wait_all([learner], timeout_s=120)
    assert coordinator.wait(30) == 0, coordinator.tail(20)
    assert "the coordinator's work is done" in coordinator.tail(5)
    assert Bus(endpoints, run_id).run_end() is not None
    late = spawn_learner(run_id, env, tmp_path, "late", steps=30)  # a slot restarted after the end
    procs.append(late)
    assert late.wait(60) == 0, late.tail(20)
    assert "is finished" in late.tail(5)
