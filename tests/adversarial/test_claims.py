"""A learner that lies about what it did: its claims are bounded by what the other learners show.

Each test puts an honest learner and a hostile one (valid credentials, well-formed objects, lying
numbers) in the same round of a real coordinator on the real servers, and asserts: the coordinator
goes on, the honest piece is merged, the hostile claim is bounded (`coordinator.influence`) with
the bound recorded, the version still replays from its manifest, and nothing is left pending.
"""

from __future__ import annotations

import time

import pytest

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
    assert manifest.settings["round_scale"] > 0.5  # the claim does not shrink the honest learners' step to nothing
    assert recorded_problems(manifest) == []  # replay recomputes the recorded weights from the counted claims
    assert rig.bus.counters().get("contributions_refused", 0) == 0


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


def test_a_heartbeat_claiming_a_nanosecond_step_does_not_set_the_clock(make_rig):
    rig = make_rig(cadence="clock")
    for name in ("a", "b"):
        rig.bus.heartbeat(name, 60.0, LearnerStats(learner=name, step_time_s=1.0), joined=True)
    rig.bus.heartbeat(BAD, 60.0, LearnerStats(learner=BAD, step_time_s=1e-9), joined=True)
    rig.coord._tend_cadence()  # what the loop does once a second
    clock = rig.bus.cadence()
    # H = 4 steps of the fastest plausible learner: 1/max_claim_ratio of the median (1 s), not 4 ns
    # (nor min_round_s, 0.25 s, which is all an unbounded 1e-9 would leave).
    assert clock is not None and clock.period_s == pytest.approx(4 * 1.0 / 4)
    # An honest learner faster than the others still sets it.
    rig.bus.heartbeat("quick", 60.0, LearnerStats(learner="quick", step_time_s=0.5), joined=True)
    rig.coord._tend_cadence()
    assert rig.bus.cadence().period_s == pytest.approx(1.0)  # within 30%: the clock keeps its phase


def test_made_up_learner_ids_that_never_send_stop_holding_rounds_open(make_rig):
    rig = make_rig(cadence="clock", round_s=0.5, max_grace_s=5.0)
    rig.coord.step()
    patience_s = rig.coord.round_cfg.max_silent_rounds * 0.5
    rig.advance(1)
    for i in range(20):
        rig.bus.heartbeat(f"made-up-{i}", 60.0, LearnerStats(learner=f"made-up-{i}", step_time_s=0.1), joined=True)
    rig.coord.step()
    waited = rig.coord.live_names
    assert "made-up-0" in waited and len(waited) <= 2  # while new, no more of them than learners that send
    step_until(rig, lambda: not rig.coord.live_names - {"good"}, timeout_s=patience_s + 3.0)
    # Now the honest learner's piece merges as soon as it is read: no round waits for the 20 ids.
    head = rig.head()
    rig.send_good("good")
    rig.coord.step()
    assert rig.head() == head + 1 and pending(rig) == []
