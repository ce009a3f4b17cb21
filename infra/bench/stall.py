"""`diloco bench stall`: the share of a learner's wall time its training loop is blocked on synchronization.

A learner's loop is blocked only inside its step hook: taking the fragment snapshot and delta to
send, merging a new version, and (synchronous DiLoCo only) waiting for a merge. Uploads and
downloads run in background threads. Each learner measures that time (`sync_s`) and its loop's
wall time (`wall_s`, from the end of its first step) and reports both in its heartbeat.

Arms: decoupled (the defaults) and synchronous DiLoCo (one fragment, quorum = all, the barrier),
M learners as fast as the CPU allows, one of them `--slow-factor` slower. Target (decoupled): <= 1%.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from diloco.infra.output import figures_table
from diloco.infra.bench.trial import (LearnerPlan, Trial, TrialResult, add_out_arguments, bench_stack, run_args,
                                      run_trial, sync_trial)
from diloco.workers.tasks.demo import DemoTask

NAME = "stall"
HELP = "fraction of learner wall time blocked on synchronization, decoupled vs synchronous"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_arguments(parser, "stall")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=400, help="inner steps per learner (default: %(default)s)")
    parser.add_argument("--slow-factor", type=float, default=2.0, help="the last learner's slowdown (default: %(default)s)")
    parser.add_argument("--sync-every", type=int, default=30, help="H (default: %(default)s)")


@dataclass
class StallResult:
    trials: dict[str, TrialResult]

    @staticmethod
    def fraction(stats: dict) -> float:
        return float(stats.get("sync_s", 0.0)) / max(float(stats.get("wall_s", 0.0)), 1e-9)

    def fleet_fraction(self, name: str) -> float:
        t = self.trials[name]
        return t.total("sync_s") / max(t.total("wall_s"), 1e-9)

    def table(self) -> str:
        rows = []
        for name, t in self.trials.items():
            for learner, stats in sorted(t.learners.items()):
                rows.append([name, learner, int(stats.get("step", 0)), float(stats.get("wall_s", 0.0)),
                             float(stats.get("sync_s", 0.0)), 100 * self.fraction(stats)])
            rows.append([name, "(fleet)", None, t.total("wall_s"), t.total("sync_s"), 100 * self.fleet_fraction(name)])
        verdict = ""
        if "decoupled" in self.trials:
            worst = max(self.fraction(s) for s in self.trials["decoupled"].learners.values())
            verdict = (f"\ndecoupled: worst learner blocked {100 * worst:.2f}% of its wall time "
                       f"(target <= 1%: {'met' if worst <= 0.01 else 'NOT met'})")
        return figures_table(["arm", "learner", "steps", "wall s", "blocked s", "blocked %"], rows) + verdict

    def to_json(self) -> dict:
        return {"bench": NAME, "fraction_blocked": {n: {k: self.fraction(s) for k, s in t.learners.items()}
                                                    for n, t in self.trials.items()},
                "fleet_fraction_blocked": {n: self.fleet_fraction(n) for n in self.trials},
                "trials": {k: t.to_json() for k, t in self.trials.items()}}


def run(args: argparse.Namespace) -> StallResult:
    task = DemoTask()
    learners = tuple(LearnerPlan(f"learner-{i}", steps=args.steps, data_seed=i,
                                 slowdown=args.slow_factor if i == args.learners - 1 else 1.0)
                     for i in range(args.learners))
    arms = {
        "decoupled": Trial("decoupled", learners, 3600.0, run_args(2, args.sync_every, 3, "int8"), ("--min-quorum", "1")),
        "sync": sync_trial("sync", learners, 3600.0, sync_every=args.sync_every),
    }
    with bench_stack(args.out, keep=args.keep_stack) as stack:
        return StallResult({name: run_trial(stack, trial, task, args.out, curve_points=1) for name, trial in arms.items()})
