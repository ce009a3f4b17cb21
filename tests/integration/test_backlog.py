"""A coordinator reads a long backlog in batches its memory budget holds, and merges all of it.

A coordinator that restarts on a backlog holds every announcement of a read until its round merges:
`read_batch_bytes` bounds one read by the largest fragment's decoded (fp32) size, so a backlog of
large fragments is taken a few at a time. Nothing is lost or refused on the way.
"""

from __future__ import annotations

import dataclasses

import pytest

from diloco.storage.history import read_manifest
from diloco.workers.fragments import model_params, plan_layout
from harness import TINY_RUN, Tiny, announcements, join, make_coordinator, train


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_backlog_is_read_two_fragments_worth_at_a_time_and_all_merged(endpoints, run_id):
    layout = plan_layout(model_params(Tiny()), TINY_RUN.num_fragments)
    largest = max(layout.fragment_bytes(f) for f in range(len(layout.fragments)))
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"),
                             read_batch_bytes=2 * largest + 1)
    learners = [join(endpoints, run_id, coord, f"l{i}") for i in range(5)]
    try:
        heads = coord.bus.heads()
        for learner, opt in learners:  # the coordinator is not stepped: a backlog builds up
            train(learner, opt, 4)
        deltas = [a for _, a in announcements(coord.bus) if a.kind == "delta"]
        sent = {f: sum(1 for a in deltas if a.fragment == f) for f in heads}
        assert sum(sent.values()) >= 5, sent
        for _ in range(20):
            coord.step(block_ms=50)
        inputs = {f: [read_manifest(coord.store, coord.keys, f, v).inputs
                      for v in range(heads[f] + 1, coord.bus.heads()[f] + 1)] for f in heads}
        assert all(len(each) <= 2 for f in heads for each in inputs[f]), inputs
        assert {f: sum(map(len, inputs[f])) for f in heads} == sent
        assert coord.bus.counters().get("contributions_refused", 0) == 0, coord.bus.refusals()
    finally:
        for learner, _ in learners:
            learner.close()
        coord.close()
