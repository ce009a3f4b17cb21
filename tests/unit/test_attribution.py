"""Per-version figures of inputs (coordinator/attribution.py): pure, on hand-made deltas."""

from __future__ import annotations

import dataclasses
import math
import uuid

import pytest
import torch

from diloco.coordinator.attribution import cosine, flat, input_figures, learner_rounds, round_without, weights_without
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.outer import NesterovState, apply_round, round_delta
from diloco.coordinator.policy import RoundConfig
from diloco.storage.protocol import Contribution

SHAPES = {"w": (6, 5), "b": (5,)}
SETTINGS = CoordinatorConfig().settings(RoundConfig(), "delta", "fp32")
RADIAL = CoordinatorConfig(radial_directional=True).settings(RoundConfig(), "delta", "fp32")


def tensors(gen: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: torch.randn(s, generator=gen) * scale for k, s in SHAPES.items()}


def scaled(d: dict[str, torch.Tensor], c: float) -> dict[str, torch.Tensor]:
    return {k: v * c for k, v in d.items()}


def contribution(learner: str, base: int = 4, tokens: int = 40, steps: int = 4) -> Contribution:
    return Contribution(contribution_id=uuid.uuid4().hex, learner=learner, seq=1, object_key="k", sha256="0" * 64,
                        base_version=base, staleness=0, tokens=tokens, steps=steps, weight=0.0, stream_id="0-1")


def test_flat_and_cosine():
    a = {"y": torch.tensor([3.0]), "x": torch.tensor([[4.0]])}
    assert flat(a).tolist() == [4.0, 3.0]  # name order, float64
    assert flat(a).dtype == torch.float64
    assert cosine(flat(a), flat(a)) == pytest.approx(1.0)
    assert cosine(flat(a), -flat(a)) == pytest.approx(-1.0)
    assert cosine(flat(a), torch.zeros(2, dtype=torch.float64)) is None


def test_a_single_input_is_the_merged_update():
    d = tensors(torch.Generator().manual_seed(1))
    for settings in (SETTINGS, RADIAL):
        [fig], merged_norm = input_figures([d], [1.0], settings)
        assert fig.cos_merged == pytest.approx(1.0)
        assert fig.norm == pytest.approx(float(torch.linalg.vector_norm(flat(d))))
        assert merged_norm == pytest.approx(fig.norm)


def test_figures_are_against_the_update_the_round_applies():
    gen = torch.Generator().manual_seed(2)
    deltas = [tensors(gen), tensors(gen, 10.0)]
    for settings in (SETTINGS, RADIAL):
        figures, merged_norm = input_figures(deltas, [0.5, 0.5], settings)
        merged = flat(round_delta(deltas, [0.5, 0.5], settings))
        assert merged_norm == pytest.approx(float(torch.linalg.vector_norm(merged)))
        for d, fig in zip(deltas, figures, strict=True):
            assert fig.cos_merged == pytest.approx(cosine(flat(d), merged))
    # A plain mean is dominated by the big delta; the radial-directional merge weighs the directions
    # of each tensor equally (so of a one-tensor fragment, both inputs are as close to the merge).
    plain, _ = input_figures(deltas, [0.5, 0.5], SETTINGS)
    assert plain[1].cos_merged > 0.95 and plain[0].cos_merged < 0.5
    one = [{"w": d["w"]} for d in deltas]
    radial, _ = input_figures(one, [0.5, 0.5], RADIAL)
    assert radial[0].cos_merged == pytest.approx(radial[1].cos_merged, abs=1e-6)  # merged in fp32


def test_round_delta_rejects_an_unknown_merge_rule():
    d = tensors(torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="merge rule 'median'"):
        round_delta([d], [1.0], dataclasses.replace(SETTINGS, merge="median"))


def test_a_flipped_learner_is_anti_aligned_with_the_others_and_they_agree():
    gen = torch.Generator().manual_seed(4)
    signal = tensors(gen)
    honest = [{k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in signal.items()} for _ in range(3)]
    flipped = scaled(signal, -1.0)
    rounds = learner_rounds(["a", "b", "c", "z"], [*honest, flipped], [0.25] * 4, SETTINGS)
    by = {r.learner: r for r in rounds}
    assert [r.learner for r in rounds] == ["a", "b", "c", "z"]
    assert by["z"].loo_cos < -0.8
    assert all(by[g].loo_cos > 0.2 for g in "abc")
    assert all(r.others == 3 and r.pieces == 1 and r.share == pytest.approx(0.25) for r in rounds)
    # What it is compared with: how much the others agree with their own consensus.
    assert by["z"].peers_cos == sorted(by[g].loo_cos for g in "abc")[1]
    assert by["a"].peers_cos == sorted(by[g].loo_cos for g in "bcz")[1]


