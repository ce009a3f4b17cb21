"""`diloco`: the command line. One row in COMMANDS per subcommand: (name, room, help).

A subcommand `name` lives in its room's `cli.py` (`diloco.infra.<room>.cli`) as two small
functions: `add_<name>_arguments(parser)` declares its options and `run_<name>(args) -> int` does
the work and returns the exit code. The room is imported only when its subcommand is chosen, so
`diloco --help` and `diloco stack` never import torch. Logging is configured here only. Results
meant for a shell or a pipe go to stdout; messages for a person go to stderr (logging).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from importlib import metadata
import sys
from collections.abc import Callable

from pathlib import Path

from diloco.infra.options import check_sources, load_sources, recording_sources, reset_sources
from diloco.storage.errors import DilocoError
from diloco.storage.heap import reuse_freed_memory

log = logging.getLogger("diloco")

COMMANDS: list[tuple[str, str, str]] = [
    ("stack", "local", "run a local Redis + S3 stack in the background"),
    ("coordinator", "roles", "create or resume a run and merge its contributions"),
    ("learner", "roles", "train the built-in demo model as one learner of a run"),
    ("finish", "roles",
     "finish a run now: its coordinator merges what is pending and records each fragment's final version"),
    ("status", "watch", "a live view of a run: heads, round clock, learners, refusals, pending, lag"),
    ("plot", "watch", "PNG plots of a run: loss vs time with failures marked, versions per fragment, staleness, "
     "bytes per token"),
    ("demo", "demo", "a whole run on an embedded local stack, with a learner killed midway, vs a baseline"),
    ("simulate", "goodput",
     "the goodput simulator: data-parallel, elastic and decoupled DiLoCo on a fleet of failing chips"),
    ("replay", "history",
     "re-derive committed versions from S3 alone and check them bit for bit against their manifests"),
    ("gc", "history", "delete the objects a run no longer needs (old versions' params, merged inputs), keeping "
     "every manifest and what replaying the last N versions needs"),
    ("whatif", "history", "re-derive a range of versions with other settings (outer lr, momentum, merge rule, "
     "staleness discount) into a scratch run, and say how far it drifts"),
    ("inspect", "history", "what went into a version (inputs, weights, norms, cosine to the merged update, "
     "refusals) or a run, per learner"),
    ("blame", "history", "rank learners by how much their contributions went against the others' (and, with "
     "--task, hurt the eval loss)"),
    ("model", "history", "take the trained model out: `diloco model export --run R --out DIR` writes the global "
     "model as safetensors, a torch state_dict or a Hugging Face checkpoint"),
    ("export", "history", "copy a run's history (every object under its root but learners' saved states) from the "
     "bucket to a local directory"),
    ("import", "history", "copy a run's history from an export directory back into the bucket the environment names"),
    ("chaos", "chaos", "a run of real processes on a local stack under a seeded schedule of faults, then an audit "
     "of every contribution"),
    ("bench", "bench", "benchmarks on real processes and servers: quality, takes, rejoin, failures, comm, stall, "
     "coordinator, hetero, wan, scale, device, flood"),  # the rooms import no room: a test holds it to bench's BENCHES
]


def room_cli(room: str) -> str:
    """The module that holds a room's subcommands."""
    return f"diloco.infra.{room}.cli"


def command_function(name: str, room: str, kind: str) -> Callable:
    """`add_<name>_arguments` (kind "add") or `run_<name>` (kind "run") of the room's cli.py, imported here."""
    attribute = f"add_{name}_arguments" if kind == "add" else f"run_{name}"
    return getattr(importlib.import_module(room_cli(room)), attribute)


def _run_later(name: str, room: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return command_function(name, room, "run")(args)
    return run


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand declares its options (and imports its room). Its
    settings' defaults come from the environment and the config file (`infra.options`)."""
    words = sys.argv[1:] if argv is None else argv
    chosen = _command(words)
    parser = argparse.ArgumentParser(prog="diloco", description="Decoupled DiLoCo over S3 and Redis.",
                                     epilog="Every setting of a command can also be given as DILOCO_<FLAG> in the "
                                            "environment or in a TOML file (--config); see `diloco COMMAND --help`.")
    parser.add_argument("--version", action="version", version=f"diloco {_version()}")
    _add_common(parser, top=True)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    load_sources(chosen, words)
    try:
        for name, room, help_text in COMMANDS:
            sub = subparsers.add_parser(name, help=help_text, description=help_text)
            if name == chosen:
                _add_common(sub, top=False)
                command_function(name, room, "add")(sub)
                check_sources([n for n, _, _ in COMMANDS])
            sub.set_defaults(handler=_run_later(name, room))
    finally:
        reset_sources()
    return parser


def every_setting() -> set[str]:
    """The setting names (field and flag spellings) of every command: each command's options
    declared on a scratch parser with nothing set (this imports every room, seconds:
    `options.KNOWN_SETTINGS` holds the result, checked against this by a unit test)."""
    recording = recording_sources()
    for name, room, _ in COMMANDS:
        command_function(name, room, "add")(argparse.ArgumentParser(prog=name, add_help=False))
    return recording.asked


def _version() -> str:
    """The installed distribution's version (pyproject reads it from diloco.__version__)."""
    try:
        return metadata.version("diloco")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _command(words: list[str]) -> str | None:
    """The subcommand `words` name: the first word that is not an option or the value of --config."""
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--config":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _add_common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """-v and --config, before the command or after it (the command's copy does not reset the top's)."""
    default = False if top else argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")
    parser.add_argument("--config", type=Path, metavar="FILE", default=None if top else argparse.SUPPRESS,
                        help="a TOML file of settings (also DILOCO_CONFIG): `key = value` for any command, "
                             "[command] tables for one; the command line and DILOCO_* variables win over it")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser(argv).parse_args(argv)
    except DilocoError as exc:  # a bad DILOCO_* value or config file
        print(f"diloco: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command != "learner":  # a learner's config decides at join
        log.debug("malloc: %s", reuse_freed_memory())
    try:
        return args.handler(args)
    except DilocoError as exc:  # a refusal or a setting a person can fix: the message says what (-v: and where)
        log.error("%s", exc, exc_info=args.verbose)
        return 1
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The `diloco` command: `main`, then exit with its code. A learner that left threads behind at its
    deadline (`workers.threads.lingering`: an upload still encoding) exits at once, its logs flushed:
    an interpreter torn down under a thread inside a torch op aborts (SIGABRT) instead of exiting with
    the command's code, and a scheduler counts that as a failure."""
    code = main()
    if "diloco.workers.threads" in sys.modules:
        from diloco.workers.threads import lingering

        if names := lingering():
            log.warning("leaving without waiting for thread(s) %s", ", ".join(names))
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
