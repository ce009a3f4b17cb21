"""`diloco bench quality`: on each task, decoupled DiLoCo vs synchronous DiLoCo (ours and torchft's)
vs one replica, the same model, data and tokens.

Arms, on one stack, each with M learners (replicas) of equal speed training a task's `steps` inner
steps each, learner i on data stream i, all from the same initial weights, inner optimizer and
schedule (so every arm trains the same tokens from the same seeds):

- decoupled: quorum K = 1, the adaptive grace window, clock cadence (the defaults);
- waiting: the decoupled arm's settings (P, tau, codec, take rule) with learners that wait for each
  merge (`--wait-for-merge`), rounds of every learner on the step cadence: what the decoupled arm
  would reach if never waiting cost nothing (invariant 11: within 0.5% of it). Not the clock: on
  shared cores a waiting learner frees the CPU for the others, the fleet's step times and so the
  clock's period shrink, and the rounds fall apart into one or two learners' short pieces;
- sync: our synchronous DiLoCo: the whole model as one fragment, quorum K = M, no grace window, step
  cadence, and every learner waits for the new version before training on (`--wait-for-merge`);
- torchft: torchft 0.2.0's synchronous DiLoCo (`infra.bench.peer`): one fragment, quorum of all M
  replicas, gloo, the same H and outer optimizer (Nesterov, lr 0.7, momentum 0.9); skipped, with a
  message, when torchft is not installed (`pip install -e '.[peer]'`);
- baseline: one replica for M x steps steps of the same batch size (the same tokens), trained in
  this process, its schedule spanning them all.

Straggler arms, every learner paced (each step takes at least `pace` seconds, the rest slept, so that
speed ratios hold on shared cores; `pace` fits the fleet's load to this machine's cores) and all of
them ending together (equal wall time):

- straggler: the decoupled arm with learner M-1 STRAGGLER_SLOWDOWN x slower per step, training
  steps / STRAGGLER_SLOWDOWN steps (its schedule spans what it does in the others' time);
- without: the decoupled arm of the M-1 fast learners alone;
- torchft_without: torchft's synchronous DiLoCo of the M-1 fast replicas: what torchft does with a
  straggler at best, leaving it out of every quorum (`min_replicas` M-1).

- restarted: the decoupled arm, paced, with learner 1 SIGKILLed at RESTART_AT of the others' time
  and back RESTART_DOWN_S later (a preempted spot instance): the new incarnation trains its whole
  `steps` again, on a new data stream, and finishes last, training on alone (SIGKILL saves no state,
  and the first periodic save, after 10 sends of fragment 0, comes later than the kill at the defaults).

A preempted learner that rejoins (issue 30), all paced alike:

- paced: the decoupled arm, paced, no outage: the reference;
- preempted: learner 1 sent SIGTERM at RESTART_AT of the others' time (a spot preemption: it sends its
  progress, saves its state and exits 143) and started again RESTART_DOWN_S later with the same
  command: it resumes from its saved state (inner optimizer, LR schedule, data position, step);
- preempted_cold: the same with `--no-save-state` for learner 1: it starts its optimizer, schedule
  and data afresh and trains its whole `steps` again (on a new data stream, as the restarted arm's:
  it repeats none of the batches it trained, so what it loses is the optimizer's and schedule's state
  alone; the recovered share errs low if anything).

The verdict holds straggler to <= both: adding a slow learner never leaves the model worse; and the
restarted arm to the end-of-run bound: a learner that finishes last, alone, does not undo the run;
and the state restore to recovering at least half of what a cold rejoin costs at the others' end
(`quality_report.rejoin`).

Our arms' learners are `diloco learner --task` processes (the public `Learner` API). Every arm's
global model is evaluated after every committed version (outer step; every M x H steps for the
baseline), after the arm has ended.

Settings: every task runs at its own H and budget (`own`) and at the run's defaults (`defaults`: H =
50, as a user gets it, over at least MIN_ROUNDS rounds per fragment: the task's steps, raised to 20 x
50 if fewer); a task whose own H is the default runs once. Prints a table task x arm (final eval
loss, best of the last 10%, end-of-run damage, ratios to torchft and to the baseline, gap to the
floor) and each task's verdict against the targets (`infra.bench.quality_report`). Tasks:
`infra.bench.quality_tasks`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from diloco.coordinator.config import RunSettings
from diloco.infra.bench.peer import run_torchft, torchft_missing
from diloco.infra.bench.quality_report import PREEMPTED, ArmCurve, TaskReport, table
from diloco.infra.bench.quality_tasks import TASKS, BenchTask, pick
from diloco.infra.bench.trial import (SYNC_LEARNER, LearnerPlan, Trial, TrialResult, add_out_arguments,
                                      add_repeats_argument, bench_stack, run_args, run_dir, run_trial, sync_trial,
                                      turns)
from diloco.infra.local.fleet import Outage
from diloco.infra.local.stack import LocalStack
from diloco.infra.output import Progress
from diloco.storage.codecs import CODECS
from diloco.workers.tasks.base import Task, train_baseline, train_step

log = logging.getLogger(__name__)

NAME = "quality"
HELP = ("eval loss of decoupled DiLoCo, synchronous DiLoCo (ours, torchft's) and a single replica on the same "
        "token budget, per task")
RUNS_ONCE = ("waiting",)
"""Arms whose every run trains the same bits: learners that wait for each merge of a round of every
learner, on the step cadence (the same final to every digit printed, run after run: 1.6178 on fast,
1.66105 on vision). `--repeats` runs them once."""
ARMS = ("decoupled", "waiting", "sync", "torchft", "baseline", "straggler", "without", "torchft_without", "restarted",
        "paced", "preempted", "preempted_cold")
PACED = ("straggler", "without", "torchft_without", "restarted", "paced", "preempted", "preempted_cold")
STRAGGLER_SLOWDOWN = 5.0
"""The straggler arm's slow learner takes this many times as long per step as the others."""
HEADROOM = 1.5
"""The paced arms' step time: this x a step's compute time x the fleet's load per core."""
RESTART_AT = 0.4
"""The restarted and preempted arms' learner 1 is killed (preempted) this far into the others' expected time."""
RESTART_DOWN_S = 10.0
"""...and started again this long after the signal."""
REJOINS = 1
"""The learner that the restarted and preempted arms take down (its index)."""
SETTINGS = ("own", "defaults")
MIN_ROUNDS = 20
"""At the run's defaults, a task's budget gives every fragment at least this many rounds of H steps."""
DEFAULTS = RunSettings()
"""The decoupled arm runs with the defaults a user gets (P, tau, codec, cadence); H is the task's or the default's."""
BUDGET_S = 3600.0
"""A cap only: the arms end when every learner has done its steps."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_arguments(parser, "quality")
    parser.add_argument("--tasks", default="demo",
                        help=f"comma-separated subset of {','.join(TASKS)}, or all (default: %(default)s)")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="inner steps per learner (default: the task's)")
    parser.add_argument("--fragments", type=int, default=DEFAULTS.num_fragments,
                        help="P of the decoupled arm (default: the run default, %(default)s)")
    parser.add_argument("--sync-every", type=int,
                        help="H of every DiLoCo arm, in one setting (default: the task's, and the run's default)")
    parser.add_argument("--at", default=",".join(SETTINGS),
                        help="comma-separated subset of %(default)s: each task at its own H and budget, and at the "
                             f"run's default H = {DEFAULTS.sync_every} over >= {MIN_ROUNDS} rounds per fragment")
    parser.add_argument("--overlap-steps", type=int, default=DEFAULTS.overlap_steps,
                        help="tau of our arms (default: the run default, %(default)s)")
    parser.add_argument("--codec", default=DEFAULTS.codec, choices=CODECS,
                        help="outer-gradient codec of our arms (default: the run default, %(default)s)")
    parser.add_argument("--learner-args", default="",
                        help="extra options for the decoupled arm's learners, e.g. '--own-version-wait 0'")
    parser.add_argument("--coordinator-args", default="",
                        help="extra options for the decoupled arm's coordinator, after the run's settings (so they "
                             "override them), e.g. '--fragments 1' or '--no-staleness-discount'")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help="comma-separated subset of %(default)s (default: all)")
    add_repeats_argument(parser, "the baseline, one process from fixed seeds, and the waiting arm, whose learners "
                                 "train the same bits every run, run once")


@dataclass(frozen=True, slots=True)
class Budget:
    label: str
    """The task's name, with its H when it runs at the run's defaults: 'fast', 'fast@H50'."""
    steps: int
    sync_every: int


def budgets(args: argparse.Namespace, name: str, bench: BenchTask) -> list[Budget]:
    """The settings a task runs at: its own H and budget, the run's default H over >= MIN_ROUNDS
    rounds (steps a multiple of H), or the one H `--sync-every` gives."""
    if args.sync_every:
        return [Budget(name, args.steps or bench.steps, args.sync_every)]
    wanted = settings(args.at)
    own = Budget(name, args.steps or bench.steps, bench.sync_every)
    h = DEFAULTS.sync_every
    steps = args.steps or -(-max(bench.steps, MIN_ROUNDS * h) // h) * h
    at_defaults = own if own.sync_every == h else Budget(f"{name}@H{h}", steps, h)
    if at_defaults == own:  # the task's own H is the default: one setting, whichever was asked for
        return [own]
    return [own] * ("own" in wanted) + [at_defaults] * ("defaults" in wanted)


def settings(names: str) -> list[str]:
    wanted = [a.strip() for a in names.split(",") if a.strip()]
    unknown = set(wanted) - set(SETTINGS)
    if unknown or not wanted:
        raise SystemExit(f"unknown setting(s) {sorted(unknown)}: choose from {', '.join(SETTINGS)}")
    return wanted


def our_arms(args: argparse.Namespace, b: Budget) -> dict[str, Trial]:
    learners = tuple(LearnerPlan(f"learner-{i}", steps=b.steps, data_seed=i) for i in range(args.learners))
    decoupled = Trial("decoupled", learners, BUDGET_S,
                      run_args(args.fragments, b.sync_every, args.overlap_steps, args.codec),
                      ("--min-quorum", "1", *args.coordinator_args.split()), tuple(args.learner_args.split()))
    return {
        "decoupled": decoupled,
        "waiting": replace(decoupled, name="waiting", learner_args=(*decoupled.learner_args, *SYNC_LEARNER),
                           coordinator_args=("--min-quorum", str(args.learners), "--cadence", "steps",
                                             *args.coordinator_args.split())),
        "sync": sync_trial("sync", learners, BUDGET_S, sync_every=b.sync_every, overlap_steps=args.overlap_steps,
                           codec=args.codec),
    }


def paced_arms(args: argparse.Namespace, b: Budget, decoupled: Trial, pace_s: float) -> dict[str, Trial]:
    """The straggler arm, our M-1 fleet without it, the restarted arm and the preempted arms with
    their reference, all paced at `pace_s` per step (see the module docstring)."""
    slow = LearnerPlan(f"learner-{args.learners - 1}", slowdown=STRAGGLER_SLOWDOWN,
                       steps=max(1, round(b.steps / STRAGGLER_SLOWDOWN)), data_seed=args.learners - 1)
    fast = decoupled.learners[:-1]
    at_s = RESTART_AT * b.steps * pace_s

    def down(outage: Outage | tuple[float, float], args: tuple[str, ...] = ()) -> tuple[LearnerPlan, ...]:
        return tuple(replace(p, outages=(outage,), args=args) if i == REJOINS else p
                     for i, p in enumerate(decoupled.learners))

    paced = replace(decoupled, name="paced", step_time_s=pace_s)
    preemption = Outage(at_s, RESTART_DOWN_S, signal.SIGTERM)
    return {"straggler": replace(decoupled, name="straggler", learners=(*fast, slow), step_time_s=pace_s),
            "without": replace(decoupled, name="without", learners=fast, step_time_s=pace_s),
            "restarted": replace(paced, name="restarted", learners=down((at_s, RESTART_DOWN_S))),
            "paced": paced,
            "preempted": replace(paced, name="preempted", learners=down(preemption)),
            "preempted_cold": replace(paced, name="preempted_cold", learners=down(preemption, ("--no-save-state",)))}


def pace(task: Task, learners: int, cores: int | None = None, steps: int = 8) -> float:
    """Seconds per step that a paced fleet of `learners - 1` learners and one straggler can keep on
    this machine's cores: a step's compute time, measured here on one thread, fitted by `fleet_pace`."""
    torch.set_num_threads(1)
    model = task.make_model(0)
    optimizer = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(optimizer, 2 * steps)
    batches = task.train_batches(0)
    train_step(task, model, optimizer, schedule, next(batches))  # warm
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(task, model, optimizer, schedule, next(batches))
    return fleet_pace((time.perf_counter() - t0) / steps, learners, cores or os.cpu_count() or 1)


def fleet_pace(step_s: float, learners: int, cores: int) -> float:
    """A step's compute time x the fleet's load per core (never below one step) x HEADROOM (for the
    coordinator and the learners' transfer threads)."""
    load = (learners - 1 + 1 / STRAGGLER_SLOWDOWN) / cores
    return round(step_s * max(1.0, load) * HEADROOM, 3)


@dataclass
class QualityResult:
    learners: int
    reports: list[TaskReport]

    def table(self) -> str:
        return table(self.reports, self.learners)

    def to_json(self) -> dict:
        return {"bench": NAME, "learners": self.learners, "tasks": {r.task: r.to_json() for r in self.reports}}


def rejoin_details(trial: Trial, t: TrialResult) -> dict:
    """What the rejoin figures need (`quality_report.rejoin`): when the learners other than the one
    the arm takes down had their last pieces merged, and when that one was started again."""
    if trial.name not in ("paced", *PREEMPTED):
        return {}
    down = trial.learners[REJOINS]
    others = [s for name, s in t.last_merged_s.items() if name != down.name]
    details = {"others_end_s": max(others), "last_merged_s": t.last_merged_s}
    if down.outages:
        at_s, down_s, *_ = down.outages[0]
        details["preempt_s"], details["restart_s"] = at_s, at_s + down_s
    return details


def trial_curve(t: TrialResult) -> ArmCurve:
    details = {"run": t.run, "curve_versions": [list(v) for v in t.curve_versions], "counters": t.counters,
               "heads": {str(k): v for k, v in t.heads.items()}, "merged_tokens": t.merged_tokens,
               "rounds": None if t.rounds is None else t.rounds.to_json(),
               "steps_through_per_take": t.total("steps_through") / max(1.0, t.total("adopted")),
               "sync_s": t.total("sync_s")}
    return ArmCurve(t.name, t.curve, t.wall_s, details=details)


def run_task(b: Budget, bench: BenchTask, args: argparse.Namespace, wanted: list[str],
             stack: LocalStack) -> TaskReport:
    """Every wanted arm on one task, `args.repeats` times: the arms in turn, each repeat starting one
    arm further along (a machine whose speed drifts over the minutes weighs on every arm alike); the
    baseline, one process from fixed seeds, and the arms of RUNS_ONCE once."""
    name, task, out = b.label, bench.task, args.out / b.label
    out.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    ours = our_arms(args, b)
    paced = set(PACED) & set(wanted)
    pace_s = pace(task, args.learners) if paced else 0.0
    if paced:
        log.info("quality %s: straggler arms paced at %.3fs per step (the straggler x%g)", name, pace_s,
                 STRAGGLER_SLOWDOWN)
        ours |= paced_arms(args, b, ours["decoupled"], pace_s)
    runners: dict[str, Callable[[Path], ArmCurve]] = {
        arm: partial(run_ours, trial, task, stack, name) for arm, trial in ours.items() if arm in wanted}
    for arm, replicas, step_s in (("torchft", args.learners, 0.0), ("torchft_without", args.learners - 1, pace_s)):
        if arm not in wanted:
            continue
        missing = torchft_missing()
        if missing:
            skipped[arm] = missing
            log.warning("quality %s: %s arm skipped: %s", name, arm, missing)
            continue
        runners[arm] = partial(run_peer, task, b, replicas, arm, step_s, name)
    arms: dict[str, list[ArmCurve]] = {}
    for repeat, order in enumerate(repeat_turns(list(runners), args.repeats)):
        if args.repeats > 1:
            log.info("quality %s: repeat %d of %d: %s", name, repeat + 1, args.repeats, ", ".join(order))
        where = run_dir(out, repeat, args.repeats)
        for arm in order:
            arms.setdefault(arm, []).append(runners[arm](where))
    if "baseline" in wanted:
        torch.set_num_threads(2)
        t0 = time.monotonic()
        total = args.learners * b.steps
        initial = task.eval_loss(task.make_model(0))
        curve = train_baseline(task, total, seed=0, eval_every=args.learners * b.sync_every)
        arms["baseline"] = [ArmCurve("baseline", [(0.0, initial), *curve], time.monotonic() - t0, x_unit="steps")]
    return TaskReport(name, b.steps, b.sync_every, task.entropy_floor(), arms, skipped, task.to_wire())


def repeat_turns(arms: list[str], repeats: int) -> list[list[str]]:
    """The arms each repeat runs, in order (`trial.turns`), the arms of RUNS_ONCE in the first only."""
    return [[a for a in order if r == 0 or a not in RUNS_ONCE] for r, order in enumerate(turns(arms, repeats))]


def run_ours(trial: Trial, task: Task, stack: LocalStack, label: str, out: Path) -> ArmCurve:
    """One run of one of our arms (its logs under `out`): its curve and details."""
    log.info("quality %s: arm %s ...", label, trial.name)
    result = run_trial(stack, trial, task, out, curve_points=None)
    arm = trial_curve(result)
    if trial.step_time_s:
        arm.details["pace_s"] = trial.step_time_s
    arm.details |= rejoin_details(trial, result)
    log.info("quality %s: arm %s: eval %.4f in %.0fs", label, trial.name, result.eval_loss, result.wall_s)
    return arm


def run_peer(task: Task, b: Budget, replicas: int, arm: str, step_s: float, label: str, out: Path) -> ArmCurve:
    """One run of a torchft arm: `replicas` replicas, paced at `step_s` per step (0: not paced), its
    logs under `out`."""
    log.info("quality %s: arm %s ...", label, arm)
    out.mkdir(parents=True, exist_ok=True)
    task_path = out / "task.json"
    task_path.write_text(json.dumps(task.to_wire()))
    peer = run_torchft(task, task_path, out, replicas=replicas, steps=b.steps, sync_every=b.sync_every,
                       budget_s=BUDGET_S, name=arm, step_time_s=step_s)
    log.info("quality %s: arm %s: eval %.4f in %.0fs", label, arm, peer.eval_loss, peer.wall_s)
    return ArmCurve(arm, peer.curve, peer.wall_s,
                    details={"steps": peer.steps, "unsynced_steps": peer.unsynced_steps,
                             **({"pace_s": step_s} if step_s else {})})


def run(args: argparse.Namespace) -> QualityResult:
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(wanted) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}: choose from {', '.join(ARMS)}")
    runs = [(b, bench) for name, bench in pick(args.tasks).items() for b in budgets(args, name, bench)]
    reports = []
    with bench_stack(args.out, keep=args.keep_stack) as stack, Progress("quality", unit="tasks") as bar:
        bar.update(0, len(runs))
        for b, bench in runs:
            reports.append(run_task(b, bench, args, wanted, stack))
            bar.advance()
            if len(runs) > 1:
                log.info("quality %s done:\n%s", b.label, table(reports[-1:], args.learners))
    return QualityResult(args.learners, reports)
