"""The demo task: the language's entropy is exact, everything is deterministic, training learns."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from diloco.workers.tasks.language import ByteText, MarkovLanguage
from diloco.workers.tasks.base import train_baseline
from diloco.workers.tasks.demo import DemoTask

SMALL = DemoTask(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=16, batch_size=8, eval_tokens=2048,
                 warmup_steps=0)


def _binary_entropy(p: float) -> float:
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def _dense_transition(lang: MarkovLanguage) -> torch.Tensor:
    """P[c, c'] over contexts, built from the tables alone (not from the class's own solver)."""
    P = torch.zeros(lang.num_contexts, lang.num_contexts, dtype=torch.float64)
    for c in range(lang.num_contexts):
        for token, p in zip(lang.successors[c].tolist(), lang.probs[c].tolist(), strict=True):
            P[c, (c * lang.vocab_size + token) % lang.num_contexts] += p
    return P


def test_entropy_rate_matches_closed_form_of_two_state_chain() -> None:
    lang = MarkovLanguage(vocab_size=2, order=1, branching=2, seed=3)
    P = _dense_transition(lang)
    a, b = P[0, 1].item(), P[1, 0].item()  # switch probabilities 0->1 and 1->0
    pi0, pi1 = b / (a + b), a / (a + b)
    expected = pi0 * _binary_entropy(a) + pi1 * _binary_entropy(b)
    assert lang.entropy_rate_nats() == pytest.approx(expected, abs=1e-12)
    assert lang.stationary.tolist() == pytest.approx([pi0, pi1], abs=1e-12)


def test_entropy_rate_and_window_floor_match_a_linear_solve_for_an_order_2_chain() -> None:
    lang = MarkovLanguage(vocab_size=3, order=2, branching=2, seed=5)
    P = _dense_transition(lang)
    n = lang.num_contexts
    # pi (P - I) = 0 with sum(pi) = 1, as one least-squares system (exact: it is consistent).
    system = torch.cat([(P - torch.eye(n, dtype=torch.float64)).T, torch.ones(1, n, dtype=torch.float64)])
    rhs = torch.cat([torch.zeros(n, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    pi = torch.linalg.lstsq(system, rhs.unsqueeze(1)).solution.squeeze(1)
    row_entropy = -(P * torch.where(P > 0, P.log(), torch.zeros_like(P))).sum(1)
    rate = float(pi @ row_entropy)
    assert lang.entropy_rate_nats() == pytest.approx(rate, abs=1e-10)
    # Window of 3 tokens: predict X_1 | X_0 (missing one token of context), then X_2 | X_0 X_1.
    pairs = pi.reshape(3, 3)
    first = pairs.sum(1)
    h_x1_given_x0 = float(-(pairs * pairs.log()).nansum() + (first * first.log()).nansum())
    assert lang.window_floor_nats(3) == pytest.approx((h_x1_given_x0 + rate) / 2, abs=1e-10)


@pytest.mark.parametrize("order", [1, 2])
def test_monte_carlo_log_loss_of_samples_matches_entropy_rate(order: int) -> None:
    lang = MarkovLanguage(vocab_size=8, order=order, branching=3, seed=11)
    tokens = lang.sample(200_000, seed=0)
    contexts = torch.zeros(len(tokens) - order, dtype=torch.long)
    for i in range(order):
        contexts = contexts * lang.vocab_size + tokens[i : len(tokens) - order + i]
    nxt = tokens[order:]
    hit = lang.successors[contexts] == nxt.unsqueeze(1)
    assert bool(hit.any(1).all()), "a sampled transition is not in the chain's tables"
    nll = -(lang.probs[contexts] * hit).sum(1).log()
    assert nll.mean().item() == pytest.approx(lang.entropy_rate_nats(), abs=0.01)
    # Windows are stationary stretches of the same chain: same per-token entropy.
    windows = lang.windows(2000, 65, torch.Generator().manual_seed(0))
    ctx = windows[:, order - 1] if order == 1 else windows[:, 0] * lang.vocab_size + windows[:, 1]
    nll_last = -(lang.probs[ctx] * (lang.successors[ctx] == windows[:, order].unsqueeze(1))).sum(1).log()
    assert nll_last.mean().item() == pytest.approx(lang.entropy_rate_nats(), abs=0.05)


def test_sampling_is_deterministic_per_seed() -> None:
    lang = MarkovLanguage(vocab_size=16, order=2, branching=3, seed=0)
    assert torch.equal(lang.sample(5000, seed=1), lang.sample(5000, seed=1))
    assert not torch.equal(lang.sample(5000, seed=1), lang.sample(5000, seed=2))
    again = MarkovLanguage(vocab_size=16, order=2, branching=3, seed=0)
    assert torch.equal(lang.probs, again.probs) and torch.equal(lang.successors, again.successors)
    first, second = SMALL.train_batches(7), SMALL.train_batches(7)
    for _ in range(3):
        (x1, y1), (x2, y2) = next(first), next(second)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(next(SMALL.train_batches(7))[0], next(SMALL.train_batches(8))[0])


def test_model_init_is_deterministic_and_names_blocks() -> None:
    a, b, c = SMALL.make_model(0).state_dict(), SMALL.make_model(0).state_dict(), SMALL.make_model(1).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
    assert {"blocks.1.mlp.fc.weight", "tok_emb.weight", "pos_emb.weight", "head.weight"} <= a.keys()


def test_untrained_model_scores_about_log_vocab_and_training_lowers_the_loss() -> None:
    torch.manual_seed(0)
    untrained = SMALL.eval_loss(SMALL.make_model(0))
    assert untrained == pytest.approx(math.log(SMALL.vocab_size), abs=0.05)
    curve = train_baseline(SMALL, total_steps=40, seed=0)
    assert curve[-1][0] == 40 and curve[-1][1] < untrained - 0.3
    assert curve[-1][1] > SMALL.entropy_floor()


def test_eval_loss_restores_training_mode_and_is_repeatable() -> None:
    model = SMALL.make_model(0)
    model.train()
    assert SMALL.eval_loss(model) == SMALL.eval_loss(model)
    assert model.training


def test_task_round_trips_through_its_wire_form() -> None:
    task = dataclasses.replace(SMALL, betas=(0.8, 0.99), lr=1e-3)
    assert DemoTask.from_wire(task.to_wire()) == task


def test_byte_text_windows_come_from_the_right_split(tmp_path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(b"a" * 9500 + b"b" * 500)  # held_out_fraction 0.05: the b's are held out
    text = ByteText(path)
    train = text.windows(200, 9, torch.Generator().manual_seed(0))
    held_out = text.windows(200, 9, torch.Generator().manual_seed(0), held_out=True)
    assert train.shape == held_out.shape == (200, 9)
    assert bool((train == ord("a")).all()) and bool((held_out == ord("b")).all())
    assert text.entropy_rate_nats() is None
    task = DemoTask(text_path=str(path), d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=8, eval_tokens=64)
    assert task.entropy_floor() is None and task.make_model(0).head.out_features == 256
