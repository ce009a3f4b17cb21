"""Which version a learner takes, and when (`workers.takes`): the decisions the step hook makes."""

from __future__ import annotations

import dataclasses

from diloco.workers.takes import STAGE_WAIT_STEPS, Awaiting, refetch_after, wait_reason

# Sent at step 100 with tau = 2 (due at 102), own_version_wait 0.5 at H = 50 (patient until 127).
SENT = Awaiting(step=102, due=102, patience=25.0, merged_in=None, staging=False, stage_waits=0)


def at(step: int, **over: object) -> Awaiting:
    return dataclasses.replace(SENT, step=step, **over)


def test_nothing_is_taken_before_the_overlap_has_passed_or_without_a_send():
    assert wait_reason(at(101)) == "not_due"
    assert wait_reason(at(500, due=None)) == "not_due"


def test_while_its_own_round_has_not_committed_a_learner_trains_on_until_its_patience_runs_out():
    assert [wait_reason(at(s)) for s in (102, 126, 127)] == ["own_round", "own_round", None]
    assert wait_reason(at(102, patience=0.0)) is None  # own_version_wait 0: the first newer version
    assert wait_reason(at(102, merged_in=7)) is None  # committed: take it once it is parked


def test_a_version_still_being_made_ready_waits_a_few_steps_then_is_taken_anyway():
    assert wait_reason(at(110, merged_in=7, staging=True)) == "staging"
    assert wait_reason(at(110, merged_in=7, staging=True, stage_waits=STAGE_WAIT_STEPS - 1)) == "staging"
    assert wait_reason(at(110, merged_in=7, staging=True, stage_waits=STAGE_WAIT_STEPS)) is None


def test_a_learner_that_waits_for_each_merge_takes_the_first_newer_version_as_soon_as_due():
    blocking = dataclasses.replace(SENT, patience=0.0, blocking=True)
    assert wait_reason(blocking) is None and not blocking.patient
    assert wait_reason(dataclasses.replace(blocking, staging=True)) is None


def test_a_parked_version_older_than_wanted_is_fetched_again():
    assert refetch_after(at(110, merged_in=7), version=5, base_version=5) == 5  # not newer than the base
    assert refetch_after(at(110, merged_in=7), version=6, base_version=5) == 6  # ours is 7: fetch newer than 6
    assert refetch_after(at(110, merged_in=7), version=7, base_version=5) is None
    assert refetch_after(at(130, merged_in=7), version=6, base_version=5) is None  # patience over: take it
    assert refetch_after(at(110), version=6, base_version=5) is None  # ours not known: anything newer
