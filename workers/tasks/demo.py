"""The demo's learning task: data, model, inner optimizer and held-out evaluation in one config.

Every learner process, the baseline and the in-process reference build the same `DemoTask`; all
randomness comes from its seeds, so the same task gives the same init, data streams and eval set
in any process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from diloco.workers.tasks.language import ByteText, LaggedCopyLanguage, MarkovLanguage
from diloco.workers.tasks.tinygpt import TinyGPT, TinyGPTConfig
from diloco.workers.tasks.base import Batch, TaskBase, adamw, fields_from_wire, mean_token_loss


@dataclass(frozen=True)
class DemoTask(TaskBase):
    """A TinyGPT on a synthetic language (exact floor), AdamW with warmup (a `workers.tasks.base.Task`;
    the batch, held-out seed and inner schedule's fields are `TaskBase`'s, at its defaults)."""

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
    # Data and evaluation (the batch and the held-out seed: TaskBase).
    seq_len: int = 64
    """Tokens per training sequence (also the model's context)."""
    eval_tokens: int = 65_536
    """Size of the fixed held-out set (predicted tokens)."""
    # Inner optimizer: AdamW (its lr, decay, schedule and clipping: TaskBase).
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas. Its weight decay is on matrices only (not biases, norms, embeddings)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seq_len < 2 or self.eval_tokens < self.seq_len:
            raise ValueError(f"need seq_len >= 2, eval_tokens >= seq_len: {self}")
        if not 0 <= self.copy_lag < self.seq_len or not 0.0 <= self.copy_prob <= 1.0:
            raise ValueError(f"need 0 <= copy_lag < seq_len, 0 <= copy_prob <= 1: {self}")
        self.model_config  # validates the model shape early  # noqa: B018

    # ---- wire form (the demo passes the task to learner processes) ----

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
        generator = self.train_generator(stream_seed)
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
        return adamw(model, self, decays=lambda name, p: p.ndim == 2 and "emb" not in name)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    def eval_set(self) -> torch.Tensor:
        """The fixed held-out windows, int64 [n, seq_len + 1] (built once per task, cached)."""
        return _eval_set(self)

    def eval_loss(self, model: torch.nn.Module) -> float:
        """Mean cross-entropy (nats/token) on the held-out set; restores the model's train/eval mode."""
        return mean_token_loss(model, model, self.eval_set())


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
    generator = task.eval_generator()
    num_windows = math.ceil(task.eval_tokens / task.seq_len)
    return task.language.windows(num_windows, task.seq_len + 1, generator, held_out=True)

