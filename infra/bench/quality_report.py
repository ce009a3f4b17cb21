"""The quality benchmark's figures: per task and arm, the final eval loss, the end of the run, the
ratios to the peer, the baseline and the same arm with waiting learners, the gap to the floor, and the
verdict against the targets.
Pure functions of the measured curves.

End of the run: the best eval loss over the last 10% of an arm's curve points (counted in points,
i.e. committed versions for our arms, outer steps for torchft, evaluations every M x H steps for the
baseline; the genesis point not counted, the final point included), and the final loss minus that
best: the damage the end of the run did (0 if the final model is the best of them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    arms: dict[str, ArmCurve]
    skipped: dict[str, str]
    """Arms that did not run, and why."""
    wire: dict | None = None
    """The task's wire form (what every arm trained), for the JSON."""

    def ratio(self, arm: str, to: str) -> float | None:
        if arm not in self.arms or to not in self.arms:
            return None
        return self.arms[arm].end.final / self.arms[to].end.final

    def rows(self) -> list[list]:
        rows = []
        for name, arm in self.arms.items():
            end = arm.end
            rows.append([self.task, name, end.final, end.best_last, 100 * end.damage_share,
                         self.ratio(name, "torchft"), self.ratio(name, "baseline"),
                         None if self.floor is None else end.final - self.floor, len(arm.curve) - 1, arm.wall_s])
        return rows

    def verdict(self) -> dict[str, bool | None]:
        """Each target of the decoupled arm: met, not met, or None (an arm it needs did not run)."""
        to_torchft, to_baseline = self.ratio("decoupled", "torchft"), self.ratio("decoupled", "baseline")
        to_waiting = self.ratio("decoupled", "waiting")
        damage, restarted = self.damage("decoupled"), self.damage("restarted")
        with_straggler = self.straggler_ratio()
        return {"to_torchft": None if to_torchft is None else to_torchft <= MAX_TO_TORCHFT,
                "to_baseline": None if to_baseline is None else to_baseline <= MAX_TO_BASELINE,
                "to_waiting": None if to_waiting is None else to_waiting <= MAX_TO_WAITING,
                "end_of_run": None if damage is None else damage <= MAX_DAMAGE,
                "straggler": None if with_straggler is None else with_straggler <= MAX_WITH_STRAGGLER,
                "restarted_end": None if restarted is None else restarted <= MAX_DAMAGE}

    def damage(self, arm: str) -> float | None:
        """The arm's end-of-run damage share (None if it did not run)."""
        return self.arms[arm].end.damage_share if arm in self.arms else None

    def straggler_ratio(self) -> float | None:
        """The straggler arm's final over the better of the fleets without it (None if any did not run)."""
        ratios = [self.ratio("straggler", arm) for arm in ("without", "torchft_without")]
        return None if None in ratios else max(ratios)

    def verdict_line(self) -> str:
        def said(ok: bool | None) -> str:
            return "n/a" if ok is None else "met" if ok else "NOT met"

        v = self.verdict()
        to_torchft, to_baseline = self.ratio("decoupled", "torchft"), self.ratio("decoupled", "baseline")
        to_waiting = self.ratio("decoupled", "waiting")
        damage, restarted = self.damage("decoupled"), self.damage("restarted")
        return (f"{self.task}: decoupled / torchft {_fmt(to_torchft, '.4f')} (<= {MAX_TO_TORCHFT}: "
                f"{said(v['to_torchft'])}), / baseline {_fmt(to_baseline, '.4f')} (<= {MAX_TO_BASELINE}: "
                f"{said(v['to_baseline'])}), / waiting {_fmt(to_waiting, '.4f')} (<= {MAX_TO_WAITING}: "
                f"{said(v['to_waiting'])}), end-of-run damage {_fmt(damage and 100 * damage, '.2f')}% "
                f"(<= {100 * MAX_DAMAGE}%: {said(v['end_of_run'])}), straggler / without it "
                f"{_fmt(self.straggler_ratio(), '.4f')} (<= {MAX_WITH_STRAGGLER}: {said(v['straggler'])}), "
                f"restarted learner last: damage {_fmt(restarted and 100 * restarted, '.2f')}% "
                f"(<= {100 * MAX_DAMAGE}%: {said(v['restarted_end'])})")

    def to_json(self) -> dict:
        return {"task": self.wire, "steps_per_learner": self.steps, "sync_every": self.sync_every, "entropy_floor": self.floor,
                "arms": {name: {**arm.to_json(), "ratio_to_torchft": self.ratio(name, "torchft"),
                                "ratio_to_baseline": self.ratio(name, "baseline"),
                                "gap_to_floor": None if self.floor is None else arm.end.final - self.floor}
                         for name, arm in self.arms.items()},
                "skipped": self.skipped, "verdict": self.verdict()}


HEADERS = ["task", "arm", "final", "best last 10%", "damage %", "/ torchft", "/ baseline", "- floor", "points",
           "wall s"]


def table(reports: Sequence[TaskReport], learners: int) -> str:
    head = (f"quality: {learners} learners (replicas) per arm, the same tokens, seeds, model, inner optimizer and "
            f"H in every arm; best last 10% = over the last 10% of each arm's curve points")
    lines = [head, figures_table(HEADERS, [row for r in reports for row in r.rows()])]
    for r in reports:
        floor = "unknown" if r.floor is None else f"{r.floor:.4f}"
        lines.append(f"{r.task}: {r.steps} steps per learner, H = {r.sync_every}, floor {floor}")
        lines.extend(f"  {arm} skipped: {why}" for arm, why in r.skipped.items())
    lines.extend(r.verdict_line() for r in reports if {"decoupled", "straggler", "restarted"} & set(r.arms))
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
