"""`diloco inspect`: what went into a version, or into a whole run, learner by learner.

With a version: one row per input as its manifest records it (learner, seq, tokens, steps,
weight, staleness, base version), plus two figures from the decoded delta, the L2 norm and the
cosine to the merged update the version applied (`coordinator.attribution`), and the
refusals the manifest lists with their reasons. Without one: per-learner aggregates over a
range of versions, and the refusals by code. Everything comes from S3 (or an export) through
`infra.history.rounds`, verified; Redis is never contacted. The JSON holds the same data as the table
and nothing about where it was read from, so a bucket and its export give the same JSON.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from diloco.coordinator.attribution import input_figures
from diloco.infra.history.rounds import Round, Run, check_fragment, read_round, rounds, versions
from diloco.infra.output import num, table
from diloco.storage.errors import Refused
from diloco.storage.objects import ObjectMissing
from diloco.storage.protocol import Manifest, VersionSettings

SETTINGS_SHOWN = ("merge", "outer_lr", "outer_momentum", "min_quorum", "max_staleness", "staleness_discount",
                  "staleness_relative")
"""The manifest settings that shape a merge, shown in the headers."""


@dataclass(frozen=True, slots=True)
class InputRow:
    learner: str
    seq: int
    contribution_id: str
    tokens: int
    steps: int
    weight: float
    staleness: int
    base_version: int
    norm: float | None
    """L2 norm of the decoded delta (None if the input could not be read)."""
    cos_merged: float | None
    """Cosine to the version's merged update (None if unreadable, or a zero vector)."""
    usual: int = 0
    """Its learner's usual piece, when the weights are at the fleet's rate (`Contribution.usual`)."""
    waited_s: float = 0.0
    """Seconds it waited in its round for the round to close (`Contribution.waited_s`)."""


@dataclass(frozen=True, slots=True)
class RefusalRow:
    learner: str
    code: str
    reason: str
    contribution_id: str
    object_key: str


