"""The quality benchmark's figures: per task and arm, the final eval loss, the end of the run, the
ratios to the peer, the baseline and the same arm with waiting learners, the gap to the floor, and the
verdict against the targets.
Pure functions of the measured curves.

Repeats (`diloco bench quality --repeats N`): each arm runs N times, alternated with the other arms.
An arm's final is the mean of its runs' finals, its spread (max - min) / mean, its end-of-run damage
the worst run's; ratios are of means, and a preempted arm's rejoin figures the mean over its runs,
each against the paced arm's run of the same repeat.

End of the run: the best eval loss over the last 10% of an arm's curve points (counted in points,
i.e. committed versions for our arms, outer steps for torchft, evaluations every M x H steps for the
baseline; the genesis point not counted, the final point included), and the final loss minus that
best: the damage the end of the run did (0 if the final model is the best of them).

A preempted learner's rejoin (issue 30), each preempted arm against `paced` (the same fleet without
the outage), on curves of seconds since each arm started:

- at the others' end: the eval loss once the last piece of the learners that were never preempted
  had merged (the arms' learners have then computed for the same time: the preempted one lost its
  downtime in both arms, and a cold one has trained as many steps as a warm one, from step 0 again);
- cost: that minus the paced arm's at its own others' end; final cost: the same of the final losses
  (a cold learner trains its whole budget again, alone at the end: its final is on more tokens);
- bump: the worst excess of the arm's curve over the paced arm's at the same progress, from the
  restart to the others' end; mean excess: the mean over the same points. Progress: the time from
  the genesis to the others' end as a share of it, in each arm (on shared cores a paced fleet does
  not keep its pace exactly, and arms differ by seconds, which early in a run is a lot of loss);
  bump before: the same worst excess before the preemption, where the two arms are the same fleet
  (the noise of the measure);
- recovered: 1 - warm cost / cold cost (None when a cold rejoin cost nothing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

from diloco.infra.output import figures_table

LAST_SHARE = 0.1
"""The end of a run: this share of its curve points."""
MAX_TO_TORCHFT = 1.01
"""Target: decoupled final <= this x the torchft arm's final."""
MAX_TO_BASELINE = 1.02
"""Target: decoupled final <= this x the single-replica baseline's final."""
MAX_TO_WAITING = 1.005
"""Target: decoupled final <= this x the waiting arm's (the same run with learners that wait for each
merge): never waiting is (nearly) free (invariant 11)."""
MAX_WITH_STRAGGLER = 1.0
"""Target: the straggler arm's final <= this x the better of the fleets without the straggler (ours
and torchft's, at equal wall time): a slow learner never leaves the model worse."""
MAX_DAMAGE = 0.005
"""Target: decoupled final <= (1 + this) x the best of the last LAST_SHARE of the run."""
MIN_RECOVERED = 0.5
"""Target: a preempted learner's state restore recovers at least this share of what a cold rejoin
loses at the others' end (issue 30)."""
PREEMPTED = ("preempted", "preempted_cold")
"""The arms whose learner rejoins after a preemption: with its state restored, and cold (`--no-save-state`)."""


@dataclass(frozen=True, slots=True)
class EndOfRun:
    final: float
    best_last: float
    """The lowest eval loss over the last LAST_SHARE of the points (the final one included)."""
    points: int
    """Points in that window."""

    @property
    def damage(self) -> float:
        return self.final - self.best_last

    @property
    def damage_share(self) -> float:
        return self.damage / self.best_last


def end_of_run(losses: Sequence[float], share: float = LAST_SHARE) -> EndOfRun:
    """The end-of-run figures of a curve's losses, in order (without the genesis point)."""
    if not losses:
        raise ValueError("an empty curve has no end")
    n = max(1, math.ceil(share * len(losses)))
    return EndOfRun(final=losses[-1], best_last=min(losses[-n:]), points=n)


def loss_at(curve: Sequence[tuple[float, float]], t: float) -> float:
    """The model's eval loss at time `t`: that of the curve's last point at or before it, to the
    hundredth of a second the JSON keeps (its first point's if none is)."""
    before = [loss for x, loss in curve if x <= t + 0.01]
    return before[-1] if before else curve[0][1]


@dataclass(frozen=True, slots=True)
class Rejoin:
    """A preempted arm's figures against the paced arm (see the module docstring)."""

    at_others_end: float
    cost: float
    final: float
    final_cost: float
    bump: float
    """The worst excess over the paced arm's curve from the restart to the others' end (nan: no point there)."""
    mean_excess: float
    bump_before: float
    """The worst excess before the preemption: the measure's noise."""


