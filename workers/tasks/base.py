"""What a learning task is: the interface every learner, baseline and benchmark arm trains through.

A task is a frozen dataclass holding everything that decides what gets trained: the data (a
synthetic source with fixed seeds), the model, the inner optimizer and its learning-rate schedule,
and the held-out evaluation. The same task gives the same initial weights, data streams and eval
set in any process, so a learner process, the single-replica baseline and a peer system's replicas
all train the same thing. It crosses processes as JSON (`to_wire`, `from_wire`; `kind` says which
class reads it, see `workers.tasks.kinds`).

One inner step is the loop a user writes (`train_step`):

    loss = task.loss(model, batch); loss.backward(); clip; optimizer.step(); schedule.step()
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

log = logging.getLogger(__name__)

TASK_SCHEMA_VERSION = 1
"""Version of every task's wire form (a dict with `schema`, `kind` and the dataclass's fields)."""

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, targets) of one inner step."""


class Task(Protocol):
    kind: ClassVar[str]
    """The task's name on the wire ("demo", "gpt2", "vision")."""
    grad_clip: float | None
    """Clip each inner step's gradient to this global norm (None = no clipping)."""

    def to_wire(self) -> dict: ...

    def make_model(self, seed: int) -> torch.nn.Module:
        """A fresh model; the same seed gives bit-identical weights (the global RNG is not touched)."""
        ...

    def make_inner_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer: ...

    def make_lr_schedule(self, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
        """The inner learning rate over a replica's `total_steps` steps, stepped once after each step."""
        ...

    def train_batches(self, stream_seed: int) -> Iterator[Batch]:
        """Infinite batches; the same seed gives the same stream. One seed per learner (and restart)."""
        ...

    def tokens_per_step(self) -> int:
        """What one inner step trains on (tokens, or samples): what token-weighted merging counts."""
        ...

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The training loss of one batch (a scalar with a graph)."""
        ...

    def eval_loss(self, model: torch.nn.Module) -> float:
        """Mean loss on the fixed held-out set (nats); restores the model's train/eval mode."""
        ...

    def entropy_floor(self) -> float | None:
        """The best eval loss any model can reach on the held-out set; None if unknown."""
        ...


# Generator seeds: train stream s uses 1_000_003 * (s + 1), eval set e uses 7_919 * (e + 1); both are
# primes, so the two only meet when s + 1 is a multiple of 7_919 and e + 1 one of 1_000_003.
_TRAIN_SEED_BASE = 1_000_003
_EVAL_SEED_BASE = 7_919


@dataclass(frozen=True)
class TaskBase:
    """What every task shares: the batch, the held-out set's seed and the inner optimizer's schedule.

    A task is a dataclass that extends it with its data, model and optimizer's own fields (AdamW's
    betas, SGD's momentum), and redeclares a field here where its default differs. The fields travel
    in the task's wire form with the rest, flat.
    """

    kind: ClassVar[str]
    batch_size: int = 32
    """Sequences (or images) per inner step."""
    eval_seed: int = 0
    """Seed of the held-out set."""
    lr: float = 3e-3
    """Peak inner learning rate."""
    weight_decay: float = 0.0
    """The inner optimizer's weight decay (which parameters it applies to is the task's choice)."""
    warmup_steps: int = 50
    """Linear warmup of the inner learning rate over a learner's first steps (0 = none)."""
    min_lr_ratio: float = 1.0
    """After the warmup, cosine-decay the inner lr from `lr` to `min_lr_ratio * lr` at the end of a
    learner's step budget (1 = constant, 0 = down to zero)."""
    grad_clip: float | None = 1.0
    """Clip each inner step's gradient to this global norm (None = no clipping)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.lr <= 0 or self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"need batch_size >= 1, lr > 0, warmup_steps >= 0, 0 <= min_lr_ratio <= 1: {self}")

    def to_wire(self) -> dict:
        return to_wire(self)

    @classmethod
    def from_wire(cls, wire: dict) -> Any:
        return cls(**fields_from_wire(cls, wire))

    def train_generator(self, stream_seed: int) -> torch.Generator:
        """The generator of training stream `stream_seed` (one per learner, and per restart if it should
        not replay data); never the held-out set's."""
        return torch.Generator().manual_seed(_TRAIN_SEED_BASE * (stream_seed + 1))

    def eval_generator(self) -> torch.Generator:
        """The generator of the held-out set (`eval_seed`)."""
        return torch.Generator().manual_seed(_EVAL_SEED_BASE * (self.eval_seed + 1))

    def lr_factor(self, step: int, total_steps: int | None = None) -> float:
        """The inner lr over `lr` at a learner's local step (0-based): linear warmup, then constant or
        cosine down to `min_lr_ratio` at `total_steps` (without a budget it stays at 1)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if total_steps is None or self.min_lr_ratio == 1.0:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def make_lr_schedule(self, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
        """`lr_factor` over a replica's `total_steps`, stepped once after each inner step."""
        return LambdaLR(optimizer, functools.partial(self.lr_factor, total_steps=total_steps))


def adamw(model: torch.nn.Module, task: Any, decays: Callable[[str, torch.Tensor], bool]) -> torch.optim.AdamW:
    """AdamW at the task's `lr` and `betas`, its `weight_decay` on the parameters `decays(name, p)`
    picks and none on the others."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": task.weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=task.lr, betas=task.betas)


@torch.no_grad()
def mean_token_loss(model: torch.nn.Module, logits_of: Callable[[torch.Tensor], torch.Tensor],
                    windows: torch.Tensor, batch: int = 64) -> float:
    """Mean next-token cross-entropy (nats/token) of `logits_of(inputs)` over held-out `windows`
    ([n, seq_len + 1]), `batch` windows at a time; restores the model's train/eval mode."""
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        for window in windows.split(batch):
            logits = logits_of(window[:, :-1])
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), window[:, 1:].flatten(), reduction="sum").item()
            count += window[:, 1:].numel()
        return total / count
    finally:
        model.train(was_training)


