"""`diloco bench quality`: decoupled vs synchronous DiLoCo vs one AdamW replica, same model, data and tokens.

Arms, each on the same stack, with M learners of equal speed training `--steps` inner steps each
(so every arm trains the same number of tokens, from the same seeds):

- decoupled: quorum K = 1, the adaptive grace window, clock cadence (the defaults);
- synchronous DiLoCo: the whole model as one fragment, quorum K = M, no grace window, step
  cadence, and every learner waits for the new version before training on (`--wait-for-merge`):
  the barrier of DiLoCo (with several fragments on staggered schedules, learners that joined at
  different times would wait on different rounds);
- baseline: one replica with AdamW for M x steps steps of the same batch size (the same tokens),
  trained in this process.

Prints eval losses, the ratios to the baseline and the gap to the synthetic language's entropy
floor (the best loss any model can reach). Target: decoupled / baseline <= 1.01.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from infra.output import figures_table
from infra.bench.trial import LearnerPlan, Trial, TrialResult, bench_stack, run_args, run_trial, sync_trial
from workers.demo.task import DemoTask, train_baseline

log = logging.getLogger(__name__)

NAME = "quality"
HELP = "eval loss of decoupled DiLoCo, synchronous DiLoCo and a single AdamW replica on the same token budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("out/bench/quality"), help="stack data and logs")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps per learner (default: %(default)s)")
    parser.add_argument("--fragments", type=int, default=2, help="P (default: %(default)s)")
    parser.add_argument("--sync-every", type=int, default=30, help="H (default: %(default)s)")
    parser.add_argument("--overlap-steps", type=int, default=3, help="tau (default: %(default)s)")
    parser.add_argument("--codec", default="int8", help="outer-gradient codec (default: %(default)s)")
    parser.add_argument("--learner-args", default="",
                        help="extra options for the decoupled arm's learners, e.g. '--own-version-wait 0'")
    parser.add_argument("--coordinator-args", default="",
                        help="extra options for the decoupled arm's coordinator, after the run's settings (so they "
                             "override them), e.g. '--fragments 1' or '--no-staleness-discount'")
    parser.add_argument("--arms", default="decoupled,sync,baseline",
                        help="comma-separated subset of decoupled,sync,baseline (default: %(default)s)")


def arms(args: argparse.Namespace) -> dict[str, Trial]:
    budget_s = 3600.0  # a cap only: the arms end when every learner has done its steps
    learners = tuple(LearnerPlan(f"learner-{i}", steps=args.steps, data_seed=i) for i in range(args.learners))
    return {
        "decoupled": Trial("decoupled", learners, budget_s,
                           run_args(args.fragments, args.sync_every, args.overlap_steps, args.codec),
                           ("--min-quorum", "1", *args.coordinator_args.split()),
                           tuple(args.learner_args.split())),
        "sync": sync_trial("sync", learners, budget_s, sync_every=args.sync_every, overlap_steps=args.overlap_steps,
                           codec=args.codec),
    }


@dataclass
class QualityResult:
    learners: int
    steps: int
    floor: float | None
    trials: dict[str, TrialResult]
    baseline: float | None
    baseline_s: float

    def losses(self) -> dict[str, float]:
        out = {name: t.eval_loss for name, t in self.trials.items()}
        if self.baseline is not None:
            out["baseline"] = self.baseline
        return out

    def table(self) -> str:
        rows = []
        for name, loss in self.losses().items():
            trial = self.trials.get(name)
            ratio = loss / self.baseline if self.baseline else None
            gap = loss - self.floor if self.floor is not None else None
            wall = trial.wall_s if trial else self.baseline_s
            versions = trial.counters.get("versions_committed") if trial else None
            r = trial.rounds if trial else None
            rows.append([name, loss, ratio, gap, versions, r and r.learners_per_version,
                         r and 100 * r.stale_share, r and r.weight_sum, wall])
        head = (f"quality: {self.learners} learners x {self.steps} steps, same tokens for every arm; "
                f"entropy floor {self.floor:.4f}" if self.floor is not None else "")
        verdict = ""
        if self.baseline and "decoupled" in self.trials:
            r = self.trials["decoupled"].eval_loss / self.baseline
            verdict = f"\ndecoupled / baseline = {r:.3f} (target <= 1.01: {'met' if r <= 1.01 else 'NOT met'})"
        return head + "\n" + figures_table(["arm", "eval loss", "/ baseline", "- floor", "versions",
                                            "learners/version", "stale %", "weight sum", "wall s"], rows) + verdict

    def to_json(self) -> dict:
        return {"bench": NAME, "learners": self.learners, "steps_per_learner": self.steps, "entropy_floor": self.floor,
                "eval_loss": self.losses(),
                "ratio_to_baseline": {k: v / self.baseline for k, v in self.losses().items()} if self.baseline else {},
                "baseline_wall_s": self.baseline_s, "trials": {k: t.to_json() for k, t in self.trials.items()}}


def run(args: argparse.Namespace) -> QualityResult:
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(wanted) - {"decoupled", "sync", "baseline"}
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}: choose from decoupled, sync, baseline")
    task = DemoTask()
    trials: dict[str, TrialResult] = {}
    with bench_stack(args.out) as stack:
        for name, trial in arms(args).items():
            if name in wanted:
                log.info("quality: arm %s ...", name)
                trials[name] = run_trial(stack, trial, task, args.out)
                log.info("quality: arm %s: eval %.4f in %.0fs", name, trials[name].eval_loss, trials[name].wall_s)
    baseline, baseline_s = None, 0.0
    if "baseline" in wanted:
        torch.set_num_threads(2)
        t0 = time.monotonic()
        baseline = train_baseline(task, args.learners * args.steps, seed=0)[-1][1]
        baseline_s = time.monotonic() - t0
    return QualityResult(args.learners, args.steps, task.entropy_floor(), trials, baseline, baseline_s)