def progress(curve: Sequence[tuple[float, float]], others_end_s: float) -> list[tuple[float, float]]:
    """The curve against progress: 0 at its first point (the genesis), 1 at the others' end."""
    t0 = curve[0][0]
    return [((x - t0) / (others_end_s - t0), loss) for x, loss in curve]


def rejoin(curve: Sequence[tuple[float, float]], paced: Sequence[tuple[float, float]], *, preempt_s: float,
           restart_s: float, others_end_s: float, paced_others_end_s: float) -> Rejoin:
    """A preempted arm's `curve` against the `paced` one: its learner preempted `preempt_s` into the
    arm and restarted at `restart_s`, the others' last pieces merged at `others_end_s`
    (`paced_others_end_s` in the paced arm)."""
    at_end = loss_at(curve, others_end_s)
    mine, theirs = progress(curve, others_end_s), progress(paced, paced_others_end_s)
    t0, span = curve[0][0], others_end_s - curve[0][0]
    preempt, restart = (preempt_s - t0) / span, (restart_s - t0) / span
    excess = [(x, loss - loss_at(theirs, x)) for x, loss in mine[1:]]
    after = [e for x, e in excess if restart <= x <= 1 + 1e-6]
    return Rejoin(at_others_end=at_end, cost=at_end - loss_at(paced, paced_others_end_s), final=curve[-1][1],
                  final_cost=curve[-1][1] - paced[-1][1], bump=max(after, default=math.nan),
                  mean_excess=sum(after) / len(after) if after else math.nan,
                  bump_before=max((e for x, e in excess if x < preempt), default=math.nan))


def recovered(warm_cost: float, cold_cost: float) -> float | None:
    """The share of a cold rejoin's cost that the state restore recovers (None if cold cost nothing)."""
    return None if cold_cost <= 0 else 1 - warm_cost / cold_cost


@dataclass
class ArmCurve:
    name: str
    curve: list[tuple[float, float]]
    """(x, eval loss), the first point the initial model: x is seconds since the arm started for the
    distributed arms, inner steps for the baseline (`x_unit`)."""
    wall_s: float
    x_unit: str = "s"
    details: dict | None = None
    """The arm's own figures for the JSON (counters, rounds, heads, unsynced steps...)."""

    @property
    def end(self) -> EndOfRun:
        return end_of_run([loss for _, loss in self.curve[1:]] or [self.curve[0][1]])

    def to_json(self) -> dict:
        end = self.end
        return {"final": end.final, "best_last": end.best_last, "last_points": end.points, "damage": end.damage,
                "damage_share": end.damage_share, "wall_s": round(self.wall_s, 2), "curve_x": self.x_unit,
                "curve": [[round(x, 2), loss] for x, loss in self.curve], **(self.details or {})}


