"""The demo's learning task: data, model, inner optimizer and held-out evaluation in one config.

Every learner process, the baseline and the in-process reference build the same `DemoTask`; all
randomness comes from its seeds, so the same task gives the same init, data streams and eval set
in any process.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from diloco.workers.tasks.language import ByteText, LaggedCopyLanguage, MarkovLanguage
from diloco.workers.tasks.tinygpt import TinyGPT, TinyGPTConfig
from diloco.workers.tasks.base import Batch, descend, fields_from_wire, to_wire

log = logging.getLogger(__name__)

_EVAL_BATCH = 64
# Generator seeds: train stream s uses 1_000_003 * (s + 1), eval set e uses 7_919 * (e + 1); both are
# primes, so the two only meet when s + 1 is a multiple of 7_919 and e + 1 one of 1_000_003.
_TRAIN_SEED_BASE = 1_000_003
_EVAL_SEED_BASE = 7_919


@dataclass(frozen=True)
class DemoTask:
    """A TinyGPT on a synthetic language (exact floor), AdamW with warmup (a `workers.tasks.base.Task`)."""

    kind: ClassVar[str] = "demo"
    # The language (ignored when text_path is set).
    vocab_size: int = 32
    """Tokens in the synthetic language."""
    order: int = 2
    """Markov order k: the next token depends on the previous k."""
    branching: int = 4
    """Possible next tokens per context (random Dirichlet(1) probabilities)."""
    language_seed: int = 0
    """Seed of the language's transition tables."""
    copy_lag: int = 0
    """0: the Markov language. > 0: the lagged-copy language instead (`vocab_size` tokens; order,
    branching and language_seed unused): each token repeats the one `copy_lag` back with probability
    `copy_prob`, else is uniform, so the loss plateaus at ln(vocab_size) until attention finds the lag."""
    copy_prob: float = 0.5
    """Probability that a lagged-copy token repeats the token `copy_lag` positions back."""
    text_path: str | None = None
    """Train on the bytes of this file (vocab 256, no known floor) instead of the synthetic language."""
    # The model.
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Transformer blocks (the fragment planner groups parameters by block)."""
    n_heads: int = 4
    """Attention heads per block."""
    d_ff: int = 256
    """MLP hidden width."""
    # Data and evaluation.
    seq_len: int = 64
    """Tokens per training sequence (also the model's context)."""
    batch_size: int = 32
    """Sequences per inner step."""
    eval_tokens: int = 65_536
    """Size of the fixed held-out set (predicted tokens)."""
    eval_seed: int = 0
    """Seed of the held-out set."""
    # Inner optimizer (AdamW).
    lr: float = 3e-3
    """Peak inner learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, on matrices only (not biases, norms, embeddings)."""
    warmup_steps: int = 50
    """Linear warmup of the inner learning rate over a learner's first steps (0 = none)."""
    min_lr_ratio: float = 1.0
    """Cosine-decay the inner lr from `lr` to `min_lr_ratio * lr` over a learner's step budget (1 = constant)."""
    grad_clip: float | None = 1.0
    """Clip each inner step's gradient to this global norm (None = no clipping)."""

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_size < 1 or self.eval_tokens < self.seq_len:
            raise ValueError(f"need seq_len >= 2, batch_size >= 1, eval_tokens >= seq_len: {self}")
        if self.lr <= 0 or self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"need lr > 0, warmup_steps >= 0, 0 <= min_lr_ratio <= 1: {self}")
        if not 0 <= self.copy_lag < self.seq_len or not 0.0 <= self.copy_prob <= 1.0:
            raise ValueError(f"need 0 <= copy_lag < seq_len, 0 <= copy_prob <= 1: {self}")
        self.model_config  # validates the model shape early  # noqa: B018

    # ---- wire form (the demo passes the task to learner processes) ----

    def to_wire(self) -> dict:
        return to_wire(self)

    @classmethod
    def from_wire(cls, wire: dict) -> DemoTask:
        """Also reads task files written before tasks had a kind (they are demo tasks)."""
        return cls(**fields_from_wire(cls, wire, default_kind=cls.kind))

    # ---- data ----

    @property
    def language(self) -> MarkovLanguage | LaggedCopyLanguage | ByteText:
        return _language(self.text_path, self.vocab_size, self.order, self.branching, self.language_seed,
                         self.copy_lag, self.copy_prob)

    @property
    def model_config(self) -> TinyGPTConfig:
        vocab = ByteText.vocab_size if self.text_path else self.vocab_size
        return TinyGPTConfig(vocab, self.seq_len, self.d_model, self.n_layers, self.n_heads, self.d_ff)

    def tokens_per_step(self) -> int:
        """Predicted tokens per inner step (what token-weighted merging counts)."""
        return self.batch_size * self.seq_len

    def train_batches(self, stream_seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Infinite (inputs, targets) batches, int64 [batch_size, seq_len]; same seed, same stream.

        Give each learner (and each restart of it, if it should not replay data) its own seed.
        """
        generator = torch.Generator().manual_seed(_TRAIN_SEED_BASE * (stream_seed + 1))
        while True:
            window = self.language.windows(self.batch_size, self.seq_len + 1, generator)
            yield window[:, :-1], window[:, 1:]

    def entropy_floor(self) -> float | None:
        """Best achievable eval loss (nats/token) on windows of seq_len + 1 tokens; None if unknown."""
        return self.language.window_floor_nats(self.seq_len + 1)

    # ---- model, optimizer, loss ----

    def make_model(self, seed: int) -> TinyGPT:
        """A fresh model; the same seed gives bit-identical weights."""
        return TinyGPT(self.model_config, seed=seed)

    def make_inner_optimizer(self, model: torch.nn.Module) -> torch.optim.AdamW:
        decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n]
        no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "emb" not in n)]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)

    def make_lr_schedule(self, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
        """`inner_lr` as a scheduler (for loops that step one, as `workers.tasks.base.train_step` does)."""
        return LambdaLR(optimizer, lambda step: self.inner_lr(step, total_steps) / self.lr)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    def inner_lr(self, step: int, total_steps: int | None = None) -> float:
        """Inner learning rate at a learner's local step (0-based): linear warmup, then constant or cosine.

        The cosine part needs the learner's step budget `total_steps`; without one the lr stays at `lr`.
        """
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if total_steps is None or self.min_lr_ratio == 1.0:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def inner_step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
        step: int, total_steps: int | None = None,
    ) -> float:
        """One AdamW step on one batch at local step `step` (of `total_steps`); returns the training loss."""
        for group in optimizer.param_groups:
            group["lr"] = self.inner_lr(step, total_steps)
        return descend(self, model, optimizer, batch)

    def eval_set(self) -> torch.Tensor:
        """The fixed held-out windows, int64 [n, seq_len + 1] (built once per task, cached)."""
        return _eval_set(self)

    @torch.no_grad()
    def eval_loss(self, model: torch.nn.Module) -> float:
        """Mean cross-entropy (nats/token) on the held-out set; restores the model's train/eval mode."""
        was_training = model.training
        model.eval()
        try:
            total, count = 0.0, 0
            for window in self.eval_set().split(_EVAL_BATCH):
                logits = model(window[:, :-1])
                total += F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten(), reduction="sum").item()
                count += window[:, 1:].numel()
            return total / count
        finally:
            model.train(was_training)


