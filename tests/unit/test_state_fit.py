"""Which saved learner state fits a rejoining learner (`workers.state.misfit`), and the state's
form: whole tensors and each rank's own objects, whatever the sharding it was saved from."""

from __future__ import annotations

import struct
import weakref

import pytest
import safetensors.torch
import torch

from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.protocol import pack
from diloco.workers.state import (LearnerState, StateSaver, _flatten, misfit, pack_tree, save_fits_link, tree_body,
                                  unpack_tree, unpack_user)

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


def test_a_state_goes_up_as_views_of_its_tensors_and_reads_back_as_written_before() -> None:
    tree = {"bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "step": torch.tensor(12.0),
            "count": torch.tensor(5, dtype=torch.int64), "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4), "moments": [torch.randn(5, 7), torch.randn(3)], "lr": 0.1}
    body = tree_body(tree)
    # No copy of a tensor: each non-empty one is a view of its own memory.
    assert len(body.views) == 1 + 6 and len(body) == sum(v.nbytes for v in body.views)
    assert body.views[-1].obj.tensor.data_ptr() == tree["moments"][1].data_ptr()
    back = unpack_tree(bytes(body), "test")
    for key in ("bf16", "step", "count", "mask", "empty"):
        assert back[key].dtype == tree[key].dtype and torch.equal(back[key], tree[key])
    assert all(torch.equal(a, b) for a, b in zip(back["moments"], tree["moments"])) and back["lr"] == 0.1
    # The blob is safetensors' format, read by its own reader; a state written by its writer (as
    # every state before this one was) still reads back.
    size = struct.unpack_from("<Q", bytes(body))[0]
    blob = safetensors.torch.load(bytes(body)[8 + size:])
    assert torch.equal(blob["0"], tree["bf16"])
    tensors: dict[str, torch.Tensor] = {}
    head = pack(_flatten(tree, tensors, "state"))
    before = unpack_tree(struct.pack("<Q", len(head)) + head + safetensors.torch.save(tensors), "test")
    assert torch.equal(before["bf16"], tree["bf16"]) and torch.equal(before["moments"][0], tree["moments"][0])
    with pytest.raises(ValueError, match="cannot hold"):
        tree_body({"x": torch.zeros(2, dtype=torch.complex64)})


def test_the_saver_lets_go_of_a_state_once_it_is_saved(tmp_path) -> None:  # noqa: ANN001
    # Held until the next save, a state's host copies (pinned on a device) cannot be reused by it.
    saver = StateSaver(DirStore(tmp_path), RunKeys("diloco", "r"), "a", 0)
    saver.start()
    try:
        saved = state()
        moment = weakref.ref(saved.optimizer["state"][0]["exp_avg"])
        saver.submit(saved)
        del saved
        assert saver.flush(30.0) and saver.saved == 1
        assert moment() is None
    finally:
        saver.close()
        saver.join(10.0)


def test_a_state_is_saved_only_if_its_upload_keeps_within_its_share_of_the_link():
    # 1.3 MB at 15.6 kB/s (0.125 Mbit/s) takes 83 s: with a share of 0.1, not before 833 s since the last.
    assert not save_fits_link(1_300_000, 15_600, since_s=50.0, share=0.1)
    assert save_fits_link(1_300_000, 15_600, since_s=900.0, share=0.1)
    assert save_fits_link(1_300_000, 100e6, since_s=1.0, share=0.1)  # a datacenter's link: every time
    assert save_fits_link(1_300_000, 1e6, since_s=1.0, share=0.1)  # 1.3 s: too quick to ration
    assert not save_fits_link(1_300_000, 0.5e6, since_s=1.0, share=0.1)  # 2.6 s
    assert save_fits_link(1_300_000, 0.0, since_s=0.0, share=0.1)  # nothing measured yet
    assert save_fits_link(1_300_000, 15_600, since_s=1.0, share=1.0)  # no limit
