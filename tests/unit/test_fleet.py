"""The command lines and process supervision of infra/local/fleet.py, without servers."""

from pathlib import Path

from diloco.infra.cli import build_parser
from diloco.infra.local.fleet import learner_argv
from diloco.workers.demo.run import DemoLearnerArgs


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
