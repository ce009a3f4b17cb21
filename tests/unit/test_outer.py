"""The merge and the outer step: bit-exact, pure, and equal to torch's own SGD."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch

from diloco.coordinator.outer import (NesterovState, apply_round, merge_deltas, nesterov_step, outer_step, round_delta,
                                      scale_update, update_norm)
from diloco.coordinator.policy import (RECENT_ROUNDS, Arrival, RoundConfig, RoundSize, merge_weights, round_size,
                                       round_step)
from diloco.storage.errors import Refused
from diloco.storage.protocol import SCHEMA_VERSION, VersionSettings, pack

SHAPES = {"blocks.0.w": (33, 7), "blocks.0.b": (7,), "scalar": ()}


def random_tensors(gen: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: torch.randn(s, generator=gen) * scale for k, s in SHAPES.items()}


def clone(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in d.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# --- merge_deltas -------------------------------------------------------------------------


def test_merge_is_bit_identical_for_the_same_inputs_in_the_same_order() -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = [random_tensors(gen) for _ in range(5)]
    weights = [0.1, 0.3, 0.2, 0.15, 0.25]
    copies = [clone(d) for d in deltas]
    first = merge_deltas(deltas, weights)
    assert same(first, merge_deltas(copies, list(weights)))
    assert all(same(d, c) for d, c in zip(deltas, copies, strict=True))  # inputs untouched


def test_weights_are_applied_as_given_by_hand() -> None:
    d1 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])}
    d2 = {"w": torch.tensor([3.0, -2.0]), "b": torch.tensor([0.0])}
    out = merge_deltas([d1, d2], [0.75, 0.25])
    assert same(out, {"w": torch.tensor([1.5, 1.0]), "b": torch.tensor([3.0])})


def test_merge_accumulates_in_fp32_whatever_the_input_dtype() -> None:
    d = {"w": torch.tensor([1.0, -0.5], dtype=torch.bfloat16)}
    out = merge_deltas([d, d], [0.5, 0.5])
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], torch.tensor([1.0, -0.5]))


def test_merge_matches_a_float64_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    deltas = [random_tensors(gen) for _ in range(4)]
    weights = [0.4, 0.3, 0.2, 0.1]
    out = merge_deltas(deltas, weights)
    for k in SHAPES:
        ref = sum(w * d[k].double() for w, d in zip(weights, deltas, strict=True))
        torch.testing.assert_close(out[k].double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("deltas, weights", [
    ([], []),
    ([{"w": torch.zeros(2)}], [0.5, 0.5]),
    ([{"w": torch.zeros(2)}, {"v": torch.zeros(2)}], [0.5, 0.5]),
    ([{"w": torch.zeros(2)}, {"w": torch.zeros(1)}], [0.5, 0.5]),
])
def test_mismatched_deltas_are_refused(deltas: list, weights: list) -> None:
    with pytest.raises(ValueError):
        merge_deltas(deltas, weights)


def l2(t: torch.Tensor) -> float:
    return t.double().norm().item()


def test_radial_directional_keeps_the_weighted_mean_norm() -> None:
    gen = torch.Generator().manual_seed(2)
    deltas = [{"w": torch.randn(10_000, generator=gen) * s} for s in (1.0, 2.0, 3.0)]
    weights = [0.5, 0.3, 0.2]
    mean_norm = sum(w * l2(d["w"]) for w, d in zip(weights, deltas, strict=True))
    radial = merge_deltas(deltas, weights, radial_directional=True)["w"]
    plain = merge_deltas(deltas, weights)["w"]
    assert l2(radial) == pytest.approx(mean_norm, rel=1e-5)
    assert l2(plain) < 0.7 * mean_norm  # near-orthogonal deltas: the plain mean shrinks
    assert same({"w": radial}, merge_deltas(deltas, weights, radial_directional=True))


def test_radial_directional_with_equal_norms_points_where_the_plain_mean_does() -> None:
    gen = torch.Generator().manual_seed(3)
    raw = [torch.randn(1000, generator=gen) for _ in range(3)]
    deltas = [{"w": r / r.norm()} for r in raw]
    radial = merge_deltas(deltas, [0.2, 0.3, 0.5], radial_directional=True)["w"]
    plain = merge_deltas(deltas, [0.2, 0.3, 0.5])["w"]
    cos = torch.dot(radial.double(), plain.double()).item() / (l2(radial) * l2(plain))
    assert cos == pytest.approx(1.0, abs=1e-6) and l2(radial) == pytest.approx(1.0, rel=1e-5)


def test_radial_directional_zero_and_cancelling_deltas_give_zero() -> None:
    d = {"w": torch.tensor([1.0, 2.0])}
    neg = {"w": torch.tensor([-1.0, -2.0])}
    zero = {"w": torch.zeros(2)}
    assert torch.equal(merge_deltas([zero, zero], [0.5, 0.5], radial_directional=True)["w"], torch.zeros(2))
    assert torch.equal(merge_deltas([d, neg], [0.5, 0.5], radial_directional=True)["w"], torch.zeros(2))
    # a zero delta adds no direction but does pull the mean norm down
    half = merge_deltas([d, zero], [0.5, 0.5], radial_directional=True)["w"]
    assert l2(half) == pytest.approx(0.5 * math.sqrt(5.0), rel=1e-6)


# --- nesterov_step ------------------------------------------------------------------------


@pytest.mark.parametrize("lr, momentum", [(0.7, 0.9), (1.0, 0.5), (0.35, 0.95)])
@pytest.mark.parametrize("foreach", [None, False, True])
def test_nesterov_step_equals_torch_sgd_bit_for_bit(lr: float, momentum: float, foreach: bool | None) -> None:
    gen = torch.Generator().manual_seed(4)
    params = random_tensors(gen)
    torch_params = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.SGD(list(torch_params.values()), lr=lr, momentum=momentum, nesterov=True,
                          foreach=foreach)
    state = NesterovState()
    for step in range(1, 7):
        delta = random_tensors(gen, scale=0.1)
        before = (clone(params), clone(delta), clone(state.momentum))
        new_params, new_state = nesterov_step(params, delta, state, lr=lr, momentum=momentum)
        # pure: nothing passed in changed
        assert same(params, before[0]) and same(delta, before[1]) and same(state.momentum, before[2])
        for k, p in torch_params.items():
            p.grad = delta[k].clone()
        opt.step()
        assert same(new_params, {k: p.detach() for k, p in torch_params.items()})
        assert same(new_state.momentum, {k: opt.state[p]["momentum_buffer"] for k, p in torch_params.items()})
        assert new_state.steps == step
        params, state = new_params, new_state


def test_first_step_buffer_is_a_copy_of_the_delta() -> None:
    params = {"w": torch.zeros(3)}
    delta = {"w": torch.tensor([1.0, -2.0, 3.0])}
    new_params, state = nesterov_step(params, delta, NesterovState())
    assert torch.equal(state.momentum["w"], delta["w"])
    assert state.momentum["w"].data_ptr() != delta["w"].data_ptr()
    # p - lr * (g + m * g) = -0.7 * 1.9 * g
    torch.testing.assert_close(new_params["w"], -0.7 * 1.9 * delta["w"])


def test_delta_must_cover_the_fragment() -> None:
    with pytest.raises(ValueError):
        nesterov_step({"w": torch.zeros(2), "b": torch.zeros(1)}, {"w": torch.zeros(2)}, NesterovState())


def test_round_delta_applies_the_recorded_round_scale_and_refuses_a_bad_one() -> None:
    deltas = [{"w": torch.tensor([1.0, -2.0, 4.0])}, {"w": torch.tensor([3.0, 2.0, 0.0])}]
    full = round_delta(deltas, [0.5, 0.5], typed())["w"]
    assert torch.equal(full, torch.tensor([2.0, 0.0, 2.0]))
    assert torch.equal(round_delta(deltas, [0.5, 0.5], typed(round_scale=0.25))["w"], torch.tensor([0.5, 0.0, 0.5]))
    assert torch.equal(round_delta(deltas, [0.5, 0.5], typed(round_scale=1.0))["w"], full)
    for bad in (0.0, 1.5, True, "half"):
        with pytest.raises(Refused, match="round_scale"):
            typed(round_scale=bad)


# --- fractional steps: a round moves the model as far as the progress it carries ----------------

OUTER = {"kind": "delta", "merge": "weighted_mean", "outer_lr": 0.7, "outer_momentum": 0.9}
"""A manifest's settings, as far as the merge and the outer step read them."""


