"""Round decisions, staleness and merge weights: the clock is an argument, nothing sleeps."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from diloco.coordinator.policy import (FIRST_DEADLINE_LEAD_S, MAX_LINK_STRETCH, STILL_PROGRESS, Arrival, Decision, RoundConfig, RoundSize,
                                       RoundState, RoundStep, decide_round, link_bound_period, lookahead, merge_order,
                                       merge_weights, next_cadence,
                                       quorum_target, served_deadline, round_size, round_step, run_end, staleness_verdict,
                                       usual_pieces)
from diloco.storage.errors import ConfigError
from diloco.storage.protocol import Cadence

HEAD = 5


def arrival(learner: str, at: float, *, base: int = HEAD, tokens: int = 1000, steps: int = 10,
            step_time_s: float = 1.0, fid: str | None = None) -> Arrival:
    return Arrival(contribution_id=fid or f"{learner}-{at}", learner=learner, base_version=base,
                   tokens=tokens, steps=steps, arrived_at=at, step_time_s=step_time_s)


def state(*arrivals: Arrival, live: int, sync_time_s: float = 0.0) -> RoundState:
    return RoundState(fragment=3, head_version=HEAD, arrivals=arrivals, live_learners=live,
                      sync_time_s=sync_time_s)


CFG = RoundConfig(min_quorum=2, grace_gamma=0.5, overlap_steps=10, max_grace_s=30.0)


# --- decide_round -------------------------------------------------------------------------


def test_no_arrivals_waits_for_the_next_one() -> None:
    d = decide_round(100.0, state(live=4), CFG)
    assert d == Decision(False, d.reason, None)
    assert d.reason.startswith("wait:")


def test_quorum_not_reached_waits_for_the_next_arrival() -> None:
    d = decide_round(150.0, state(arrival("a", 100.0), live=4), CFG)
    assert not d.merge and d.wake_at is None
    assert "1/2" in d.reason and "quorum not reached" in d.reason


def test_quorum_with_stragglers_waits_until_the_grace_deadline_then_merges() -> None:
    # slack = tau * t_step - (t_quorum - t_open + t_sync) = 10 * 1.0 - (2.0 + 1.0) = 7.0 s
    # grace = gamma * slack = 3.5 s, so the round closes at t_quorum + 3.5 = 105.5
    s = state(arrival("a", 100.0), arrival("b", 102.0), live=4, sync_time_s=1.0)
    d = decide_round(103.0, s, CFG)
    assert not d.merge and d.wake_at == pytest.approx(105.5)
    assert "2.50s more" in d.reason and "+3.50s" in d.reason and "slack 7.00s" in d.reason
    assert "2/4 learners in" in d.reason
    assert not decide_round(105.49, s, CFG).merge
    for now in (105.5, 200.0):
        d = decide_round(now, s, CFG)
        assert d.merge and d.reason.startswith("merge:") and "3.50s" in d.reason


def test_grace_uses_the_slowest_step_time_and_the_kth_learners_arrival() -> None:
    # K=2: quorum at b's arrival (102), not c's (103); t_step is c's 2.0 s: slack 20 - 2 = 18, grace 9.
    s = state(arrival("a", 100.0), arrival("b", 102.0), arrival("c", 103.0, step_time_s=2.0), live=4)
    assert decide_round(103.0, s, CFG).wake_at == pytest.approx(111.0)


def test_all_live_learners_in_merges_before_the_grace_deadline() -> None:
    s = state(arrival("a", 100.0), arrival("b", 100.5), live=2)
    d = decide_round(100.5, s, RoundConfig(min_quorum=1, overlap_steps=100))
    assert d.merge and "all 2 live learners arrived" in d.reason


def test_fleet_smaller_than_k_lowers_the_quorum_and_says_so() -> None:
    cfg = RoundConfig(min_quorum=4)
    assert quorum_target(cfg, 2) == 2 and quorum_target(cfg, 9) == 4 and quorum_target(cfg, 0) == 1
    d = decide_round(100.0, state(arrival("a", 100.0), live=2), cfg)
    assert not d.merge and "1/2" in d.reason and "lowered from min_quorum 4" in d.reason
    d = decide_round(101.0, state(arrival("a", 100.0), arrival("b", 101.0), live=2), cfg)
    assert d.merge and "lowered from min_quorum 4: only 2 learners live" in d.reason


def test_pending_work_of_learners_whose_heartbeat_lapsed_still_merges() -> None:
    assert decide_round(100.0, state(arrival("a", 99.0), live=0), CFG).merge
    # b died after sending: 2 arrivals, 1 live heartbeat; nothing is left to wait for.
    assert decide_round(100.0, state(arrival("a", 99.0), arrival("b", 99.5), live=1), CFG).merge


def test_negative_slack_clamps_grace_to_zero() -> None:
    # slack = 2 * 1.0 - (105 - 100) = -3 s: merging at quorum already costs the first learner time.
    s = state(arrival("a", 100.0), arrival("b", 105.0), live=3)
    d = decide_round(105.0, s, RoundConfig(min_quorum=2, overlap_steps=2))
    assert d.merge and "no slack left: -3.00s" in d.reason and "0.00s" in d.reason


def test_grace_is_capped_at_max_grace_s() -> None:
    # slack = 100 * 10 - 1 = 999 s, gamma * slack = 499.5 s > cap 30 s
    s = state(arrival("a", 100.0, step_time_s=10.0), arrival("b", 101.0, step_time_s=5.0), live=3)
    cfg = RoundConfig(min_quorum=2, overlap_steps=100, max_grace_s=30.0)
    d = decide_round(101.0, s, cfg)
    assert not d.merge and d.wake_at == pytest.approx(131.0)
    assert "capped at max_grace_s 30s" in d.reason and "slack 999.00s" in d.reason
    assert decide_round(131.0, s, cfg).merge


@pytest.mark.parametrize("kwargs", [
    {"min_quorum": 0}, {"grace_gamma": 0.0}, {"grace_gamma": 1.0}, {"grace_gamma": float("nan")},
    {"overlap_steps": -1}, {"max_grace_s": -1.0}, {"max_grace_s": float("nan")}, {"max_staleness": -1},
])
def test_invalid_round_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        RoundConfig(**kwargs)


# --- finishing ------------------------------------------------------------------------------

def final_arrival(learner: str, at: float, deadline: float = 100.0) -> Arrival:
    return replace(clock_arrival(learner, at, deadline), final=True)


def test_a_finished_learners_final_piece_joins_the_others_round_which_waits_for_nothing_more_from_it() -> None:
    cfg = RoundConfig(grace_gamma=0.5, max_grace_s=30.0)
    # a finished (its final piece is in); b, c and d train on: the round is theirs too.
    s = RoundState(fragment=0, head_version=HEAD, arrivals=(final_arrival("a", 98.0),), live_learners=3,
                   period_s=4.0, finished=frozenset({"a"}))
    d = decide_round(99.0, s, cfg)
    assert not d.merge and d.wake_at == pytest.approx(102.0) and "1/4 learners in" in d.reason
    s = replace(s, arrivals=(*s.arrivals, *(clock_arrival(x, 99.9) for x in "bcd")))
    d = decide_round(100.0, s, cfg)
    assert d.merge and "all 4 live learners arrived (1 of them leaving)" in d.reason
    # A final piece says the same before the learner's finish is seen (or of a preempted learner).
    preempted = replace(s, finished=frozenset())
    assert decide_round(100.0, preempted, cfg).merge


def test_once_every_learner_of_the_fleet_has_finished_their_final_pieces_merge_at_once_as_one_round() -> None:
    cfg = RoundConfig(min_quorum=4, grace_gamma=0.5, max_grace_s=30.0)
    s = RoundState(fragment=0, head_version=HEAD, arrivals=(final_arrival("a", 98.0), final_arrival("b", 98.5)),
                   live_learners=1, period_s=4.0, finished=frozenset({"a", "b"}))
    assert not decide_round(99.0, s, cfg).merge  # c still trains: its piece of this round is to come
    d = decide_round(99.0, replace(s, live_learners=0), cfg)
    assert d.merge and "every learner of the fleet has finished" in d.reason and "2 learners in" in d.reason


def test_an_operator_asking_to_finish_merges_every_open_round_now() -> None:
    s = state(arrival("a", 100.0), live=4)
    assert not decide_round(100.0, s, CFG).merge
    d = decide_round(100.0, replace(s, finish_asked=True), CFG)
    assert d.merge and "an operator asked to finish the run" in d.reason and "1 learner in" in d.reason


def test_a_run_is_over_once_nothing_is_pending_and_every_learner_that_joined_has_finished() -> None:
    ab = frozenset({"a", "b"})
    assert run_end(joined=ab, live=frozenset(), finished=ab, asked_by=None, pending=0) == (
        "learners", "every learner that joined has finished (a, b)")
    assert run_end(joined=ab, live=frozenset(), finished=ab, asked_by=None, pending=1) is None
    # b joined and died without finishing: it may be restarted, so the run stays open ...
    assert run_end(joined=ab, live=frozenset(), finished=frozenset({"a"}), asked_by=None, pending=0) is None
    # ... as it does for a live learner that is not finished (the joined set lost with Redis's data).
    assert run_end(joined=frozenset(), live=frozenset({"c"}), finished=ab, asked_by=None, pending=0) is None
    assert run_end(joined=frozenset(), live=frozenset(), finished=frozenset(), asked_by=None, pending=0) is None
    many = frozenset(f"l{i}" for i in range(7))
    assert run_end(joined=many, live=frozenset(), finished=many, asked_by=None, pending=0)[1].endswith(
        "(l0, l1, l2, l3, l4 and 2 more)")


def test_an_operator_ends_the_run_whoever_still_trains_once_nothing_is_pending() -> None:
    live = frozenset({"a"})
    assert run_end(joined=live, live=live, finished=frozenset(), asked_by="ops", pending=2) is None
    assert run_end(joined=live, live=live, finished=frozenset(), asked_by="ops", pending=0) == (
        "operator", "an operator asked to finish it (ops)")


# --- staleness_verdict --------------------------------------------------------------------

STALE = RoundConfig(max_staleness=2, staleness_discount=True)


def test_contribution_against_the_head_is_accepted() -> None:
    ok, s, reason = staleness_verdict(5, 5, STALE)
    assert (ok, s) == (True, 0) and "head version 5" in reason


def test_stale_within_bound_is_accepted_and_the_reason_tells_the_weight() -> None:
    ok, s, reason = staleness_verdict(3, 5, STALE)
    assert (ok, s) == (True, 2) and "2 versions behind head 5" in reason and "1/3" in reason
    _, _, reason = staleness_verdict(3, 5, RoundConfig(max_staleness=2, staleness_discount=False))
    assert "full weight" in reason


def test_stale_beyond_bound_is_refused() -> None:
    ok, s, reason = staleness_verdict(2, 5, STALE)
    assert (ok, s) == (False, 3) and reason.startswith("refused:") and "max_staleness 2" in reason


def test_base_from_the_future_is_refused() -> None:
    ok, s, reason = staleness_verdict(6, 5, STALE)
    assert (ok, s) == (False, -1) and "from the future" in reason


# --- merge_weights / merge_order ----------------------------------------------------------

NO_DISCOUNT = RoundConfig(staleness_discount=False)


def test_token_weighting_by_hand() -> None:
    # w = tokens * tokens/steps: a 1000*100 = 100000, b 500*50 = 25000, c 2000*50 = 100000
    arrivals = [arrival("a", 1.0, tokens=1000, steps=10), arrival("b", 2.0, tokens=500, steps=10),
                arrival("c", 3.0, tokens=2000, steps=40)]
    assert merge_weights(arrivals, HEAD, NO_DISCOUNT) == pytest.approx([100 / 225, 25 / 225, 100 / 225])
    assert merge_weights(arrivals[:2], HEAD, NO_DISCOUNT) == pytest.approx([0.8, 0.2])


ABSOLUTE = RoundConfig(staleness_relative=False)


def test_staleness_discount_divides_by_one_plus_staleness() -> None:
    arrivals = [arrival("a", 1.0), arrival("b", 2.0, base=HEAD - 1), arrival("c", 3.0, base=HEAD - 3)]
    # equal learner shares of 1/3, shrunk by 1, 1/2, 1/4: stale updates are not renormalized away
    assert merge_weights(arrivals, HEAD, ABSOLUTE) == pytest.approx([1 / 3, 1 / 6, 1 / 12])
    assert merge_weights(arrivals, HEAD, NO_DISCOUNT) == pytest.approx([1 / 3] * 3)
    # Relative to the round: the same shares, summing to a round at its median staleness (1): 1/2.
    assert merge_weights(arrivals, HEAD, RoundConfig()) == pytest.approx([2 / 7, 1 / 7, 1 / 14])


def test_stale_pieces_among_fresh_ones_take_less_of_a_whole_round() -> None:
    """Two learners of four on thin links send pieces a version stale: the round moves as far as a
    fresh one, theirs half a fresh piece's share of it; absolute, every such round was 3/4 of one.
    A round all of one staleness, or a lone stale piece, shrinks by it either way."""
    thin = [arrival("a", 1.0), arrival("b", 2.0), arrival("c", 3.0, base=HEAD - 1), arrival("d", 4.0, base=HEAD - 1)]
    assert merge_weights(thin, HEAD, RoundConfig()) == pytest.approx([1 / 3, 1 / 3, 1 / 6, 1 / 6])
    assert math.fsum(merge_weights(thin, HEAD, ABSOLUTE)) == pytest.approx(0.75)
    stale = [arrival(n, float(i), base=HEAD - 2) for i, n in enumerate("abcd")]
    assert merge_weights(stale, HEAD, RoundConfig()) == pytest.approx([1 / 12] * 4)
    assert merge_weights(stale[:1], HEAD, RoundConfig()) == merge_weights(stale[:1], HEAD, ABSOLUTE) == [1 / 3]
    # Mostly stale: the round is as stale as most of it (the lower median of 0, 2, 2).
    most = [arrival("a", 1.0), *stale[1:3]]
    assert merge_weights(most, HEAD, RoundConfig()) == pytest.approx([1 / 5, 1 / 15, 1 / 15])


def test_weights_are_normalized_and_per_learner_independent_of_order() -> None:
    arrivals = [arrival(n, float(i), tokens=t, steps=s, base=HEAD - i % 2)
                for i, (n, t, s) in enumerate([("a", 1234, 7), ("b", 999, 13), ("c", 31, 3), ("d", 4096, 64)])]
    expected = dict(zip("abcd", merge_weights(arrivals, HEAD, NO_DISCOUNT), strict=True))
    assert math.fsum(expected.values()) == pytest.approx(1.0, abs=1e-15)
    expected = dict(zip("abcd", merge_weights(arrivals, HEAD, RoundConfig()), strict=True))
    for perm in itertools.permutations(arrivals):
        got = dict(zip((a.learner for a in perm), merge_weights(perm, HEAD, RoundConfig()), strict=True))
        assert got == expected  # exact, not approx


def test_without_token_counts_learners_are_weighed_by_steps() -> None:
    arrivals = [arrival("a", 1.0, tokens=0, steps=30), arrival("b", 2.0, tokens=0, steps=10)]
    assert merge_weights(arrivals, HEAD, NO_DISCOUNT) == pytest.approx([0.75, 0.25])


def test_pieces_of_one_learner_add_up_and_share_its_weight() -> None:
    # a sent twice in the round (500 tokens / 5 steps each), b once (1000 / 10): equal learners.
    arrivals = [arrival("a", 1.0, tokens=500, steps=5, fid="a1"), arrival("b", 2.0, tokens=1000, steps=10),
                arrival("a", 3.0, tokens=500, steps=5, fid="a2")]
    assert merge_weights(arrivals, HEAD, NO_DISCOUNT) == pytest.approx([0.5, 0.5, 0.5])


# --- the fleet's rate: a slow learner's short pieces add to the round, never shorten it ---

FAST = ("f1", "f2", "f3")
USUAL = {"f1": 50, "f2": 50, "f3": 50, "slow": 10}


def _round(slow_steps: int = 10, slow_tokens: int | None = None) -> list[Arrival]:
    return [*(arrival(f, float(i), tokens=50 * 100, steps=50) for i, f in enumerate(FAST)),
            arrival("slow", 9.0, tokens=slow_tokens if slow_tokens is not None else slow_steps * 100, steps=slow_steps)]


def test_a_slow_learners_delta_counts_at_the_fleets_rate() -> None:
    # Each learner's delta is its steps times one progress per step: the merged update of the
    # fleet with a 5x slower learner is as long as the fast learners' alone (token weights made it
    # 150/160 * 50 + 10/160 * 10 = 47.5 steps long), and the slow learner adds its steps to the estimate.
    def merged(arrivals: list[Arrival], weights: list[float]) -> float:
        return math.fsum(w * a.steps for a, w in zip(arrivals, weights, strict=True))

    fast_alone = _round()[:3]
    assert merged(fast_alone, merge_weights(fast_alone, HEAD, NO_DISCOUNT, USUAL, 50)) == pytest.approx(50)
    assert merged(_round(), merge_weights(_round(), HEAD, NO_DISCOUNT)) == pytest.approx(47.5)
    at_rate = merge_weights(_round(), HEAD, NO_DISCOUNT, USUAL, 50)
    assert at_rate == pytest.approx([50 / 160] * 4) and merged(_round(), at_rate) == pytest.approx(50)
    # Alone in its round it is raised as much: round_step then sizes that round by its usual piece
    # (10 of 160 steps), which gives its delta the weight it has in the whole round.
    alone = _round()[3:]
    (w,) = merge_weights(alone, HEAD, NO_DISCOUNT, USUAL, 50)
    fleet = round_step(round_size(alone), [RoundSize(16000, 4, steps=160)] * 8, USUAL, 50)
    assert w * fleet.scale == pytest.approx(50 / 160)


def test_the_fleets_rate_raises_a_learner_at_most_to_the_heaviest_other() -> None:
    # A learner claiming 1 step for many tokens already outweighs the others: not raised further.
    liar = _round(slow_steps=1, slow_tokens=5000)
    plain = merge_weights(liar, HEAD, NO_DISCOUNT)
    assert merge_weights(liar, HEAD, NO_DISCOUNT, {**USUAL, "slow": 1}, 50) == plain
    # An honest slow learner with a smaller usual piece than its rate: raised to a fast one's weight, no more.
    assert merge_weights(_round(), HEAD, NO_DISCOUNT, {**USUAL, "slow": 2}, 50) == pytest.approx([50 / 160] * 4)
    # Learners at the rate, rate 0 (the clock has a fixed period) or no usual pieces: the token weights.
    assert merge_weights(_round()[:3], HEAD, NO_DISCOUNT, USUAL, 50) == merge_weights(_round()[:3], HEAD, NO_DISCOUNT)
    assert merge_weights(_round(), HEAD, NO_DISCOUNT, USUAL, 0) == merge_weights(_round(), HEAD, NO_DISCOUNT)
    assert merge_weights(_round(), HEAD, NO_DISCOUNT, {}, 50) == merge_weights(_round(), HEAD, NO_DISCOUNT)
    # The discount still shrinks a stale piece after the raise.
    stale = [*_round()[:3], arrival("slow", 9.0, tokens=1000, steps=10, base=HEAD - 1)]
    assert merge_weights(stale, HEAD, ABSOLUTE, USUAL, 50)[3] == pytest.approx(50 / 160 / 2)


@pytest.mark.parametrize("bad", [
    [arrival("a", 1.0, steps=0)],                                 # no steps
    [arrival("a", 1.0, base=HEAD + 1)],                           # from the future
])
def test_unweighable_contributions_raise(bad: list[Arrival]) -> None:
    with pytest.raises(ValueError):
        merge_weights(bad, HEAD, RoundConfig())


def test_merge_order_is_the_same_for_every_arrival_order() -> None:
    arrivals = [arrival("b", 1.0, fid="x2"), arrival("a", 2.0, fid="z"), arrival("b", 3.0, fid="x1"),
                arrival("c", 0.5, fid="a")]
    orders = {tuple(a.contribution_id for a in merge_order(p)) for p in itertools.permutations(arrivals)}
    assert orders == {("z", "x1", "x2", "a")}


# --- clock cadence rounds ---------------------------------------------------------------------

def clock_arrival(learner: str, at: float, deadline: float = 100.0) -> Arrival:
    return Arrival(contribution_id=f"{learner}-{at}", learner=learner, base_version=HEAD, tokens=1000, steps=10,
                   arrived_at=at, step_time_s=0.1, deadline=deadline)


def test_clock_round_merges_as_soon_as_every_live_learner_sent() -> None:
    s = RoundState(fragment=0, head_version=HEAD, arrivals=(clock_arrival("a", 99.9), clock_arrival("b", 100.05)),
                   live_learners=2, period_s=4.0)
    assert decide_round(100.06, s, RoundConfig()).merge


def test_clock_round_waits_gamma_period_past_the_deadline_for_missing_learners() -> None:
    cfg = RoundConfig(grace_gamma=0.5, max_grace_s=30.0)
    s = RoundState(fragment=0, head_version=HEAD, arrivals=(clock_arrival("a", 99.9),), live_learners=3, period_s=4.0)
    d = decide_round(100.1, s, cfg)
    assert not d.merge and d.wake_at == pytest.approx(102.0) and "1/3 learners in" in d.reason
    assert decide_round(102.0, s, cfg).merge
    capped = decide_round(100.6, s, RoundConfig(grace_gamma=0.5, max_grace_s=0.5))
    assert capped.merge and "grace passed" in capped.reason


def test_a_late_arrival_for_a_round_that_merged_waits_for_the_next_round_instead_of_merging_alone() -> None:
    cfg = RoundConfig(grace_gamma=0.5, max_grace_s=30.0)
    late = clock_arrival("c", 102.5, deadline=100.0)  # round 100 merged at 102.0 without it
    s = RoundState(fragment=0, head_version=HEAD, arrivals=(late,), live_learners=3, period_s=4.0,
                   merged_deadline=100.0)
    d = decide_round(102.5, s, cfg)
    assert not d.merge and d.wake_at == pytest.approx(106.0) and "held for the next" in d.reason
    # The next round's arrivals come in: it merges with them, at their deadline's grace at the latest.
    s = RoundState(fragment=0, head_version=HEAD, live_learners=3, period_s=4.0, merged_deadline=100.0,
                   arrivals=(late, clock_arrival("a", 103.9, deadline=104.0), clock_arrival("b", 104.0, deadline=104.0)))
    assert decide_round(104.1, s, cfg).merge
    # Alone, it merges after the next deadline's grace; and a lone learner never waits.
    assert decide_round(106.0, replace(s, arrivals=(late,)), cfg).merge
    assert decide_round(102.5, replace(s, arrivals=(late,), live_learners=1), cfg).merge
    # Merged alone, it served round 104: a piece sent for 104 that comes after that is late too,
    # held for round 108 with the others, not a version of its own.
    assert served_deadline(100.0, (late,), 4.0) == 104.0
    assert served_deadline(100.0, (late, clock_arrival("a", 103.9, deadline=104.0)), 4.0) == 104.0
    assert served_deadline(0.0, (clock_arrival("a", 99.9),), 4.0) == 100.0
    after = replace(s, arrivals=(clock_arrival("a", 106.5, deadline=104.0),), merged_deadline=104.0)
    d = decide_round(106.5, after, cfg)
    assert not d.merge and d.wake_at == pytest.approx(110.0) and "held for the next" in d.reason


def test_the_log_of_a_clock_round_says_when_its_last_piece_came_against_its_deadline() -> None:
    from diloco.coordinator.policy import last_in
    pieces = (clock_arrival("a", 99.95), clock_arrival("thin", 101.21), clock_arrival("b", 100.02))
    assert last_in(pieces) == "last piece 1.21s after its deadline, from thin"
    assert last_in(pieces[:1]) == "last piece 0.05s before its deadline, from a"
    step_cadence = Arrival(contribution_id="x", learner="a", base_version=HEAD, tokens=1, steps=1, arrived_at=5.0,
                           step_time_s=0.1)
    assert last_in((step_cadence,)) == "" and last_in(()) == ""


def test_the_round_clock_is_re_set_only_on_a_large_change_and_keeps_its_phase() -> None:
    first = next_cadence(None, 4.0, now=1000.0, num_fragments=2)
    assert first == Cadence(origin=1002.0, period_s=4.0)
    assert next_cadence(first, 4.0 * 1.12, now=1009.0) is None  # 12% slower: rounds keep their phase
    assert next_cadence(first, 4.0 * 1.25, now=1009.0) is not None  # 25%: every round would be 4/5 of a step
    assert next_cadence(first, 4.0 * 0.95, now=1009.0) is None  # 5% faster: noise
    # Slower by 50%: the new clock starts at the old one's last fragment-0 deadline (1006), so the
    # next deadline of fragment 1 of 2 moves from 1012 to 1015, not to anywhere.
    slower = next_cadence(first, 6.0, now=1009.5)
    assert slower == Cadence(origin=1006.0, period_s=6.0)
    assert first.next_deadline(1, 2, after=1009.5) == 1012.0
    assert slower.next_deadline(1, 2, after=1009.5) == 1015.0
    assert slower.next_deadline(0, 2, after=1009.5) == 1012.0
    # Faster by 15%: a clock running slow would make every round carry more than H steps of the
    # fastest learner (fewer outer steps in the run), so it follows.
    assert next_cadence(first, 4.0 * 0.85, now=1009.5) == Cadence(origin=1006.0, period_s=3.4)


def test_the_round_clock_stretches_when_most_learners_links_are_over_their_share() -> None:
    """Links busy 4 s of each round at 0.5 allowed: rounds of 8 s, not H steps' 5 (the same bytes
    over more time). A minority of full links are slow learners, not the fleet's clock; none
    measured, or a share of 1, leaves H steps of the fastest learner."""
    assert link_bound_period(5.0, [4.0, 4.0, 3.75, 4.5], 0.5) == (8.0, 4.0)
    assert link_bound_period(5.0, [0.5, 0.5, 20.0], 0.5) == (5.0, 0.5)  # one full link among three
    assert link_bound_period(5.0, [1.5, 1.0], 0.5) == (5.0, 1.0)  # under the share: H steps
    assert link_bound_period(5.0, [60.0, 60.0], 0.5)[0] == 5.0 * MAX_LINK_STRETCH  # bounded
    assert link_bound_period(5.0, [], 0.5) == (5.0, 0.0)
    assert link_bound_period(5.0, [0.0, 0.0, float("nan")], 0.5) == (5.0, 0.0)
    assert link_bound_period(5.0, [4.5, 4.5], 1.0) == (5.0, 0.0)


def test_a_first_clock_leaves_learners_time_to_read_it_before_any_deadline() -> None:
    """Learners read the clock on their heartbeat: a deadline right after the clock is published
    is made by some of them and missed by others, which splits that round in two."""
    now = 1000.0
    short = next_cadence(None, 1.6, now=now, num_fragments=4)  # H steps of 0.08 s
    deadlines = [short.next_deadline(f, 4, after=now) for f in range(4)]
    assert min(deadlines) >= now + FIRST_DEADLINE_LEAD_S
    assert deadlines == pytest.approx([now + FIRST_DEADLINE_LEAD_S + 0.4 * f for f in range(4)])  # staggered
    # A long period: fragment 0's first round is its share of a period, as on the step cadence.
    long = next_cadence(None, 400.0, now=now, num_fragments=4)
    assert [long.next_deadline(f, 4, after=now) for f in range(4)] == [1100.0, 1200.0, 1300.0, 1400.0]
    # The clock has no deadline before its origin, for any `after`.
    assert long.next_deadline(3, 4, after=0.0) == 1400.0


def test_a_round_smaller_than_usual_steps_by_its_share_and_a_larger_one_takes_a_whole_step() -> None:
    usual = [RoundSize(t, 4) for t in (4000, 4100, 3900, 4000)] + [RoundSize(1000, 1)]  # one odd round
    # One learner of four, alone, with a usual interval: a quarter of the fleet's update, a quarter step.
    assert round_step(RoundSize(1000, 1), usual) == RoundStep(scale=0.25, progress=pytest.approx(0.25))
    assert round_step(RoundSize(3000, 3), usual) == RoundStep(scale=0.75, progress=pytest.approx(0.75))
    # A straggler's two intervals: not scaled up, a whole step.
    assert round_step(RoundSize(5000, 4), usual) == RoundStep(1.0, 1.0)
    # Everyone's last piece, a tenth of an interval each: the whole fleet's update (whose deltas are
    # short already), a tenth of a step.
    assert round_step(RoundSize(400, 4), usual) == RoundStep(scale=1.0, progress=pytest.approx(0.1))
    # One learner's last piece alone: its share of the fleet, and only the progress it carries.
    assert round_step(RoundSize(100, 1), usual) == RoundStep(scale=0.25, progress=pytest.approx(0.025))
    assert round_step(RoundSize(1000, 1), []) == RoundStep(1.0, 1.0)  # no history: a run's first round
    assert round_step(RoundSize(0, 1), usual) == RoundStep(1.0, 1.0)  # no token counts


def test_a_round_carrying_more_than_two_usual_rounds_per_learner_is_capped_there() -> None:
    usual = [RoundSize(4000, 4)] * 8  # 1000 tokens per learner
    assert round_step(RoundSize(8000, 4), usual) == RoundStep(1.0, 1.0)  # two rounds' worth each: within the cap
    # A backlog: every learner's pieces of 16 rounds merged at once.
    assert round_step(RoundSize(64000, 4), usual) == RoundStep(scale=pytest.approx(2 / 16), progress=1.0)
    # A learner back from an S3 outage alone, its queued pieces coalesced into one 16-round delta:
    # a quarter of the fleet, 16 rounds' reach capped at 2; a whole step's time.
    assert round_step(RoundSize(16000, 1), usual) == RoundStep(scale=pytest.approx(0.25 * 2 / 16), progress=1.0)


def test_a_round_that_barely_moves_steps_by_its_movement_not_its_tokens() -> None:
    usual = [RoundSize(4000, 4, norm) for norm in (2.0, 1.8, 2.2, 2.0)]  # usual movement: 2.0
    # Mid-run, a round moves about as far as usual (or half as far): its tokens say how far it steps.
    assert round_step(RoundSize(4000, 4, 1.1), usual) == RoundStep(1.0, 1.0)
    assert round_step(RoundSize(2000, 4, 1.5), usual) == RoundStep(1.0, pytest.approx(0.5))
    # The end of a cosine schedule: usual tokens, but its learners hardly moved (inner lr near 0):
    # a step of its movement against half the usual one, momentum included.
    assert round_step(RoundSize(4000, 4, 0.1), usual) == RoundStep(1.0, pytest.approx(0.1))
    # The lesser of the two counts: a quarter of the tokens that moved a tenth as far.
    assert round_step(RoundSize(1000, 4, 0.01), usual) == RoundStep(1.0, pytest.approx(0.01))
    # Learners that did not move at all (an inner lr of exactly 0): a step that changes nothing.
    assert round_step(RoundSize(4000, 4, 0.0), usual) == RoundStep(1.0, STILL_PROGRESS)
    # Movement unknown on either side (versions made before it was recorded): tokens alone.
    assert round_step(RoundSize(4000, 4), usual) == RoundStep(1.0, 1.0)
    assert round_step(RoundSize(4000, 4, 0.1), [RoundSize(4000, 4)] * 4) == RoundStep(1.0, 1.0)
    # Movement is before the round's scale: a learner alone moves as far as a fleet's mean.
    assert round_step(RoundSize(1000, 1, 3.0), usual) == RoundStep(scale=0.25, progress=pytest.approx(0.25))


def test_round_size_counts_tokens_and_distinct_learners() -> None:
    pieces = [arrival("a", 1.0, tokens=300), arrival("a", 2.0, tokens=200), arrival("b", 1.5, tokens=500)]
    assert round_size(pieces) == RoundSize(tokens=1000, learners=2, steps=30, names=frozenset({"a", "b"}))
    assert round_size(pieces).reach == 500


def one_learner_rounds(learners: int, count: int, steps: int = 20) -> list[RoundSize]:
    """Rounds of one learner each, the learners in turn: the step cadence with quorum 1."""
    return [round_size([arrival(f"l{i % learners}", i, tokens=100 * steps, steps=steps)]) for i in range(count)]


def test_rounds_of_one_learner_each_are_each_their_share_of_the_fleet() -> None:
    """Quorum 1 on the step cadence: each of 4 learners' pieces merges alone. Their median round
    holds one learner; counted against it, every round would be a whole outer step of one
    learner's delta, four per interval of the fleet (the run diverges). Counted against the
    learners that contribute and are live, each round is a quarter."""
    recent = one_learner_rounds(4, 12)
    piece = round_size([arrival("l0", 99.0, tokens=2000, steps=20)])
    assert round_step(piece, recent, whole(4, 20), interval=20) == RoundStep(scale=0.25, progress=0.25)
    assert round_step(piece, recent, whole(4, 1)) == RoundStep(scale=0.25, progress=0.25)  # by tokens per learner
    # Contributors that are gone do not count: two of the four left, the fleet is the two live ones.
    assert round_step(piece, recent, whole(2, 20), interval=20) == RoundStep(scale=0.5, progress=0.5)
    # Without the fleet (not known) the median is all there is.
    assert round_step(piece, recent) == RoundStep(1.0, 1.0)


def test_a_usual_piece_is_h_steps_so_a_clock_that_drifts_does_not_move_the_usual_round() -> None:
    """On the clock, rounds carry more or fewer steps as the period follows the fleet's step time:
    whole rounds of every learner with H steps each are whole steps whatever the recent rounds held,
    and a round of learners slower than the fastest carries their share of H."""
    slow_clock = [round_size([arrival(f"l{k}", float(k), tokens=2600, steps=26) for k in range(4)])] * 8
    fleet_round = round_size([arrival(f"l{k}", 9.0, tokens=2000, steps=20) for k in range(4)])
    assert round_step(fleet_round, slow_clock, whole(4, 20), interval=20) == RoundStep(1.0, 1.0)
    assert round_step(fleet_round, slow_clock, whole(4, 1)).progress == pytest.approx(20 / 26)  # against the median
    # Learners whose usual piece is not known count H steps each: a round of fewer is that much less.
    uneven = round_size([arrival(f"l{k}", 9.0, tokens=100 * n, steps=n) for k, n in enumerate((20, 18, 16, 14))])
    assert round_step(uneven, slow_clock, whole(4, 20), interval=20) == RoundStep(1.0, pytest.approx(68 / 80))
    # A straggler's two intervals: a whole step, not more.
    two = round_size([arrival(f"l{k}", 9.0, tokens=100 * n, steps=n) for k, n in enumerate((20, 20, 20, 40))])
    assert round_step(two, slow_clock, whole(4, 20), interval=20) == RoundStep(1.0, 1.0)


def whole(learners: int, steps: int) -> dict[str, int]:
    """A fleet of `learners` (l0, l1...) whose usual piece is `steps` each."""
    return {f"l{k}": steps for k in range(learners)}


def test_a_slow_learner_adds_its_progress_to_a_round_and_its_absence_costs_its_share() -> None:
    """On the clock, a learner five times slower than the others sends H / 5 steps into each round:
    that is its usual piece (`usual_pieces`, from the recent rounds), so a round of the whole fleet
    is a whole step, where counting it as H steps made every round 0.8 of one (a slow learner made
    the fleet worse than it was without it). A round it misses counts for the others' share of the
    fleet's usual steps, by the scale of its update as by its step."""
    h = 50
    rounds = [[arrival(f"l{k}", float(k), tokens=100 * n, steps=n) for k, n in enumerate((50, 50, 50, 10))]] * 8
    usual = usual_pieces([f"l{k}" for k in range(4)], rounds, h)
    assert usual == {"l0": 50, "l1": 50, "l2": 50, "l3": 10}
    recent = [round_size(r) for r in rounds]
    assert round_step(round_size(rounds[0]), recent, usual, h) == RoundStep(1.0, 1.0)
    assert round_step(round_size(rounds[0]), recent, whole(4, h), h) == RoundStep(1.0, pytest.approx(0.8))  # as H each
    without = round_size(rounds[0][:3])
    assert round_step(without, recent, usual, h) == RoundStep(pytest.approx(150 / 160), pytest.approx(150 / 160))
    # Its piece missed a round and came with the next: the two add up within that round.
    late = [[*r[:3], r[3], replace(r[3], contribution_id="again")] for r in rounds[:1]] + rounds[1:]
    assert usual_pieces(["l3"], late, h) == {"l3": 10}
    assert usual_pieces(["l3"], [[replace(rounds[0][3], steps=10)], [replace(rounds[0][3], steps=20)]] * 3, h) == \
        {"l3": 15}
    # A newcomer counts whole until its pieces show otherwise; no piece counts more than H.
    assert usual_pieces(["new", "l0"], [[replace(rounds[0][0], steps=400)]], h) == {"new": h, "l0": h}
    # A learner that finished counts with the usual piece it had before (at most H), not the final
    # sliver that is all the recent rounds hold of it at last.
    final = [[replace(rounds[0][3], steps=2)], *[[r[0]] for r in rounds[:7]]]
    assert usual_pieces(["l3", "l0"], final, h) == {"l3": 2, "l0": h}
    assert usual_pieces(["l3", "l0"], final, h, finished={"l3": 10}) == {"l3": 10, "l0": h}
    assert usual_pieces(["l3"], final, h, finished={"l3": 400}) == {"l3": h}
    # With no fixed interval, learners count one each.
    assert usual_pieces(["a", "b"], rounds, 0) == {"a": 1, "b": 1}