def to_wire(task: Any) -> dict:
    """The wire form of a task dataclass: schema, kind, and every field (tuples as lists)."""
    values = {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}
    return {"schema": TASK_SCHEMA_VERSION, "kind": task.kind,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}


def fields_from_wire(cls: Any, wire: dict, *, default_kind: str | None = None) -> dict:
    """The constructor arguments of task class `cls` in `wire`, checked: schema and kind must match
    (`default_kind`: what a wire form without a kind is), unknown keys are ignored, and lists go back
    to tuples where the field's default is a tuple. Raises ValueError."""
    if wire.get("schema") != TASK_SCHEMA_VERSION:
        raise ValueError(f"task schema {wire.get('schema')!r}, this code reads {TASK_SCHEMA_VERSION}")
    kind = wire.get("kind", default_kind)
    if kind != cls.kind:
        raise ValueError(f"a {kind!r} task is not a {cls.kind!r} task")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in wire:
            value = wire[f.name]
            values[f.name] = tuple(value) if isinstance(f.default, tuple) and isinstance(value, list) else value
    return values


def train_step(task: Task, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: LRScheduler,
               batch: Batch) -> float:
    """One inner step as a user's loop does it; returns the batch's training loss. A `Learner` or a
    peer system's DiLoCo hooks `optimizer.step()`, so every arm's step is this one."""
    loss = descend(task, model, optimizer, batch)
    schedule.step()
    return loss


def descend(task: Task, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    """Loss, backward, the task's gradient clipping and `optimizer.step()` on one batch, at the lr the
    optimizer holds; returns the batch's training loss."""
    loss = task.loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if task.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip)
    optimizer.step()
    return loss.item()


def train_baseline(task: Task, total_steps: int, seed: int = 0, eval_every: int = 0) -> list[tuple[int, float]]:
    """One replica trained for `total_steps` (its schedule spans them all); returns [(step, eval loss)],
    every `eval_every` steps if > 0, always ending at total_steps. Init and data stream `seed`."""
    model = task.make_model(seed)
    optimizer = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(optimizer, total_steps)
    batches = task.train_batches(seed)
    curve: list[tuple[int, float]] = []
    started = time.perf_counter()
    for step in range(1, total_steps + 1):
        train_step(task, model, optimizer, schedule, next(batches))
        if step == total_steps or (eval_every and step % eval_every == 0):
            curve.append((step, task.eval_loss(model)))
            log.info("baseline step %d/%d eval %.4f (%.1f s)", step, total_steps, curve[-1][1],
                     time.perf_counter() - started)
    return curve
