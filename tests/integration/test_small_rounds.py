"""A round smaller than usual takes a smaller outer step, also right after a coordinator restart.

With `scale_rounds` (the default) the coordinator sizes each round's outer step against the usual
round (`policy.round_step`): every learner of the fleet (the median learners of the recent rounds,
never fewer than the live ones that send pieces) with H steps each. A small round's
merged update counts for its learners' share of the fleet and its fractional Nesterov step for its
share of the steps; both are recorded in the manifest's settings (`round_scale`, `progress`). A round
carrying more than two usual rounds of progress per learner (a backlog) is scaled down to that. A
coordinator that starts on an existing run recalls those recent rounds from the manifests, so a
lone learner's round right after a restart or a standby takeover is scaled as it would have been
without one.
"""

from __future__ import annotations

import dataclasses

import pytest

from diloco.coordinator.policy import RECENT_ROUNDS
from diloco.storage.history import read_manifest
from harness import TINY_RUN, join, make_coordinator, train

RUN = dataclasses.replace(TINY_RUN, cadence="steps")


class TwoLearners:
    """A coordinator of a step-cadence run and learners "a" and "b", the coordinator restartable."""

    def __init__(self, endpoints, run_id) -> None:  # noqa: ANN001
        self.endpoints, self.run_id = endpoints, run_id
        self.coord = make_coordinator(endpoints, run_id, settings=RUN)
        self.learners = {name: join(endpoints, run_id, self.coord, name) for name in ("a", "b")}

    def round_of(self, *names: str, steps: int = 4) -> tuple[int, float, float]:
        """Each named learner trains `steps` steps (sending every 4), the coordinator merges what
        came: (tokens, round_scale, progress) of fragment 0's head version."""
        for name in names:
            train(*self.learners[name], steps)
        for _ in range(10):
            self.coord.step(block_ms=50)
        m = read_manifest(self.coord.store, self.coord.keys, 0, self.coord.bus.heads()[0])
        assert m.settings.outer == "fractional_nesterov"
        return sum(c.tokens for c in m.inputs), m.settings.round_scale, m.settings.progress

    def restart(self) -> None:
        self.coord.close()
        self.coord = make_coordinator(self.endpoints, self.run_id, settings=RUN)

    def close(self) -> None:
        for learner, _ in self.learners.values():
            learner.close()
        self.coord.close()


@pytest.fixture
def fleet(endpoints, run_id):  # noqa: ANN001, ANN201
    two = TwoLearners(endpoints, run_id)
    yield two
    two.close()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_lone_learners_round_steps_by_its_share_and_a_backlog_is_capped_also_after_a_restart(fleet):
    for _ in range(3):  # rounds of both learners: 2 x 4 steps x 10 tokens
        assert fleet.round_of("a", "b") == (80, 1.0, 1.0)
    assert fleet.round_of("a") == (40, 0.5, 0.5)  # a alone: half the fleet, half a usual round's steps
    fleet.restart()  # recalls 80, 80, 80, 40: median 2 learners
    assert fleet.round_of("a") == (40, 0.5, 0.5)
    # A backlog: a's four sends merged in one round, 160 tokens from one learner where a usual
    # round holds 40 per learner: half the fleet, capped at two rounds' worth; a whole step's time.
    assert fleet.round_of("a", steps=16) == (160, 0.25, 1.0)


@pytest.mark.slow  # make test-slow (CI runs it after make test)
def test_rounds_that_each_hold_one_learner_stay_each_its_share_of_the_fleet(fleet):
    """Quorum 1 on the step cadence, the learners' pieces merged one at a time: soon every recent
    round holds one learner. Against their median, each round would be a whole outer step of one
    learner's delta (twice as many whole steps as the fleet's rounds: a run diverged so). Against
    the learners that send pieces and are live, each is half, also after a restart. A learner that
    is live and sends nothing (here "c", which joined and does not train) is not part of it."""
    for turn in range(12):
        if turn == 4:
            fleet.learners["c"] = join(fleet.endpoints, fleet.run_id, fleet.coord, "c")
        step = fleet.round_of("ab"[turn % 2])
        if turn > 1:  # until b has contributed, a alone is all the fleet the rounds know of
            assert step == (40, 0.5, 0.5), turn
    fleet.restart()  # recalls who sent pieces
    assert fleet.round_of("a") == (40, 0.5, 0.5)


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_the_last_learners_pieces_stay_their_share_when_the_others_have_finished(fleet):
    """At the end of a run learners finish one after another. Counted against the live learners
    alone, the last one's lone pieces would be whole outer steps of one learner's delta: the
    fleet that trained is the usual round to the run's end, also once the finished learners' pieces
    have left the recent rounds (a learner restarted mid-run trains on alone for many rounds), each
    finished learner with the usual piece it had, not its final sliver."""
    for turn in range(6):
        fleet.round_of("ab"[turn % 2])
    train(*fleet.learners["a"], 1)  # a's final piece: one step, a sliver of its usual four
    fleet.learners["a"][0].finish()
    for _ in range(10):
        fleet.coord.step(block_ms=50)
    assert "a" in fleet.coord.view.finished
    for turn in range(RECENT_ROUNDS + 2):
        assert fleet.round_of("b") == (40, 0.5, 0.5), turn