def test_a_learner_gone_without_finishing_does_not_hold_the_run_open():
    ab, a = frozenset("ab"), frozenset("a")
    assert run_end(joined=ab, live=frozenset(), finished=a, asked_by=None, pending=0) is None
    by, reason = run_end(joined=ab, live=frozenset(), finished=a, asked_by=None, pending=0, gone=frozenset("b"))
    assert by == "learners" and reason.endswith("gone without finishing: b")
    # Gone but live again (it came back): the run waits for it; nobody finished: the run goes on.
    assert run_end(joined=ab, live=frozenset("b"), finished=a, asked_by=None, pending=0, gone=frozenset("b")) is None
    assert run_end(joined=ab, live=frozenset(), finished=frozenset(), asked_by=None, pending=0, gone=ab) is None


def test_the_look_ahead_is_the_share_of_the_round_s_learners_that_train_on() -> None:
    assert lookahead(4, 0) == 1.0  # mid-run
    assert lookahead(3, 1) == 0.75  # one learner of four sent its final piece
    assert lookahead(0, 2) == 0.0  # the run's last round: nobody trains from it
    assert lookahead(0, 0) == 1.0  # no fleet known: the plain step
    assert lookahead(4, 0, finishing=True) == 0.0  # `diloco finish`: nobody trains from it
