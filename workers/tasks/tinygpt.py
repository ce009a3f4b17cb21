"""A tiny GPT for the demo: token + position embeddings, pre-LN blocks, final LN, untied head.

Parameter names are part of the contract: the fragment planner groups tensors by their
`blocks.<i>.` prefix (`blocks.3.attn.qkv.weight`); everything else (`tok_emb`, `pos_emb`, `ln_f`,
`head`) is a non-block parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TinyGPTConfig:
    vocab_size: int
    """Number of distinct tokens."""
    context: int
    """Longest input the model accepts (size of the position table)."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention heads per block; must divide d_model."""
    d_ff: int
    """Hidden width of each block's MLP."""
    dropout: float = 0.0
    """Dropout on attention and residual branches (0 for the demo: it is data-rich)."""

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.context, self.d_model, self.n_layers, self.n_heads, self.d_ff) < 1:
            raise ValueError(f"every size must be >= 1: {self}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class Attention(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).view(batch, time, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class MLP(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, cfg: TinyGPTConfig, seed: int = 0) -> None:
        """Builds the model with a deterministic initialization: same config and seed, same weights.

        The global torch RNG is neither read nor advanced.
        """
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.to_empty(device="cpu")
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers), zero biases."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():  # fixed order: the module definition order
            if name.endswith("bias"):
                param.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                param.normal_(0.0, std, generator=generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab] for token ids idx [batch, time], time <= context."""
        time = idx.shape[1]
        if time > self.cfg.context:
            raise ValueError(f"sequence of {time} tokens is longer than the model's context {self.cfg.context}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(time, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
