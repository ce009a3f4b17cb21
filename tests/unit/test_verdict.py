"""Scores and verdicts of `diloco blame` (infra/history/verdict.py): pure, on hand-made evidence."""

from __future__ import annotations

import pytest

from diloco.coordinator.attribution import LearnerRound
from diloco.infra.history.verdict import MIN_VERSIONS, judge, ranked, sign_test


def rounds(cosines: list[float], *, others: int = 3, ratio: float = 1.0, share: float = 0.25,
           peers: float | None = None) -> list[LearnerRound]:
    """Evidence of one learner: its leave-one-out cosine in each version; `peers` the others' own (median)."""
    return [LearnerRound(learner="x", pieces=1, share=share, norm=ratio, others=others, loo_cos=c, norm_ratio=ratio,
                         peers_cos=peers) for c in cosines]


def test_sign_test():
    assert sign_test(0, 10) == 1.0
    assert sign_test(10, 10) == pytest.approx(2 ** -10)
    assert sign_test(5, 10) == pytest.approx(638 / 1024)
    assert sign_test(0, 0) == 1.0


def test_anti_aligned_in_most_versions_is_a_suspect_and_the_score_says_how_much():
    b = judge("bad", rounds([-0.5] * 18 + [0.1] * 2))
    assert b.suspect and b.verdict == "suspect: anti-aligned with the others in 18/20 versions"
    assert b.score == pytest.approx(-(18 * -0.5 + 2 * 0.1) / 20)
    assert (b.evidence, b.anti_aligned, b.aligned) == (20, 18, 2)


def test_the_score_weighs_versions_by_the_share_the_learner_got():
    evidence = rounds([-1.0], share=0.9) + rounds([1.0], share=0.1)
    assert judge("x", evidence).score == pytest.approx(0.9 * 1.0 - 0.1 * 1.0)


def test_aligned_learners_are_consistent_not_suspects():
    b = judge("good", rounds([0.3, 0.2, 0.4, 0.1, 0.3, 0.25, 0.35, 0.2]))
    assert not b.suspect and b.verdict == "consistent: aligned with the others in 8/8 versions"
    assert b.score < 0


def test_a_coin_flip_is_unclear_not_a_verdict():
    b = judge("meh", rounds([0.1, -0.1] * 10))
    assert not b.suspect and b.verdict.startswith("unclear: aligned with the others in 10/20 versions")


def test_big_deltas_that_agree_less_than_the_others_do_are_suspect_by_their_norm():
    # Scaled noise on top of real training: slightly aligned, but much less than the others are.
    b = judge("noisy", rounds([0.04, 0.03] * 10, ratio=12.0, peers=0.14))
    assert b.suspect and b.norm_ratio == 12.0 and b.less_aligned == 20
    assert b.verdict == ("suspect: deltas 12.0x the others' norm and less aligned with the consensus than the others "
                         "in 20/20 versions")
    eager = judge("eager", rounds([0.15, 0.13] * 10, ratio=12.0, peers=0.14))
    assert not eager.suspect and eager.less_aligned == 10  # a bigger step that agrees as well is not noise
    assert not judge("small", rounds([0.04, 0.03] * 10, ratio=1.0, peers=0.14)).suspect


def test_too_little_evidence_is_said_and_rounds_of_two_are_no_evidence():
    few = judge("new", rounds([-0.9] * (MIN_VERSIONS - 1)))
    assert not few.suspect and few.verdict.startswith(f"too little evidence: {MIN_VERSIONS - 1} version(s)")
    pairs = judge("pair", rounds([-0.9] * 30, others=1))
    assert pairs.evidence == 0 and pairs.score is None and not pairs.suspect
    assert pairs.versions == 30 and pairs.verdict.startswith("too little evidence: 0 version(s)")


def test_loss_evidence_alone_can_make_a_suspect():
    b = judge("pair", rounds([-0.9] * 10, others=1), loss_impacts=[0.01] * 11 + [-0.001])
    assert b.suspect and b.verdict == "suspect: leaving it out lowered the eval loss in 11/12 re-derived versions"
    assert b.loss_impact == pytest.approx((0.11 - 0.001) / 12)
    assert not judge("pair", [], loss_impacts=[0.01] * 9 + [-0.001]).suspect  # 9/10: p = 0.011
    helped = judge("good", rounds([0.3] * 10), loss_impacts=[-0.01] * 10)
    assert not helped.suspect and helped.verdict.endswith("lowered the eval loss in 0/10 re-derived versions")


def test_ranking_puts_suspects_first_then_the_highest_scores():
    bad = judge("bad", rounds([-0.5] * 10))
    meh = judge("meh", rounds([0.1, -0.1] * 5))
    good = judge("good", rounds([0.5] * 10))
    none = judge("none", [])
    assert [b.learner for b in ranked([good, none, meh, bad])] == ["bad", "meh", "good", "none"]
