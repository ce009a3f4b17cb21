"""`diloco bench rejoin`: what a preempted learner's saved state is worth, in one process, with no
servers and no timing noise: the figures behind `LearnerConfig.save_state` (issue 30). The quality
benchmark's preempted arms do the same with real processes, where the run-to-run spread is as large
as the effect.

M replicas of a quality task train in lockstep as in `bench takes`, at the run's defaults (rebase,
each version taken tau steps after its send; P fragments at the run's offsets; the coordinator's
outer step over the plain mean of the pieces). Replica 1 is preempted at `--at` of the budget: it
sends the progress since its last send of each fragment (into each fragment's next round, as a
preempted learner's final pieces) and is away for `--down` steps, the others' rounds merged
without it. It then rejoins at the global model:

- none: no preemption (the reference);
- warm: with its saved state: its optimizer's moments and step, its schedule and data positions;
- cold: afresh (`--no-save-state`): a new optimizer, its schedule over a whole budget from step 0,
  a new data stream.

Figures: the global model's eval loss once the others' budget is done; cost = that minus none's;
recovered = 1 - warm cost / cold cost. Deterministic: the same seeds give the same figures.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.infra.bench.quality_tasks import TASKS
from diloco.infra.bench.takes import Replicas, Setting
from diloco.infra.output import figures_table
from diloco.workers.fragments import due_fragments
from diloco.workers.tasks.base import Task, train_step

log = logging.getLogger(__name__)

NAME = "rejoin"
HELP = "in one process: a preempted learner rejoining with its saved state against afresh, deterministic"
ARMS = ("none", "warm", "cold")
AWAY = 1
"""The replica that is preempted."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults, outer = RunSettings(), CoordinatorConfig()
    parser.add_argument("--tasks", default="gpt2,vision",
                        help=f"comma-separated quality tasks, of {','.join(TASKS)} (default: %(default)s)")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=0, help="inner steps per replica (default: the task's)")
    parser.add_argument("--sync-every", type=int, default=defaults.sync_every, help="H (default: %(default)s)")
    parser.add_argument("--fragments", type=int, default=defaults.num_fragments, help="P (default: %(default)s)")
    parser.add_argument("--overlap-steps", type=int, default=defaults.overlap_steps, help="tau (default: %(default)s)")
    parser.add_argument("--at", type=float, default=0.4, help="preempted at this share of the budget (default: 0.4)")
    parser.add_argument("--down", type=int, default=50, help="steps the others train while it is away (default: 50)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: model and data streams start there")
    parser.add_argument("--outer-lr", type=float, default=outer.outer_lr)
    parser.add_argument("--outer-momentum", type=float, default=outer.outer_momentum)


@dataclass
class RejoinResult:
    rows: list[tuple[str, int, dict[str, float]]]
    """(task, seed, arm -> eval at the others' end)."""

    def table(self) -> str:
        out = []
        for task, seed, evals in self.rows:
            warm, cold = evals["warm"] - evals["none"], evals["cold"] - evals["none"]
            out.append([task, seed, evals["none"], warm, cold, recovered(warm, cold)])
        return "\n".join(["rejoin: the global model's eval once the others' budget is done; costs against none",
                          figures_table(["task", "seed", "none", "warm cost", "cold cost", "recovered"], out)])

    def to_json(self) -> dict:
        return {"bench": NAME, "runs": [{"task": t, "seed": s, **evals} for t, s, evals in self.rows]}


def recovered(warm_cost: float, cold_cost: float) -> float | None:
    """The share of a cold rejoin's cost that the saved state recovers (None if cold cost nothing)."""
    return None if cold_cost <= 0 else 1 - warm_cost / cold_cost


def run_arm(task: Task, args: argparse.Namespace, arm: str) -> float:
    fleet = Replicas(task, args, Setting("rebase", args.overlap_steps))
    leave = max(1, round(args.at * args.steps))
    back = leave + args.down
    for step in range(1, args.steps + 1):
        if arm != "none" and step == leave + 1:  # it left after step `leave`, its progress sent
            fleet.away.add(AWAY)
            fleet.leaving[AWAY] = set(range(args.fragments))
        if arm != "none" and step == back + 1:
            rejoin(fleet, task, args, cold=arm == "cold")
        for i, model in enumerate(fleet.models):
            if i not in fleet.away:
                train_step(task, model, fleet.optimizers[i], fleet.schedules[i], next(fleet.batches[i]))
        for fragment in due_fragments(step, args.fragments, args.sync_every):
            fleet.send(fragment, step)
        for fragment in fleet.takes.pop(step, []):
            fleet.take(fragment)
    return fleet.eval_global()


@torch.no_grad()
def rejoin(fleet: Replicas, task: Task, args: argparse.Namespace, *, cold: bool) -> None:
    """Replica AWAY joins again at the global model; cold: with a new optimizer, schedule and stream."""
    fleet.away.discard(AWAY)
    for n, p in fleet.params[AWAY].items():
        p.copy_(fleet.globals[n])
        fleet.anchors[AWAY][n] = fleet.globals[n].clone()
    if cold:
        model = fleet.models[AWAY]
        fleet.optimizers[AWAY] = task.make_inner_optimizer(model)
        fleet.schedules[AWAY] = task.make_lr_schedule(fleet.optimizers[AWAY], args.steps)
        fleet.batches[AWAY] = task.train_batches(args.seed + args.learners + AWAY)  # a stream no replica had


def run(args: argparse.Namespace) -> RejoinResult:
    torch.set_num_threads(1)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(names) - set(TASKS))
    if unknown:
        raise SystemExit(f"unknown task(s) {unknown}: choose from {', '.join(TASKS)}")
    rows = []
    budget = args.steps
    for name in names:
        for seed in (int(s) for s in args.seeds.split(",") if s.strip()):
            task_args = argparse.Namespace(**{**vars(args), "seed": seed, "steps": budget or TASKS[name].steps,
                                              "rule": "rebase", "alpha": 0.0})
            if not 0 < task_args.at * task_args.steps + task_args.down < task_args.steps:
                raise SystemExit(f"{name}: preempted at {task_args.at} of {task_args.steps} steps and away "
                                 f"{task_args.down}: it must be back before the end")
            evals = {}
            for arm in ARMS:
                evals[arm] = run_arm(TASKS[name].task, task_args, arm)
                log.info("rejoin %s seed %d %s: %.4f", name, seed, arm, evals[arm])
            rows.append((name, seed, evals))
    return RejoinResult(rows)
