"""A learner preempted alone sends the progress it has not sent yet, and it is merged; leaving does not.

A learner has up to H steps per fragment trained since its last send: `Learner.send_progress`
sends them. Leaving (`close`) does not: a run whose every learner stops at once would merge rounds
made only of those short pieces, each at a full outer momentum step.
"""

from __future__ import annotations

import dataclasses

from harness import TINY_RUN, announcements, join, make_coordinator, train
from storage.history import read_manifest

STEPS_RUN = dataclasses.replace(TINY_RUN, cadence="steps")  # H = 4: fragment 0 sends at step 4, fragment 1 at 6


def deltas(coord) -> list:  # noqa: ANN001
    return [a for _, a in announcements(coord.bus) if a.kind == "delta"]


def test_send_progress_sends_each_fragments_unsent_steps_and_they_are_merged(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner, opt = join(endpoints, run_id, coord, "a")
    try:
        train(learner, opt, 5)  # fragment 0 sent at step 4; fragment 1 never (due at 6)
        assert [(a.fragment, a.steps) for a in deltas(coord)] == [(0, 4)]
        learner.send_progress()
    finally:
        learner.close()
    sent = sorted((a.fragment, a.steps, a.tokens) for a in deltas(coord))
    assert sent == [(0, 1, 10), (0, 4, 40), (1, 5, 50)]  # the step after fragment 0's send; all 5 of fragment 1
    for _ in range(20):
        coord.step(block_ms=50)
    merged = [(f, c.steps) for f in (0, 1) for v in range(1, coord.bus.heads()[f] + 1)
              for c in read_manifest(coord.store, coord.keys, f, v).inputs]
    assert sorted(merged) == [(0, 1), (0, 4), (1, 5)]
    coord.close()


def test_leaving_sends_nothing_more(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner, opt = join(endpoints, run_id, coord, "quiet")
    train(learner, opt, 3)  # nothing due yet
    learner.close()
    assert deltas(coord) == []
    coord.close()