def typed(**over: object) -> VersionSettings:
    """The settings of a manifest recording OUTER with `over`, read back as a manifest's are."""
    return VersionSettings.from_wire(pack({"schema": SCHEMA_VERSION, "type": "VersionSettings", **OUTER, **over}))


def test_a_whole_fractional_step_is_the_torch_sgd_step_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(5)
    params, state = random_tensors(gen), NesterovState()
    for _ in range(3):
        delta = random_tensors(gen, 0.1)
        whole, whole_state = nesterov_step(params, delta, state)
        frac, frac_state = apply_round(params, state, [delta], [1.0], typed(outer="fractional_nesterov", progress=1.0))
        assert same(whole, frac) and same(whole_state.momentum, frac_state.momentum)
        params, state = whole, whole_state


def test_a_small_step_moves_the_model_by_its_progress_momentum_included() -> None:
    gen = torch.Generator().manual_seed(6)
    params, state = random_tensors(gen), NesterovState()
    for _ in range(5):  # a warm buffer: the momentum push is what a whole step would repeat
        params, state = nesterov_step(params, random_tensors(gen, 0.1), state)
    tiny = {k: torch.zeros_like(v) for k, v in params.items()}  # a round carrying no update at all
    whole, _ = nesterov_step(params, tiny, state)
    for s in (0.5, 0.1, 0.01):
        part, part_state = nesterov_step(params, tiny, state, progress=s)
        for k in params:
            moved, full = (part[k] - params[k]).norm(), (whole[k] - params[k]).norm()
            # A whole step pushes lr * m * (m * buf); s of a step pushes s of lr * m * (m ** s * buf).
            torch.testing.assert_close(moved, full * s * 0.9 ** s / 0.9, rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(part_state.momentum[k], state.momentum[k] * 0.9 ** s, rtol=1e-5, atol=1e-7)


def test_fractional_steps_are_bit_identical_for_the_same_inputs() -> None:
    gen = torch.Generator().manual_seed(7)
    params, delta = random_tensors(gen), random_tensors(gen, 0.1)
    _, state = nesterov_step(params, random_tensors(gen, 0.1), NesterovState())
    first = nesterov_step(params, delta, state, progress=0.37)
    again = nesterov_step(clone(params), clone(delta), NesterovState(dict(state.momentum), state.steps), progress=0.37)
    assert same(first[0], again[0]) and same(first[1].momentum, again[1].momentum)
    for bad in (0.0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="progress"):
            nesterov_step(params, delta, state, progress=bad)


def test_the_look_ahead_scales_the_momentum_push_and_none_of_it_leaves_the_plain_step() -> None:
    """A version fewer learners train on from takes less of Nesterov's look-ahead: at 0 the params
    move by lr x the round's update alone, at 1/2 by half the push, and the buffer is the same
    either way (the next rounds, if any, keep the momentum)."""
    gen = torch.Generator().manual_seed(8)
    params, state = random_tensors(gen), NesterovState()
    for _ in range(4):
        params, state = nesterov_step(params, random_tensors(gen, 0.1), state)
    delta = random_tensors(gen, 0.1)
    whole, whole_state = nesterov_step(params, delta, state)
    for progress in (1.0, 0.4):
        full, full_state = nesterov_step(params, delta, state, progress=progress)
        none, none_state = nesterov_step(params, delta, state, progress=progress, lookahead=0.0)
        half, half_state = nesterov_step(params, delta, state, progress=progress, lookahead=0.5)
        for k in params:
            torch.testing.assert_close(none[k], params[k] - 0.7 * delta[k], rtol=0, atol=1e-6)
            torch.testing.assert_close(half[k] - none[k], (full[k] - none[k]) / 2, rtol=1e-4, atol=1e-6)
            assert torch.equal(none_state.momentum[k], half_state.momentum[k])
            assert torch.equal(none_state.momentum[k], full_state.momentum[k])
    assert same(whole, nesterov_step(params, delta, state, lookahead=1.0)[0])  # 1: the torch step, untouched
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match="lookahead"):
            nesterov_step(params, delta, state, lookahead=bad)
    assert typed(outer="fractional_nesterov", lookahead=0.25).lookahead == 0.25
    assert typed().lookahead == 1.0  # a manifest written before it: the whole look-ahead
    for bad in ({"lookahead": 0.5}, {"lookahead": 1.5, "outer": "fractional_nesterov"}):  # whole steps take all of it
        with pytest.raises(Refused):
            typed(**bad)


