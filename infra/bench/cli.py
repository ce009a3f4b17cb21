"""`diloco bench NAME [options] [--json PATH]`: one subcommand per benchmark module."""

from __future__ import annotations

import argparse
import importlib
import logging
from pathlib import Path

from diloco.infra.output import write_json

log = logging.getLogger(__name__)

BENCHES = ("quality", "takes", "rejoin", "failures", "comm", "stall", "coordinator", "hetero", "wan", "scale", "device", "flood")
"""Benchmark names; `diloco bench coordinator` lives in `infra.bench.throughput` (no clash with the package)."""

MODULES = {"coordinator": "throughput"}


def module(name: str):  # noqa: ANN201 (a module)
    return importlib.import_module(f"diloco.infra.bench.{MODULES.get(name, name)}")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in BENCHES:
        try:
            bench = module(name)
        except ModuleNotFoundError as exc:
            if exc.name != f"diloco.infra.bench.{MODULES.get(name, name)}":
                raise
            continue  # not built yet
        p = sub.add_parser(name, help=bench.HELP, description=bench.HELP)
        p.add_argument("--json", type=Path, metavar="PATH", help="write the results to this JSON file")
        bench.add_arguments(p)


def run_bench(args: argparse.Namespace) -> int:
    result = module(args.bench).run(args)
    print(result.table(), flush=True)
    if args.json is not None:
        write_json(args.json, result.to_json())
        log.info("wrote %s", args.json)
    return 0
