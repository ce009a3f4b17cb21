"""The command lines and process supervision of infra/local/fleet.py, without servers."""

import signal
import time
from pathlib import Path

import pytest

from diloco.infra.cli import build_parser
from diloco.infra.local.fleet import Exit, Supervisor, Outage, ProcessError, learner_argv, process_env, wait_until
from diloco.workers.tasks.train import DemoLearnerArgs


def _parsed(argv: list[str]):  # noqa: ANN202 (argparse.Namespace)
    assert argv[1:3] == ["-m", "diloco.infra.cli"]
    return build_parser(argv[3:]).parse_args(argv[3:])


def test_the_learner_argv_is_what_diloco_learner_parses():
    args = _parsed(learner_argv("r1", "learner-2", Path("/t/task.json"), steps=40, data_seed=2001, slowdown=2.5,
                                until=1700000000.123, step_time_s=0.05, extra=("--wait-for-merge",)))
    assert (args.command, args.run, args.learner_id, args.task, args.steps, args.data_seed) == (
        "learner", "r1", "learner-2", Path("/t/task.json"), 40, 2001)
    assert (args.slowdown, args.until, args.step_time_s, args.wait_for_merge) == (2.5, 1700000000.12, 0.05, True)


def test_a_learner_argv_without_a_deadline_or_pace_keeps_the_learners_defaults():
    args = _parsed(learner_argv("r1", "l0", Path("task.json"), steps=5, data_seed=0))
    defaults = DemoLearnerArgs(run="r1", learner_id="l0", steps=5)
    assert (args.slowdown, args.until, args.step_time_s) == (1.0, defaults.until, defaults.step_time_s)


# ---- the supervisor, on small shell processes ------------------------------------------------------

def _sh(script: str) -> list[str]:
    return ["sh", "-c", script]


RUNS = _sh("while :; do sleep 0.05; done")
EXITS_0_ON_TERM = _sh("trap 'exit 0' TERM; while :; do sleep 0.05; done")
IGNORES_TERM = _sh("trap '' TERM; while :; do sleep 0.05; done")


def _exits(fleet: Supervisor, timeout_s: float = 5.0) -> list[Exit]:
    """The exits `watch` reports until one comes (or the timeout)."""
    seen: list[Exit] = []
    wait_until(lambda: bool(seen.extend(fleet.watch()) or seen), timeout_s, tick_s=0.02)
    return seen


def test_exits_are_judged_by_what_the_process_was_sent(tmp_path):
    with Supervisor(process_env({}), tmp_path) as fleet:
        fleet.add("finishes", _sh("echo done; exit 0"))
        (done,) = _exits(fleet)
        assert (done.name, done.returncode, done.problem) == ("finishes", 0, None) and "done" in done.tail
        fleet.add("fails", _sh("exit 3"))
        (failed,) = _exits(fleet)
        assert failed.problem.startswith("fails failed (3)")
        fleet.add("coordinator", _sh("exit 1"), service=True)  # a service must not fail ...
        (gone,) = _exits(fleet)
        assert gone.problem.startswith("coordinator exited 1 on its own")
        fleet.add("done", _sh("exit 0"), service=True)  # ... and exits 0 once its work is done (its run finished)
        (done,) = _exits(fleet)
        assert done.problem is None
        fleet.add("killed", RUNS)
        fleet.kill("killed")
        (killed,) = _exits(fleet)
        assert (killed.returncode, killed.sent, killed.problem) == (-signal.SIGKILL, signal.SIGKILL, None)
        fleet.add("preempted", EXITS_0_ON_TERM, service=True)
        time.sleep(0.2)  # its trap is set
        fleet.term("preempted")
        (preempted,) = _exits(fleet)
        assert (preempted.returncode, preempted.sent, preempted.problem) == (0, signal.SIGTERM, None)


def test_check_raises_on_a_failure_with_the_tail_of_the_log(tmp_path):
    with Supervisor(process_env({}), tmp_path) as fleet:
        fleet.add("learner", _sh("echo 'Traceback: boom'; exit 1"))
        assert wait_until(lambda: not fleet.alive("learner"), 5.0, tick_s=0.02)
        with pytest.raises(ProcessError, match="learner failed \\(1\\):\nTraceback: boom"):
            fleet.check()


def test_a_member_killed_for_an_outage_comes_back_as_its_next_incarnation(tmp_path):
    with Supervisor(process_env({}), tmp_path) as fleet:
        fleet.add("l0", lambda i: _sh(f"echo incarnation {i}; while :; do sleep 0.05; done"))
        fleet.kill("l0", back_in_s=0.3)
        assert fleet.busy(["l0"]) and not fleet.alive("l0")  # down, but due back
        assert _exits(fleet)[0].problem is None
        assert wait_until(lambda: fleet.alive("l0"), 5.0, tick_s=0.02, between=fleet.watch)
        assert fleet.restarts == 1 and fleet.members["l0"].starts == 2
        assert wait_until(lambda: "incarnation 1" in fleet.proc("l0").tail(), 5.0, tick_s=0.02)
        fleet.kill("l0", back_in_s=0.0, argv=_sh("echo replaced; exit 0"))  # this once, another command line
        assert wait_until(lambda: not fleet.busy(["l0"]), 5.0, tick_s=0.02, between=fleet.watch)
        assert (tmp_path / "l0.log").read_text().splitlines()[-1] == "replaced"  # one log over incarnations


