"""The coordinator's round with fewer whole-fragment temporaries gives the same bits as before.

`outer.merge_deltas` (tensor by tensor, one delta after the other, so that a round's pieces can be
decoded a tensor at a time), `outer._norm` (sums in one half-length buffer, the padding never made), the fractional Nesterov step
(adds and multiplies in place on its own temporaries), `updates.encode_update` and `apply_update`
(the difference becomes the residual, the decoded update the params) were rewritten to hold less
memory. Replay re-derives every version bit for bit, and the norm is recorded in manifests, so each
is checked here against the formula it replaced, written out as it was, and found bit-identical;
inputs stay untouched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from diloco.coordinator.outer import NesterovState, _fp32, _norm, merge_deltas, nesterov_step
from diloco.storage import codecs
from diloco.storage.updates import apply_update, encode_update

SHAPES = {"w": (64, 33), "b": (33,), "s": (), "e": (0, 4), "odd": (4097,)}


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (-0.0 is not 0.0, a NaN equals itself)."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(as_int) if t.numel() else t


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[n]), bits(b[n])) for n in a)


def padded_norm(t: torch.Tensor) -> float:
    """The norm as it was computed: squares padded with zeros to a power of two, halved into new tensors."""
    sq = t.detach().reshape(-1).to(torch.float64).square()
    size = 1 << max(0, (sq.numel() - 1).bit_length())
    sq = F.pad(sq, (0, size - sq.numel()))
    while sq.numel() > 1:
        half = sq.numel() // 2
        sq = sq[:half] + sq[half:]
    return math.sqrt(sq.item())


@pytest.mark.parametrize("n", [*range(0, 40), 63, 64, 65, 127, 128, 129, 1000, 4095, 4096, 4097, 100_003])
def test_the_norm_is_the_padded_trees_bit_for_bit(n):
    g = torch.Generator().manual_seed(n)
    for scale in (1.0, 1e-30, 1e30, 1e-42):  # tiny: subnormal squares; huge: squares far beyond float32
        t = torch.randn(n, generator=g) * scale
        assert _norm(t).hex() == padded_norm(t).hex()


def test_the_norm_of_special_and_shaped_tensors():
    for t in (torch.tensor([1.0, float("inf"), 2.0]), torch.randn(33, 7).t(), torch.randn(3, 5)[:, ::2],
              torch.tensor(3.0), torch.zeros(5)):
        a, b = _norm(t), padded_norm(t)
        assert a.hex() == b.hex()
    assert math.isnan(_norm(torch.tensor([1.0, float("nan")])))
    x = torch.randn(10, dtype=torch.float64)
    before = x.clone()
    _norm(x)  # a float64 input is squared in a copy, never in place
    assert torch.equal(x, before)


def fractional_step_as_it_was(params, delta, state, lr, momentum, progress):  # noqa: ANN001, ANN201
    decay = _fp32(momentum ** progress)
    gain = _fp32((1.0 - momentum ** progress) / (1.0 - momentum) / progress)
    push, rate = _fp32(progress * momentum), _fp32(lr)
    new_params, new_momentum = {}, {}
    for name, p in params.items():
        grad = delta[name]
        added = grad * gain
        buf = state.momentum.get(name)
        buf = added if buf is None else buf * decay + added
        new_momentum[name] = buf
        new_params[name] = p - (grad + buf * push) * rate
    return new_params, new_momentum


@pytest.mark.parametrize("threads", [1, 2])
def test_the_fractional_step_is_the_formula_it_replaced_bit_for_bit(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for trial in range(10):
            params, delta = tensors(3 * trial), tensors(3 * trial + 1, 10.0 ** (trial % 5 - 4))
            momentum = {n: t for n, t in tensors(3 * trial + 2).items() if n != "b"}  # "b" steps for the first time
            state = NesterovState(momentum=momentum, steps=3)
            progress = 0.01 + 0.98 * float(torch.rand((), generator=g))
            copies = [{n: t.clone() for n, t in d.items()} for d in (params, delta, momentum)]
            want_params, want_momentum = fractional_step_as_it_was(params, delta, state, 0.7, 0.9, progress)
            got_params, got_state = nesterov_step(params, delta, state, lr=0.7, momentum=0.9, progress=progress)
            assert same_bits(got_params, want_params) and same_bits(got_state.momentum, want_momentum)
            assert all(same_bits(d, c) for d, c in zip((params, delta, momentum), copies))  # inputs untouched
    finally:
        torch.set_num_threads(previous)


def encode_update_as_it_was(parent, target, residual, codec):  # noqa: ANN001, ANN201
    update = {name: target[name] - p for name, p in parent.items()}
    carried = {name: t + residual[name] if name in residual else t for name, t in update.items()}
    blob = codecs.encode(carried, codec, compress=True, meta={"kind": "update"})
    decoded, _ = codecs.decode(blob, max_bytes=1 << 24)
    left = {name: carried[name] - decoded[name] for name in carried}
    return blob, {name: p + decoded[name] for name, p in parent.items()}, left


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "bf16", "fp32"])
def test_the_update_its_params_and_residual_are_as_they_were_bit_for_bit(codec):
    parent = tensors(10)
    residual = {}
    for step in range(3):  # the first without a residual, then carrying one
        target = {n: t + 0.01 * tensors(20 + step)[n] for n, t in parent.items()}
        copies = [{n: t.clone() for n, t in d.items()} for d in (parent, target, residual)]
        want = encode_update_as_it_was(parent, target, residual, codec)
        blob, published, left = encode_update(parent, target, residual, codec, compress=True)
        assert blob == want[0] and same_bits(published, want[1]) and same_bits(left, want[2])
        assert all(same_bits(d, c) for d, c in zip((parent, target, residual), copies))
        learner = {n: t.clone() for n, t in parent.items()}
        applied = apply_update(learner, blob, max_bytes=1 << 24, expect=SHAPES)
        assert same_bits(applied, published) and same_bits(learner, parent)
        parent, residual = published, left


def merge_as_it_was(deltas, weights, radial):  # noqa: ANN001, ANN201
    """Tensor by tensor, every delta's at once: the merge before it read one delta at a time."""
    def weighted(tensors, ws):  # noqa: ANN001, ANN202
        acc = tensors[0] * _fp32(ws[0])
        for t, w in zip(tensors[1:], ws[1:], strict=True):
            acc.add_(t * _fp32(w))
        return acc

    def radial_directional(tensors, ws):  # noqa: ANN001, ANN202
        norms = [_norm(t) for t in tensors]
        mean_norm = math.fsum(w * n for w, n in zip(ws, norms, strict=True))
        live = [(t, w / n) for t, w, n in zip(tensors, ws, norms, strict=True) if n > 0.0]
        if not live:
            return torch.zeros_like(tensors[0])
        direction = weighted([t for t, _ in live], [c for _, c in live])
        length = _norm(direction)
        return torch.zeros_like(direction) if length == 0.0 else direction * _fp32(mean_norm / length)

    merge = radial_directional if radial else weighted
    return {name: merge([d[name].to(torch.float32) for d in deltas], list(weights)) for name in deltas[0]}


