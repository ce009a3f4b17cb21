"""Watching a run on the command line: `diloco status` and `diloco plot`.

Each subcommand is `add_<name>_arguments(parser)` + `run_<name>(args) -> int`, listed in
`infra.cli.COMMANDS`. `status` reads Redis and S3 (the environment's `DILOCO_*` settings); `plot`
reads S3 only, or an export (`--dir`), like the history tools. Neither imports torch until it needs
to (`plot --task` evaluates models), so both answer `--help` at once. Results go to stdout, progress
and problems to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
import time
from pathlib import Path

from diloco.infra.output import write_json
from diloco.storage.errors import ConfigError, DilocoError

log = logging.getLogger("diloco")


# -- status --------------------------------------------------------------------------------------

def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = status_epilog()  # the learner states, listed where --help shows them
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--watch", action="store_true",
                        help="redraw the view every --interval seconds until Ctrl-C (default: print it once); "
                             "a run that does not exist yet is waited for")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="seconds between two reads with --watch (default: %(default)s)")
    parser.add_argument("--refusals", type=int, default=8, metavar="N",
                        help="list the last N refusals (default: %(default)s)")
    parser.add_argument("--json", dest="json_path", type=Path, metavar="PATH",
                        help="also write the status as JSON to this file (with --watch: rewritten at every read)")


def status_epilog() -> str:
    from diloco.infra.watch.status import LEARNER_STATES

    return "learner states (finished learners are listed apart):\n" + "\n".join(
        textwrap.fill(meaning, 100, initial_indent=f"  {state:10} ", subsequent_indent=" " * 13)
        for state, meaning in LEARNER_STATES.items())


def run_status(args: argparse.Namespace) -> int:
    """Exit 0 after printing the view (or after Ctrl-C with --watch); 1 if the run does not exist
    (with --watch: wait for it)."""
    import redis

    from diloco.infra.watch.render import render_rich, render_text
    from diloco.infra.watch.status import RunMissing, read_status
    from diloco.storage.bus import Bus
    from diloco.storage.objects import ObjectStore
    from diloco.storage.settings import Endpoints

    if not args.interval > 0:
        raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.refusals < 0:
        raise ConfigError(f"--refusals must be >= 0, got {args.refusals}")
    endpoints = Endpoints.from_env()
    bus, store = Bus(endpoints, args.run), ObjectStore(endpoints)

    def read():  # noqa: ANN202
        status = read_status(bus, store, refusals=args.refusals)
        write_json(args.json_path, status.to_json())
        return status

    try:
        status = read()  # a run that does not exist is an error here, before any drawing
    except RunMissing as exc:
        if not args.watch:
            raise
        log.info("%s\nwaiting for run %r to appear (a read every %g s, Ctrl-C to stop)", exc, args.run, args.interval)
        try:
            status = _first_read(read, args.interval)
        except KeyboardInterrupt:
            return 0
    if not args.watch:
        if sys.stdout.isatty():
            from rich.console import Console
            Console().print(render_rich(status))
        else:
            print(render_text(status))
        return 0

    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console()
    try:
        if not console.is_terminal:  # a pipe or a file: one plain view per read
            while True:
                print(render_text(status), flush=True)
                print(flush=True)
                time.sleep(args.interval)
                status = read()
        with Live(render_rich(status), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    status = read()
                    live.update(render_rich(status), refresh=True)
                except (DilocoError, redis.RedisError, OSError) as exc:  # shown, and read again next time
                    failed = Text(f"the last read failed at {time.strftime('%H:%M:%S')} (showing the one "
                                  f"before): {exc}", style="bold red")
                    live.update(Group(render_rich(status), failed), refresh=True)
    except KeyboardInterrupt:
        return 0


def _first_read(read, interval_s: float):  # noqa: ANN001, ANN202
    """Read until the run exists."""
    from diloco.infra.watch.status import RunMissing

    while True:
        time.sleep(interval_s)
        try:
            return read()
        except RunMissing:
            continue


# -- plot ----------------------------------------------------------------------------------------

def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    # The history tools' source options (`infra.history.cli.add_source_arguments`), declared here so
    # that `diloco plot --help` does not import the history tools (and torch with them).
    parser.add_argument("--run", help="run id (optional with --dir when the export holds one run)")
    parser.add_argument("--dir", type=Path, metavar="EXPORT",
                        help="read the run from this export directory (`diloco export`) instead of the bucket "
                             "the environment names")
    parser.add_argument("--prefix", help="read the run under this key prefix instead of DILOCO_S3_PREFIX or the "
                        "export's")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="directory to write the PNGs into (created; needs matplotlib: diloco[plot])")
    parser.add_argument("--tensorboard", type=Path, metavar="DIR",
                        help="also (or instead of --out) write the loss series as TensorBoard event files here: a "
                             "run per learner process, `loss` against its steps and `loss_by_tokens` against its "
                             "tokens (needs diloco[tensorboard])")
    parser.add_argument("--task", type=Path, metavar="TASK.json",
                        help="a built-in task the run trained (OUT/task.json of `diloco demo`): also plot the global "
                             "model's eval loss over time (the learners' reported losses are drawn for any model)")
    parser.add_argument("--evals", type=int, default=40, metavar="N",
                        help="with --task: evaluate at most N global models, evenly spread over the run "
                             "(default: %(default)s)")


def run_plot(args: argparse.Namespace) -> int:
    from diloco.infra.history.cli import open_source
    from diloco.infra.watch.plot import NO_LOSS, check_matplotlib, eval_losses, read_history, write_plots
    from diloco.infra.watch.tensorboard import summary_writer, write_tensorboard
    from diloco.workers.losses import read_losses
    from diloco.workers.tasks.kinds import load_task

    if args.evals < 1:
        raise ConfigError(f"--evals must be at least 1, got {args.evals}")
    if args.out is None and args.tensorboard is None:
        raise ConfigError("say where to write: --out DIR (PNGs), --tensorboard DIR (event files), or both")
    if args.out is not None:
        check_matplotlib()  # before reading anything: say what to install at once
    if args.tensorboard is not None:
        summary_writer()
    task = load_task(args.task) if args.task is not None else None
    store, keys = open_source(args)
    history = read_history(store, keys)
    reported, unreadable = read_losses(store, keys)
    log.info("run %s: %d committed version(s) over %d fragment(s), %d contribution object(s) in the bucket, "
             "%d reported loss(es) of %d learner(s)", keys.run, len(history.commits), history.spec.num_fragments,
             len(history.sizes), sum(len(s.losses) for s in reported), len({s.learner for s in reported}))
    for problem in history.problems + unreadable:
        log.warning("%s", problem)
    losses, floor, note = None, None, NO_LOSS
    if task is not None:
        losses, skipped = eval_losses(history, store, keys, task, evals=args.evals,
                                      progress=lambda line: log.info("%s", line))
        for line in skipped:
            log.warning("not evaluated: %s", line)
        floor = task.entropy_floor()
        note = "no global model could be evaluated: " + ("; ".join(skipped[:3]) or "no version 0 of every fragment")
    if args.out is not None:
        for path in write_plots(history, args.out, losses=losses, floor=floor, note=note, reported=reported):
            print(path)
    if args.tensorboard is not None:
        for path in write_tensorboard(args.tensorboard, reported, losses):
            print(path)
    return 0