@dataclass(frozen=True, slots=True)
class VersionView:
    """One version: its inputs next to the merged update, and the refusals its manifest lists."""

    fragment: int
    version: int
    parent_version: int
    kind: str
    committed_at: float
    epoch: int
    settings: VersionSettings
    merged_norm: float | None
    inputs: list[InputRow]
    refused: list[RefusalRow]
    problem: str
    """Why the deltas could not be measured ('' when they were)."""
    collected: bool
    """The inputs were deleted by `diloco gc` (the manifest's records are all there is)."""

    def to_json(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        s = self.settings
        what = "genesis (the proposed initial parameters)" if self.kind == "genesis" else (
            f"{len(self.inputs)} input(s), merged update norm {num(self.merged_norm)}, {s.merge}, "
            f"outer lr {s.outer_lr}, momentum {s.outer_momentum}"
            + (f", at the rate of {s.rate_steps} steps" if s.rate_steps else ""))
        lines = [f"fragment {self.fragment} version {self.version} (parent {self.parent_version}): {what}; committed "
                 f"{_utc(self.committed_at)} by epoch {self.epoch}"]
        if self.problem:
            lines.append(f"  cannot measure the deltas: {self.problem}")
        lines.append(table(
            ("learner", "seq", "tokens", "steps", "usual", "weight", "staleness", "base", "waited s", "delta norm",
             "cos merged"),
            [(r.learner, r.seq, r.tokens, r.steps, r.usual or "-", num(r.weight), r.staleness, r.base_version,
              f"{r.waited_s:.2f}", num(r.norm), num(r.cos_merged, "+.4f")) for r in self.inputs]))
        lines.append(f"refused since version {self.parent_version}: {len(self.refused) or 'none'}")
        if self.refused:
            lines.append(table(("learner", "code", "reason"), [(r.learner or "?", r.code, r.reason)
                                                               for r in self.refused], align="lll"))
        return "\n".join(lines)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _refusals(manifest: Manifest) -> list[RefusalRow]:
    return [RefusalRow(r.learner, r.code, r.reason, r.contribution_id, r.object_key) for r in manifest.refused]


def view_round(r: Round) -> VersionView:
    """The figures of one version read by `infra.history.rounds`."""
    m = r.manifest
    figures, merged_norm = [None] * len(m.inputs), None
    problem = r.problem
    if r.deltas is not None and r.deltas:
        figures, merged_norm = input_figures(r.deltas, [c.weight for c in m.inputs], m.settings)
    rows = [InputRow(c.learner, c.seq, c.contribution_id, c.tokens, c.steps, c.weight, c.staleness, c.base_version,
                     f.norm if f else None, f.cos_merged if f else None, c.usual, c.waited_s)
            for c, f in zip(m.inputs, figures, strict=True)]
    return VersionView(fragment=m.fragment, version=m.version, parent_version=m.parent_version,
                       kind=m.settings.kind, committed_at=m.committed_at, epoch=m.epoch, settings=m.settings,
                       merged_norm=merged_norm, inputs=rows, refused=_refusals(m), problem=problem,
                       collected=r.collected)


def inspect_version(run: Run, version: int, fragment: int | None = None) -> list[VersionView]:
    """Version `version` of `fragment`, or of every fragment that has it.
    Raises Refused('missing_object') when none has it, naming the versions there are."""
    views = []
    for f in check_fragment(run, fragment):
        try:
            views.append(view_round(read_round(run, f, version)))
        except ObjectMissing:
            continue
    if not views:
        have = ", ".join(f"fragment {f}: {_span(versions(run, f))}" for f in check_fragment(run, fragment))
        raise Refused("missing_object", f"run {run.keys.run!r} has no committed version {version} "
                      f"({have})")
    return views


def _span(vs: list[int]) -> str:
    return f"v{vs[0]}..v{vs[-1]}" if vs else "no versions"


# -- a run (or a range of versions) summarised per learner --------------------------------------


@dataclass
class LearnerSummary:
    learner: str
    merged: int = 0
    """Contributions merged (a learner's pieces in one round count separately)."""
    versions: int = 0
    """Versions it had at least one input in."""
    tokens: int = 0
    steps: int = 0
    weights: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    cosines: list[float] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    """Refusals by code."""

    def add(self, row: InputRow) -> None:
        self.merged += 1
        self.tokens += row.tokens
        self.steps += row.steps
        self.weights.append(row.weight)
        self.staleness.append(row.staleness)
        if row.norm is not None:
            self.norms.append(row.norm)
        if row.cos_merged is not None:
            self.cosines.append(row.cos_merged)

    def to_json(self) -> dict:
        return {"learner": self.learner, "merged": self.merged, "versions": self.versions, "tokens": self.tokens,
                "steps": self.steps, "mean_weight": _mean(self.weights), "mean_staleness": _mean(self.staleness),
                "mean_norm": _mean(self.norms), "max_norm": max(self.norms) if self.norms else None,
                "mean_cos_merged": _mean(self.cosines), "refused": dict(sorted(self.refused.items()))}


def _mean(values: list) -> float | None:
    return statistics.fmean(values) if values else None


@dataclass
class RunView:
    """Per-learner aggregates over versions start..end of some fragments."""

    run: str
    spec: dict[str, object]
    fragments: list[int]
    start: int
    end: int | None
    versions: dict[int, list[int]] = field(default_factory=dict)
    """Fragment -> the committed versions looked at."""
    settings: list[dict] = field(default_factory=list)
    """Each distinct set of merge settings (SETTINGS_SHOWN) in those versions, with how many versions used it."""
    learners: dict[str, LearnerSummary] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """Versions whose deltas could not be measured, and why (one line per fragment for those gc collected)."""

    def learner(self, name: str) -> LearnerSummary:
        return self.learners.setdefault(name, LearnerSummary(name))

    def add(self, view: VersionView) -> None:
        self.versions.setdefault(view.fragment, []).append(view.version)
        for r in view.refused:
            self.learner(r.learner or "?").refused[r.code] += 1
        if view.kind == "genesis":
            return  # its input is initial parameters, not a contribution
        shown = {k: getattr(view.settings, k) for k in SETTINGS_SHOWN}
        for entry in self.settings:
            if entry["settings"] == shown:
                entry["versions"] += 1
                break
        else:
            self.settings.append({"settings": shown, "versions": 1})
        if view.problem and not view.collected:  # inspect_run notes collected versions once per fragment
            self.problems.append(f"fragment {view.fragment} version {view.version}: {view.problem}")
        for row in view.inputs:
            self.learner(row.learner).add(row)
        for name in dict.fromkeys(row.learner for row in view.inputs):
            self.learners[name].versions += 1

    def to_json(self) -> dict:
        return {"run": self.run, "spec": self.spec, "fragments": self.fragments, "from": self.start, "to": self.end,
                "versions": {str(f): vs for f, vs in self.versions.items()}, "settings": self.settings,
                "learners": [s.to_json() for s in self._sorted()], "problems": self.problems}

    def _sorted(self) -> list[LearnerSummary]:
        return sorted(self.learners.values(), key=lambda s: (s.learner == "?", s.learner))

    def render(self) -> str:
        s = self.spec
        lines = [f"run {self.run}: {s['num_fragments']} fragment(s), H={s['sync_every']}, tau={s['overlap_steps']}, "
                 f"codec {s['codec']}{'+zstd' if s['compress'] else ''}, cadence {s['cadence']}, learners "
                 f"take new versions by {s['merge_rule']}"]
        lines.append("versions: " + ", ".join(f"fragment {f}: {_span(self.versions.get(f, []))} "
                                              f"({len(self.versions.get(f, []))})" for f in self.fragments))
        for entry in self.settings:
            st = entry["settings"]
            lines.append(f"merged with {st['merge']}, outer lr {st['outer_lr']}, momentum {st['outer_momentum']}, "
                         f"min_quorum {st['min_quorum']}, max_staleness {st['max_staleness']}, staleness discount "
                         f"{('relative' if st['staleness_relative'] else 'on') if st['staleness_discount'] else 'off'} "
                         f"({entry['versions']} version(s))")
        rows = []
        for ls in self._sorted():
            j = ls.to_json()
            rows.append((ls.learner, ls.merged, ls.versions, ls.tokens, num(j["mean_weight"]),
                         num(j["mean_staleness"], ".2f"), num(j["mean_norm"]), num(j["max_norm"]),
                         num(j["mean_cos_merged"], "+.3f"),
                         ", ".join(f"{code} x{n}" for code, n in sorted(ls.refused.items())) or "-"))
        lines.append(table(("learner", "merged", "versions", "tokens", "mean weight", "mean stale", "mean norm",
                            "max norm", "mean cos", "refused"), rows, align="lrrrrrrrrl"))
        lines.extend(f"note: {p}" for p in self.problems)
        return "\n".join(lines)


def inspect_run(run: Run, fragment: int | None = None, start: int = 0, end: int | None = None) -> RunView:
    """Per-learner aggregates over versions start..end of one fragment or all of them."""
    spec = {k: getattr(run.spec, k) for k in ("num_fragments", "sync_every", "overlap_steps", "merge_rule", "alpha",
                                              "codec", "compress", "cadence")}
    view = RunView(run=run.keys.run, spec=spec, fragments=check_fragment(run, fragment), start=start, end=end)
    for f in view.fragments:
        for r in rounds(run, f, start, end):
            view.add(view_round(r))
        collected = [v for v in view.versions.get(f, []) if 1 <= v < run.floor(f)]  # 0 is no contribution
        if collected:
            which = (f"versions {collected[0]}..{collected[-1]} count" if len(collected) > 1
                     else f"version {collected[0]} counts")
            view.problems.append(f"fragment {f}: {which} in merged, tokens, weights and staleness only: "
                                 f"{run.floors[f].reason()}")
    return view