def test_pieces_of_one_learner_add_up_and_norms_compare_to_the_others_median():
    gen = torch.Generator().manual_seed(5)
    a1, a2, b, c = tensors(gen), tensors(gen), tensors(gen), tensors(gen, 10.0)
    # Each piece of a learner carries the learner's weight (merge_weights); c is 10x the others.
    rounds = learner_rounds(["a", "a", "b", "c"], [a1, a2, b, c], [0.2, 0.2, 0.3, 0.5], SETTINGS)
    by = {r.learner: r for r in rounds}
    summed = flat(a1) + flat(a2)
    assert by["a"].pieces == 2 and by["a"].norm == pytest.approx(float(torch.linalg.vector_norm(summed)))
    assert by["a"].share == pytest.approx(0.2)  # 0.2 / (0.2 + 0.3 + 0.5)
    others = flat(round_delta([b, c], [0.3, 0.5], SETTINGS))
    assert by["a"].loo_cos == pytest.approx(cosine(summed, others))
    norm_b = float(torch.linalg.vector_norm(flat(b)))
    assert by["c"].norm_ratio == pytest.approx(by["c"].norm / ((by["a"].norm + norm_b) / 2))  # median of two
    assert 5 < by["c"].norm_ratio < 20


def test_no_others_no_comparison_and_two_learners_mirror_each_other():
    gen = torch.Generator().manual_seed(6)
    [alone] = learner_rounds(["a"], [tensors(gen)], [1.0], SETTINGS)
    assert alone.others == 0 and alone.loo_cos is None and alone.norm_ratio is None and alone.share == 1.0
    a, b = learner_rounds(["a", "b"], [tensors(gen), tensors(gen)], [0.5, 0.5], SETTINGS)
    assert a.loo_cos == pytest.approx(b.loo_cos)  # one pair: who disagrees with whom is undecidable


def test_weights_without_a_learner_are_what_merge_weights_gives_the_rest():
    inputs = [contribution("a", tokens=40), contribution("b", tokens=80, steps=8), contribution("c", base=3)]
    kept, weights = weights_without(inputs, "b", parent_version=4, settings=SETTINGS)
    assert kept == [0, 2]
    # a and c weigh the same (40 tokens / 4 steps); c is one version stale: 1/(1+1) of a's share
    # with the discount, of a round that moves as far as at its median staleness, 0 (the lower).
    assert weights == pytest.approx([2 / 3, 1 / 3])
    _, absolute = weights_without(inputs, "b", 4, dataclasses.replace(SETTINGS, staleness_relative=False))
    assert absolute == pytest.approx([0.5, 0.25])
    _, undiscounted = weights_without(inputs, "b", 4, dataclasses.replace(SETTINGS, staleness_discount=False))
    assert undiscounted == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match="no inputs other than"):
        weights_without([contribution("a")], "a", 4, SETTINGS)


def test_round_without_takes_the_same_outer_step_from_the_same_parent():
    gen = torch.Generator().manual_seed(7)
    parent = tensors(gen)
    _, state = apply_round(parent, NesterovState(), [tensors(gen, 0.1)], [1.0], SETTINGS, staleness=[0],
                           bounded=[False])  # momentum
    inputs = [contribution("a"), contribution("b"), contribution("c")]
    deltas = [tensors(gen, 0.1) for _ in inputs]
    without_b = round_without(parent, state, inputs, deltas, "b", 4, SETTINGS)
    expected, _ = apply_round(parent, state, [deltas[0], deltas[2]], [0.5, 0.5], SETTINGS,
                              staleness=[inputs[0].staleness, inputs[2].staleness], bounded=[False, False])
    assert all(torch.equal(without_b[k], expected[k]) for k in SHAPES)
    with_all, _ = apply_round(parent, state, deltas, [1 / 3] * 3, SETTINGS, staleness=[c.staleness for c in inputs],
                              bounded=[False] * 3)
    assert not torch.equal(without_b["w"], with_all["w"])
    assert math.isfinite(float(flat(without_b).sum()))
