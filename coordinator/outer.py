"""The merge of a round's deltas and the outer optimizer step: deterministic, so replayable.

Replay (invariant 4) rebuilds any version from the manifest's inputs; that only works if the
same inputs in the same order give the same bits. Here is what guarantees it:

- `merge_deltas` casts every delta to fp32 and each weight (a Python float64) to fp32 by
  round-to-nearest, then computes acc = w_0*d_0, acc = acc + w_i*d_i in the given order, as
  separate elementwise multiply and add kernels. Each element is a fixed chain of correctly
  rounded IEEE fp32 operations, so the result is bit-identical for the same inputs in the same
  order, whatever the thread count or CPU (checked under ATen's DEFAULT, AVX2 and AVX512 kernels).
  Never `add(..., alpha=w)`: ATen's vectorized kernels fuse it into an FMA, whose bits differ
  from the scalar kernels'. Norms (radial-directional merge) are exact float64 squares summed by a
  fixed pairwise tree of elementwise adds, never a threaded reduction.
- `nesterov_step` of a whole round (progress 1) must equal torch.optim.SGD(nesterov=True) bit for
  bit, so it issues exactly SGD's kernels, including `add(alpha=...)`. It is therefore bit-exact on
  machines running the same ATen CPU kernels (`torch.backends.cpu.get_cpu_capability()`); to replay
  an outer step on a machine with a different capability, pin it with ATEN_CPU_CAPABILITY. A
  fractional step (progress < 1) is a fixed chain of separate elementwise multiplies and adds with
  fp32 scalars, like the merge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from diloco.coordinator.timing import Timed, untimed
from diloco.storage.protocol import Contribution, VersionSettings
from diloco.storage.updates import encode_update

def merge_deltas(deltas: Sequence[Mapping[str, Tensor]], weights: Sequence[float], *,
                 radial_directional: bool = False, pool: Executor | None = None) -> dict[str, Tensor]:
    """Weighted sum of per-tensor deltas, in fp32, in the order given (pass `merge_order`).

    `weights` are used as given (`merge_weights` normalizes them to sum 1). Every delta must hold
    the same tensor names and shapes. Inputs are not modified. Bit-identical for the same inputs
    in the same order (see the module docstring).

    radial_directional=True averages norms and unit directions separately, per tensor: the
    result has the weighted mean norm sum(w_m * |d_m|) along the direction of sum(w_m * d_m/|d_m|).
    A plain mean of near-orthogonal deltas shrinks ~1/sqrt(M); this one keeps the typical step
    length. Zero deltas add nothing to the direction; if the directions cancel, the result is 0.

    Each tensor is merged on its own (`_sum_of` or `_radial_of`), each delta's value of it read once
    (twice, radial_directional: its norm first): deltas that decode a tensor when it is read (the
    coordinator's pieces, `intake.Piece`) hold one decoded tensor per merging thread, not whole
    pieces. With `pool`, the tensors merge in parallel on it: the same operations on each, so the
    same bits as without.
    """
    if not deltas or len(deltas) != len(weights):
        raise ValueError(f"need one weight per delta and at least one delta, got "
                         f"{len(deltas)} deltas and {len(weights)} weights")
    names = list(deltas[0])
    for i, d in enumerate(deltas):
        if set(d) != set(names):
            raise ValueError(f"delta {i} and delta 0 differ in tensors {sorted(set(d) ^ set(names))}")
    merge = _radial_of if radial_directional else _sum_of
    weights = list(weights)
    fp32_weights = [_fp32(w) for w in weights]

    def one(name: str) -> Tensor:
        return merge(lambda: _values_of(deltas, name), weights, fp32_weights)

    merged = pool.map(one, names) if pool is not None else map(one, names)
    return dict(zip(names, merged, strict=True))


def _values_of(deltas: Sequence[Mapping[str, Tensor]], name: str) -> Iterator[Tensor]:
    """Each delta's tensor `name` in order, as fp32; ValueError for one whose shape is not delta 0's."""
    shape = None
    for i, d in enumerate(deltas):
        t = d[name].to(torch.float32)
        if shape is None:
            shape = t.shape
        elif t.shape != shape:
            raise ValueError(f"delta {i} has {name} of shape {tuple(t.shape)}, delta 0 has {tuple(shape)}")
        yield t


def _sum_of(values: Callable[[], Iterator[Tensor]], weights: list[float], fp32_weights: list[Tensor]) -> Tensor:
    """acc = w_0 * d_0, then acc = acc + w_i * d_i, one delta after the other."""
    total: Tensor | None = None
    for t, w in zip(values(), fp32_weights):
        total = t * w if total is None else total.add_(t * w)  # alpha 1: a plain correctly rounded add, never an FMA
    assert total is not None
    return total


def _radial_of(values: Callable[[], Iterator[Tensor]], weights: list[float], fp32_weights: list[Tensor]) -> Tensor:
    """The weighted sum of the unit directions of the deltas whose norm is not zero (the first of
    them starts the sum), scaled to the weighted mean norm; 0 if no direction is left."""
    norms, shape = [], None
    for t in values():
        norms.append(_norm(t))
        shape = t.shape
    direction: Tensor | None = None
    for t, w, norm in zip(values(), weights, norms, strict=True):
        if norm > 0.0:
            part = t * _fp32(w / norm)
            direction = direction.add_(part) if direction is not None else part
    mean_norm = math.fsum(w * n for w, n in zip(weights, norms, strict=True))
    length = _norm(direction) if direction is not None else 0.0
    if direction is None or length == 0.0:
        assert shape is not None
        return torch.zeros(shape, dtype=torch.float32)
    return direction * _fp32(mean_norm / length)


def _fp32(x: float) -> Tensor:
    """A float64 weight rounded to the nearest fp32, as a 0-dim tensor (one rounding, everywhere)."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32)


def _norm(t: Tensor) -> float:
    """L2 norm with a fixed summation order: exact float64 squares, pairwise tree of adds. The tree:
    the squares zero-padded to a power-of-two length, then, level by level, element i plus element
    i + half, until one is left.

    Computed in one float64 buffer of half the padded length, in place: the first level reads the
    squares' second half straight from the tensor, and leaves the elements whose partner is padding
    as they are (a square plus 0.0 is itself), so the padding is never made. The same adds in the
    same tree as padding and halving into new tensors, with about 2x the tensor's fp32 bytes of
    memory rather than 5.5x (a 154 MB embedding is one tensor, and a fragment of its own)."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n < 2:
        return math.sqrt(flat.to(torch.float64).square().item()) if n else 0.0
    half = 1 << ((n - 1).bit_length() - 1)  # half the padded length: n - half elements have a partner
    sums = flat[:half].to(torch.float64, copy=True).square_()
    sums[:n - half].add_(flat[half:].to(torch.float64, copy=True).square_())
    while half > 1:
        half //= 2
        sums[:half].add_(sums[half:2 * half])
    return math.sqrt(sums[0].item())


@dataclass
class NesterovState:
    """Outer optimizer state of one fragment: torch SGD's momentum buffers, by tensor name."""

    momentum: dict[str, Tensor] = field(default_factory=dict)
    """Momentum buffer per tensor; absent before that tensor's first step."""
    steps: int = 0
    """Outer steps taken."""
    residual: dict[str, Tensor] = field(default_factory=dict)
    """What the published params still owe the outer step's exact result: the quantization error of
    the last update sent downstream (`storage.updates`), added to the next one. Empty in fp32."""


def nesterov_step(params: Mapping[str, Tensor], delta: Mapping[str, Tensor], state: NesterovState,
                  lr: float = 0.7, momentum: float = 0.9, progress: float = 1.0, lookahead: float = 1.0,
                  buffered: Mapping[str, Tensor] | None = None) -> tuple[dict[str, Tensor], NesterovState]:
    """One outer step: new params and state; `params`, `delta` and `state` are not modified.

    A whole step (`progress` 1) is bit for bit `torch.optim.SGD(params, lr=lr, momentum=momentum,
    nesterov=True)` (dampening 0, no weight decay) stepping with `p.grad = delta`, where delta =
    global - merged local, the outer gradient. As in torch, the first step sets the buffer to the
    delta itself:
        buf = delta                    (first step)  |  buf = momentum * buf + delta
        params = params - lr * (delta + momentum * buf)

    A fractional step of progress s in (0, 1) (a round carrying s of a usual round's progress, see
    `policy.round_step`) is that step over s of the time: the buffer decays by momentum ** s and
    gains what s usual rounds of the same outer gradient per round would add to it, and the update
    is s of a whole one, momentum included:
        rate = delta / s               (the outer gradient per usual round)
        buf  = momentum ** s * buf + (1 - momentum ** s) / (1 - momentum) * rate
        params = params - lr * (delta + s * momentum * buf)
    So s = 1 is the whole step, a round of almost no progress barely moves the model however large
    the momentum, and n rounds of progress 1/n (the same deltas cut into more rounds) give nearly
    the model one whole round gives (the same buffer in the steady state; exactly the same linear
    part). `params`, `delta` and the buffers share a dtype (fp32 in practice).

    `lookahead` in [0, 1] scales the momentum's push (`s * momentum * buf`), not the buffer: Nesterov
    publishes the point one momentum step ahead, for learners to train from and correct. A version
    fewer learners train on from (`policy.lookahead`: the run's last rounds) takes less of that
    extrapolation; at 0 it is params - lr * delta, the buffer still taking the delta in.

    `buffered`: what the buffer takes in place of `delta` (the fresh inputs' part of it,
    `apply_round`); the params still move by all of `delta`.
    """
    if set(params) != set(delta):
        raise ValueError(f"delta does not match the fragment: tensors "
                         f"{sorted(set(params) ^ set(delta))} are in one but not the other")
    if isinstance(progress, bool) or not 0.0 < progress <= 1.0:
        raise ValueError(f"progress {progress!r} must be a number in (0, 1]")
    if isinstance(lookahead, bool) or not 0.0 <= lookahead <= 1.0:
        raise ValueError(f"lookahead {lookahead!r} must be a number in [0, 1]")
    if progress == 1.0 and lookahead == 1.0 and buffered is None:
        new_params, new_state = _whole_step(params, delta, state, lr, momentum)
        return new_params, replace(new_state, residual=state.residual)
    decay = _fp32(momentum ** progress)
    gain = _fp32((1.0 - momentum ** progress) / (1.0 - momentum) / progress)
    push, rate = _fp32(progress * momentum * lookahead), _fp32(lr)
    new_params: dict[str, Tensor] = {}
    new_momentum: dict[str, Tensor] = {}
    for name, p in params.items():
        grad = delta[name].detach()
        buf = state.momentum.get(name)
        # Separate correctly rounded ops, never an FMA: buf = buf * decay + grad * gain, and params =
        # p - (grad + buf * push) * rate, the adds and multiplies in place on this step's own
        # temporaries (the same bits: a + b is b + a), so that a tensor as big as the fragment is
        # not made four times over.
        into = grad if buffered is None else buffered[name].detach()
        buf = into * gain if buf is None else (buf * decay).add_(into * gain)
        new_momentum[name] = buf
        new_params[name] = p.detach() - (buf * push).add_(grad).mul_(rate)
    return new_params, NesterovState(momentum=new_momentum, steps=state.steps + 1, residual=state.residual)


def _whole_step(params: Mapping[str, Tensor], delta: Mapping[str, Tensor], state: NesterovState, lr: float,
                momentum: float) -> tuple[dict[str, Tensor], NesterovState]:
    new_params: dict[str, Tensor] = {}
    new_momentum: dict[str, Tensor] = {}
    for name, p in params.items():
        grad = delta[name].detach()
        buf = state.momentum.get(name)
        # The same kernels as torch.optim.sgd._single_tensor_sgd, out of place.
        buf = grad.clone() if buf is None else buf.mul(momentum).add_(grad, alpha=1)
        new_momentum[name] = buf
        new_params[name] = p.detach().add(grad.add(buf, alpha=momentum), alpha=-lr)
    return new_params, NesterovState(momentum=new_momentum, steps=state.steps + 1)


def round_delta(deltas: Sequence[Mapping[str, Tensor]], weights: Sequence[float],
                settings: VersionSettings, *, pool: Executor | None = None) -> dict[str, Tensor]:
    """The merged update of a round: `deltas` (in merge order) merged with `weights` by the merge
    rule of `settings`, times its `round_scale`. This is the outer gradient `apply_round` steps
    with; `diloco inspect` and `diloco blame` measure inputs against it. `pool`: see `merge_deltas`."""
    merged = merge_deltas(deltas, weights, radial_directional=settings.merge == "radial_directional", pool=pool)
    return scale_update(merged, settings.round_scale)


def scale_update(merged: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """A merged update times a round's `round_scale`, in place (fp32 scalar: the same bits in a
    replay as live)."""
    if scale == 1.0:
        return merged
    factor = _fp32(scale)
    return {name: t.mul_(factor) for name, t in merged.items()}


def update_norm(delta: Mapping[str, Tensor]) -> float:
    """L2 norm of a round's merged update over all its tensors (fixed summation order, see `_norm`):
    how far its learners moved the fragment, before the round's scale and momentum
    (`policy.RoundSize.norm`)."""
    return math.sqrt(math.fsum(_norm(delta[name]) ** 2 for name in sorted(delta)))


def apply_round(params: Mapping[str, Tensor], state: NesterovState, deltas: Sequence[Mapping[str, Tensor]],
                weights: Sequence[float], settings: VersionSettings, *, staleness: Sequence[int] | None = None,
                bounded: Sequence[bool] | None = None, timed: Timed = untimed
                ) -> tuple[dict[str, Tensor], NesterovState]:
    """One round: merge `deltas` (in merge order) with `weights` (`round_delta`), one outer Nesterov
    step of the round's `progress` (`outer_step`), then the published params through the downstream
    codec (`downstream_step`), as `settings` (read from the version's manifest) configure them: the
    live coordinator and a replay run the very same computation. `staleness` and `bounded`: each
    input's, as its manifest records them (`Contribution.staleness`, and whether its `bounded` is
    not empty; needed when `settings.stale_momentum` or `settings.bounded_momentum` is False). `timed`
    times the merge ("merge") and the outer step ("outer")."""
    with timed("merge"):
        delta = round_delta(deltas, weights, settings)
        buffered = buffered_part(deltas, weights, staleness, settings, delta, bounded=bounded)
    with timed("outer"):
        target, new_state = outer_step(params, state, delta, settings, buffered=buffered)
        published, new_state, _ = downstream_step(params, target, new_state, settings)
        return published, new_state


def apply_recorded(params: Mapping[str, Tensor], state: NesterovState, deltas: Sequence[Mapping[str, Tensor]],
                   weights: Sequence[float], settings: VersionSettings, inputs: Sequence[Contribution]
                   ) -> tuple[dict[str, Tensor], NesterovState]:
    """`apply_round` of recorded `inputs` (a manifest's, in merge order, one per delta): each one's
    staleness and bound as the manifest records them. Replay, blame, attribution and whatif all
    re-derive rounds through it."""
    return apply_round(params, state, deltas, weights, settings, staleness=[c.staleness for c in inputs],
                       bounded=[bool(c.bounded) for c in inputs])


def downstream_step(parent: Mapping[str, Tensor], target: Mapping[str, Tensor], state: NesterovState,
                    settings: VersionSettings, *, compress: bool = False,
                    meta: Mapping[str, str | int | float] | None = None
                    ) -> tuple[dict[str, Tensor], NesterovState, bytes | None]:
    """The params a version publishes, given the outer step's exact result `target`, and the update
    object learners holding `parent` download (`storage.updates`): in the `downstream` codec of
    `settings`, `parent + decode(encode(target - parent + residual))`, the new residual kept in the
    state. In fp32, `target` itself, no update object and no residual. Raises Refused("non_finite") if the
    update overflows."""
    if settings.downstream == "fp32":
        return dict(target), replace(state, residual={}), None
    blob, published, residual = encode_update(parent, target, state.residual, settings.downstream,
                                              compress=compress, meta=meta)
    return published, replace(state, residual=residual), blob


def buffered_part(deltas: Sequence[Mapping[str, Tensor]], weights: Sequence[float], staleness: Sequence[int] | None,
               settings: VersionSettings, update: Mapping[str, Tensor], *, bounded: Sequence[bool] | None = None,
               pool: Executor | None = None) -> dict[str, Tensor] | None:
    """What the momentum buffer takes of a round when it does not take every input
    (`buffered_inputs`): the round's merged update of the inputs it takes alone (with their weights
    in the round; zeros shaped like the round's `update` if it takes none), scaled like the whole.
    None when it takes them all: the buffer takes the update."""
    taken = buffered_inputs(settings, len(weights), staleness, bounded)
    if taken is None:
        return None
    kept = [i for i, take in enumerate(taken) if take and weights[i] != 0]
    if not kept:
        return {name: torch.zeros_like(t, dtype=torch.float32) for name, t in update.items()}
    return round_delta([deltas[i] for i in kept], [weights[i] for i in kept], settings, pool=pool)


def buffered_inputs(settings: VersionSettings, n: int, staleness: Sequence[int] | None,
                    bounded: Sequence[bool] | None) -> list[bool] | None:
    """Which of a round's `n` inputs enter the momentum buffer (the params take them all); None: all.

    - Stale inputs do not, when `settings.stale_momentum` is False. A stale piece's progress was
      computed against a version the buffer has moved on from; fed to the buffer again it acts as
      extra momentum, and the published model overshoots (`bench wan`'s mixed links, 6 runs a side:
      1.376 against 1.463).
    - Bounded inputs do not, when `settings.bounded_momentum` is False: pieces whose learner's
      claims or norms the merge cut (`coordinator.influence`, the manifest's `bounded`). Such a
      piece moves the params once, at its bounded share; in the buffer its push would come back in
      every later round (about 1 / (1 - momentum) times in all), and a learner sending noise as large
      as the bound allows would steer the run. When every input was bounded (a backlog after the
      coordinator was down cuts every learner alike) the buffer takes them all.
    """
    taken = [True] * n
    if not settings.stale_momentum:
        if staleness is None or len(staleness) != n:
            raise ValueError("stale_momentum False needs each input's staleness")
        taken = [s == 0 for s in staleness]
    if not settings.bounded_momentum:
        if bounded is None or len(bounded) != n:
            raise ValueError("bounded_momentum False needs whether each input was bounded")
        if not all(bounded):
            taken = [t and not b for t, b in zip(taken, bounded, strict=True)]
    return None if all(taken) else taken


def outer_step(params: Mapping[str, Tensor], state: NesterovState, delta: Mapping[str, Tensor],
               settings: VersionSettings, *, buffered: Mapping[str, Tensor] | None = None
               ) -> tuple[dict[str, Tensor], NesterovState]:
    """The outer step of `settings` with the round's merged update `delta` (`round_delta`): the
    second half of `apply_round`, for the coordinator, which sizes the step after measuring the
    update."""
    return nesterov_step(params, delta, state, lr=settings.outer_lr, momentum=settings.outer_momentum,
                         progress=settings.progress, lookahead=settings.lookahead, buffered=buffered)
