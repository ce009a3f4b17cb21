"""`diloco bench hetero`: does a fleet of mixed speeds beat its fastest member? Same wall clock for every arm.

Profiles (step-time multipliers of four learners, paced at `--step-time-s` x multiplier per step,
so the ratios hold however many processes share the cores):

- A: 1, 1.3, 1.7, 2.2 (hardware generations);
- B: 1, 1, 1, 4 (one straggler);
- C: A, with learner 1 SIGKILLed halfway through the budget and restarted `--down-s` later.

Arms, each for the same `--budget-s` of wall clock:

- default: the run's default policy (what `diloco coordinator` does without options);
- sync: quorum = all learners, no grace window, step cadence, one fragment, learners wait for
  every merge (synchronous DiLoCo: the slowest sets the pace);
- fastest_alone: only the fastest learner, through the same coordinator;
- equal_speed: four learners of equal speed doing the same total number of steps as the
  profile's fleet (each at multiplier 4 / sum(1 / m_i)), under the default policy.

The table is the final eval loss of the global model per profile and arm; the JSON also holds each
arm's loss-over-wall-time curve (`diloco bench hetero --plot PNG` draws profile A's).
Targets: default beats sync and fastest_alone on every profile and is within 3% of equal_speed.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from diloco.infra.output import figures_table
from diloco.infra.bench.trial import (LearnerPlan, Trial, TrialResult, add_out_arguments, bench_stack, run_args,
                                      run_trial, sync_trial)
from diloco.workers.tasks.demo import DemoTask

log = logging.getLogger(__name__)

NAME = "hetero"
HELP = "mixed-speed fleets (profiles A, B, C) vs synchronous, the fastest learner alone and equal-speed learners"

PROFILES: dict[str, tuple[float, ...]] = {"A": (1.0, 1.3, 1.7, 2.2), "B": (1.0, 1.0, 1.0, 4.0), "C": (1.0, 1.3, 1.7, 2.2)}
KILLED = {"C": 1}
"""Profile -> index of the learner killed halfway and restarted."""
ARMS = ("default", "sync", "fastest_alone", "equal_speed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_arguments(parser, "hetero")
    parser.add_argument("--profiles", default="A,B,C", help="comma-separated subset of A,B,C (default: %(default)s)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of %(default)s")
    parser.add_argument("--budget-s", type=float, default=150.0, help="wall clock per arm (default: %(default)s)")
    parser.add_argument("--step-time-s", type=float, default=0.1,
                        help="pace of a learner of multiplier 1, seconds per step (default: %(default)s)")
    parser.add_argument("--down-s", type=float, default=10.0, help="profile C: how long the killed learner is down")
    parser.add_argument("--sync-every", type=int, default=30, help="H (default: %(default)s)")
    parser.add_argument("--fragments", type=int, default=2, help="P for the non-synchronous arms (default: %(default)s)")
    parser.add_argument("--coordinator-args", default="",
                        help="extra options for the coordinator of the default and equal_speed arms, e.g. "
                             "'--grace-gamma 0.3' (to measure a policy change)")
    parser.add_argument("--learner-args", default="",
                        help="extra options for the learners of the default and equal_speed arms, e.g. "
                             "'--own-version-wait 0'")
    parser.add_argument("--curve-points", type=int, default=10, help="evaluations per arm (default: %(default)s)")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="plot profile A's loss over wall time (needs matplotlib)")


def equal_multiplier(multipliers: tuple[float, ...]) -> float:
    """The multiplier at which len(multipliers) equal learners do as many steps as the mixed fleet."""
    return len(multipliers) / sum(1.0 / m for m in multipliers)


def plans(profile: str, arm: str, budget_s: float, down_s: float) -> tuple[LearnerPlan, ...]:
    speeds = PROFILES[profile]
    if arm == "fastest_alone":
        speeds = (min(speeds),)
    elif arm == "equal_speed":
        speeds = (equal_multiplier(speeds),) * len(speeds)
    killed = KILLED.get(profile)
    return tuple(LearnerPlan(f"learner-{i}", slowdown=round(m, 4), data_seed=i,
                             outages=((budget_s / 2, down_s),) if i == killed and i < len(speeds) else ())
                 for i, m in enumerate(speeds))


def trial(profile: str, arm: str, args: argparse.Namespace) -> Trial:
    learners = plans(profile, arm, args.budget_s, args.down_s)
    name = f"{profile}-{arm}".replace("_", "-")
    if arm == "sync":
        return sync_trial(name, learners, args.budget_s, sync_every=args.sync_every, step_time_s=args.step_time_s)
    return Trial(name, learners, args.budget_s, run_args(args.fragments, args.sync_every, 3, "int8"),
                 tuple(args.coordinator_args.split()), tuple(args.learner_args.split()), step_time_s=args.step_time_s)


@dataclass
class HeteroResult:
    budget_s: float
    results: dict[str, dict[str, TrialResult]]

    def losses(self) -> dict[str, dict[str, float]]:
        return {p: {a: t.eval_loss for a, t in arms.items()} for p, arms in self.results.items()}

    def verdicts(self) -> dict[str, str]:
        out = {}
        for p, loss in self.losses().items():
            if "default" not in loss:
                continue
            parts = []
            for other in ("sync", "fastest_alone"):
                if other in loss:
                    parts.append(f"{'beats' if loss['default'] < loss[other] else 'does NOT beat'} {other}")
            if "equal_speed" in loss:
                gap = loss["default"] / loss["equal_speed"] - 1
                parts.append(f"{gap:+.1%} vs equal_speed ({'within' if gap <= 0.03 else 'NOT within'} 3%)")
            out[p] = f"profile {p}: default " + ", ".join(parts)
        return out

    def table(self) -> str:
        arms = [a for a in ARMS if any(a in r for r in self.results.values())]
        rows = [[p, *(self.results[p][a].eval_loss if a in self.results[p] else None for a in arms)]
                for p in self.results]
        head = f"hetero: final eval loss after {self.budget_s:.0f}s of wall clock per arm"
        return "\n".join([head, figures_table(["profile", *arms], rows), *self.verdicts().values()])

    def to_json(self) -> dict:
        return {"bench": NAME, "budget_s": self.budget_s, "profiles": self.losses(), "verdicts": self.verdicts(),
                "multipliers": {p: PROFILES[p] for p in self.results},
                "trials": {p: {a: t.to_json() for a, t in arms.items()} for p, arms in self.results.items()}}


def plot(result: HeteroResult, profile: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for arm, t in result.results[profile].items():
        ax.plot([x for x, _ in t.curve], [y for _, y in t.curve], marker="o", markersize=3, label=arm)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("eval loss of the global model")
    ax.set_title(f"profile {profile}: multipliers {', '.join(f'{m:g}' for m in PROFILES[profile])}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    log.info("wrote %s", path)


def run(args: argparse.Namespace) -> HeteroResult:
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = (set(profiles) - set(PROFILES)) | (set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown profile(s)/arm(s) {sorted(unknown)}: profiles {sorted(PROFILES)}, arms {ARMS}")
    task = DemoTask()
    results: dict[str, dict[str, TrialResult]] = {}
    with bench_stack(args.out, keep=args.keep_stack) as stack:
        for p in profiles:
            for a in arms:
                t = run_trial(stack, trial(p, a, args), task, args.out, curve_points=args.curve_points)
                results.setdefault(p, {})[a] = t
                log.info("hetero: profile %s arm %s: eval %.4f (%d versions)", p, a, t.eval_loss,
                         t.counters.get("versions_committed", 0))
    result = HeteroResult(args.budget_s, results)
    if args.plot is not None and "A" in results:
        plot(result, "A", args.plot)
    return result
