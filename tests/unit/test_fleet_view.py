"""The coordinator's view of its learners (`coordinator.fleet_view`): what a fleet read and the pieces make of it."""

from __future__ import annotations

from diloco.coordinator.fleet_view import FleetView
from diloco.storage.bus import Fleet


def fleet(live: str = "", finished: str = "") -> Fleet:
    return Fleet(live=frozenset(live), joined=frozenset(live + finished), finished=frozenset(finished),
                 finish_request=None)


def view() -> FleetView:
    return FleetView(bus=None, gone_after_s=60.0)  # type: ignore[arg-type]  (see/sent/clock_sample read no server)


def test_a_learner_counts_as_finished_only_after_a_complete_read() -> None:
    v = view()
    v.see(fleet("ab"), True, fleet("ab"), at=10.0, known=frozenset(), patience_s=0.0)
    assert v.waited == {"a", "b"} and v.first_seen == {"a": 10.0, "b": 10.0}
    # b finished: a read that has not taken in every announcement yet keeps waiting for its final pieces.
    v.see(fleet("a", "b"), False, fleet("a", "b"), at=11.0, known=frozenset(), patience_s=0.0)
    assert v.finished == frozenset() and v.waited == {"a", "b"}
    v.see(fleet("a", "b"), True, fleet("a", "b"), at=12.0, known=frozenset(), patience_s=0.0)
    assert v.finished == {"b"} and v.waited == {"a"}
    assert v.first_seen == {"a": 10.0}  # b is no longer live; a keeps when it was first seen


def test_silent_ids_are_not_waited_for_once_their_patience_is_up() -> None:
    v = view()
    v.see(fleet("ab"), True, fleet("ab"), at=0.0, known=frozenset(), patience_s=5.0)
    v.sent("a", 8.0)
    v.see(fleet("ab"), True, fleet("ab"), at=9.0, known=frozenset("a"), patience_s=5.0)
    assert v.waited == {"a"}  # b heartbeats and never sends


def test_the_round_clock_reads_the_senders_the_earliest_seen_first() -> None:
    v = view()
    v.see(fleet("c"), True, fleet("c"), at=1.0, known=frozenset(), patience_s=0.0)
    v.see(fleet("abcd"), True, fleet("abcd"), at=2.0, known=frozenset(), patience_s=0.0)
    assert v.clock_sample(2) == ["c", "a"]  # nobody sent yet: every live one, the earliest seen first
    v.sent("d", 3.0)
    v.sent("b", 3.5)
    v.sent("gone", 3.5)  # not live: not sampled
    assert v.clock_sample(10) == ["b", "d"]
    v.sent("b", 1.0)  # an older piece (a manifest read after) does not move the last one back
    assert v.last_piece["b"] == 3.5
