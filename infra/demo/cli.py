"""`diloco demo [--out DIR] [options]`: the demo on the command line; its options are `DemoConfig`'s fields."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco.infra.demo.runner import DemoConfig, run_demo as demo
from diloco.infra.options import add_options, build


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("out/demo"),
                        help="output directory; its previous contents are replaced (default: %(default)s)")
    parser.add_argument("--text", help="train on this text file (byte level) instead of the synthetic language")
    add_options(parser, DemoConfig, skip=("out", "text"))


def run_demo(args: argparse.Namespace) -> int:
    demo(build(DemoConfig, args))
    return 0
