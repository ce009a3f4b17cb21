"""`diloco bench takes`: the in-process take rules do what the learner's do."""

from __future__ import annotations

import argparse

import torch

from diloco.infra.bench import takes
from diloco.infra.bench.quality_tasks import TASKS
from diloco.workers.tasks.base import train_step


def args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    takes.add_arguments(parser)
    parsed = parser.parse_args([])
    for name, value in overrides.items():
        setattr(parsed, name, value)
    return parsed


def trained(fleet: takes.Replicas, steps: int) -> None:
    for _ in range(steps):
        for i, model in enumerate(fleet.models):
            train_step(fleet.task, model, fleet.optimizers[i], fleet.schedules[i], next(fleet.batches[i]))


def snapshot(fleet: takes.Replicas, i: int, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: fleet.params[i][n].detach().clone() for n in names}


def test_a_round_is_the_mean_piece_and_each_rule_folds_the_version_in_as_the_learner_does() -> None:
    task = TASKS["fast"].task
    a = args(learners=2, fragments=2, steps=10, outer_lr=1.0, outer_momentum=0.0)
    for rule in ("rebase", "adopt", "mix"):
        fleet = takes.Replicas(task, a, takes.Setting(rule, 3))
        names = fleet.names[0]
        trained(fleet, 4)
        sent = [snapshot(fleet, i, names) for i in range(2)]
        fleet.send(0, step=4)
        # Outer lr 1, no momentum: the version is the mean of the replicas at the send.
        for n in names:
            torch.testing.assert_close(fleet.globals[n], (sent[0][n] + sent[1][n]) / 2)
        assert fleet.takes == {7: [0]}
        trained(fleet, 3)
        before = snapshot(fleet, 0, names)
        fleet.take(0)
        for n in names:
            g, p = fleet.globals[n], fleet.params[0][n]
            expected = {"rebase": g + (before[n] - sent[0][n]), "adopt": g, "mix": 0.5 * before[n] + 0.5 * g}[rule]
            torch.testing.assert_close(p, expected)
            torch.testing.assert_close(fleet.anchors[0][n], g)  # the next piece is the progress from the version


def test_a_codec_piece_is_decoded_and_what_it_dropped_is_carried_or_kept_in_the_model() -> None:
    from diloco.storage.updates import encode_carrying

    task = TASKS["fast"].task
    a = args(learners=2, fragments=2, steps=10, outer_lr=1.0, outer_momentum=0.0)
    for unsent in ("carry", "keep"):
        fleet = takes.Replicas(task, a, takes.Setting("rebase", 3, "sign8", "fp32", unsent))
        names = fleet.names[0]
        start = {n: fleet.globals[n].clone() for n in names}
        trained(fleet, 4)
        sent = [snapshot(fleet, i, names) for i in range(2)]
        pieces = [encode_carrying({n: start[n] - sent[i][n] for n in names}, {}, "sign8", compress=True)
                  for i in range(2)]
        fleet.send(0, step=4)
        for n in names:  # outer lr 1, no momentum: the version moves by the mean decoded piece
            torch.testing.assert_close(fleet.globals[n], start[n] - (pieces[0][1][n] + pieces[1][1][n]) / 2)
        dropped = pieces[0][2]
        assert all(float(dropped[n].abs().sum()) > 0 for n in names)  # sign8 keeps one in eight
        trained(fleet, 3)
        before = snapshot(fleet, 0, names)
        fleet.take(0)
        for n in names:
            kept = dropped[n] if unsent == "keep" else 0
            torch.testing.assert_close(fleet.params[0][n], fleet.globals[n] + (before[n] - sent[0][n]) - kept)
        # carry: the next piece carries it; keep: the model holds it, nothing is carried beside it.
        assert (0 in fleet.dropped[0]) == (unsent == "carry")
    assert fleet.bits_per_param("up") < 1.5 and fleet.bits_per_param("down") == 32.0


def test_versions_go_down_as_a_runs_coordinator_sends_them_unless_told() -> None:
    small = dict(task="fast", learners=2, fragments=2, steps=4, sync_every=2, lags="1", rules="rebase", codecs="sign8,int4")
    rows = takes.run(args(**small)).rows
    assert [(r.setting.codec, r.setting.downstream) for r in rows] == [("sign8", "int4"), ("int4", "int4")]
    assert all(r.down_bits < 32 for r in rows)
    rows = takes.run(args(**small, downstream="fp32")).rows
    assert [r.setting.downstream for r in rows] == ["fp32", "fp32"] and all(r.down_bits == 32 for r in rows)


def test_versions_as_the_merged_gradient_count_their_bits_and_apply_the_outer_step_to_what_went_down() -> None:
    task = TASKS["fast"].task
    a = args(learners=2, fragments=1, steps=4, outer_lr=1.0, outer_momentum=0.0)
    fleet = takes.Replicas(task, a, takes.Setting("rebase", 1, "fp32", "int4", versions="gradient"))
    names = fleet.names[0]
    before = {n: fleet.globals[n].clone() for n in names}
    trained(fleet, 2)
    pieces = [{n: fleet.anchors[i][n] - fleet.params[i][n] for n in names} for i in range(2)]
    fleet.send(0, 2)
    assert 3.0 < fleet.bits_per_param("down") < 5.0  # int4 and its scales, zstd on
    for n in names:
        mean = (pieces[0][n] + pieces[1][n]) / 2
        step = before[n] - fleet.globals[n]  # lr 1, no momentum: the step is what went down
        # int4's error is within half a step of the block's absmax; what it lost waits in the residual
        assert torch.allclose(step + fleet.down_residual[0][n], mean, atol=1e-6)
