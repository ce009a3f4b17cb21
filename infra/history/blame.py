"""`diloco blame`: which learners' contributions hurt the global model, from the run's history.

Two kinds of evidence, both from S3 (or an export) alone:

- Geometry, from every version in the range: each learner's progress against the merged update
  of the other learners in the same round (`coordinator.attribution.learner_rounds`), scored and
  judged by `infra.history.verdict`.
- Loss, when the run's task is given (`--task`, the JSON `diloco demo` writes to OUT/task.json):
  for the last `loss_versions` versions of each fragment that merged two or more learners, the
  version is re-derived without each learner in turn (`attribution.round_without`: the same
  parent and outer step, the weights the coordinator would have given the others) and the global
  model is evaluated both ways. The other fragments are taken at the versions that were current
  when the version was committed. This measures the immediate effect of one round only, not what
  the learner's inputs did to the rounds after it; and it costs one evaluation per learner per
  sampled version, which is why it is bounded.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from diloco.coordinator.attribution import LearnerRound, learner_rounds, round_without
from diloco.coordinator.outer import apply_recorded
from diloco.infra.history.rounds import Round, Run, check_fragment, read_state, rounds, versions
from diloco.infra.history.task_model import check_task_fits, load_params, load_version
from diloco.infra.history.verdict import MIN_OTHERS, LearnerBlame, judge, ranked
from diloco.infra.output import num, table
from diloco.storage.errors import Refused
from diloco.storage.history import read_manifest
from diloco.storage.objects import ObjectMissing
from diloco.storage.protocol import Manifest
from diloco.workers.tasks.demo import DemoTask

log = logging.getLogger(__name__)


@dataclass
class BlameReport:
    run: str
    fragments: list[int]
    start: int
    end: int | None
    versions: int = 0
    """Merged versions read (version 0, the genesis, is nobody's contribution)."""
    with_evidence: int = 0
    """Of which merged MIN_OTHERS + 1 or more learners."""
    pairs: int = 0
    """Of which merged exactly two learners (no geometric evidence: see infra.history.verdict)."""
    learners: list[LearnerBlame] = field(default_factory=list)
    loss: dict | None = None
    """How the loss evidence was gathered (versions per fragment asked for, versions re-derived, evaluations,
    seconds); None without a task."""
    problems: list[str] = field(default_factory=list)
    """Versions left out because their inputs could not be read or were collected, and loss samples skipped."""

    def notes(self) -> list[str]:
        notes = []
        if not any(b.evidence for b in self.learners):
            notes.append("too little evidence to blame anyone from geometry: no version merged "
                         f"{MIN_OTHERS + 1} or more learners (a round of one input compares with nothing; in a round "
                         "of two each learner's only peer is the other, which tells that they disagree, not which "
                         "one is wrong). Rounds hold more learners with a higher --min-quorum on the coordinator."
                         + ("" if self.loss else " --task adds loss evidence, which needs only two."))
        if not any(b.suspect for b in self.learners) and any(b.evidence for b in self.learners):
            notes.append("no learner is a suspect: none differs from the others by more than chance would allow")
        return notes + [f"left out: {p}" for p in self.problems]

    def to_json(self) -> dict:
        return {"run": self.run, "fragments": self.fragments, "from": self.start, "to": self.end,
                "versions": self.versions, "with_evidence": self.with_evidence, "pairs": self.pairs,
                "loss": self.loss, "learners": [b.to_json() for b in self.learners], "notes": self.notes()}

    def render(self) -> str:
        lines = [f"blame of run {self.run}: {len(self.learners)} learner(s), {self.versions} merged version(s) over "
                 f"{len(self.fragments)} fragment(s), {self.with_evidence} with {MIN_OTHERS + 1}+ learners (geometric "
                 f"evidence), {self.pairs} with two"]
        if self.loss:
            lines.append(f"loss impact: {self.loss['sampled']} version(s) re-derived without each of their learners "
                         f"(the last {self.loss['per_fragment']} per fragment with 2+ learners), "
                         f"{self.loss['evaluations']} evaluations on the task's eval set, {self.loss['seconds']:.1f}s")
        rows = [(i + 1, b.learner, num(b.score, "+.3f"), f"{b.evidence}/{b.versions}",
                 f"{b.anti_aligned}/{b.evidence}", num(b.mean_loo_cos, "+.3f"), num(b.norm_ratio, ".2f"),
                 num(b.loss_impact, "+.4f") if b.loss_samples else "-", b.verdict)
                for i, b in enumerate(self.learners)]
        lines.append(table(("rank", "learner", "score", "evidence", "anti", "loo cos", "norm ratio", "loss impact",
                            "verdict"), rows, align="rlrrrrrrl"))
        lines.extend(f"note: {n}" for n in self.notes())
        return "\n".join(lines)


class _Evaluator:
    """The task's model loaded with the global parameters at a given version of one fragment."""

    def __init__(self, run: Run, task: DemoTask) -> None:
        self.run, self.task = run, task
        self.model = task.make_model(0)
        self._versions = {f: versions(run, f) for f in run.fragments}
        self._manifests: dict[tuple[int, int], Manifest] = {}
        self._loaded: dict[int, int] = {}
        self.evaluations = 0

    def _manifest(self, fragment: int, version: int) -> Manifest:
        if (fragment, version) not in self._manifests:
            self._manifests[fragment, version] = read_manifest(self.run.store, self.run.keys, fragment, version)
        return self._manifests[fragment, version]

    def context(self, manifest: Manifest) -> None:
        """Load every other fragment at its latest version committed no later than `manifest`."""
        for f, vs in self._versions.items():
            if f == manifest.fragment or not vs:
                continue
            i = bisect.bisect_right(vs, manifest.committed_at, key=lambda v, f=f: self._manifest(f, v).committed_at)
            v = vs[max(i - 1, 0)]
            if self._loaded.get(f) != v:
                load_version(self.model, self.run.store, self.run.layout, self._manifest(f, v))
                self._loaded[f] = v

    def loss(self, fragment_values: Mapping[str, torch.Tensor]) -> float:
        load_params(self.model, fragment_values)
        self.evaluations += 1
        return self.task.eval_loss(self.model)


def loss_impacts(run: Run, task: DemoTask, sampled: list[Round]) -> tuple[dict[str, list[float]], int, list[str]]:
    """Per learner, eval loss with minus without its inputs over the `sampled` versions; the number
    of evaluations made; and the versions skipped because a parameter object they need is gone
    (`diloco gc` keeps only the last versions' params) or damaged."""
    evaluator = _Evaluator(run, task)
    impacts: dict[str, list[float]] = {}
    skipped = []
    for r in sampled:
        m, deltas = r.manifest, r.deltas
        assert deltas is not None
        try:
            parent_params, parent_state = read_state(run, read_manifest(run.store, run.keys, m.fragment,
                                                                        m.parent_version))
            evaluator.context(m)
        except (ObjectMissing, Refused) as exc:
            skipped.append(f"fragment {m.fragment} version {m.version}: not re-derived for loss evidence: {exc}")
            continue
        merge = m.settings
        merged, _ = apply_recorded(parent_params, parent_state, deltas, [c.weight for c in m.inputs], merge, m.inputs)
        with_all = evaluator.loss(merged)
        for learner in dict.fromkeys(c.learner for c in m.inputs):
            without = round_without(parent_params, parent_state, m.inputs, deltas, learner, m.parent_version, merge)
            impacts.setdefault(learner, []).append(with_all - evaluator.loss(without))
        log.debug("fragment %d version %d: loss with every input %.4f", m.fragment, m.version, with_all)
    return impacts, evaluator.evaluations, skipped


def blame_run(run: Run, *, fragment: int | None = None, start: int = 0, end: int | None = None,
              task: DemoTask | None = None, loss_versions: int = 10,
              progress: Callable[[str], None] | None = None) -> BlameReport:
    """Score every learner that merged in versions start..end of one fragment or all of them. A
    `task` is checked against the run's layout before anything is read."""
    report = BlameReport(run=run.keys.run, fragments=check_fragment(run, fragment), start=start, end=end)
    if task is not None:
        check_task_fits(task, run.layout, run.keys.run)
    evidence: dict[str, list[LearnerRound]] = {}
    sampled: list[Round] = []
    for f in report.fragments:
        last: deque[Round] = deque(maxlen=max(0, loss_versions))
        if start < run.floor(f):
            report.problems.append(f"fragment {f} before version {run.floor(f)}: {run.floors[f].reason()}")
        for r in rounds(run, f, max(1, start, run.floor(f)), end):
            m = r.manifest
            if r.deltas is None:
                report.problems.append(f"fragment {f} version {m.version}: {r.problem}")
                continue
            per_learner = learner_rounds([c.learner for c in m.inputs], r.deltas, [c.weight for c in m.inputs],
                                         m.settings)
            report.versions += 1
            for lr in per_learner:
                evidence.setdefault(lr.learner, []).append(lr)
            report.with_evidence += len(per_learner) > MIN_OTHERS
            report.pairs += len(per_learner) == 2
            if task is not None and len(per_learner) >= 2:
                last.append(r)
        if progress is not None:
            progress(f"fragment {f}: {len(evidence)} learner(s) so far, {report.versions} version(s) read")
        sampled.extend(last)
    impacts: dict[str, list[float]] = {}
    if task is not None:
        t0 = time.monotonic()
        impacts, evaluations, skipped = loss_impacts(run, task, sampled)
        report.problems.extend(skipped)
        report.loss = {"per_fragment": loss_versions, "sampled": len(sampled) - len(skipped),
                       "evaluations": evaluations, "seconds": round(time.monotonic() - t0, 3)}
    report.learners = ranked([judge(g, evidence.get(g, []), impacts.get(g, []))
                              for g in sorted(set(evidence) | set(impacts))])
    return report
