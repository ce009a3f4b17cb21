"""`diloco stack up|down|env`: a local Redis + S3 stack that outlives the command (`infra.local.stack`)."""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from diloco.storage.settings import redact_url

log = logging.getLogger("diloco")

DEFAULT_STACK_DIR = Path(".stack")


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
    from diloco.infra.local.stack import DetachedStack, stack_down, stack_up  # boto3: only when asked for

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
