"""Versions downstream as quantized updates with error feedback (storage.updates, outer.downstream_step).

What users rely on: a learner that applies the update objects to the version it holds gets the
coordinator's params bit for bit; the published params follow the outer optimizer's exact
trajectory within one quantization step however many versions go by (the error is carried, not
lost); the outer state, residual included, survives its object; an update is refused like any
object from the network.
"""

from __future__ import annotations

import pytest
import torch

from diloco.coordinator.outer import NesterovState, apply_round, downstream_step
from diloco.storage.protocol import VersionSettings
from diloco.coordinator.publish import decode_state, state_body
from diloco.storage import codecs
from diloco.storage.errors import Refused
from diloco.storage.keys import RunKeys
from diloco.storage.updates import apply_update, chain_worth_it, encode_carrying, encode_update

KEYS = RunKeys("p", "r")
SHAPES = {"w": (64, 33), "b": (33,)}


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def settings(downstream: str) -> VersionSettings:
    return VersionSettings(kind="delta", merge="weighted_mean", outer_lr=0.7, outer_momentum=0.9,
                           outer="fractional_nesterov", downstream=downstream)


@pytest.mark.parametrize("codec", ["int8", "int4", "bf16"])
def test_a_learner_applying_the_update_gets_the_published_params_bit_for_bit(codec):
    parent = tensors(0)
    target = {n: t + 0.01 * tensors(1)[n] for n, t in parent.items()}
    blob, published, residual = encode_update(parent, target, {}, codec, compress=True)
    learner = apply_update({n: t.clone() for n, t in parent.items()}, blob, max_bytes=1 << 20, expect=SHAPES)
    for n in SHAPES:
        assert torch.equal(learner[n], published[n])
        # The residual is exactly what the published params still owe the target.
        assert torch.allclose(published[n] + residual[n], target[n], atol=1e-6)
    assert len(blob) < codecs.tensor_nbytes("fp32", (64 * 33 + 33,), 0) / (1.5 if codec == "bf16" else 3)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_error_feedback_keeps_the_published_params_on_the_exact_trajectory(codec):
    """Thirty outer steps: with the error carried, the published params stay within one quantization
    step of the outer optimizer run without any quantization; dropping it, the error accumulates."""
    exact_params, exact_state = tensors(0), NesterovState()
    params, state = dict(exact_params), NesterovState()
    dropped, dropped_state = dict(exact_params), NesterovState()
    s = settings(codec)
    for k in range(30):
        delta = [tensors(100 + k, 0.01)]
        exact_params, exact_state = apply_round(exact_params, exact_state, delta, [1.0], settings("fp32"))
        params, state = apply_round(params, state, delta, [1.0], s)
        dropped, dropped_state = apply_round(dropped, dropped_state, delta, [1.0], s)
        dropped_state = NesterovState(dropped_state.momentum, dropped_state.steps)  # the residual forgotten
    step = max(float(state.residual[n].abs().max()) for n in SHAPES)
    gap = max(float((params[n] - exact_params[n]).abs().max()) for n in SHAPES)
    drift = max(float((dropped[n] - exact_params[n]).abs().max()) for n in SHAPES)
    assert state.steps == 30 and gap <= 1.01 * step + 1e-7
    assert drift > 2 * gap


def test_fp32_downstream_publishes_the_target_itself_and_no_update():
    parent, target = tensors(0), tensors(1)
    published, state, blob = downstream_step(parent, target, NesterovState(residual=tensors(2)), settings("fp32"))
    assert blob is None and state.residual == {} and all(torch.equal(published[n], target[n]) for n in SHAPES)


def test_the_outer_state_keeps_its_residual_through_its_object():
    state = NesterovState(momentum=tensors(3), steps=7, residual=tensors(4))
    back = decode_state(bytes(state_body(state, KEYS, 0, 7)), 1 << 20)
    assert back.steps == 7 and list(back.momentum) == list(state.momentum) and list(back.residual) == list(SHAPES)
    assert all(torch.equal(back.momentum[n], state.momentum[n]) and torch.equal(back.residual[n], state.residual[n])
               for n in SHAPES)
    # Without a residual the object is what it was before residuals existed.
    plain = NesterovState(momentum=tensors(3), steps=7)
    assert "residuals" not in codecs.read_header(bytes(state_body(plain, KEYS, 0, 7)), max_bytes=1 << 20).meta
    assert decode_state(bytes(state_body(plain, KEYS, 0, 7)), 1 << 20).residual == {}


def test_an_outer_state_lying_about_its_residuals_is_refused():
    blob = codecs.encode(tensors(3), "fp32", meta={"kind": "outer_state", "residuals": 1})
    with pytest.raises(Refused) as refused:
        decode_state(blob, 1 << 20)
    assert refused.value.code == "bad_header"


