"""Token sources for the demo: synthetic languages with a known entropy rate, or bytes of a file.

All expose the same small interface, which is all `DemoTask` uses:

- `vocab_size: int`
- `windows(num_windows, length, generator, held_out=False) -> LongTensor[num_windows, length]`
- `entropy_rate_nats() -> float | None` (None when unknown)
- `window_floor_nats(length) -> float | None`: the lowest achievable mean cross-entropy of a model
  that predicts tokens 1..length-1 of a window from the tokens before them in the same window.

`MarkovLanguage` is an order-k chain over `vocab_size` tokens in which every context (the last k
tokens) has `branching` possible next tokens with Dirichlet-random probabilities. One of them is
always `(last token + 1) mod vocab_size`: following only those edges, every context reaches the
cycle of "run" contexts (c, c+1, ..., c+k-1), so the chain has exactly one closed class and a
unique stationary distribution pi, even if some contexts are transient. Every sampled window starts
from a context drawn from pi, so the sampled process is stationary and its per-token conditional
entropy is exactly `sum_c pi(c) H(next | c)` from the k-th token on (periodicity does not matter for
this; pi is found by power iteration on the lazy chain (I + P) / 2, which has the same pi and
always converges).

`LaggedCopyLanguage` hides all its structure at one distance: each token repeats the token `lag`
positions back with probability `copy_prob` and is otherwise uniform. Every token is marginally
uniform and tokens less than `lag` apart are independent, so no short-context statistic helps: a
model sits at ln(vocab_size) until it learns to look exactly `lag` back, then drops to the floor.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

import torch

_STATIONARY_TOL = 1e-13
_STATIONARY_MAX_ITERS = 200_000


_DENSE_SCORES_MAX = 1 << 26
"""Contexts x vocabulary up to which the successors are ranked from a dense score table (every
language the benchmarks' tasks use); above, they are drawn without one (a GPT-2 vocabulary)."""


def _sparse_successors(forced: torch.Tensor, vocab: int, branching: int) -> torch.Tensor:
    """successors[c] = the forced token, then branching - 1 distinct others drawn uniformly: what the
    dense ranking gives in distribution, without a contexts x vocabulary table."""
    others = torch.randint(0, vocab - 1, (len(forced), branching - 1))
    others += (others >= forced.unsqueeze(1)).long()  # never the forced token
    for _ in range(64):
        ordered = others.sort(dim=1).values
        clash = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1) if branching > 2 else torch.zeros(len(forced), dtype=torch.bool)
        if not clash.any():
            break
        redraw = torch.randint(0, vocab - 1, (int(clash.sum()), branching - 1))
        others[clash] = redraw + (redraw >= forced[clash].unsqueeze(1)).long()
    return torch.cat([forced.unsqueeze(1), others], dim=1)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last dim (0 log 0 = 0)."""
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


class MarkovLanguage:
    """A deterministic random order-k Markov chain over tokens (see the module docstring)."""

    def __init__(
        self, vocab_size: int, order: int, branching: int, seed: int, concentration: float = 1.0
    ) -> None:
        if vocab_size < 2 or order < 1 or not 1 <= branching <= vocab_size:
            raise ValueError(f"need vocab_size >= 2, order >= 1, 1 <= branching <= vocab_size; got "
                             f"{vocab_size=}, {order=}, {branching=}")
        if vocab_size**order > 1 << 20:
            raise ValueError(f"vocab_size**order = {vocab_size**order} contexts is too many for the tables")
        self.vocab_size = vocab_size
        self.order = order
        self.branching = branching
        self.seed = seed
        self.num_contexts = vocab_size**order
        self.successors, self.probs = self._random_tables(concentration)
        self.cdf = self.probs.cumsum(-1)
        self.cdf[:, -1] = 1.0  # no rounding gap above the last bucket
        self.stationary = self._stationary()
        self.stationary_cdf = self.stationary.cumsum(0)
        self.stationary_cdf[-1] = 1.0

    def _random_tables(self, concentration: float) -> tuple[torch.Tensor, torch.Tensor]:
        """successors[c] (int64, [C, b]) and their probabilities (float64, [C, b]) for every context c."""
        num_contexts, vocab, branching = self.num_contexts, self.vocab_size, self.branching
        forced = (torch.arange(num_contexts) % vocab + 1) % vocab  # keeps the chain unichain
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            if num_contexts * vocab <= _DENSE_SCORES_MAX:
                scores = torch.rand(num_contexts, vocab, dtype=torch.float64)
                scores[torch.arange(num_contexts), forced] = -1.0  # forced token first in the ranking
                successors = scores.argsort(dim=-1)[:, :branching]
            else:
                successors = _sparse_successors(forced, vocab, branching)
            alpha = torch.full((num_contexts, branching), float(concentration), dtype=torch.float64)
            probs = torch.distributions.Dirichlet(alpha).sample()
        return successors, probs

    def next_context(self, context: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return (context * self.vocab_size + token) % self.num_contexts

    def _stationary(self) -> torch.Tensor:
        """Stationary distribution over contexts, float64, by power iteration on the lazy chain."""
        contexts = torch.arange(self.num_contexts).unsqueeze(1).expand_as(self.successors)
        targets = self.next_context(contexts, self.successors).reshape(-1)
        pi = torch.full((self.num_contexts,), 1.0 / self.num_contexts, dtype=torch.float64)
        for _ in range(_STATIONARY_MAX_ITERS):
            step = torch.zeros_like(pi).index_add_(0, targets, (pi.unsqueeze(1) * self.probs).reshape(-1))
            new = 0.5 * (pi + step)
            new /= new.sum()
            if (new - pi).abs().sum().item() < _STATIONARY_TOL:
                pi = new
                break
            pi = new
        else:
            raise RuntimeError(f"stationary distribution did not converge in {_STATIONARY_MAX_ITERS} iterations")
        return pi

    def entropy_rate_nats(self) -> float:
        """Exact entropy rate of the stationary chain: sum over contexts of pi(c) * H(next | c)."""
        return float((self.stationary * _entropy(self.probs)).sum())

    def _prefix_entropy_nats(self, length: int) -> float:
        """H(X_0, ..., X_{length-1}) under the stationary law, for 0 <= length <= order."""
        if length == 0:
            return 0.0
        shape = (self.vocab_size**length, self.vocab_size ** (self.order - length))
        return float(_entropy(self.stationary.reshape(shape).sum(1)))

    def window_floor_nats(self, length: int) -> float:
        """Mean of H(X_j | X_0..X_{j-1}) over j = 1..length-1: the best achievable loss on a window.

        From j = order on this is the entropy rate; the first order-1 predictions lack part of their
        context and cost H(X_0..X_j) - H(X_0..X_{j-1}) each (zero extra for order 1).
        """
        if length < 2:
            raise ValueError(f"a window of {length} tokens has nothing to predict")
        rate = self.entropy_rate_nats()
        per_position = [
            self._prefix_entropy_nats(j + 1) - self._prefix_entropy_nats(j) if j < self.order else rate
            for j in range(1, length)
        ]
        return sum(per_position) / len(per_position)

    def windows(
        self, num_windows: int, length: int, generator: torch.Generator, held_out: bool = False
    ) -> torch.Tensor:
        """`num_windows` independent stationary stretches of the chain, int64 [num_windows, length].

        Vectorized over windows: one small batch of tensor ops per position. `held_out` is accepted
        for interface parity; fresh randomness (a different generator seed) is already held out.
        """
        del held_out
        start = self._sample_from(self.stationary_cdf, num_windows, generator)
        out = torch.empty(num_windows, max(length, self.order), dtype=torch.long)
        for i in range(self.order):  # the first `order` tokens are the digits of the start context
            out[:, i] = start // self.vocab_size ** (self.order - 1 - i) % self.vocab_size
        context = start
        for i in range(self.order, length):
            u = torch.rand(num_windows, 1, dtype=torch.float64, generator=generator)
            choice = (u >= self.cdf[context]).sum(-1).clamp_(max=self.branching - 1)
            token = self.successors[context, choice]
            out[:, i] = token
            context = self.next_context(context, token)
        return out[:, :length]

    @staticmethod
    def _sample_from(cdf: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        u = torch.rand(n, dtype=torch.float64, generator=generator)
        return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1)

    def sample(self, num_tokens: int, seed: int) -> torch.Tensor:
        """One stationary run of the chain, int64 [num_tokens]. Sequential by nature: ~0.5 us/token.

        Training does not use this (it uses `windows`, which is vectorized); it is here for analysis
        and tests that want one long, unbroken stream.
        """
        generator = torch.Generator().manual_seed(seed)
        context = int(self._sample_from(self.stationary_cdf, 1, generator))
        uniforms = torch.rand(max(num_tokens - self.order, 0), dtype=torch.float64, generator=generator).tolist()
        cdf, successors = self.cdf.tolist(), self.successors.tolist()
        last = self.branching - 1
        vocab, num_contexts = self.vocab_size, self.num_contexts
        tokens = [context // vocab ** (self.order - 1 - i) % vocab for i in range(self.order)]
        append = tokens.append
        for u in uniforms:
            token = successors[context][min(bisect.bisect_right(cdf[context], u), last)]
            append(token)
            context = (context * vocab + token) % num_contexts
        return torch.tensor(tokens[:num_tokens], dtype=torch.long)


class LaggedCopyLanguage:
    """x_t = x_{t-lag} with probability `copy_prob`, else uniform over `vocab_size` (see the module docstring).

    There are no tables: all randomness comes from the generator passed to `windows`. Every window
    starts afresh, so its first `lag` tokens are uniform and independent (they have no source).
    """

    def __init__(self, vocab_size: int, lag: int, copy_prob: float) -> None:
        if vocab_size < 2 or lag < 1 or not 0.0 <= copy_prob <= 1.0:
            raise ValueError(f"need vocab_size >= 2, lag >= 1, 0 <= copy_prob <= 1; got {vocab_size=}, {lag=}, "
                             f"{copy_prob=}")
        self.vocab_size = vocab_size
        self.lag = lag
        self.copy_prob = copy_prob

    def entropy_rate_nats(self) -> float:
        """H(x_t | x_{<t}) for t >= lag: the mixture copy_prob * [x_{t-lag}] + (1 - copy_prob) * uniform."""
        other = (1.0 - self.copy_prob) / self.vocab_size
        same = self.copy_prob + other
        return float(_entropy(torch.tensor([same] + [other] * (self.vocab_size - 1), dtype=torch.float64)))

    def window_floor_nats(self, length: int) -> float:
        """Mean of H(X_j | X_0..X_{j-1}) over j = 1..length-1: ln(vocab_size) for j < lag, the rate after."""
        if length < 2:
            raise ValueError(f"a window of {length} tokens has nothing to predict")
        blind = min(self.lag, length) - 1  # positions 1..lag-1 have no source in the window
        sourced = length - 1 - blind
        return (blind * math.log(self.vocab_size) + sourced * self.entropy_rate_nats()) / (length - 1)

    def windows(
        self, num_windows: int, length: int, generator: torch.Generator, held_out: bool = False
    ) -> torch.Tensor:
        """`num_windows` independent windows, int64 [num_windows, length]; one tensor op per `lag` positions.

        `held_out` is accepted for interface parity; fresh randomness (a different generator seed) is
        already held out.
        """
        del held_out
        out = torch.randint(0, self.vocab_size, (num_windows, length), generator=generator)
        copy = torch.rand(num_windows, length, generator=generator) < self.copy_prob
        for start in range(self.lag, length, self.lag):
            stop = min(start + self.lag, length)
            out[:, start:stop] = torch.where(copy[:, start:stop], out[:, start - self.lag:stop - self.lag],
                                             out[:, start:stop])
        return out


class ByteText:
    """Byte-level tokens (vocab 256) of any file; the last `held_out_fraction` is the held-out split."""

    vocab_size = 256

    def __init__(self, path: str | Path, held_out_fraction: float = 0.05) -> None:
        data = Path(path).read_bytes()
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.split = int(len(self.tokens) * (1.0 - held_out_fraction))
        if min(self.split, len(self.tokens) - self.split) < 2:
            raise ValueError(f"{path}: {len(data)} bytes is too little text for a train and a held-out split")

    def windows(
        self, num_windows: int, length: int, generator: torch.Generator, held_out: bool = False
    ) -> torch.Tensor:
        """Random windows from the train part (or the held-out tail), int64 [num_windows, length]."""
        lo, hi = (self.split, len(self.tokens)) if held_out else (0, self.split)
        if hi - lo < length:
            raise ValueError(f"windows of {length} tokens do not fit in a split of {hi - lo}")
        starts = torch.randint(lo, hi - length + 1, (num_windows,), generator=generator)
        return self.tokens[starts.unsqueeze(1) + torch.arange(length)]

    def entropy_rate_nats(self) -> None:
        return None

    def window_floor_nats(self, length: int) -> None:
        return None
