"""Timings recorded from a real run, and the model that projects them.

The timing file (JSON, `"format": "diloco-timings/1"`) holds what the simulator needs from a run:

    {"format": "diloco-timings/1", "run": "my-run", "duration_s": 412.0,
     "sync_every": 30, "overlap_steps": 3, "cadence": "clock",
     "step_time_s": {"learner-0": 0.061, "learner-1": 0.064},   # per learner, median of its announcements
     "upload_s": 0.09,      # median, the learner's send -> its announcement's stream entry (clock cadence)
     "merge_s": 0.21,       # median, a version's last merged arrival -> its commit (manifest committed_at)
     "failures": [{"learner": "learner-1", "at_s": 151.3, "down_s": 9.8}]}

`timings_from_run` derives it from what a run records anyway: the announcements stream (learner,
`sent_at`, `step_time_s`, the round `deadline`; the entry id is the Redis server time it
arrived), the manifests in S3 (`committed_at`, inputs by stream id) and the run spec (H, tau,
cadence). No record says when a learner decided to send (`sent_at` is taken after the S3 PUT,
just before the announcement): on the clock cadence it sends at its last step boundary before the
deadline, on average half a step before it, and `upload_s` is measured from there; on the steps
cadence it is left at 0.
No record says when a learner process died or started (a restarted learner reuses its id and
continues its object sequence), so failures are inferred: a failure is a gap in a learner's
announcements of fragment 0 longer than `GAP_FACTOR` of its usual interval between sends; it went
down after its last send before the gap and was back after `down_s` (the gap less one usual
interval). That is a heuristic: a learner stalled that long for another reason looks the same,
and a shorter outage is not seen.

`project` turns timings into a `Model`: the recorded learners, speeds, H, tau, cadence, upload
and merge times, and the recorded downtime as the restart time. The fleet is the recorded one
(one slice per learner, failing at the recorded rate, learners restarting as the recorded ones
did) unless `chips` is given: then it is the model's fleet of that size.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from diloco.infra.goodput.model import YEAR_S, Model
from diloco.infra.output import write_json
from diloco.storage.errors import ConfigError
from diloco.storage.protocol import Announcement, Manifest, RunSpec

FORMAT = "diloco-timings/1"
GAP_FACTOR = 5.0
"""A gap between two sends of a learner longer than this many of its usual intervals is a failure
(on a busy 2-core machine live learners were seen to stall for up to 3.5 intervals)."""


@dataclass(frozen=True, slots=True)
class Failure:
    learner: str
    at_s: float
    """Seconds from the run's first announcement to the learner's last send before it went down."""
    down_s: float


@dataclass(frozen=True, slots=True)
class Timings:
    run: str
    duration_s: float
    """First to last announcement."""
    sync_every: int
    overlap_steps: int
    cadence: str
    step_time_s: dict[str, float]
    upload_s: float
    merge_s: float
    failures: tuple[Failure, ...] = ()

    def __post_init__(self) -> None:
        if not self.step_time_s or min(self.step_time_s.values()) <= 0:
            raise ConfigError(f"timings of run {self.run!r}: need a positive step time for at least one learner")
        if not self.duration_s > 0:
            raise ConfigError(f"timings of run {self.run!r}: duration_s must be positive, got {self.duration_s}")

    def to_wire(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_wire(cls, data: dict) -> Timings:
        if data.get("format") != FORMAT:
            raise ConfigError(f"not a timing file of format {FORMAT!r}: format is {data.get('format')!r}")
        fields = {k: v for k, v in data.items() if k != "format"}
        try:
            return cls(**fields | {"failures": tuple(Failure(**f) for f in fields.get("failures", ()))})
        except TypeError as exc:
            raise ConfigError(f"timing file: {exc}") from None

    def save(self, path: Path) -> None:
        write_json(path, self.to_wire())

    @classmethod
    def load(cls, path: Path) -> Timings:
        return cls.from_wire(json.loads(path.read_text()))


def entry_time(entry_id: str) -> float:
    """The Redis server time (seconds) a stream entry was added: the first part of its id, in ms."""
    return int(entry_id.partition("-")[0]) / 1000.0


def timings_from_run(spec: RunSpec, entries: Sequence[tuple[str, Announcement]],
                     manifests: Sequence[Manifest]) -> Timings:
    """Timings of a run from its records: the delta announcements with their stream entry ids,
    and the manifests."""
    if not entries:
        raise ConfigError(f"run {spec.run!r} has no announced contributions to time")
    arrived = {eid: entry_time(eid) for eid, _ in entries}
    start, end = min(arrived.values()), max(arrived.values())
    sends: dict[str, list[float]] = {}
    for _, a in sorted(entries, key=lambda e: e[1].sent_at):
        if a.fragment == 0:  # an outage shows in every fragment: one is enough to see it
            sends.setdefault(a.learner, []).append(a.sent_at)
    step_time = {name: statistics.median(a.step_time_s for _, a in entries if a.learner == name)
                 for name in sorted({a.learner for _, a in entries})}
    # A learner sends at its last step boundary before the deadline, on average half a step before it.
    upload = [arrived[eid] - (a.deadline - a.step_time_s / 2) for eid, a in entries if a.deadline > 0]
    merge = [m.committed_at - max(arrived[c.stream_id] for c in m.inputs)
             for m in manifests if m.version > 0 and m.inputs and all(c.stream_id in arrived for c in m.inputs)]
    return Timings(run=spec.run, duration_s=end - start, sync_every=spec.sync_every,
                   overlap_steps=spec.overlap_steps, cadence=spec.cadence,
                   step_time_s={k: v for k, v in sorted(step_time.items()) if v > 0},
                   upload_s=max(0.0, statistics.median(upload)) if upload else 0.0,
                   merge_s=max(0.0, statistics.median(merge)) if merge else 0.0,
                   failures=tuple(sorted(_gaps(sends, step_time, spec.sync_every, start), key=lambda f: f.at_s)))


def _gaps(sends: dict[str, list[float]], step_time: dict[str, float], sync_every: int,
          start: float) -> list[Failure]:
    """Outages: gaps between a learner's sends of a fragment longer than GAP_FACTOR usual
    intervals (its median interval, or H of its steps if longer: a learner left alone at the end
    of a run sends less often)."""
    found = []
    for learner, times in sends.items():
        intervals = [b - a for a, b in zip(times, times[1:])]
        if len(intervals) < 2:
            continue
        usual = max(statistics.median(intervals), sync_every * step_time[learner])
        found += [Failure(learner, at_s=a - start, down_s=(b - a) - usual)
                  for a, b in zip(times, times[1:]) if b - a > GAP_FACTOR * usual]
    return found


def project(t: Timings, base: Model, *, chips: int | None = None) -> Model:
    """The model of the recorded run (see the module docstring); `base` gives every parameter the
    recording does not (and the seed, hours and round policy)."""
    names = sorted(t.step_time_s)
    fastest = min(t.step_time_s.values())
    restart_s = statistics.mean(f.down_s for f in t.failures) if t.failures else base.restart_s
    model = replace(base, learners=len(names), step_time_s=fastest,
                    speeds=tuple(t.step_time_s[n] / fastest for n in names), sync_every=t.sync_every,
                    overlap_steps=t.overlap_steps, cadence=t.cadence, upload_s=t.upload_s, merge_s=t.merge_s,
                    restart_s=restart_s)
    if chips is not None:
        return replace(model, chips=chips)
    if not t.failures:
        raise ConfigError(f"run {t.run!r} recorded no failures, so there is no failure rate to project: "
                          "give --chips (and --mtbi-years) to project it onto a fleet of that size")
    # The recorded fleet: a learner is one slice of one chip, out for its downtime when it fails.
    learner_mtbi_s = len(names) * t.duration_s / len(t.failures)
    return replace(model, chips=len(names), slice_chips=1, mtbi_years=learner_mtbi_s / YEAR_S,
                   repair_s=restart_s, learner_failure="restart")
