"""`diloco`: the command line. One entry in COMMANDS per subcommand: (name, help, add_arguments, run).

A subcommand is two small functions: `add_arguments(parser)` declares its options and
`run(args) -> int` does the work and returns the exit code. Logging is configured here only.
Results meant for a shell or a pipe go to stdout; messages for a person go to stderr (logging).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from diloco.storage.errors import DilocoError
from diloco.storage.settings import redact_url

log = logging.getLogger("diloco")

DEFAULT_STACK_DIR = Path(".stack")


# -- stack ----------------------------------------------------------------------------------------


def _print_exports(env: dict[str, str]) -> None:
    for name, value in sorted(env.items()):
        print(f"export {name}={shlex.quote(value)}")


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("up", "down", "env"),
                        help="up: start Redis + S3 in the background and print `export` lines "
                             "(use as `eval $(diloco stack up)`); down: stop them; env: print the exports again")
    parser.add_argument("--dir", type=Path, default=DEFAULT_STACK_DIR,
                        help=f"data and state directory of the stack (default: {DEFAULT_STACK_DIR})")
    parser.add_argument("--redis-auth", action="store_true",
                        help="up: Redis requires ACL user `diloco` with a new random password (in the exported URL)")
    parser.add_argument("--redis-tls", action="store_true",
                        help="up: Redis speaks TLS only (rediss://), with a CA made under <dir>/redis/tls/ whose "
                             "path is in the exported URL; needs a redis-server built with TLS (Debian's)")


def run_stack(args: argparse.Namespace) -> int:
    from diloco.infra.stack import DetachedStack, stack_down, stack_up

    data_dir: Path = args.dir
    if args.action == "up":
        env, started = stack_up(data_dir, redis_auth=args.redis_auth, redis_tls=args.redis_tls)
        log.info("%s in %s: redis %s, s3 %s, bucket %s", "started a stack" if started else "a stack already runs",
                 data_dir, redact_url(env["DILOCO_REDIS_URL"]), env.get("DILOCO_S3_ENDPOINT"), env["DILOCO_S3_BUCKET"])
        _print_exports(env)
        return 0
    if args.action == "down":
        if not stack_down(data_dir):
            log.info("no stack running in %s", data_dir)
            return 0
        log.info("stopped the stack in %s", data_dir)
        return 0
    existing = DetachedStack.load(data_dir)
    if existing is None or not existing.running():
        log.error("no stack running in %s: start one with `eval $(diloco stack up --dir %s)`", data_dir, data_dir)
        return 1
    _print_exports(existing.env)
    return 0


# -- the table of subcommands --------------------------------------------------------------------

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _lazy(name: str, module: str = "diloco.infra.commands") -> Callable:
    """A function of `module`, imported on first use: `diloco stack` stays fast (no torch import)."""
    def call(arg):  # noqa: ANN001, ANN202
        return getattr(importlib.import_module(module), name)(arg)
    return call


COMMANDS: list[Command] = [
    ("stack", "run a local Redis + S3 stack in the background", add_stack_arguments, run_stack),
    ("coordinator", "create or resume a run and merge its contributions", _lazy("add_coordinator_arguments"),
     _lazy("run_coordinator")),
    ("learner", "train the built-in demo model as one learner of a run", _lazy("add_learner_arguments"),
     _lazy("run_learner")),
    ("finish", "finish a run now: its coordinator merges what is pending and records each fragment's final version",
     _lazy("add_finish_arguments"), _lazy("run_finish")),
    ("demo", "a whole run on an embedded local stack, with a learner killed midway, vs a baseline",
     _lazy("add_demo_arguments"), _lazy("run_demo")),
    ("simulate", "the goodput simulator: data-parallel, elastic and decoupled DiLoCo on a fleet of failing chips",
     _lazy("add_arguments", "diloco.infra.goodput.cli"), _lazy("run", "diloco.infra.goodput.cli")),
    ("replay", "re-derive committed versions from S3 alone and check them bit for bit against their manifests",
     _lazy("add_replay_arguments"), _lazy("run_replay")),
    ("gc", "delete the objects a run no longer needs (old versions' params, merged inputs), keeping every manifest "
     "and what replaying the last N versions needs", _lazy("add_gc_arguments", "diloco.infra.gc"),
     _lazy("run_gc", "diloco.infra.gc")),
    ("whatif", "re-derive a range of versions with other settings (outer lr, momentum, merge rule, staleness "
     "discount) into a scratch run, and say how far it drifts", _lazy("add_whatif_arguments", "diloco.infra.whatif"),
     _lazy("run_whatif", "diloco.infra.whatif")),
    ("inspect", "what went into a version (inputs, weights, norms, cosine to the merged update, refusals) or a "
     "run, per learner", _lazy("add_inspect_arguments", "diloco.infra.history_commands"),
     _lazy("run_inspect", "diloco.infra.history_commands")),
    ("blame", "rank learners by how much their contributions went against the others' (and, with --task, hurt the "
     "eval loss)", _lazy("add_blame_arguments", "diloco.infra.history_commands"),
     _lazy("run_blame", "diloco.infra.history_commands")),
    ("export", "copy a run's history (every object under its root) from the bucket to a local directory",
     _lazy("add_export_arguments"), _lazy("run_export")),
    ("import", "copy a run's history from an export directory back into the bucket the environment names",
     _lazy("add_import_arguments"), _lazy("run_import")),
    ("chaos", "a run of real processes on a local stack under a seeded schedule of faults, then an audit of "
     "every contribution", _lazy("add_chaos_arguments"), _lazy("run_chaos")),
    ("bench", "benchmarks on real processes and servers: quality, failures, comm, stall, coordinator, hetero",
     _lazy("add_bench_arguments", "diloco.infra.bench.cli"), _lazy("run_bench", "diloco.infra.bench.cli")),
]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand declares its options (so `stack` never imports torch)."""
    words = sys.argv[1:] if argv is None else argv
    chosen = next((w for w in words if not w.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="diloco", description="Decoupled DiLoCo over S3 and Redis.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, add_arguments, run in COMMANDS:
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            add_arguments(sub)
        sub.set_defaults(handler=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.handler(args)
    except DilocoError as exc:  # a refusal or a setting a person can fix: the message says what
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
