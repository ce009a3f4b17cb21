"""A learner that lies about what it did: its claims are bounded by what the other learners show.

Each test puts an honest learner and a hostile one (valid credentials, well-formed objects, lying
numbers) in the same round of a real coordinator on the real servers, and asserts: the coordinator
goes on, the honest piece is merged, the hostile claim is bounded (`coordinator.influence`) with
the bound recorded, the version still replays from its manifest, and nothing is left pending.
"""

from __future__ import annotations

import math
import statistics
import time

import pytest
import torch

from diloco.coordinator.rederive import recorded_problems
from diloco.storage.history import read_manifest
from diloco.storage.protocol import LearnerStats
from rig import BAD, Rig, new_id


def pending(rig: Rig) -> list[str]:
    return [p["message_id"].decode()
            for p in rig.bus.r.xpending_range(rig.keys.announcements, rig.keys.GROUP, "-", "+", 100)]


def step_until(rig: Rig, condition, timeout_s: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        rig.coord.step(block_ms=100)


def tend_cadence(rig: Rig) -> None:
    """A loop step that sets the round clock from the live learners' stats (what it does once a second)."""
    rig.coord._last_cadence_check = 0.0
    rig.coord.step()


def test_a_piece_claiming_2_to_the_64_tokens_in_one_step_weighs_a_bounded_share(rig: Rig):
    rig.advance(3)  # the honest learner's pieces: 40 tokens in 4 steps each
    head = rig.head()
    _, good = rig.send_good("good")
    _, other = rig.send_good("good2")
    cid = new_id()
    rig.forge(rig.delta_blob(cid), cid=cid, tokens=2**64 - 1, steps=1)
    rig.coord.step()

    assert rig.head() == head + 1 and pending(rig) == []
    manifest = read_manifest(rig.store, rig.keys, 0, head + 1)
    inputs = {c.learner: c for c in manifest.inputs}
    assert {good.contribution_id, other.contribution_id, cid} == {c.contribution_id for c in manifest.inputs}
    liar = inputs[BAD]
    # Counted as 4x the others' median tokens (40) and 4x their median weight (40**2 / 4): 160 tokens in 16 steps.
    assert (liar.tokens, liar.steps) == (160, 16), liar
    assert "claimed 18446744073709551615 tokens in 1 steps" in liar.bounded
    assert liar.weight == pytest.approx(2 / 3) and inputs["good"].weight == pytest.approx(1 / 6)
    assert manifest.settings.round_scale > 0.5  # the claim does not shrink the honest learners' step to nothing
    assert recorded_problems(manifest) == []  # replay recomputes the recorded weights from the counted claims
    assert rig.bus.counters().get("contributions_refused", 0) == 0


def test_sixteen_honest_looking_pieces_in_one_round_move_the_model_no_more_than_the_bound(rig: Rig):
    """One learner sends sixteen pieces into one round, each as large as an honest one (its own
    keys, its own announcements). Each piece merges with its learner's share (a learner's pieces in
    a round are consecutive progress and add up): bounded one piece at a time, the sixteen outweighed
    the honest learners 85 times and reversed the round. Its claims are bounded together, and its
    pieces' norms together: at most max_claim_ratio x the median learner's, recorded, replayable."""
    rig.advance(3)
    head = rig.head()
    rig.send_good("good")
    rig.send_good("good2")
    copy = {s.name: -0.01 * torch.randn(s.shape) for s in rig.layout.fragments[0]}  # against the round
    ids = []
    for _ in range(16):
        cid = new_id()
        rig.forge(rig.delta_blob(cid, tensors=copy), cid=cid)
        ids.append(cid)
    rig.coord.step()

    assert rig.head() == head + 1 and pending(rig) == []
    manifest = read_manifest(rig.store, rig.keys, 0, head + 1)
    mine = [c for c in manifest.inputs if c.learner == BAD]
    honest = [c for c in manifest.inputs if c.learner != BAD]
    assert sorted(c.contribution_id for c in mine) == sorted(ids) and len(honest) == 2
    # Its claims together: 640 tokens in 64 steps counted as 4x the median learner's round (160 in 16).
    assert sum(c.tokens for c in mine) <= 160 and all("over 16 piece(s)" in c.bounded for c in mine)
    # Its pieces together move the model at most 4x as far as the median learner's round (the
    # honest pieces of this round and the three before), at a share at most 4x the median learner's.
    norms = sorted(c.norm for m in range(head - 2, head + 2) for c in read_manifest(rig.store, rig.keys, 0, m).inputs
                   if c.learner != BAD)
    assert math.fsum(c.clip * c.norm for c in mine) <= 4 * statistics.median(norms) * (1 + 1e-9)
    assert mine[0].weight / mine[0].clip <= 4 * statistics.median(c.weight for c in honest)
    assert all(c.clip == mine[0].clip < 1 and "scaled by" in c.bounded for c in mine)
    assert all(c.clip == 1.0 and not c.bounded for c in honest)
    assert recorded_problems(manifest) == []  # replay recomputes weight x clip from the manifest


def test_a_deadline_far_in_the_future_does_not_hold_the_fragments_rounds_open(make_rig):
    rig = make_rig(cadence="clock", round_s=1.0, max_grace_s=0.5)
    rig.coord.step()  # publishes the round clock
    clock = rig.bus.cadence()
    assert clock is not None and clock.period_s == 1.0
    # A third learner is live and has not sent: the round waits for it until its deadline's grace.
    rig.bus.heartbeat("late", 60.0, LearnerStats(learner="late", step_time_s=0.25), joined=True)
    head = rig.head()
    deadline = clock.next_deadline(0, 2, after=time.time())
    rig.send_good("good", deadline=deadline)
    cid = new_id()
    rig.forge(rig.delta_blob(cid), cid=cid, deadline=1e15)
    # Merged once the real deadline plus its grace has passed (within a few periods), not at 1e15.
    step_until(rig, lambda: rig.head() > head, timeout_s=6.0)
    inputs = read_manifest(rig.store, rig.keys, 0, head + 1).inputs
    assert {c.learner for c in inputs} == {"good", BAD} and pending(rig) == []


@pytest.mark.parametrize("clocked", [True, False], ids=["clock", "before_the_clock"])
def test_a_final_piece_for_a_far_deadline_does_not_make_every_later_round_late(make_rig, clocked: bool):
    """A learner's last piece, or any piece before the fragment has a clock, sent for the deadline
    1e15: merged, it set the fragment's merged deadline to 1e15 for the coordinator's life, and
    every later round counted as late (waiting for every live learner)."""
    rig = make_rig(cadence="clock", round_s=1.0, max_grace_s=0.5)
    if clocked:
        rig.coord.step()  # publishes the round clock
    head = rig.head()
    rig.send_good("good")
    cid = new_id()
    rig.forge(rig.delta_blob(cid), cid=cid, deadline=1e15, final=True)
    step_until(rig, lambda: rig.head() > head, timeout_s=6.0)
    assert BAD in {c.learner for c in read_manifest(rig.store, rig.keys, 0, head + 1).inputs}
    period = rig.bus.cadence().period_s if rig.bus.cadence() else 1.0
    assert rig.coord.fragments[0].merged_deadline <= time.time() + 2 * period


def test_a_heartbeat_claiming_a_nanosecond_step_does_not_set_the_clock(make_rig):
    rig = make_rig(cadence="clock")
    for name in ("a", "b"):
        rig.bus.heartbeat(name, 60.0, LearnerStats(learner=name, step_time_s=1.0), joined=True)
    rig.bus.heartbeat(BAD, 60.0, LearnerStats(learner=BAD, step_time_s=1e-9), joined=True)
    tend_cadence(rig)
    clock = rig.bus.cadence()
    # H = 4 steps of the fastest plausible learner: 1/max_claim_ratio of the median (1 s), not 4 ns
    # (nor min_round_s, 0.25 s, which is all an unbounded 1e-9 would leave).
    assert clock is not None and clock.period_s == pytest.approx(4 * 1.0 / 4)
    # An honest learner faster than the others still sets it.
    rig.bus.heartbeat("quick", 60.0, LearnerStats(learner="quick", step_time_s=0.5), joined=True)
    tend_cadence(rig)
    assert rig.bus.cadence().period_s == pytest.approx(1.0)  # within 30%: the clock keeps its phase


def test_made_up_learner_ids_that_never_send_stop_holding_rounds_open(make_rig):
    rig = make_rig(cadence="clock", round_s=0.5, max_grace_s=5.0)
    rig.coord.step()
    patience_s = rig.coord.round_cfg.max_silent_rounds * 0.5
    rig.advance(1)
    for i in range(20):
        rig.bus.heartbeat(f"made-up-{i}", 60.0, LearnerStats(learner=f"made-up-{i}", step_time_s=0.1), joined=True)
    rig.coord.step()
    waited = rig.coord.view.waited
    assert "made-up-0" in waited and len(waited) <= 2  # while new, no more of them than learners that send
    step_until(rig, lambda: not rig.coord.view.waited - {"good"}, timeout_s=patience_s + 3.0)
    # Now the honest learner's piece merges as soon as it is read: no round waits for the 20 ids.
    head = rig.head()
    rig.send_good("good")
    rig.coord.step()
    assert rig.head() == head + 1 and pending(rig) == []
