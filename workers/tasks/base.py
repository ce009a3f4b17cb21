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
import logging
import time
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

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
