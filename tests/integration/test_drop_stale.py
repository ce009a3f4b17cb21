"""A learner does not send a piece the coordinator would refuse as stale: it drops it as the
coordinator would, takes the newest version at once, and its next piece, based on that version, is
merged (against the real Redis and S3).

A learner whose link cannot download versions as fast as they come would otherwise spend its
upload on pieces refused on arrival, which also slows the downloads it is waiting for.
"""

from __future__ import annotations

import dataclasses
import time

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from harness import TINY_RUN, announcements, join, train


def test_a_piece_that_would_be_refused_as_stale_is_not_sent_and_the_next_one_is_merged(endpoints, run_id):
    coord = Coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"),  # H = 4
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0, max_staleness=0)))
    a, opt_a = join(endpoints, run_id, coord, "a")
    b, opt_b = join(endpoints, run_id, coord, "b")
    try:
        train(a, opt_a, 4)  # a sends fragment 0 (due at step 4)
        while coord.bus.heads()[0] < 1:
            coord.step(block_ms=50)  # v1: a's piece alone
        deadline = time.monotonic() + 20
        while not b.fetcher.too_stale(0, 0):  # b hears of v1 on the versions stream
            assert time.monotonic() < deadline, "b's fetcher never heard of v1"
            time.sleep(0.05)

        train(b, opt_b, 4)  # fragment 0 due at step 4, based on v0: one behind, over max_staleness 0
        assert b.dropped_stale == 1 and b.fragments[0].steps == 0
        assert not [x for _, x in announcements(coord.bus) if x.learner == "b" and x.fragment == 0]
        deadline = time.monotonic() + 20
        while b.versions[0] < 1:  # b takes v1 at its next step boundary once fetched
            assert time.monotonic() < deadline, "b never took v1"
            train(b, opt_b, 1)
            time.sleep(0.05)
        train(b, opt_b, 4 * (b.step // 4 + 1) - b.step)  # b's next send of fragment 0
        for _ in range(20):
            coord.step(block_ms=50)
    finally:
        a.close()
        b.close()
    sent = [x for _, x in announcements(coord.bus) if x.learner == "b" and x.fragment == 0]
    assert len(sent) == 1
    # Based on the version it took, carrying the steps since the last piece it dropped (every one due
    # before it took v1); nothing refused.
    assert sent[0].base_version == 1 and sent[0].steps == 4 and sent[0].tokens == 40
    assert coord.bus.counters().get("contributions_refused", 0) == 0, coord.bus.refusals()
    assert coord.bus.heads()[0] == 2
    coord.close()