@pytest.mark.parametrize("radial", [False, True])
def test_the_merge_is_the_formula_it_replaced_bit_for_bit(radial):
    g = torch.Generator().manual_seed(7)
    for trial in range(24):
        count = 1 + trial % 5
        deltas = [tensors(100 * trial + i, 10.0 ** (i % 4 - 3)) for i in range(count)]
        if trial % 3 == 0:
            deltas[0]["w"] = torch.zeros(SHAPES["w"])  # a zero delta: no direction
        if trial % 4 == 1:
            deltas[-1]["b"] = deltas[-1]["b"].half()  # cast to fp32 as it is read
        if trial % 6 == 2 and count > 1:
            deltas[1]["odd"] = -deltas[0]["odd"]  # directions that may cancel
        weights = torch.rand(count, generator=g, dtype=torch.float64).tolist()
        copies = [{n: t.clone() for n, t in d.items()} for d in deltas]
        got = merge_deltas(deltas, weights, radial_directional=radial)
        assert same_bits(got, merge_as_it_was(deltas, weights, radial))
        assert all(same_bits(d, c) for d, c in zip(deltas, copies))


class Decoding(Mapping):
    """A delta whose tensors are made when read, like the coordinator's pieces; records the reads."""

    def __init__(self, seed: int, reads: list[tuple[int, str]]) -> None:
        self.seed, self.reads = seed, reads

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads.append((self.seed, name))
        return tensors(self.seed)[name]

    def __iter__(self):
        return iter(SHAPES)

    def __len__(self) -> int:
        return len(SHAPES)


@pytest.mark.parametrize("radial, passes", [(False, 1), (True, 2)])
@pytest.mark.parametrize("threads", [0, 3])
def test_the_merge_reads_each_tensor_of_each_delta_once_tensor_by_tensor(radial, passes, threads):
    """So a round decoding its pieces' tensors as they are read holds one decoded tensor per thread;
    with a pool the tensors merge in parallel, to the same bits."""
    reads: list[tuple[int, str]] = []
    lazy = [Decoding(seed, reads) for seed in (1, 2, 3, 4)]
    pool = ThreadPoolExecutor(threads) if threads else None
    got = merge_deltas(lazy, [0.1, 0.2, 0.3, 0.4], radial_directional=radial, pool=pool)
    if pool is not None:
        pool.shutdown()
    for name in SHAPES:
        assert [seed for seed, n in reads if n == name] == [1, 2, 3, 4] * passes
    if pool is None:  # one tensor after the other
        assert [n for _, n in reads] == [n for n in SHAPES for _ in range(4 * passes)]
    eager = [tensors(s) for s in (1, 2, 3, 4)]
    assert same_bits(got, merge_deltas(eager, [0.1, 0.2, 0.3, 0.4], radial_directional=radial))
