"""Which saved learner state fits a rejoining learner (`workers.state.misfit`), and the state's
form: whole tensors and each rank's own objects, whatever the sharding it was saved from."""

from __future__ import annotations

import pytest
import torch

from diloco.workers.state import LearnerState, misfit, pack_tree, unpack_user

PARAMS = (("w", (4, 3)), ("b", (4,)))


def state(ranks=(), saved_at=100.0) -> LearnerState:  # noqa: ANN001
    return LearnerState(learner="a", step=7, tokens=70, versions=(3, 4), params=PARAMS,
                        optimizer={"state": {0: {"exp_avg": torch.ones(4, 3)}}, "param_groups": []},
                        user={"data": {"consumed": 7}}, saved_at=saved_at, ranks=ranks)


def test_a_state_fits_a_learner_of_the_same_parameters_fragments_age_and_ranks() -> None:
    heads = {0: 9, 1: 9}
    assert misfit(state(), PARAMS, heads, now=200.0, max_age_s=1800) is None
    assert "other parameters" in misfit(state(), (("w", (4, 4)), ("b", (4,))), heads, 200.0, 1800)
    assert "fragments" in misfit(state(), PARAMS, {0: 9}, 200.0, 1800)
    assert "state_max_age_s" in misfit(state(), PARAMS, heads, 2000.0, 1800)
    island = state(ranks=({"data": {"consumed": 107}},))
    assert misfit(island, PARAMS, heads, 200.0, 1800, world=2) is None
    assert "2 rank(s), this one has 1" in misfit(island, PARAMS, heads, 200.0, 1800)
    assert "1 rank(s), this one has 2" in misfit(state(), PARAMS, heads, 200.0, 1800, world=2)


def test_each_ranks_objects_travel_with_the_state_and_a_state_from_before_islands_reads_as_one_rank() -> None:
    island = state(ranks=({"data": {"consumed": 107}}, {"data": {"consumed": 207}}))
    back = LearnerState.from_bytes(island.to_bytes())
    assert back.ranks == island.ranks and back.user == island.user
    assert torch.equal(back.optimizer["state"][0]["exp_avg"], torch.ones(4, 3))
    old = pack_tree({k: v for k, v in {"format": 1, "learner": "a", "step": 7, "tokens": 70, "versions": [3, 4],
                                        "params": [["w", [4, 3]]], "optimizer": {}, "user": {},
                                        "saved_at": 1.0}.items()})  # written before islands saved states
    assert LearnerState.from_bytes(old).ranks == ()
    assert unpack_user(pack_tree({"data": {"consumed": 3}}), 1) == {"data": {"consumed": 3}}
    for bad in (b"", b"\x05\x00\x00\x00\x00\x00\x00\x00abc"):
        with pytest.raises(ValueError, match="rank 1"):
            unpack_user(bad, 1)