@functools.lru_cache(maxsize=8)
def _language(
    text_path: str | None, vocab_size: int, order: int, branching: int, seed: int, copy_lag: int, copy_prob: float
) -> MarkovLanguage | LaggedCopyLanguage | ByteText:
    if text_path:
        return ByteText(text_path)
    if copy_lag:
        return LaggedCopyLanguage(vocab_size, copy_lag, copy_prob)
    return MarkovLanguage(vocab_size, order, branching, seed)


@functools.lru_cache(maxsize=8)
def _eval_set(task: DemoTask) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_EVAL_SEED_BASE * (task.eval_seed + 1))
    num_windows = math.ceil(task.eval_tokens / task.seq_len)
    return task.language.windows(num_windows, task.seq_len + 1, generator, held_out=True)


def train_baseline(
    task: DemoTask, total_steps: int, seed: int = 0, log_every: int = 0
) -> list[tuple[int, float]]:
    """Plain single-replica AdamW for `total_steps`; returns [(step, eval_loss)], ending at total_steps.

    `log_every` > 0 also evaluates every that many steps. Uses data stream `seed` and init `seed`.
    """
    model = task.make_model(seed)
    optimizer = task.make_inner_optimizer(model)
    batches = task.train_batches(seed)
    curve: list[tuple[int, float]] = []
    started = time.perf_counter()
    for step in range(total_steps):
        task.inner_step(model, optimizer, next(batches), step, total_steps)
        done = step + 1
        if done == total_steps or (log_every and done % log_every == 0):
            curve.append((done, task.eval_loss(model)))
            log.info("baseline step %d/%d eval %.4f (%.1f s)", done, total_steps, curve[-1][1],
                     time.perf_counter() - started)
    return curve
