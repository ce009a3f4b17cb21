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
was unrelated to them, negative that it agreed. A learner whose deltas dwarf the others' without
agreeing with them (scaled noise) scores near 0 but is flagged by its norm ratio.

A verdict says "suspect" only when a sign test rejects "its direction is unrelated to the others'"
(or "leaving it out changes nothing") at `ALPHA` over at least `MIN_VERSIONS` versions. Versions
are not independent draws (momentum, one learner's data), so the p-value is a guide to how lopsided
the counts are, not a proof; the counts themselves are in the verdict.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from coordinator.attribution import LearnerRound

MIN_OTHERS = 2
"""Other learners a version must hold to be evidence about a learner."""
MIN_VERSIONS = 5
"""Fewer evidence versions (or loss samples) than this are too few for any verdict."""
ALPHA = 0.01
"""Sign-test level for 'suspect' and 'consistent'."""
BIG_NORM = 4.0
"""A median norm ratio from this up, with no significant agreement, makes a learner suspect."""


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
    n, m = len(evidence), len(loss_impacts)
    cosines = [r.loo_cos for r in evidence if r.loo_cos is not None]
    shares = [r.share for r in evidence]
    score = None
    if evidence:
        score = (math.fsum(-c * s for c, s in zip(cosines, shares, strict=True)) / math.fsum(shares)
                 if math.fsum(shares) > 0 else -statistics.fmean(cosines))
    anti, aligned = sum(c < 0 for c in cosines), sum(c > 0 for c in cosines)
    ratios = [r.norm_ratio for r in evidence if r.norm_ratio is not None]
    ratio = statistics.median(ratios) if ratios else None
    worse = sum(x > 0 for x in loss_impacts)
    reasons = []
    if n >= MIN_VERSIONS and sign_test(anti, n) < ALPHA:
        reasons.append(f"anti-aligned with the others in {anti}/{n} versions")
    if n >= MIN_VERSIONS and ratio is not None and ratio >= BIG_NORM and sign_test(aligned, n) >= ALPHA:
        reasons.append(f"deltas {ratio:.1f}x the others' norm, aligned with them in only {aligned}/{n} versions")
    if m >= MIN_VERSIONS and sign_test(worse, m) < ALPHA:
        reasons.append(f"leaving it out lowered the eval loss in {worse}/{m} re-derived versions")
    loss_note = f"; leaving it out lowered the eval loss in {worse}/{m} re-derived versions" if m else ""
    if reasons:
        verdict = "suspect: " + "; ".join(reasons)
    elif n < MIN_VERSIONS and m < MIN_VERSIONS:
        verdict = (f"too little evidence: {n} version(s) shared with {MIN_OTHERS}+ other learners"
                   + (f", {m} re-derived without it" if m else ""))
    elif n >= MIN_VERSIONS and sign_test(aligned, n) < ALPHA:
        verdict = f"consistent: aligned with the others in {aligned}/{n} versions" + loss_note
    else:
        verdict = (f"unclear: aligned with the others in {aligned}/{n} versions, mean cosine "
                   f"{statistics.fmean(cosines) if cosines else 0.0:+.2f}" + loss_note)
    return LearnerBlame(learner=learner, versions=len(rounds), evidence=n, score=score, anti_aligned=anti,
                        aligned=aligned, mean_loo_cos=statistics.fmean(cosines) if cosines else None,
                        norm_ratio=ratio, mean_share=statistics.fmean(shares) if shares else None,
                        loss_samples=m, loss_worse=worse,
                        loss_impact=statistics.fmean(loss_impacts) if loss_impacts else None,
                        suspect=bool(reasons), verdict=verdict)


def ranked(blames: Sequence[LearnerBlame]) -> list[LearnerBlame]:
    """Suspects first, then by score (highest: most against the others), then by loss impact; a
    learner without any evidence last."""
    def key(b: LearnerBlame) -> tuple:
        return (not b.suspect, b.score is None, -(b.score or 0.0), -(b.loss_impact or 0.0), b.learner)
    return sorted(blames, key=key)