def test_restart_after_any_exit_with_a_log_per_incarnation(tmp_path):
    with Supervisor(process_env({}), tmp_path) as fleet:
        fleet.add("l1", lambda i: _sh(f"echo run {i}; exit 0"), log=lambda i: f"l1.{i}.log", service=True,
                  restart_after_s=0.0)
        assert wait_until(lambda: fleet.members["l1"].starts >= 3, 5.0, tick_s=0.02, between=fleet.watch)
        fleet.stop()
    assert [(tmp_path / f"l1.{i}.log").read_text() for i in range(2)] == ["run 0\n", "run 1\n"]


def test_a_member_that_ignores_sigterm_is_killed_after_the_deadline_and_that_is_a_failure(tmp_path):
    with Supervisor(process_env({}), tmp_path, term_timeout_s=0.2) as fleet:
        fleet.add("stuck", IGNORES_TERM)
        time.sleep(0.2)  # its trap is set
        fleet.term("stuck")
        (stuck,) = _exits(fleet)
        assert stuck.returncode == -signal.SIGKILL and stuck.problem.startswith("stuck still running 0s after SIGTERM")


def test_stop_terminates_in_order_and_leaving_the_with_block_kills_what_is_left(tmp_path):
    with Supervisor(process_env({}), tmp_path) as fleet:
        fleet.add("a", EXITS_0_ON_TERM)
        fleet.add("b", RUNS)
        time.sleep(0.2)
        assert fleet.stop(["a"], timeout_s=5) == {"a": 0}
        b = fleet.proc("b")
    assert b is not None and b.returncode() == -signal.SIGKILL


def test_planned_outages_are_carried_out_in_time_and_none_restarts_after_the_cutoff(tmp_path):
    with Supervisor(process_env({}), tmp_path, restarts_until_s=0.9) as fleet:
        fleet.add("l0", lambda i: _sh(f"echo incarnation {i}; while :; do sleep 0.05; done"))
        # In time order: down at 0.2 s for 0.2 s, at 0.6 s for 0.1 s, then at 0.7 s (once back) for
        # 0.5 s: back at 1.2 s would be past the 0.9 s cutoff, so it stays down.
        fleet.schedule("l0", [(0.6, 0.1), (0.2, 0.2), (0.7, 0.5)])
        seen: list[Exit] = []
        assert wait_until(lambda: not fleet.busy(["l0"]), 5.0, tick_s=0.02, between=lambda: seen.extend(fleet.watch()))
        assert [(e.sent, e.problem) for e in seen] == [(signal.SIGKILL, None)] * 3
        assert fleet.members["l0"].starts == 3 and fleet.restarts == 2
        assert time.monotonic() - fleet.started >= 1.2  # the last outage at 0.7 s, after the one back at 0.7 s
    assert (tmp_path / "l0.log").read_text().split() == ["incarnation", "0", "incarnation", "1", "incarnation", "2"]


def test_an_outage_due_while_the_member_has_finished_is_dropped(tmp_path):
    with Supervisor(process_env({}), tmp_path) as fleet:
        fleet.add("l0", _sh("exit 0"))
        fleet.schedule("l0", [(0.3, 0.1)])
        assert wait_until(lambda: not fleet.busy(["l0"]) and not fleet.members["l0"].outages, 5.0, tick_s=0.02,
                          between=fleet.watch)
        assert fleet.restarts == 0


def test_a_sigterm_outage_is_a_preemption_the_member_leaves_with_143_and_comes_back_after_its_exit(tmp_path):
    """A learner preempted on SIGTERM sends its progress and saves its state before it exits 143: the
    exit is no failure, and the next incarnation starts `down_s` after the signal, never before the exit."""
    leaves_slowly = _sh("echo incarnation; trap 'sleep 0.3; exit 143' TERM; while :; do sleep 0.05; done")
    with Supervisor(process_env({}), tmp_path) as fleet:
        fleet.add("l0", leaves_slowly)
        fleet.schedule("l0", [Outage(0.2, 0.1, signal.SIGTERM)])
        seen: list[Exit] = []
        assert wait_until(lambda: fleet.members["l0"].starts == 2, 5.0, tick_s=0.02,
                          between=lambda: seen.extend(fleet.watch()))
        assert [(e.sent, e.returncode, e.problem) for e in seen] == [(signal.SIGTERM, 143, None)]
        assert time.monotonic() - fleet.started >= 0.5  # the signal at 0.2 s, the exit 0.3 s later