@dataclass
class TaskReport:
    task: str
    steps: int
    """Inner steps per learner."""
    sync_every: int
    floor: float | None
    arms: dict[str, list[ArmCurve]]
    """Each arm's runs, in the order they ran (one per repeat)."""
    skipped: dict[str, str]
    """Arms that did not run, and why."""
    wire: dict | None = None
    """The task's wire form (what every arm trained), for the JSON."""

    def final(self, arm: str) -> float | None:
        """The mean of the arm's runs' final eval losses (None if it did not run)."""
        runs = self.arms.get(arm)
        return fmean([r.end.final for r in runs]) if runs else None

    def spread(self, arm: str) -> float:
        """(max - min) / mean of the arm's finals: 0 for a single run."""
        finals = [r.end.final for r in self.arms[arm]]
        return (max(finals) - min(finals)) / fmean(finals)

    def ratio(self, arm: str, to: str) -> float | None:
        mine, theirs = self.final(arm), self.final(to)
        return None if mine is None or theirs is None else mine / theirs

    def rows(self) -> list[list]:
        rows = []
        for name, runs in self.arms.items():
            final = self.final(name)
            rows.append([self.task, name, len(runs), final, 100 * self.spread(name),
                         fmean([r.end.best_last for r in runs]), 100 * self.damage(name),
                         self.ratio(name, "torchft"), self.ratio(name, "baseline"),
                         None if self.floor is None else final - self.floor, len(runs[0].curve) - 1,
                         fmean([r.wall_s for r in runs])])
        return rows

    def verdict(self) -> dict[str, bool | None]:
        """Each target of the decoupled arm: met, not met, or None (an arm it needs did not run)."""
        to_torchft, to_baseline = self.ratio("decoupled", "torchft"), self.ratio("decoupled", "baseline")
        to_waiting = self.ratio("decoupled", "waiting")
        damage, restarted = self.damage("decoupled"), self.damage("restarted")
        with_straggler = self.straggler_ratio()
        restored = self.recovered()
        return {"to_torchft": None if to_torchft is None else to_torchft <= MAX_TO_TORCHFT,
                "to_baseline": None if to_baseline is None else to_baseline <= MAX_TO_BASELINE,
                "to_waiting": None if to_waiting is None else to_waiting <= MAX_TO_WAITING,
                "end_of_run": None if damage is None else damage <= MAX_DAMAGE,
                "straggler": None if with_straggler is None else with_straggler <= MAX_WITH_STRAGGLER,
                "restarted_end": None if restarted is None else restarted <= MAX_DAMAGE,
                "restore_recovers": None if restored is None else restored >= MIN_RECOVERED}

    def _paired_rejoins(self, name: str) -> list[Rejoin]:
        """The preempted arm `name`'s runs, each against the paced arm's run of the same repeat; the
        arms' details carry `preempt_s`, `restart_s` and `others_end_s` (`infra.bench.quality`)."""
        return [rejoin(arm.curve, paced.curve, preempt_s=arm.details["preempt_s"], restart_s=arm.details["restart_s"],
                       others_end_s=arm.details["others_end_s"], paced_others_end_s=paced.details["others_end_s"])
                for arm, paced in zip(self.arms.get(name, []), self.arms["paced"])]

    def rejoins(self) -> dict[str, Rejoin]:
        """Each preempted arm that ran against the paced arm (none without it): the mean over its runs."""
        if "paced" not in self.arms:
            return {}
        return {name: _mean_rejoin(pairs) for name in PREEMPTED if (pairs := self._paired_rejoins(name))}

    def recovered(self) -> float | None:
        """What the state restore recovers of a cold rejoin's cost at the others' end (None: an arm
        did not run, or the cold rejoin cost nothing)."""
        r = self.rejoins()
        return recovered(r["preempted"].cost, r["preempted_cold"].cost) if set(PREEMPTED) <= set(r) else None

    def rejoin_rows(self) -> list[list]:
        paced = self.arms["paced"]
        rows = [[self.task, "paced", fmean([loss_at(p.curve, p.details["others_end_s"]) for p in paced]), 0.0,
                 fmean([p.curve[-1][1] for p in paced]), 0.0, None, None, None]]
        return rows + [[self.task, name, c.at_others_end, c.cost, c.final, c.final_cost, c.bump, c.mean_excess,
                        c.bump_before]
                       for name, c in self.rejoins().items()]

    def rejoin_line(self) -> str:
        r, restored = self.rejoins(), self.recovered()
        said = "n/a" if restored is None else "met" if restored >= MIN_RECOVERED else "NOT met"
        costs = ", ".join(f"{name} {c.cost:+.4f}" for name, c in r.items())
        saves = r["preempted_cold"].at_others_end - r["preempted"].at_others_end if set(PREEMPTED) <= set(r) else None
        return (f"{self.task}: a preempted learner's rejoin costs at the others' end ({costs}; cold - warm "
                f"{_fmt(saves, '+.4f')}); the state restore recovers {_fmt(restored, '.2f')} of the cold cost "
                f"(>= {MIN_RECOVERED}: {said})")

    def damage(self, arm: str) -> float | None:
        """The arm's end-of-run damage share, its worst run's (None if it did not run)."""
        return max(r.end.damage_share for r in self.arms[arm]) if arm in self.arms else None

    def straggler_ratio(self) -> float | None:
        """The straggler arm's final over the better of the fleets without it that ran (None: the
        straggler arm or both of them did not run)."""
        ratios = [r for arm in ("without", "torchft_without") if (r := self.ratio("straggler", arm)) is not None]
        return max(ratios, default=None)

    def verdict_line(self) -> str:
        def said(ok: bool | None) -> str:
            return "n/a" if ok is None else "met" if ok else "NOT met"

        v = self.verdict()
        to_torchft, to_baseline = self.ratio("decoupled", "torchft"), self.ratio("decoupled", "baseline")
        to_waiting = self.ratio("decoupled", "waiting")
        damage, restarted = self.damage("decoupled"), self.damage("restarted")
        runs = max(len(r) for r in self.arms.values())
        return (f"{self.task}{f' (means of {runs} runs)' if runs > 1 else ''}: decoupled / torchft "
                f"{_fmt(to_torchft, '.4f')} (<= {MAX_TO_TORCHFT}: "
                f"{said(v['to_torchft'])}), / baseline {_fmt(to_baseline, '.4f')} (<= {MAX_TO_BASELINE}: "
                f"{said(v['to_baseline'])}), / waiting {_fmt(to_waiting, '.4f')} (<= {MAX_TO_WAITING}: "
                f"{said(v['to_waiting'])}), end-of-run damage {_fmt(damage and 100 * damage, '.2f')}% "
                f"(<= {100 * MAX_DAMAGE}%: {said(v['end_of_run'])}), straggler / without it "
                f"{_fmt(self.straggler_ratio(), '.4f')} (<= {MAX_WITH_STRAGGLER}: {said(v['straggler'])}), "
                f"restarted learner last: damage {_fmt(restarted and 100 * restarted, '.2f')}% "
                f"(<= {100 * MAX_DAMAGE}%: {said(v['restarted_end'])})")

    def to_json(self) -> dict:
        return {"task": self.wire, "steps_per_learner": self.steps, "sync_every": self.sync_every, "entropy_floor": self.floor,
                "arms": {name: {"final": self.final(name), "finals": [r.end.final for r in runs],
                                "spread": self.spread(name), "damage_share": self.damage(name),
                                "ratio_to_torchft": self.ratio(name, "torchft"),
                                "ratio_to_baseline": self.ratio(name, "baseline"),
                                "gap_to_floor": None if self.floor is None else self.final(name) - self.floor,
                                "runs": [r.to_json() for r in runs]}
                         for name, runs in self.arms.items()},
                "skipped": self.skipped, "verdict": self.verdict(),
                **({"rejoin": {name: dataclasses.asdict(c) for name, c in rejoins.items()}, "recovered": self.recovered()}
                   if (rejoins := self.rejoins()) else {})}