def test_an_update_of_other_tensors_is_refused():
    blob, _, _ = encode_update(tensors(0), tensors(1), {}, "int8", compress=False)
    with pytest.raises(Refused) as refused:
        apply_update(tensors(0), blob, max_bytes=1 << 20, expect={"w": (64, 33), "b": (34,)})
    assert refused.value.code == "wrong_shape"
    with pytest.raises(Refused):
        apply_update(tensors(0), blob[:-10], max_bytes=1 << 20, expect=SHAPES)


def test_a_chain_of_updates_is_taken_only_while_smaller_than_the_params():
    assert chain_worth_it([100, 100], 1000)
    assert not chain_worth_it([600, 600], 1000)
    assert not chain_worth_it([100, 0], 1000)  # a version without an update object in between
    assert not chain_worth_it([], 1000)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_a_learner_carrying_what_the_codec_lost_sends_its_whole_progress(codec):
    """A hundred deltas of one fragment: with error feedback, what the coordinator decodes adds up
    to the learner's progress less the last send's own error; without, the small steady components
    a block's scale rounds away (a drift of 0.01 per send beside values of 1) are lost for good."""
    total = {n: torch.zeros(s) for n, s in SHAPES.items()}
    received = {n: torch.zeros(s) for n, s in SHAPES.items()}
    received_plain = {n: torch.zeros(s) for n, s in SHAPES.items()}
    residual: dict[str, torch.Tensor] = {}
    for k in range(100):
        delta = tensors(200 + k, 0.002)
        delta["w"] += 0.01
        delta["w"][:, 0] += 1.0  # one large column sets every block's scale: the rest is coarsely quantized
        _, decoded, residual = encode_carrying(delta, residual, codec, compress=False)
        _, plain, _ = encode_carrying(delta, {}, codec, compress=False)
        for n in SHAPES:
            total[n] += delta[n]
            received[n] += decoded[n]
            received_plain[n] += plain[n]
    lost = max(float((total[n] - received[n] - residual[n]).abs().max()) for n in SHAPES)
    error = max(float((total[n] - received[n]).abs().max()) for n in SHAPES)
    error_plain = max(float((total[n] - received_plain[n]).abs().max()) for n in SHAPES)
    assert lost < 1e-4  # fp32 rounding of the sums only
    assert error <= max(float(r.abs().max()) for r in residual.values()) + 1e-4
    assert error_plain > 1.5 * error


@pytest.mark.parametrize("codec", ["int8", "int4", "sign8", "sparse", "bf16"])
def test_a_learners_piece_is_encode_carryings_object_and_residual(codec: str) -> None:
    """`encode_piece`, what a learner sends: the same object and next residual as `encode_carrying`,
    bit for bit, for float32 and bfloat16 deltas (a residual kept in the model's dtype) and for a
    delta not contiguous in memory, and neither the delta nor the residual it was given changes."""
    from diloco.storage.updates import encode_piece
    gen = torch.Generator().manual_seed(3)
    delta = {"w": torch.randn(300, 40, generator=gen), "b": torch.randn(40, 300, generator=gen).t(),
             "h": torch.randn(1001, generator=gen).bfloat16()}
    residual: dict[str, torch.Tensor] = {}
    for _ in range(3):
        before = {n: t.clone() for n, t in delta.items()}
        kept = {n: t.clone() for n, t in residual.items()}
        blob, _, want = encode_carrying(delta, residual, codec, compress=True, meta={"k": 1})
        got_blob, got = encode_piece(delta, residual, codec, compress=True, meta={"k": 1})
        assert got_blob == blob
        for n, t in want.items():
            assert got[n].dtype == torch.float32 and got[n].is_contiguous()
            assert torch.equal(got[n].to(t.dtype), t), n
        assert all(torch.equal(delta[n], before[n]) for n in delta)
        assert all(torch.equal(residual[n], kept[n]) for n in residual)
        residual = {n: r.to(delta[n].dtype) for n, r in got.items()}
        delta = {n: t * 0.5 for n, t in delta.items()}


def test_versions_of_a_run_whose_codec_drops_elements_go_down_in_int4_unless_told_otherwise() -> None:
    from diloco.coordinator.config import CoordinatorConfig
    from diloco.coordinator.policy import RoundConfig

    def downstream(config: CoordinatorConfig, run_codec: str) -> str:
        return config.settings(RoundConfig(), "delta", run_codec).downstream

    assert [downstream(CoordinatorConfig(), c) for c in ("fp32", "int4", "int8", "sign8", "sparse")] == \
        ["fp32", "int4", "int8", "int4", "int4"]
    assert downstream(CoordinatorConfig(downstream_codec="sign8"), "sign8") == "sign8"
    assert CoordinatorConfig().settings(RoundConfig(), "genesis", "sign8").downstream == "fp32"
