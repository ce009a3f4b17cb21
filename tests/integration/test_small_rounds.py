"""A round smaller than usual takes a smaller outer step, also right after a coordinator restart.

With `scale_rounds` (the default) the coordinator sizes each round's outer step against the usual
round (`policy.round_step`): every learner of the fleet (the median learners of the recent rounds,
never fewer than those that contributed lately and are live) with H steps each. A small round's
merged update counts for its learners' share of the fleet and its fractional Nesterov step for its
share of the steps; both are recorded in the manifest's settings (`round_scale`, `progress`). A round
carrying more than two usual rounds of progress per learner (a backlog) is scaled down to that. A
coordinator that starts on an existing run recalls those recent rounds from the manifests, so a
lone learner's round right after a restart or a standby takeover is scaled as it would have been
without one.
"""

from __future__ import annotations

import dataclasses

from diloco.storage.history import read_manifest
from harness import TINY_RUN, join, make_coordinator, train

RUN = dataclasses.replace(TINY_RUN, cadence="steps")


def merge_all(coord) -> None:  # noqa: ANN001
    for _ in range(10):
        coord.step(block_ms=50)


def last_round(coord) -> tuple[int, float, float]:  # noqa: ANN001
    """(tokens, round_scale, progress) of fragment 0's head version."""
    m = read_manifest(coord.store, coord.keys, 0, coord.bus.heads()[0])
    assert m.settings["outer"] == "fractional_nesterov"
    return sum(c.tokens for c in m.inputs), m.settings["round_scale"], m.settings["progress"]


def test_a_lone_learners_round_steps_by_its_share_and_a_backlog_is_capped_also_after_a_restart(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=RUN)
    (a, opt_a), (b, opt_b) = join(endpoints, run_id, coord, "a"), join(endpoints, run_id, coord, "b")
    try:
        for _ in range(3):  # rounds of both learners: 2 x 4 steps x 10 tokens
            train(a, opt_a, 4)
            train(b, opt_b, 4)
            merge_all(coord)
            assert last_round(coord) == (80, 1.0, 1.0)
        train(a, opt_a, 4)  # a alone: half the fleet, half a usual round's tokens
        merge_all(coord)
        assert last_round(coord) == (40, 0.5, 0.5)
        coord.close()
        coord = make_coordinator(endpoints, run_id, settings=RUN)  # recalls 80, 80, 80, 40: median 80
        train(a, opt_a, 4)
        merge_all(coord)
        assert last_round(coord) == (40, 0.5, 0.5)
        # A backlog: a's four sends merged in one round, 160 tokens from one learner where a usual
        # round holds 40 per learner: half the fleet, capped at two rounds' worth; a whole step's time.
        train(a, opt_a, 16)
        merge_all(coord)
        assert last_round(coord) == (160, 0.25, 1.0)
    finally:
        a.close()
        b.close()
        coord.close()


def test_rounds_that_each_hold_one_learner_stay_each_its_share_of_the_fleet(endpoints, run_id):
    """Quorum 1 on the step cadence, the learners' pieces merged one at a time: soon every recent
    round holds one learner. Against their median, each round would be a whole outer step of one
    learner's delta (twice as many whole steps as the fleet's rounds: a run diverged so). Against
    the learners that contribute and are live, each is half, also after a restart."""
    coord = make_coordinator(endpoints, run_id, settings=RUN)
    (a, opt_a), (b, opt_b) = join(endpoints, run_id, coord, "a"), join(endpoints, run_id, coord, "b")
    try:
        for turn in range(12):
            learner, opt = (a, opt_a) if turn % 2 == 0 else (b, opt_b)
            train(learner, opt, 4)
            merge_all(coord)
            if turn > 1:  # until b has contributed, a alone is all the fleet the rounds know of
                assert last_round(coord) == (40, 0.5, 0.5), turn
        coord.close()
        coord = make_coordinator(endpoints, run_id, settings=RUN)  # recalls who contributed
        train(a, opt_a, 4)
        merge_all(coord)
        assert last_round(coord) == (40, 0.5, 0.5)
    finally:
        a.close()
        b.close()
        coord.close()
