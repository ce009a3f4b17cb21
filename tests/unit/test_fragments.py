"""Fragment planning (strided over blocks, balanced by size) and the staggered schedule."""

import pytest
import torch

from diloco.workers.fragments import due_fragments, layout_mismatch, model_params, plan_layout, unit_of


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Linear(d, 2 * d)


class Net(torch.nn.Module):
    def __init__(self, n_blocks=8, d=16, vocab=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = torch.nn.Linear(d, vocab)


def test_units_group_blocks():
    assert unit_of("blocks.3.attn.weight") == "blocks.3"
    assert unit_of("model.layers.11.mlp.up_proj.weight") == "model.layers.11"
    assert unit_of("embed.weight") == "embed.weight"


def test_equal_blocks_are_strided_and_every_param_is_placed_once():
    net = Net(n_blocks=8, vocab=8)  # small embeddings: blocks dominate
    layout = plan_layout(model_params(net), 4)
    owner = {p.name: f for f, frag in enumerate(layout.fragments) for p in frag}
    assert sorted(owner) == sorted(n for n, _ in net.named_parameters())
    block_owner = [owner[f"blocks.{i}.attn.weight"] for i in range(8)]
    # all four params of a block together, and block i with block i+4
    assert all(owner[f"blocks.{i}.mlp.bias"] == block_owner[i] for i in range(8))
    assert block_owner[:4] == block_owner[4:]
    assert sorted(block_owner[:4]) == [0, 1, 2, 3]


def test_fragments_are_balanced_by_size():
    net = Net(n_blocks=12, d=32, vocab=512)
    layout = plan_layout(model_params(net), 4)
    sizes = [sum(p.numel for p in frag) for frag in layout.fragments]
    biggest_unit = 512 * 32 + 512
    assert max(sizes) - min(sizes) <= biggest_unit


def test_too_many_fragments_is_a_clear_error():
    with pytest.raises(ValueError, match="--fragments"):
        plan_layout(model_params(torch.nn.Linear(2, 2)), 3)


def test_mismatch_names_the_first_difference():
    a = plan_layout(model_params(Net(d=16)), 2)
    b = plan_layout(model_params(Net(d=8)), 2)
    assert layout_mismatch(a, a) is None
    assert "shape" in layout_mismatch(a, b)


def test_schedule_is_staggered_and_every_fragment_syncs_every_h_steps():
    P, H = 4, 20
    sends = {f: [s for s in range(1, 201) if f in due_fragments(s, P, H)] for f in range(P)}
    for f, steps in sends.items():
        assert steps[0] == H + f * H // P
        assert all(b - a == H for a, b in zip(steps, steps[1:]))
    # no two fragments on the same step when H is divisible by P: peak bandwidth is 1/P
    assert all(len(due_fragments(s, P, H)) <= 1 for s in range(1, 201))
    assert due_fragments(0, P, H) == []


def test_clock_cadence_sends_each_fragment_once_per_deadline_at_the_last_step_before_it():
    from diloco.storage.protocol import Cadence
    from diloco.workers.fragments import clock_due
    cadence = Cadence(origin=1000.0, period_s=4.0)  # fragment 0 due at 1004, 1008...; fragment 1 at 1002, 1006...
    assert cadence.next_deadline(1, 2, after=1000.0) == pytest.approx(1002.0)
    assert cadence.next_deadline(0, 2, after=1004.0) == pytest.approx(1008.0)
    sent: dict[int, float] = {}
    sends = []
    t = 1000.0
    while t < 1012.0:  # a learner stepping every 0.25 s (exact in binary)
        for f, deadline in clock_due(t, 0.25, cadence, 2, sent):
            sent[f] = deadline
            sends.append((f, deadline, t))
        t += 0.25
    assert [(f, d) for f, d, _ in sends] == [(1, 1002.0), (0, 1004.0), (1, 1006.0), (0, 1008.0), (1, 1010.0), (0, 1012.0)]
    assert all(d - 0.25 <= at < d for _, d, at in sends)  # the last step boundary before each deadline


def test_clock_cadence_sends_ahead_by_the_lead_and_still_once_per_deadline():
    from diloco.storage.protocol import Cadence
    from diloco.workers.fragments import clock_due
    cadence = Cadence(origin=1000.0, period_s=4.0)  # fragment 0 of 1 due at 1004, 1008...
    sent: dict[int, float] = {}
    sends = []
    t, previous = 1000.0, None
    while t < 1016.0:
        lead = 1.0 if t < 1008.0 else 0.5  # the link got faster: a shorter lead from then on
        for f, deadline in clock_due(t, 0.25, cadence, 1, sent, previous, lead):
            sent[f] = deadline
            sends.append((deadline, t))
        t, previous = t + 0.25, t
    assert [d for d, _ in sends] == [1004.0, 1008.0, 1012.0, 1016.0]  # every deadline served, once
    assert [at for _, at in sends] == [1002.75, 1006.75, 1011.25, 1015.25]  # lead + one step before each


def test_send_lead_is_the_pieces_lag_up_to_half_a_round():
    from diloco.workers.fragments import send_lead
    assert send_lead(0.0, 5.0) == 0.0  # nothing measured yet: send at the deadline
    assert send_lead(1.3, 5.0) == 1.3
    assert send_lead(4.0, 5.0) == 2.5  # a piece keeps at least half its round's steps
    assert send_lead(1.0, 0.0) == 0.0  # no clock
    assert send_lead(float("nan"), 5.0) == 0.0


def test_clock_cadence_sends_late_for_a_deadline_that_a_slow_step_crossed():
    from diloco.storage.protocol import Cadence
    from diloco.workers.fragments import clock_due
    cadence = Cadence(origin=1000.0, period_s=4.0)  # fragment 0 of 1 due at 1004, 1008...
    sent: dict[int, float] = {}
    assert clock_due(1003.5, 0.25, cadence, 1, sent, previous=1003.25) == []  # 1003.75 < 1004: not yet
    # The next step took 0.75 s instead of 0.25: it ended past 1004, which was never served.
    assert clock_due(1004.25, 0.25, cadence, 1, sent, previous=1003.5) == [(0, 1004.0)]
    sent[0] = 1004.0
    assert clock_due(1004.5, 0.25, cadence, 1, sent, previous=1004.25) == []  # served once
    # Served on time at the last boundary before it, then crossed: not sent twice.
    sent[0] = 1008.0
    assert clock_due(1008.2, 0.25, cadence, 1, sent, previous=1007.8) == []
    # A stall across several deadlines serves the latest one; the first step of a learner serves none.
    assert clock_due(1021.0, 0.25, cadence, 1, sent, previous=1009.0) == [(0, 1020.0)]
    assert clock_due(1021.0, 0.25, cadence, 1, {}, previous=None) == []