def _mean_rejoin(pairs: Sequence[Rejoin]) -> Rejoin:
    """The mean of each figure over a preempted arm's runs (a figure nan in every run stays nan)."""
    def mean(name: str) -> float:
        values = [v for p in pairs if not math.isnan(v := getattr(p, name))]
        return fmean(values) if values else math.nan

    return Rejoin(**{f.name: mean(f.name) for f in dataclasses.fields(Rejoin)})


REJOIN_HEADERS = ["task", "arm", "at others' end", "cost", "final", "final cost", "bump", "mean excess",
                  "bump before"]
HEADERS = ["task", "arm", "runs", "final", "spread %", "best last 10%", "damage %", "/ torchft", "/ baseline",
           "- floor", "points", "wall s"]


def table(reports: Sequence[TaskReport], learners: int) -> str:
    head = (f"quality: {learners} learners (replicas) per arm, the same tokens, seeds, model, inner optimizer and "
            f"H in every arm; best last 10% = over the last 10% of each arm's curve points; with several runs, "
            f"final and best last are means, spread (max - min) / mean of the finals, damage the worst run's")
    lines = [head, figures_table(HEADERS, [row for r in reports for row in r.rows()])]
    for r in reports:
        floor = "unknown" if r.floor is None else f"{r.floor:.4f}"
        lines.append(f"{r.task}: {r.steps} steps per learner, H = {r.sync_every}, floor {floor}")
        lines.extend(f"  {arm} skipped: {why}" for arm, why in r.skipped.items())
    lines.extend(r.verdict_line() for r in reports if {"decoupled", "straggler", "restarted"} & set(r.arms))
    rejoins = [r for r in reports if r.rejoins()]
    if rejoins:
        lines.append("a preempted learner (SIGTERM, back after its downtime) against the paced arm without the "
                     "outage: at the others' end = once the last pieces of the learners never preempted merged; "
                     "bump, mean excess = over the paced arm's curve at the same progress (time from the genesis as a "
                     "share of the others' end's) from the restart to then; bump before = the same before the "
                     "preemption (noise)")
        lines.append(figures_table(REJOIN_HEADERS, [row for r in rejoins for row in r.rejoin_rows()]))
        lines.extend(r.rejoin_line() for r in rejoins)
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
