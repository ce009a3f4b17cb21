"""`diloco bench failures`: decoupled vs synchronous DiLoCo under learner kills, restarts and a straggler.

Both arms run the same fleet for the same wall-clock budget: M learners paced at `--step-time-s`
per step (so their speeds do not depend on how many processes share the cores), the last one
`--slow-factor` times slower, and one seeded schedule of SIGKILLs: every learner fails at
exponentially distributed intervals (mean `--mtbf-s`) and comes back `--down-s` later, as a
replacement machine joining from the latest global versions.

- decoupled: quorum K = 1, grace window, clock cadence; nobody waits.
- synchronous: one fragment, quorum K = M, no grace, step cadence, learners wait for each merge
  (the barrier; with one fragment every learner waits on the same round, as in DiLoCo).
  A dead learner holds the round until its heartbeat lease lapses (then the quorum shrinks to
  the live learners); the straggler sets everyone's pace.

Figures per arm: the eval loss of the global model over wall time, the time to reach `--target`
(interpolated between evaluations), and goodput:

    goodput = tokens merged into global versions / tokens the fleet would have trained in the
              same wall time at its paced speed with no failures and no waiting
            = merged / sum_learners(budget_s / (step_time_s x slowdown)) x tokens_per_step

Work lost in a kill (unsent progress), time down, time spent waiting at the barrier, refused and
dropped contributions all count against it. Target: decoupled reaches the target at least 3x sooner.
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass

from diloco.infra.output import figures_table
from diloco.infra.bench.trial import (LearnerPlan, Trial, TrialResult, add_out_arguments, bench_stack, run_args,
                                      run_trial, sync_trial, time_to)
from diloco.workers.tasks.demo import DemoTask

log = logging.getLogger(__name__)

NAME = "failures"
HELP = "decoupled vs synchronous DiLoCo under seeded learner kills and a straggler: time to a target loss, goodput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_arguments(parser, "failures")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget of each arm (default: %(default)s)")
    parser.add_argument("--step-time-s", type=float, default=0.12,
                        help="pace of a full-speed learner, seconds per step (default: %(default)s)")
    parser.add_argument("--slow-factor", type=float, default=3.0, help="the last learner's slowdown (default: %(default)s)")
    parser.add_argument("--mtbf-s", type=float, default=45.0,
                        help="mean time between failures of each learner (default: %(default)s)")
    parser.add_argument("--down-s", type=float, default=10.0, help="how long a killed learner stays down (default: %(default)s)")
    parser.add_argument("--target", type=float, default=2.2, help="eval loss to reach (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default: %(default)s)")
    parser.add_argument("--sync-every", type=int, default=30, help="H (default: %(default)s)")
    parser.add_argument("--curve-points", type=int, default=24, help="evaluations per arm (default: %(default)s)")


def outage_schedule(seed: int, learners: int, budget_s: float, mtbf_s: float, down_s: float
                    ) -> list[tuple[tuple[float, float], ...]]:
    """Per learner, (at_s, down_s) kills: exponential up-times of mean `mtbf_s` between them."""
    rng = random.Random(seed)
    schedule = []
    for _ in range(learners):
        kills, t = [], 0.0
        while True:
            t += rng.expovariate(1.0 / mtbf_s)
            if t >= budget_s - down_s:
                break
            kills.append((round(t, 1), down_s))
            t += down_s
        schedule.append(tuple(kills))
    return schedule


def fleet(args: argparse.Namespace) -> tuple[LearnerPlan, ...]:
    outages = outage_schedule(args.seed, args.learners, args.budget_s, args.mtbf_s, args.down_s)
    return tuple(LearnerPlan(f"learner-{i}", slowdown=args.slow_factor if i == args.learners - 1 else 1.0,
                             data_seed=i, outages=outages[i]) for i in range(args.learners))


def ideal_tokens(plans: tuple[LearnerPlan, ...], budget_s: float, step_time_s: float, tokens_per_step: int) -> float:
    return sum(budget_s / (step_time_s * p.slowdown) for p in plans) * tokens_per_step


@dataclass
class FailuresResult:
    target: float
    budget_s: float
    plans: tuple[LearnerPlan, ...]
    trials: dict[str, TrialResult]
    ideal_tokens: float

    def reached(self, name: str) -> float | None:
        return time_to(self.trials[name].curve, self.target)

    def goodput(self, name: str) -> float:
        return self.trials[name].merged_tokens / self.ideal_tokens

    def speedup(self) -> tuple[float | None, str]:
        """(sync time / decoupled time, how to read it)."""
        d, s = self.reached("decoupled"), self.reached("sync")
        if d is None:
            return None, "decoupled did not reach the target within the budget"
        if s is None:
            return self.budget_s / d, f"at least {self.budget_s / d:.1f}x: sync did not reach the target within the budget"
        return s / d, f"{s / d:.1f}x"

    def table(self) -> str:
        kills = sum(len(p.outages) for p in self.plans)
        rows = [[name, t.eval_loss, self.reached(name), self.goodput(name), t.counters.get("versions_committed"),
                 t.restarts] for name, t in self.trials.items()]
        head = (f"failures: {len(self.plans)} learners (last {self.plans[-1].slowdown:g}x slower), {kills} kills, "
                f"{self.budget_s:.0f}s per arm, target eval loss {self.target}")
        ratio, text = self.speedup()
        verdict = (f"\ndecoupled reaches the target {text} sooner (target >= 3x: {'met' if ratio >= 3 else 'NOT met'})"
                   if ratio is not None else f"\n{text}")
        return head + "\n" + figures_table(["arm", "final eval", "s to target", "goodput", "versions", "restarts"], rows) + verdict

    def to_json(self) -> dict:
        ratio, text = self.speedup()
        return {"bench": NAME, "target": self.target, "budget_s": self.budget_s,
                "schedule": {p.name: {"slowdown": p.slowdown, "outages": p.outages} for p in self.plans},
                "seconds_to_target": {n: self.reached(n) for n in self.trials},
                "goodput": {n: self.goodput(n) for n in self.trials}, "speedup": ratio, "speedup_text": text,
                "ideal_tokens": self.ideal_tokens, "trials": {k: t.to_json() for k, t in self.trials.items()}}


def run(args: argparse.Namespace) -> FailuresResult:
    task = DemoTask()
    plans = fleet(args)
    shape = run_args(2, args.sync_every, 3, "int8")
    arms = {
        "decoupled": Trial("decoupled", plans, args.budget_s, shape, ("--min-quorum", "1"),
                           step_time_s=args.step_time_s),
        "sync": sync_trial("sync", plans, args.budget_s, sync_every=args.sync_every, step_time_s=args.step_time_s),
    }
    trials = {}
    with bench_stack(args.out, keep=args.keep_stack) as stack:
        for name, trial in arms.items():
            log.info("failures: arm %s ...", name)
            trials[name] = run_trial(stack, trial, task, args.out, curve_points=args.curve_points)
    return FailuresResult(args.target, args.budget_s, plans, trials,
                          ideal_tokens(plans, args.budget_s, args.step_time_s, task.tokens_per_step()))
