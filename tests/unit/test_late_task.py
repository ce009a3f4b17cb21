"""The lagged-copy language behind the "late" benchmark task: its rule, its exact floor, its seeds."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from diloco.infra.bench.quality_tasks import TASKS
from diloco.workers.tasks.language import LaggedCopyLanguage, MarkovLanguage
from diloco.workers.tasks.demo import DemoTask
from diloco.workers.tasks.kinds import task_from_wire

LANG = LaggedCopyLanguage(vocab_size=8, lag=5, copy_prob=0.4)


def _windows(seed: int, num: int = 200, length: int = 40) -> torch.Tensor:
    return LANG.windows(num, length, torch.Generator().manual_seed(seed))


def test_windows_copy_at_the_lag_and_are_uniform_otherwise() -> None:
    w = _windows(0)  # 200 x 35 = 7000 lagged pairs
    assert w.shape == (200, 40) and w.dtype == torch.long and 0 <= int(w.min()) and int(w.max()) < 8
    same = (w[:, 5:] == w[:, :-5]).double().mean().item()
    assert same == pytest.approx(0.4 + 0.6 / 8, abs=0.02)
    for lag in (1, 3, 4):  # other distances carry nothing: chance agreement 1/8
        assert (w[:, lag:] == w[:, :-lag]).double().mean().item() == pytest.approx(1 / 8, abs=0.02)
    counts = torch.bincount(w.flatten(), minlength=8).double() / w.numel()
    assert counts.tolist() == pytest.approx([1 / 8] * 8, abs=0.015)


def test_floor_is_the_mixture_entropy_after_the_lag_and_ln_v_before() -> None:
    q, v = LANG.copy_prob, LANG.vocab_size
    a, b = q + (1 - q) / v, (1 - q) / v
    rate = -(a * math.log(a)) - (v - 1) * b * math.log(b)
    assert LANG.entropy_rate_nats() == pytest.approx(rate, abs=1e-12)
    # Window of 12: positions 1..4 have no source (ln 8 each), 5..11 cost the rate.
    assert LANG.window_floor_nats(12) == pytest.approx((4 * math.log(v) + 7 * rate) / 11, abs=1e-12)
    assert LANG.window_floor_nats(4) == pytest.approx(math.log(v))  # shorter than the lag: nothing to copy
    # The Bayes predictor's log loss on sampled windows estimates the floor.
    w = _windows(1, num=2000, length=12)
    probs = torch.full((2000, 11, v), b, dtype=torch.float64)
    probs[:, :4] = 1 / v
    probs[:, 4:].scatter_add_(2, w[:, :7].unsqueeze(2), torch.full((2000, 7, 1), q, dtype=torch.float64))
    nll = -probs.gather(2, w[:, 1:].unsqueeze(2)).log().mean().item()
    assert nll == pytest.approx(LANG.window_floor_nats(12), abs=0.03)
    task = DemoTask(vocab_size=8, copy_lag=5, copy_prob=0.4, seq_len=11, eval_tokens=1100)
    assert isinstance(task.language, LaggedCopyLanguage) and task.entropy_floor() == LANG.window_floor_nats(12)
    assert isinstance(DemoTask().language, MarkovLanguage)


def test_seeds_fix_the_windows_and_held_out_windows_are_fresh() -> None:
    assert torch.equal(_windows(3), _windows(3)) and not torch.equal(_windows(3), _windows(4))
    task = DemoTask(vocab_size=8, copy_lag=5, copy_prob=0.4, seq_len=16, batch_size=8, eval_tokens=256)
    x1, y1 = next(task.train_batches(0))
    assert torch.equal(x1, next(task.train_batches(0))[0]) and not torch.equal(x1, next(task.train_batches(1))[0])
    assert x1.shape == (8, 16) and torch.equal(x1[:, 1:], y1[:, :-1])
    held = task.eval_set()
    assert held.shape == (16, 17)
    train = torch.cat([x1, y1[:, -1:]], 1)  # the first training windows, seq_len + 1 tokens like the held-out ones
    assert not any(torch.equal(row, t) for row in held for t in train)


def test_wire_form_round_trips_and_fields_are_checked() -> None:
    task = DemoTask(vocab_size=16, copy_lag=7, copy_prob=0.25, seq_len=32)
    wire = task.to_wire()
    assert wire["copy_lag"] == 7 and wire["copy_prob"] == 0.25
    assert DemoTask.from_wire(wire) == task == task_from_wire(wire)
    old = {k: v for k, v in DemoTask().to_wire().items() if k not in ("copy_lag", "copy_prob")}
    assert DemoTask.from_wire(old) == DemoTask() and DemoTask().copy_lag == 0  # older wires: the Markov language
    for bad in ({"copy_lag": -1}, {"copy_lag": 32}, {"copy_prob": 1.5}):
        with pytest.raises(ValueError, match="copy"):
            dataclasses.replace(task, **bad)
    late = TASKS["late"]
    assert late.sync_every == 50 and late.steps % 50 == 0 and late.task.copy_lag > 0
    assert late.task.copy_lag < late.task.seq_len and late.task.entropy_floor() < math.log(late.task.vocab_size) - 0.2
