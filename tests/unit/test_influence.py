"""Bounded influence: one learner's claims against the others' (`coordinator.influence`), pure."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from diloco.coordinator.influence import (FLEET_EVERY_STEP, FLEET_READ_S_PER_NAME, Claim, _median_without, clip_norms,
                                          count_claims, fastest_plausible, fleet_read_due, plausible_deadline,
                                          usual_fleet, waited_learners)
from diloco.coordinator.policy import (Arrival, RoundConfig, RoundSize, RoundState, decide_round, merge_weights,
                                       round_size, round_step, slowest_plausible)
from diloco.storage.errors import ConfigError
from diloco.storage.protocol import Cadence

HEAD = 7


def piece(learner: str, tokens: int = 1000, steps: int = 10, **kw) -> Arrival:
    return Arrival(contribution_id=f"{learner}-{tokens}-{steps}", learner=learner, base_version=HEAD, tokens=tokens,
                   steps=steps, arrived_at=0.0, step_time_s=kw.pop("step_time_s", 0.1), **kw)


HONEST = [piece("a"), piece("b"), piece("c")]
HISTORY = [[Claim(n, 1000, 10) for n in "abc"] for _ in range(4)]  # four rounds of three learners


def test_a_lying_piece_weighs_at_most_ratio_times_the_median_learner() -> None:
    liar = piece("mallory", tokens=2**64 - 1, steps=1)
    counted = count_claims([*HONEST, liar], HISTORY, 4.0)
    (m, note) = counted[-1]
    assert m.tokens == 4000 and m.steps == 40  # 4x the tokens, 4x the weight (4000**2 / 40 = 4 x 1000**2 / 10)
    assert "claimed 18446744073709551615 tokens in 1 steps" in note and "max_claim_ratio 4" in note
    assert [n for _, n in counted[:3]] == ["", "", ""]  # the honest pieces count as they claim
    weights = merge_weights([a for a, _ in counted], HEAD, RoundConfig())
    assert weights[-1] == pytest.approx(4 / 7) and all(w == pytest.approx(1 / 7) for w in weights[:3])
    # The round's step is not shrunk to nothing by the claim: its reach stays within the usual cap.
    usual = [RoundSize(tokens=3000, learners=3)] * 4
    assert round_step(round_size([a for a, _ in counted]), usual).scale > 0.5


def test_a_lying_piece_alone_in_its_round_is_bounded_by_the_history() -> None:
    (m, note), = count_claims([piece("mallory", tokens=10**12, steps=1)], HISTORY, 4.0)
    assert (m.tokens, m.steps) == (4000, 40) and note


def test_many_pieces_of_one_learner_in_a_round_weigh_together_at_most_ratio_times_the_median_learner() -> None:
    """Sixteen honest-looking pieces from one learner in one round (each as large as the others'):
    bounded one by one, each got the learner's whole share and together they outweighed the fleet
    85 times. Their total is bounded: at most 4x the median learner's round."""
    flood = [Arrival(f"m{i}", "mallory", HEAD, 1000, 10, 0.0, 0.1) for i in range(16)]
    counted = count_claims([*HONEST, *flood], HISTORY, 4.0)
    mine = [a for a, _ in counted if a.learner == "mallory"]
    assert sum(a.tokens for a in mine) <= 4000 and sum(a.steps for a in mine) >= 40
    assert all(note.startswith("claimed 16000 tokens in 160 steps over 16 piece(s)") for a, note in counted
               if a.learner == "mallory")
    # Its pieces add up (consecutive progress), each merged with its learner's share: that share is
    # at most 4x the median learner's (4/7 beside three honest ones); how far the pieces together
    # move the model is bounded by their norms (`clip_norms`).
    weights = merge_weights([a for a, _ in counted], HEAD, RoundConfig())
    assert all(w <= 4 / 7 + 1e-12 for (a, _), w in zip(counted, weights) if a.learner == "mallory")
    # Two pieces of a learner that missed a round are within the bound: counted as they claim.
    late = [piece("a"), replace(piece("a"), contribution_id="a-again"), piece("b"), piece("c")]
    assert [note for _, note in count_claims(late, HISTORY, 4.0)] == ["", "", "", ""]
    # A backlog (every learner's pieces of many rounds at once) cuts every learner alike.
    backlog = [Arrival(f"{n}{i}", n, HEAD, 1000, 10, 0.0, 0.1) for n in "abc" for i in range(10)]
    weights = merge_weights([a for a, _ in count_claims(backlog, HISTORY, 4.0)], HEAD, RoundConfig())
    assert weights == pytest.approx([1 / 3] * 30)


def test_the_median_without_a_learners_own_rounds_matches_the_plain_median() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        values = sorted(rng.choice([1, 2, 3, 5, 8]) for _ in range(rng.randint(2, 12)))
        remove = sorted(rng.sample(values, rng.randint(0, len(values) - 1)))
        kept = list(values)
        for v in remove:
            kept.remove(v)
        assert _median_without(values, remove) == statistics.median(kept)


def test_an_honest_fleet_within_the_ratio_is_counted_as_it_claims() -> None:
    # One learner 3x faster than the others (3x the tokens and steps), one with twice their batch.
    fleet = [piece("a"), piece("b"), piece("fast", tokens=3000, steps=30), piece("wide", tokens=2000, steps=10)]
    assert [note for _, note in count_claims(fleet, HISTORY, 4.0)] == ["", "", "", ""]


def test_without_another_learner_nothing_is_cut() -> None:
    alone = piece("solo", tokens=10**9, steps=1)
    assert count_claims([alone], [[Claim("solo", 10, 1)]], 4.0) == [(alone, "")]


def test_when_the_others_report_no_tokens_a_claim_of_tokens_counts_none() -> None:
    zero = [piece("a", tokens=0), piece("b", tokens=0)]
    (m, note) = count_claims([*zero, piece("mallory", tokens=10**6, steps=10**6)], [], 4.0)[-1]
    assert (m.tokens, m.steps) == (0, 40) and note  # weighed by steps, capped at 4x theirs
    weights = merge_weights([*zero, m], HEAD, RoundConfig())
    assert weights[-1] == pytest.approx(40 / 60)


def test_a_deadline_far_ahead_counts_as_the_next_one() -> None:
    clock = Cadence(origin=1000.0, period_s=10.0)
    now = 1234.0
    nxt = clock.next_deadline(1, 4, after=now)
    assert plausible_deadline(1e15, now=now, cadence=clock, fragment=1, num_fragments=4) == nxt
    assert plausible_deadline(nxt, now=now, cadence=clock, fragment=1, num_fragments=4) == nxt
    assert plausible_deadline(now - 30, now=now, cadence=clock, fragment=1, num_fragments=4) == now - 30  # late
    # Sent on step counts by a learner that had not read the clock yet (a run's first pieces): it
    # joins the round of the fragment's next deadline, not a round of its own; a last piece does not wait.
    assert plausible_deadline(0.0, now=now, cadence=clock, fragment=1, num_fragments=4) == nxt
    assert plausible_deadline(0.0, now=now, cadence=clock, fragment=1, num_fragments=4, final=True) == 0.0
    assert plausible_deadline(0.0, now=now, cadence=None, fragment=1, num_fragments=4) == 0.0  # step cadence
    # Bounded also for a learner's last piece, and before the fragment has a clock (none: 0).
    assert plausible_deadline(1e15, now=now, cadence=clock, fragment=1, num_fragments=4, final=True) == nxt
    assert plausible_deadline(1e15, now=now, cadence=None, fragment=1, num_fragments=4) == 0.0
    assert plausible_deadline(1e15, now=now, cadence=None, fragment=1, num_fragments=4, final=True) == 0.0
    assert plausible_deadline(now - 1, now=now, cadence=None, fragment=1, num_fragments=4) == now - 1


def test_the_round_clock_follows_no_step_time_far_below_the_others() -> None:
    assert fastest_plausible([0.2, 0.25, 1e-9], 4.0) == pytest.approx(0.2 / 4)  # the median is 0.2
    assert fastest_plausible([0.2, 0.3], 4.0) == 0.2  # an honest fast learner sets the clock
    assert fastest_plausible([0.2, 1e-9], 4.0) == pytest.approx(0.05)  # two learners: one cannot pull the other
    assert fastest_plausible([0.2], 4.0) == 0.2
    assert fastest_plausible([0.0, float("nan")], 4.0) is None


def test_a_grace_window_is_sized_by_no_step_time_far_above_the_others() -> None:
    assert slowest_plausible([0.1, 0.2, 1e9], 4.0) == pytest.approx(0.8)
    assert slowest_plausible([0.1, 0.3], 4.0) == 0.3
    # decide_round: one arrival claiming 1e9 s per step does not hold the round for the grace cap.
    arrivals = (piece("a", step_time_s=0.1), piece("mallory", step_time_s=1e9))
    arrivals = tuple(Arrival(**{**{f: getattr(a, f) for f in a.__slots__}, "arrived_at": 100.0 + i})
                     for i, a in enumerate(arrivals))
    cfg = RoundConfig(min_quorum=2, overlap_steps=5, max_grace_s=30.0)
    d = decide_round(101.0, RoundState(fragment=0, head_version=HEAD, arrivals=arrivals, live_learners=3), cfg)
    assert not d.merge and d.wake_at is not None and d.wake_at - 101.0 < 1.0, d


def test_learners_that_never_send_are_not_waited_for_once_their_time_is_up() -> None:
    live = frozenset({"a", "b", *(f"fake-{i}" for i in range(50))})
    first_seen = {n: 100.0 for n in live}
    last_piece = {"a": 195.0, "b": 190.0}
    known = frozenset({"a", "b"})
    # While new, made-up ids are waited for only up to the size of the fleet that sends (2 here).
    early = waited_learners(live, first_seen=first_seen, last_piece=last_piece, known=known, now=120.0, patience_s=40)
    assert {"a", "b"} <= early and len(early) == 4
    # Once silent for longer than the patience, they are not waited for; senders still are.
    late = waited_learners(live, first_seen=first_seen, last_piece=last_piece, known=known, now=200.0, patience_s=40)
    assert late == {"a", "b"}
    # One that sends again is waited for again.
    last_piece["fake-7"] = 199.0
    assert "fake-7" in waited_learners(live, first_seen=first_seen, last_piece=last_piece, known=known, now=200.0,
                                       patience_s=40)
    # Without a round clock (patience unknown), everyone live is waited for.
    assert waited_learners(live, first_seen=first_seen, last_piece={}, known=known, now=200.0, patience_s=0) == live


def test_a_restarted_coordinator_waits_for_the_fleet_its_manifests_name() -> None:
    live = frozenset({"a", "b", "c", "fake"})
    now = 1000.0  # just started: everyone first seen now; the manifests' last pieces are old
    waited = waited_learners(live, first_seen=dict.fromkeys(live, now), last_piece=dict.fromkeys("abc", 10.0),
                             known=frozenset("abc"), now=now, patience_s=40)
    assert waited == {"a", "b", "c"}  # known learners first; room for 3 newcomers is taken by them


def test_at_a_runs_start_every_new_learner_is_waited_for() -> None:
    live = frozenset(f"learner-{i}" for i in range(6))
    waited = waited_learners(live, first_seen=dict.fromkeys(live, 10.0), last_piece={}, known=frozenset(), now=12.0,
                             patience_s=40)
    assert waited == live


def test_a_large_fleet_is_read_at_a_constant_cost_per_second() -> None:
    # The fleets people run are read every loop step.
    assert fleet_read_due(4, since_s=0.0) and fleet_read_due(FLEET_EVERY_STEP, since_s=0.0)
    # Past that, a read of n names waits n x FLEET_READ_S_PER_NAME: reads per second fall as their
    # size grows, so the names read per second stay the same (4096 made-up ids: one read a second).
    for names in (FLEET_EVERY_STEP + 1, 4096, 8192, 30_000):
        wait = names * FLEET_READ_S_PER_NAME
        assert not fleet_read_due(names, since_s=0.99 * wait) and fleet_read_due(names, since_s=wait)
    assert 0.5 <= 4096 * FLEET_READ_S_PER_NAME <= 2.0  # a flood's reads lag by about a second, leases by more


def test_bounds_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_claim_ratio"):
        RoundConfig(max_claim_ratio=0.5)
    with pytest.raises(ConfigError, match="max_silent_rounds"):
        RoundConfig(max_silent_rounds=0)


def test_the_usual_fleet_counts_senders_the_rounds_own_and_the_finished_not_heartbeats() -> None:
    sent = {"a": 1.0, "b": 2.0, "old": 0.5}
    none: frozenset[str] = frozenset()
    # A thousand ids that only heartbeat count for nothing; live senders count.
    flood = frozenset({"a", "b"} | {f"x{i}" for i in range(1000)})
    assert usual_fleet(flood, arrived=none, sent=sent, merged=none, finished=none) == {"a", "b"}
    # The round's own learners count, also one whose final piece is in it (no longer live).
    assert usual_fleet(frozenset({"a"}), arrived=frozenset({"b"}), sent=sent, merged=none, finished=none) == {"a", "b"}
    # Finished learners with pieces merged here count, to the run's end (a learner training on alone
    # after them stays its share of the fleet that trained); crashed ones (neither live nor
    # finished) do not, nor finished ids that never had a piece merged here (a flood of made-up ids
    # that "finish").
    merged = frozenset({"a", "b", "old", "crashed"})
    finished = frozenset({"b", "old"} | {f"x{i}" for i in range(1000)})
    assert usual_fleet(frozenset({"a"}), arrived=none, sent=sent, merged=merged, finished=finished) == {"a", "b", "old"}


def normed(learner: str, norm: float, cid: str = "") -> Arrival:
    return replace(piece(learner), contribution_id=cid or f"{learner}-{norm}", norm=norm)


NORMED_HISTORY = [[Claim(n, 1000, 10, 1.0) for n in "abc"] for _ in range(4)]


def test_a_learners_pieces_move_the_model_at_most_ratio_times_as_far_as_the_median_learners() -> None:
    """Sixteen copies of one delta in one round (each an honest-looking piece): merged with the
    learner's share each, they moved the model sixteen times as far as one; their norms together
    are bounded by the other learners' per round, and so is one piece sixteen times too long."""
    honest = [normed(n, 1.0) for n in "abc"]
    copies = [normed("mallory", 1.0, f"m{i}") for i in range(16)]
    clips = clip_norms([*honest, *copies], NORMED_HISTORY, 4.0)
    assert clips["mallory"][0] == pytest.approx(4 / 16) and "sum to 16" in clips["mallory"][1]
    assert all(clips[n] == (1.0, "") for n in "abc")
    assert clip_norms([*honest, normed("mallory", 160.0)], NORMED_HISTORY, 4.0)["mallory"][0] == pytest.approx(4 / 160)
    # Honest progress that differs by less than the ratio, two pieces of a late learner included,
    # is merged as sent.
    assert all(c == (1.0, "") for c in clip_norms([*honest[:2], normed("c", 2.0), normed("c", 1.5, "c2")],
                                                     NORMED_HISTORY, 4.0).values())
    # A backlog (every learner's pieces of ten rounds at once, after the coordinator was down) is
    # not scaled: the round is capped as a whole (`policy.round_step`).
    backlog = [normed(n, 1.0, f"{n}{i}") for n in "abc" for i in range(10)]
    assert all(c == (1.0, "") for c in clip_norms(backlog, NORMED_HISTORY, 4.0).values())
    assert clip_norms([*backlog, *copies], NORMED_HISTORY, 4.0)["mallory"] == (1.0, "")  # 16 against their 10
    # Without norms (versions made before they were recorded) or another learner, nothing is scaled.
    assert clip_norms([*HONEST, piece("mallory")], HISTORY, 4.0)["mallory"] == (1.0, "")
    assert clip_norms([normed("solo", 1e9)], [[Claim("solo", 10, 1, 1.0)]], 4.0)["solo"] == (1.0, "")
