"""From per-version evidence about a learner to a score and a one-line verdict (`diloco blame`). Pure.

The evidence (`coordinator.attribution.LearnerRound`, and optionally loss impacts):

- Geometry. In a version where the learner merged alongside at least `MIN_OTHERS` other learners,
  the cosine of its progress to the merged update of the others (leave-one-out). With no other
  learner there is nothing to compare with; with exactly one, the two cosines are the same number,
  which says that two learners disagree, not which one is wrong. So those versions are not evidence.
- Loss, when a task is given: eval loss of the global model with the version as merged minus
  the same version re-derived without the learner. Positive: its inputs made the model worse.

The score is the mean of -cosine over the evidence versions, weighted by the share of the round's
weight the learner actually got: +1 means it always pointed exactly against the others, 0 that it
was unrelated to them, negative that it agreed. A learner whose deltas dwarf the others' and that
agrees with the consensus less than the others do (scaled noise on top of training) scores near 0,
just above the honest learners, and is flagged by its norm ratio together with that comparison: a
learner that merely trains with a larger step agrees as well as the others and is not flagged.

A verdict says "suspect" only when a sign test rejects "its direction is unrelated to the others'"
(or "leaving it out changes nothing") at `ALPHA` over at least `MIN_VERSIONS` versions. Versions
are not independent draws (momentum, one learner's data), so the p-value is a guide to how lopsided
the counts are, not a proof; the counts themselves are in the verdict.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from diloco.coordinator.attribution import LearnerRound

MIN_OTHERS = 2
"""Other learners a version must hold to be evidence about a learner."""
MIN_VERSIONS = 5
"""Fewer evidence versions (or loss samples) than this are too few for any verdict."""
ALPHA = 0.01
"""Sign-test level for 'suspect' and 'consistent'."""
BIG_NORM = 4.0
"""A median norm ratio from this up makes a learner suspect if it is also less aligned with the consensus than
the others are with theirs in significantly many versions."""


def sign_test(successes: int, trials: int) -> float:
    """P(X >= successes) for X ~ Binomial(trials, 1/2): how surprising that many is by chance."""
    if trials <= 0:
        return 1.0
    return math.fsum(math.comb(trials, k) for k in range(max(0, successes), trials + 1)) / 2 ** trials


@dataclass(frozen=True, slots=True)
class LearnerBlame:
    """Everything blame says about one learner."""

    learner: str
    versions: int
    """Versions it had inputs in."""
    evidence: int
    """Of which held at least MIN_OTHERS other learners (with a direction to compare)."""
    score: float | None
    """Share-weighted mean of -(leave-one-out cosine) over the evidence versions; None without evidence."""
    anti_aligned: int
    """Evidence versions where its leave-one-out cosine was negative."""
    aligned: int
    """... and positive."""
    less_aligned: int
    """Evidence versions where its leave-one-out cosine was below the median of the others' own."""
    mean_loo_cos: float | None
    norm_ratio: float | None
    """Median over the evidence versions of its norm over the median of the others' norms."""
    mean_share: float | None
    """Mean share of the round's weight it got in the evidence versions."""
    loss_samples: int
    """Versions re-derived without it (0 without a task)."""
    loss_worse: int
    """Of which its inputs made the eval loss worse."""
    loss_impact: float | None
    """Mean eval loss with its inputs minus without (positive: it hurt)."""
    suspect: bool
    verdict: str

    def to_json(self) -> dict:
        return asdict(self)


def judge(learner: str, rounds: Sequence[LearnerRound], loss_impacts: Sequence[float] = ()) -> LearnerBlame:
    """Score and verdict of `learner` from its `LearnerRound`s (every version it merged in) and the
    loss impacts of the versions re-derived without it."""
    evidence = [r for r in rounds if r.others >= MIN_OTHERS and r.loo_cos is not None]
    cosines = [float(r.loo_cos) for r in evidence]  # type: ignore[arg-type]
    shares = [r.share for r in evidence]
    ratios = [r.norm_ratio for r in evidence if r.norm_ratio is not None]
    score = None
    if evidence:
        total = math.fsum(shares)
        score = (math.fsum(-c * s for c, s in zip(cosines, shares, strict=True)) / total if total > 0
                 else -statistics.fmean(cosines))
    blame = LearnerBlame(
        learner=learner, versions=len(rounds), evidence=len(evidence), score=score,
        anti_aligned=sum(c < 0 for c in cosines), aligned=sum(c > 0 for c in cosines),
        less_aligned=sum(r.peers_cos is not None and float(r.loo_cos) < r.peers_cos  # type: ignore[arg-type]
                         for r in evidence),
        mean_loo_cos=statistics.fmean(cosines) if cosines else None,
        norm_ratio=statistics.median(ratios) if ratios else None,
        mean_share=statistics.fmean(shares) if shares else None,
        loss_samples=len(loss_impacts), loss_worse=sum(x > 0 for x in loss_impacts),
        loss_impact=statistics.fmean(loss_impacts) if loss_impacts else None, suspect=False, verdict="")
    reasons = _suspicions(blame)
    return dataclasses.replace(blame, suspect=bool(reasons), verdict=_verdict(blame, reasons))


def _suspicions(b: LearnerBlame) -> list[str]:
    """What makes `b` a suspect: each a sign test rejecting 'like the others' at ALPHA."""
    n, m = b.evidence, b.loss_samples
    reasons = []
    if n >= MIN_VERSIONS and sign_test(b.anti_aligned, n) < ALPHA:
        reasons.append(f"anti-aligned with the others in {b.anti_aligned}/{n} versions")
    if n >= MIN_VERSIONS and (b.norm_ratio or 0.0) >= BIG_NORM and sign_test(b.less_aligned, n) < ALPHA:
        reasons.append(f"deltas {b.norm_ratio:.1f}x the others' norm and less aligned with the consensus than the "
                       f"others in {b.less_aligned}/{n} versions")
    if m >= MIN_VERSIONS and sign_test(b.loss_worse, m) < ALPHA:
        reasons.append(f"leaving it out lowered the eval loss in {b.loss_worse}/{m} re-derived versions")
    return reasons


def _verdict(b: LearnerBlame, reasons: list[str]) -> str:
    n, m = b.evidence, b.loss_samples
    if reasons:
        return "suspect: " + "; ".join(reasons)
    if n < MIN_VERSIONS and m < MIN_VERSIONS:
        return (f"too little evidence: {n} version(s) shared with {MIN_OTHERS}+ other learners"
                + (f", {m} re-derived without it" if m else ""))
    loss = f"; leaving it out lowered the eval loss in {b.loss_worse}/{m} re-derived versions" if m else ""
    if n >= MIN_VERSIONS and sign_test(b.aligned, n) < ALPHA:
        return f"consistent: aligned with the others in {b.aligned}/{n} versions" + loss
    return (f"unclear: aligned with the others in {b.aligned}/{n} versions, mean cosine "
            f"{b.mean_loo_cos or 0.0:+.2f}" + loss)


def ranked(blames: Sequence[LearnerBlame]) -> list[LearnerBlame]:
    """Suspects first, then by score (highest: most against the others), then by loss impact; a
    learner without any evidence last."""
    def key(b: LearnerBlame) -> tuple:
        return (not b.suspect, b.score is None, -(b.score or 0.0), -(b.loss_impact or 0.0), b.learner)
    return sorted(blames, key=key)
