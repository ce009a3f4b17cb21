"""A tiny Hugging Face GPT-2, unmodified, with AdamW and a cosine schedule with warmup, on a synthetic
Markov language whose floor is exact.

Unlike the demo task: the model is `transformers.GPT2LMHeadModel` (tied input and output embeddings,
`transformer.h.<i>` blocks), the optimizer decays weights, the learning rate follows transformers'
cosine schedule with warmup (to `min_lr_ratio`, zero by default, at the end of a replica's budget),
and the language is smaller and peakier (vocab 16, 3 successors per context, Dirichlet
concentration below 1). The floor is the loss of the language's own probabilities on the held-out windows: exact for
that set (its expectation over sets is the language's window floor). `transformers` is imported
only when a model or schedule is built.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from diloco.workers.tasks.language import MarkovLanguage
from diloco.workers.tasks.base import Batch, TaskBase, adamw, mean_token_loss


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class GPT2Task(TaskBase):
    kind: ClassVar[str] = "gpt2"
    # The language.
    vocab_size: int = 16
    """Tokens in the synthetic language (also the model's vocabulary)."""
    order: int = 2
    """Markov order k: the next token depends on the previous k."""
    branching: int = 3
    """Possible next tokens per context."""
    concentration: float = 0.5
    """Dirichlet concentration of each context's next-token probabilities (below 1: peaky)."""
    language_seed: int = 1
    """Seed of the language's transition tables."""
    # The model (GPT2Config).
    n_layer: int = 3
    """Transformer blocks."""
    n_embd: int = 96
    """Width of the residual stream."""
    n_head: int = 4
    """Attention heads per block."""
    dtype: str = "float32"
    """The parameters' dtype: "float32", or "bfloat16" (half the memory of the weights, their
    gradients and AdamW's moments; the run's global model stays float32)."""
    # Data and evaluation (the held-out seed: TaskBase).
    seq_len: int = 64
    """Tokens per training sequence (also the model's context, n_positions)."""
    batch_size: int = 16
    eval_tokens: int = 16_384
    """Size of the fixed held-out set (predicted tokens)."""
    # Inner optimizer: AdamW, transformers' cosine schedule with linear warmup (the fields: TaskBase).
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas. Its weight decay is on matrices only (not biases, norms; the tied embedding included)."""
    weight_decay: float = 0.1
    warmup_steps: int = 40
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_embd % self.n_head or self.seq_len < 2 or self.eval_tokens < self.seq_len:
            raise ValueError(f"need n_head | n_embd, seq_len >= 2, eval_tokens >= seq_len: {self}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {sorted(_DTYPES)}")

    # ---- data ----

    @property
    def language(self) -> MarkovLanguage:
        return _language(self.vocab_size, self.order, self.branching, self.language_seed, self.concentration)

    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def train_batches(self, stream_seed: int) -> Iterator[Batch]:
        generator = self.train_generator(stream_seed)
        while True:
            window = self.language.windows(self.batch_size, self.seq_len + 1, generator)
            yield window[:, :-1], window[:, 1:]

    def entropy_floor(self) -> float:
        """The mean loss of the Bayes predictor (the language's own probabilities, each token given
        every earlier token of its window) on the held-out windows."""
        return _bayes_loss(self)

    def eval_set(self) -> torch.Tensor:
        """The fixed held-out windows, int64 [n, seq_len + 1]."""
        return _eval_set(self)

    # ---- model, optimizer, loss ----

    def config(self):  # noqa: ANN201 (a transformers.GPT2Config; transformers is imported lazily)
        from transformers import GPT2Config

        # bos/eos inside the vocabulary (the default 50256 only makes transformers warn); no dropout:
        # the data never repeats, and dropout would draw from the global RNG.
        return GPT2Config(vocab_size=self.vocab_size, n_positions=self.seq_len, n_embd=self.n_embd,
                          n_layer=self.n_layer, n_head=self.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

    def make_model(self, seed: int) -> torch.nn.Module:
        from transformers import GPT2LMHeadModel

        with torch.random.fork_rng(devices=[]):  # transformers initializes from the global RNG
            torch.manual_seed(seed)
            return GPT2LMHeadModel(self.config()).to(_DTYPES[self.dtype])

    def make_inner_optimizer(self, model: torch.nn.Module) -> torch.optim.AdamW:
        return adamw(model, self, decays=lambda name, p: p.ndim >= 2)

    def make_lr_schedule(self, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
        """transformers' schedule (its warmup starts at 0, the shared one's at lr / warmup_steps)."""
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, self.warmup_steps, total_steps,
                                                           min_lr_rate=self.min_lr_ratio)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())

    def eval_loss(self, model: torch.nn.Module) -> float:
        return mean_token_loss(model, lambda inputs: model(input_ids=inputs).logits, self.eval_set())


@functools.lru_cache(maxsize=4)
def _language(vocab_size: int, order: int, branching: int, seed: int, concentration: float) -> MarkovLanguage:
    return MarkovLanguage(vocab_size, order, branching, seed, concentration)


def window_nll(language: MarkovLanguage, windows: torch.Tensor) -> torch.Tensor:
    """-log p(x_j | x_0..x_{j-1}) under the language, float64 [n, length - 1], for every window token j >= 1.

    From j = order on the context is complete and p comes from the transition tables; before it,
    p(x_j | x_0..x_{j-1}) = P(x_0..x_j) / P(x_0..x_{j-1}), prefix marginals of the stationary law
    over contexts (as `MarkovLanguage.window_floor_nats` averages them)."""
    vocab, order = language.vocab_size, language.order
    n, length = windows.shape
    out = torch.empty(n, length - 1, dtype=torch.float64)
    prefix = torch.zeros(n, dtype=torch.long)  # index of x_0..x_j among vocab**(j + 1) prefixes
    previous = torch.ones(n, dtype=torch.float64)  # P(x_0..x_{j-1})
    for j in range(length):
        if j < order:
            prefix = prefix * vocab + windows[:, j]
            marginal = language.stationary.reshape(vocab ** (j + 1), -1).sum(1)[prefix]
            if j > 0:
                out[:, j - 1] = -(marginal / previous).log()
            previous = marginal
            continue
        context = torch.zeros(n, dtype=torch.long)
        for i in range(j - order, j):
            context = context * vocab + windows[:, i]
        hit = language.successors[context] == windows[:, j].unsqueeze(1)
        out[:, j - 1] = -(language.probs[context] * hit).sum(1).log()
    return out


@functools.lru_cache(maxsize=4)
def _bayes_loss(task: GPT2Task) -> float:
    return float(window_nll(task.language, task.eval_set()).mean())


@functools.lru_cache(maxsize=4)
def _eval_set(task: GPT2Task) -> torch.Tensor:
    generator = task.eval_generator()
    return task.language.windows(math.ceil(task.eval_tokens / task.seq_len), task.seq_len + 1, generator)
