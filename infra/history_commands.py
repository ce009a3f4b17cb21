"""`diloco inspect` and `diloco blame`: the subcommands that explain a run's history.

Each is `add_arguments(parser)` + `run(args) -> int`, listed in `infra.cli.COMMANDS`. Both read a
live bucket (S3 settings from the environment, never Redis) or an export (`--dir`), through
`infra.archive.open_source`. The table goes to stdout, `--json PATH` gets the same data, and
progress and problems go to stderr.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from diloco.infra.archive import add_range_arguments, add_source_arguments, open_source
from diloco.infra.blame import blame_run
from diloco.infra.inspect import inspect_run, inspect_version
from diloco.infra.output import write_json
from diloco.infra.rounds import Run, open_run
from diloco.infra.task_model import load_task
from diloco.storage.errors import ConfigError

log = logging.getLogger("diloco")


def _add_range(parser: argparse.ArgumentParser) -> None:
    add_range_arguments(parser, verb="look at", start_default=0, start_help="0",
                        json_help="also write the same data as JSON to this file")


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--version", type=int, metavar="V",
                        help="show this version's inputs and refusals (of every fragment that has it, or of "
                             "--fragment); without it, per-learner aggregates over --from..--to")
    _add_range(parser)


def _open(args: argparse.Namespace) -> Run:
    return open_run(*open_source(args))  # S3 (or an export) is the history: never Redis


def run_inspect(args: argparse.Namespace) -> int:
    run = _open(args)
    keys = run.keys
    if args.version is not None:
        views = inspect_version(run, args.version, args.fragment)
        print("\n\n".join(v.render() for v in views))
        write_json(args.json_path, {"run": keys.run, "versions": [v.to_json() for v in views]})
    else:
        view = inspect_run(run, args.fragment, args.start, args.end)
        print(view.render())
        write_json(args.json_path, view.to_json())
    return 0


def add_blame_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    _add_range(parser)
    parser.add_argument("--task", type=Path, metavar="TASK.json",
                        help="the demo task the run trained (OUT/task.json of `diloco demo`): adds loss evidence, "
                             "each sampled version re-derived without each of its learners and evaluated")
    parser.add_argument("--loss-versions", type=int, default=10, metavar="N",
                        help="with --task: re-derive the last N versions per fragment that merged two or more "
                             "learners (default: %(default)s; each costs one evaluation per learner)")


def run_blame(args: argparse.Namespace) -> int:
    """Exit 0 whatever the verdicts: blame reports evidence, it does not fail a run."""
    if args.loss_versions < 1:
        raise ConfigError(f"--loss-versions must be at least 1, got {args.loss_versions}")
    task = load_task(args.task) if args.task is not None else None
    report = blame_run(_open(args), fragment=args.fragment, start=args.start, end=args.end, task=task,
                       loss_versions=args.loss_versions, progress=lambda line: log.info("%s", line))
    print(report.render())
    write_json(args.json_path, report.to_json())
    return 0
