"""`diloco simulate`: the goodput simulator on the command line.

    diloco simulate --chips 1200000 --learners 8 [--mtbi-years 1] [--json PATH]   # one fleet
    diloco simulate --sweep [--json PATH] [--plot PNG]                            # the paper's table
    diloco simulate --record RUN --json timings.json      # timings of a real run (Redis + S3 from env)
    diloco simulate --from-json timings.json [--chips N]  # those timings, simulated
    diloco simulate --params 12e9 --shard-mb-s 53 [--shards 1,2,4,8]   # coordinator shards for a model

Every parameter of `infra.goodput.model.Model` and of the coordinator's `RoundConfig` is an
option (its docstring is the help). Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from dataclasses import asdict, replace

from diloco.coordinator.config import RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.infra.goodput.model import Model
from diloco.infra.goodput.shards import ShardLoad, shard_loads, shards_needed
from diloco.infra.goodput.sweep import plot, point_table, simulate, sweep, sweep_table, to_json
from diloco.infra.goodput.timings import Timings, project
from diloco.infra.options import add_options, build, whole_numbers
from diloco.infra.output import figures_table, write_json
from diloco.storage.codecs import CODECS
from diloco.storage.errors import ConfigError

log = logging.getLogger(__name__)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true",
                      help="the paper's grid: 150k..2.4M chips x data-parallel, elastic, decoupled M=2/4/8/16 "
                           "(--chips and --learners are ignored)")
    mode.add_argument("--from-json", type=Path, metavar="TIMINGS",
                      help="simulate the timings recorded from a real run (--record): its learners, step times, "
                           "H, tau, sync times and restarts; its own fleet and failure rate unless --chips is given")
    mode.add_argument("--record", metavar="RUN",
                      help="read the timings of run RUN from the Redis and S3 the environment names, and write "
                           "them to --json (the input of --from-json)")
    mode.add_argument("--params", type=float, metavar="N",
                      help="project the coordinator shards a model of N parameters needs (`infra/goodput/shards.py`) "
                           "at --shard-mb-s, with --fragments, --codec, --learners, --sync-every and --step-time-s, "
                           "then simulate the fleet with that merge time")
    parser.add_argument("--shard-mb-s", type=float, metavar="MB_S",
                        help="with --params: what one coordinator shard takes in, MB/s of contribution objects "
                             "(`diloco bench coordinator` on the coordinator's machine: its coord MB/s)")
    parser.add_argument("--shards", help="with --params: the shard counts to project, comma-separated, each at "
                        "most --fragments (default: 1, 2, 4... up to --fragments)")
    parser.add_argument("--fragments", type=int, default=RunSettings().num_fragments,
                        help="with --params: P (default: the run's, %(default)s)")
    parser.add_argument("--codec", default=RunSettings().codec, choices=CODECS,
                        help="with --params: the learners' codec (default: the run's, %(default)s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results (or the timings) as JSON here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="with --sweep: draw goodput against chips here "
                        "(needs matplotlib: pip install -e '.[bench]')")
    add_options(parser, Model)
    add_options(parser, RoundConfig, skip=("overlap_steps",))
    parser.set_defaults(chips=None)  # None when not given: --from-json then keeps the recorded fleet


def run_simulate(args: argparse.Namespace) -> int:
    if args.record:
        return _record(args)
    if args.plot and not args.sweep:
        raise ConfigError("--plot draws the sweep: use it with --sweep")
    chips = vars(args).pop("chips")
    model = build(Model, args, round=build(RoundConfig, args), **({} if chips is None else {"chips": chips}))
    loads = _shards(args, model) if args.params is not None else []
    if loads:
        if shards_needed(loads) is None:  # merges that fall behind: nothing the simulator models
            write_json(args.json, {"shards": [asdict(x) for x in loads], "model": asdict(model)})
            return 0
        model = replace(model, merge_s=loads[0].merge_s)
    if args.from_json:
        model = project(Timings.load(args.from_json), model, chips=chips)
        log.info("projecting %s: %d learners, step times x%s, H %d, tau %d, upload %.3fs, merge %.3fs, "
                 "restart %.1fs", args.from_json, model.learners, [round(s, 2) for s in model.speeds],
                 model.sync_every, model.overlap_steps, model.upload_s, model.merge_s, model.restart_s)
    started = time.perf_counter()
    if args.sweep:
        results = sweep(model)
        print(sweep_table(results, model), flush=True)
        if args.plot and plot(results, args.plot):
            log.info("wrote %s", args.plot)
    else:
        results = simulate(model)
        print(point_table(results, model), flush=True)
    log.info("simulated %g h of %s in %.1fs", model.hours, "each fleet" if args.sweep else f"{model.chips:,} chips",
             time.perf_counter() - started)
    write_json(args.json, to_json(results, model) | ({"shards": [asdict(x) for x in loads]} if loads else {}))
    return 0


def _shards(args: argparse.Namespace, model: Model) -> list[ShardLoad]:
    """Print and return the busiest shard's load per shard count."""
    if args.shard_mb_s is None:
        raise ConfigError("--params needs --shard-mb-s: one shard's rate, from `diloco bench coordinator`")
    counts = (whole_numbers(args.shards, "--shards") if args.shards else
              sorted({*(2 ** i for i in range(args.fragments.bit_length()) if 2 ** i <= args.fragments), args.fragments}))
    loads = shard_loads(params=int(args.params), fragments=args.fragments, learners=model.learners,
                        period_s=model.period_s, codec=args.codec, shard_mb_s=args.shard_mb_s, shards=counts)
    print(f"coordinator shards for {args.params:,.0f} parameters, P {args.fragments}, {model.learners} learners, "
          f"{args.codec}, a round every {model.period_s:g}s (H {model.sync_every} x {model.step_time_s:g}s), one "
          f"shard {args.shard_mb_s:g} MB/s; piece {loads[0].piece_mb:,.1f} MB, a fragment's round "
          f"{model.learners * loads[0].piece_mb:,.1f} MB")
    print(figures_table(["shards", "fragments each", "need MB/s", "utilization", "keeps up"],
                        [[x.shards, x.fragments_per_shard, x.need_mb_s, x.utilization, "yes" if x.keeps_up else "no"]
                         for x in loads]))
    needed = shards_needed(loads)
    if needed is None:
        print("none of these keeps up: more fragments (and shards), or faster shards", flush=True)
    else:
        print(f"fewest shards that keep up: {needed}; a fragment's round at one shard's rate, from its first piece "
              f"to its version: at most {loads[0].merge_s:.2f}s (the fleet below is simulated with it)\n", flush=True)
    return loads


def _record(args: argparse.Namespace) -> int:
    from diloco.infra.goodput.record import record_run
    from diloco.storage.settings import Endpoints

    timings = record_run(Endpoints.from_env(), args.record)
    if args.json:
        timings.save(args.json)
        log.info("wrote %s", args.json)
    print(json.dumps(timings.to_wire(), indent=1) if not args.json else
          f"run {timings.run}: {len(timings.step_time_s)} learners over {timings.duration_s:.0f}s, "
          f"{len(timings.failures)} failure(s), upload {timings.upload_s:.3f}s, merge {timings.merge_s:.3f}s")
    return 0