def test_the_outer_step_of_a_manifest_is_one_this_build_knows() -> None:
    with pytest.raises(Refused, match="outer: .adam. is not one of nesterov, fractional_nesterov"):
        typed(outer="adam")
    for bad in ({"outer_lr": "fast"}, {"outer_momentum": None}, {"merge": "median"}, {"progress": 0.0,
                                                                                      "outer": "fractional_nesterov"},
                {"progress": 0.5}):  # a whole step of half a step
        with pytest.raises(Refused):
            typed(**bad)
    assert typed(outer="fractional_nesterov", progress=0.5).progress == 0.5


def _cut_into_rounds(cuts: list[list[list[int]]], fractional: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """4 learners' deltas over 4 intervals, merged in the rounds `cuts` gives each interval, through
    the coordinator's own weights, round steps and outer step. Returns (params before, after)."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(300, generator=gen)
    params, state = {"w": torch.zeros(300)}, NesterovState()
    for _ in range(3):  # momentum already in play, as mid-run
        params, state = apply_round(params, state, [{"w": common * 0.1}], [1.0], typed())
    before = params["w"].clone()
    recent, head, cfg = [RoundSize(4 * 3000, 4)] * RECENT_ROUNDS, 0, RoundConfig()
    for t, groups in enumerate(cuts):
        deltas = [common * 0.1 + 0.1 * torch.randn(300, generator=gen) for _ in range(4)]
        for group in groups:
            arrivals = [Arrival(f"c{t}-{i}", f"l{i}", head, 3000, 30, 0.0, 0.1) for i in group]
            step = round_step(round_size(arrivals), recent)
            settings = (typed(outer="fractional_nesterov", round_scale=step.scale, progress=step.progress)
                        if fractional else typed(round_scale=step.scale))
            params, state = apply_round(params, state, [{"w": deltas[i]} for i in group],
                                        merge_weights(arrivals, head, cfg), settings)
            recent, head = [*recent, round_size(arrivals)][-RECENT_ROUNDS:], head + 1
    return before, params["w"]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_deltas_cut_into_more_rounds_give_nearly_the_same_model(seed: int) -> None:
    whole = [[[0, 1, 2, 3]]] * 4  # 4 rounds of 4 learners
    cut = [[[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1, 2, 3]], [[0, 1, 2], [3]]]  # the same deltas in 7 rounds
    before, four = _cut_into_rounds(whole, fractional=True, seed=seed)
    _, seven = _cut_into_rounds(cut, fractional=True, seed=seed)
    assert float((four - seven).norm() / (four - before).norm()) < 0.08
    # A whole Nesterov step per round (the merged update scaled, the momentum push not): far apart.
    before, four = _cut_into_rounds(whole, fractional=False, seed=seed)
    _, seven = _cut_into_rounds(cut, fractional=False, seed=seed)
    assert float((four - seven).norm() / (four - before).norm()) > 0.3


def _through_a_decay(inner_lrs: list[float], movement: bool, seed: int = 3) -> list[torch.Tensor]:
    """4 learners' rounds whose deltas scale with `inner_lrs` (one per round), through the
    coordinator's own path: merge, measure the update (or not), size the step, scale, outer step.
    Returns the params after each round."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(300, generator=gen)
    params, state, recent, cfg, out = {"w": torch.zeros(300)}, NesterovState(), [], RoundConfig(), []
    for r, lr in enumerate(inner_lrs):
        deltas = [{"w": lr * (0.1 * direction + 0.05 * torch.randn(300, generator=gen))} for _ in range(4)]
        arrivals = [Arrival(f"c{r}-{i}", f"l{i}", r, 3000, 30, 0.0, 0.1) for i in range(4)]
        update = round_delta(deltas, merge_weights(arrivals, r, cfg), typed())
        norm = update_norm(update) if movement else None
        step = round_step(round_size(arrivals, norm), recent)
        settings = typed(outer="fractional_nesterov", round_scale=step.scale, progress=step.progress)
        replayed, _ = apply_round(params, state, deltas, merge_weights(arrivals, r, cfg), settings)
        params, state = outer_step(params, state, scale_update(update, step.scale), settings)
        assert torch.equal(params["w"], replayed["w"])  # a replay from the manifest's settings: the same bits
        recent = [*recent, round_size(arrivals, norm)][-RECENT_ROUNDS:]
        out.append(params["w"].clone())
    return out


def test_when_the_learners_stop_moving_the_model_stops_too() -> None:
    # Twelve rounds at a constant inner lr, then the last rounds of a cosine schedule decaying to 0.
    lrs = [1.0] * 12 + [0.3, 0.1, 0.03, 0.01, 0.0]
    tokens_only, by_movement = _through_a_decay(lrs, movement=False), _through_a_decay(lrs, movement=True)
    # Mid-run every round moves about as far as usual: the same steps, bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(tokens_only[:12], by_movement[:12], strict=True))
    # In the decay, a whole step per round is mostly momentum and carries the model on long after the
    # learners stopped; a step of the round's movement stops nearly where they did.
    usual = float((tokens_only[11] - tokens_only[10]).norm())
    drift_tokens = float((tokens_only[-1] - tokens_only[11]).norm()) / usual
    drift_movement = float((by_movement[-1] - by_movement[11]).norm()) / usual
    assert drift_movement < 0.5 * drift_tokens
    assert float((by_movement[-1] - by_movement[-2]).norm()) < 1e-4 * usual  # the round of lr 0: no move


def test_the_momentum_takes_only_the_fresh_part_of_a_round_with_stale_pieces() -> None:
    gen = torch.Generator().manual_seed(9)
    params, state = random_tensors(gen), NesterovState()
    params, state = nesterov_step(params, random_tensors(gen, 0.1), state)
    fresh, stale = random_tensors(gen, 0.1), random_tensors(gen, 0.1)
    on = typed(outer="fractional_nesterov")
    off = typed(outer="fractional_nesterov", stale_momentum=False)
    both, both_state = apply_round(params, state, [fresh, stale], [0.5, 0.5], on)
    split, split_state = apply_round(params, state, [fresh, stale], [0.5, 0.5], off, staleness=[0, 1])
    only_fresh = {k: fresh[k] * 0.5 for k in fresh}
    for k in params:  # the buffer took half of the fresh piece; the params moved by both, and that buffer
        torch.testing.assert_close(split_state.momentum[k], state.momentum[k] * 0.9 + only_fresh[k], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(split[k], params[k] - 0.7 * ((fresh[k] + stale[k]) * 0.5 + 0.9 * split_state.momentum[k]),
                                   rtol=1e-5, atol=1e-6)
    assert not same(both_state.momentum, split_state.momentum)
    again = apply_round(params, state, [fresh, stale], [0.5, 0.5], off, staleness=[0, 0])  # nothing stale: as on
    assert same(again[0], apply_round(params, state, [fresh, stale], [0.5, 0.5], on)[0])
    with pytest.raises(ValueError, match="staleness"):
        apply_round(params, state, [fresh, stale], [0.5, 0.5], off)
    with pytest.raises(Refused):
        typed(stale_momentum=False)  # whole steps take everything into the buffer


def test_a_round_of_stale_pieces_alone_moves_the_params_and_leaves_the_momentum_to_decay() -> None:
    gen = torch.Generator().manual_seed(11)
    params, state = random_tensors(gen), NesterovState()
    params, state = nesterov_step(params, random_tensors(gen, 0.1), state)
    a, b = random_tensors(gen, 0.1), random_tensors(gen, 0.1)
    off = typed(outer="fractional_nesterov", stale_momentum=False)
    moved, moved_state = apply_round(params, state, [a, b], [0.5, 0.5], off, staleness=[1, 2])
    for k in params:  # the buffer took nothing (zeros); the params moved by the whole round
        torch.testing.assert_close(moved_state.momentum[k], state.momentum[k] * 0.9, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(moved[k], params[k] - 0.7 * ((a[k] + b[k]) * 0.5 + 0.9 * moved_state.momentum[k]),
                                   rtol=1e-5, atol=1e-6)


def test_a_bounded_piece_moves_the_params_once_and_never_enters_the_momentum() -> None:
    """A piece whose learner the merge bounded (`influence`: as large as the bound allows, and noise)
    moves the params at its share and leaves the buffer to the round's other pieces: it is not
    pushed again in every later round, as it is when the buffer takes it (about 1 / (1 - momentum)
    times as far in all)."""
    gen = torch.Generator().manual_seed(13)
    params, state = random_tensors(gen), NesterovState()
    params, state = nesterov_step(params, random_tensors(gen, 0.1), state)
    honest, noise = random_tensors(gen, 0.1), random_tensors(gen, 0.4)
    quiet = {k: torch.zeros_like(v) for k, v in honest.items()}
    on = typed(outer="fractional_nesterov")
    off = typed(outer="fractional_nesterov", bounded_momentum=False)
    moved, moved_state = apply_round(params, state, [honest, noise], [0.5, 0.5], off, bounded=[False, True])
    for k in params:  # the buffer took the honest half; the params moved by both
        torch.testing.assert_close(moved_state.momentum[k], state.momentum[k] * 0.9 + honest[k] * 0.5,
                                   rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(moved[k], params[k] - 0.7 * ((honest[k] + noise[k]) * 0.5
                                                                 + 0.9 * moved_state.momentum[k]), rtol=1e-5, atol=1e-6)

    def run_on(settings: VersionSettings, pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The round, then 30 rounds in which the learners moved nothing."""
        p, st = apply_round(params, state, pieces, [0.5, 0.5], settings, bounded=[False, True])
        for _ in range(30):
            p, st = apply_round(p, st, [quiet, quiet], [0.5, 0.5], settings, bounded=[False, False])
        return p

    def reach(settings: VersionSettings) -> float:
        """How far the noise moved the params in all, against the same rounds without it."""
        with_noise, without = run_on(settings, [honest, noise]), run_on(settings, [honest, quiet])
        return math.sqrt(sum(float((with_noise[k] - without[k]).norm()) ** 2 for k in params))

    once = 0.7 * 0.5 * math.sqrt(sum(float(noise[k].norm()) ** 2 for k in params))
    assert reach(off) == pytest.approx(once, rel=1e-4)
    assert reach(on) > 8 * once  # the buffer pushed it again in every round


def test_the_buffer_takes_every_input_when_every_one_was_bounded_and_says_what_it_needs() -> None:
    from diloco.coordinator.outer import buffered_inputs
    off = typed(outer="fractional_nesterov", bounded_momentum=False, stale_momentum=False)
    assert buffered_inputs(off, 3, [0, 1, 0], [False, False, True]) == [True, False, False]
    assert buffered_inputs(off, 2, [0, 0], [False, False]) is None
    # A backlog after the coordinator was down cuts every learner alike: nothing is left out for it.
    assert buffered_inputs(off, 2, [0, 0], [True, True]) is None
    assert buffered_inputs(off, 2, [0, 1], [True, True]) == [True, False]
    assert buffered_inputs(typed(outer="fractional_nesterov"), 2, None, None) is None  # older manifests
    with pytest.raises(ValueError, match="bounded"):
        buffered_inputs(off, 2, [0, 0], None)
    with pytest.raises(Refused):
        typed(bounded_momentum=False)  # whole steps take everything into the buffer


class Reading(Mapping):
    """A piece that records each tensor read of it (the coordinator's pieces decode a tensor when read)."""

    def __init__(self, index: int, tensors: dict[str, torch.Tensor], read: list[tuple[int, str]]) -> None:
        self.index, self.tensors, self.read = index, tensors, read

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.append((self.index, name))
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def test_buffered_part_reads_only_the_fresh_pieces() -> None:
    from diloco.coordinator.outer import buffered_part, round_delta
    gen = torch.Generator().manual_seed(12)
    pieces = [random_tensors(gen, 0.1) for _ in range(3)]
    read: list[tuple[int, str]] = []
    reading = [Reading(i, p, read) for i, p in enumerate(pieces)]

    off = typed(outer="fractional_nesterov", stale_momentum=False)
    update = round_delta(pieces, [0.2, 0.3, 0.5], off)
    part = buffered_part(reading, [0.2, 0.3, 0.5], [0, 1, 0], off, update)
    assert sorted({i for i, _ in read}) == [0, 2]  # the stale piece is not decoded again
    assert sorted(read) == sorted((i, name) for i in (0, 2) for name in pieces[0])  # each tensor once
    assert part is not None and same(part, round_delta([pieces[0], pieces[2]], [0.2, 0.5], off))
    read.clear()
    zeros = buffered_part(reading, [0.2, 0.3, 0.5], [1, 1, 2], off, update)
    assert read == [] and zeros is not None  # all stale: zeros shaped like the update, nothing decoded
    assert all(zeros[k].shape == update[k].shape and not zeros[k].any() for k in update)
