"""`diloco chaos [--seconds N] [--seed S] [--json PATH]`: the chaos suite on the command line."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from diloco.infra.chaos.config import ChaosConfig
from diloco.infra.chaos.suite import run_chaos as chaos
from diloco.infra.options import add_options, build
from diloco.infra.output import write_json

log = logging.getLogger("diloco")


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("out/chaos"),
                        help="output directory: the stack's data and every process's log; its stack is "
                             "replaced (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the figures (faults by kind, versions, contributions "
                        "applied/refused/dropped/pending/announced, lost, duplicated, hostile inputs by outcome) "
                        "to this file")
    add_options(parser, ChaosConfig, skip=("out",))


def run_chaos(args: argparse.Namespace) -> int:
    """Exit 0 only if nothing was lost or applied twice, every fault kind fired, versions are
    contiguous, every hostile input had an outcome it may have and no coordinator exited unasked,
    and the global model's loss is finite and below its start."""
    report = chaos(build(ChaosConfig, args))
    write_json(args.json, report.figures())
    for problem in report.problems():
        log.error("chaos: %s", problem)
    print(report.line(), flush=True)
    return 0 if not report.problems() else 1
