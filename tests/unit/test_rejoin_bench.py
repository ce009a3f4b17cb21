"""`diloco bench rejoin`: a preempted replica leaves with its progress sent, is away, and rejoins at
the global model with its own state (warm) or afresh (cold); the figures are deterministic."""

from __future__ import annotations

import argparse

import pytest
import torch

from diloco.infra.bench import rejoin
from diloco.infra.bench.quality_tasks import TASKS
from diloco.infra.bench.takes import Replicas, Setting

TASK = TASKS["fast"].task


def args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    rejoin.add_arguments(parser)
    parsed = parser.parse_args([])
    values = {"learners": 3, "steps": 24, "sync_every": 6, "fragments": 2, "down": 6, "seed": 0, "rule": "rebase",
              "alpha": 0.0, **overrides}
    for name, value in values.items():
        setattr(parsed, name, value)
    return parsed


def test_a_replica_away_sends_its_last_pieces_then_nothing_and_takes_nothing() -> None:
    a = args(outer_lr=1.0, outer_momentum=0.0)
    fleet = Replicas(TASK, a, Setting("rebase", 2))
    with torch.no_grad():
        for i, params in enumerate(fleet.params):
            for p in params.values():
                p.add_(float(i + 1))  # replica i moved by -(i + 1) from the anchors everywhere
    fleet.away.add(1)
    fleet.leaving[1] = {0, 1}
    names = fleet.names[0]
    before = {n: fleet.globals[n].clone() for n in names}
    fleet.send(0, step=6)  # its last piece of fragment 0 is in: the mean of all three
    for n in names:
        torch.testing.assert_close(fleet.globals[n], before[n] + 2.0)
    assert fleet.leaving[1] == {1}
    with torch.no_grad():
        for params in fleet.params:
            for n in names:
                params[n].add_(1.0)
    before = {n: fleet.globals[n].clone() for n in names}
    fleet.send(0, step=12)  # then the others' alone
    for n in names:
        torch.testing.assert_close(fleet.globals[n], before[n] + 1.0)
    away = {n: fleet.params[1][n].clone() for n in names}
    fleet.take(0)
    for n in names:
        torch.testing.assert_close(fleet.params[1][n], away[n])  # it took nothing


@pytest.mark.slow  # 7 s of trained arms; `make test` keeps the bench's other tests
def test_the_arms_are_deterministic_and_differ_by_the_rejoin_alone() -> None:
    a = args(learners=2, steps=12, sync_every=4, down=3)
    none, warm, cold = (rejoin.run_arm(TASK, a, arm) for arm in rejoin.ARMS)
    assert rejoin.run_arm(TASK, a, "warm") == warm  # the same seeds, the same figure
    assert len({none, warm, cold}) == 3
    assert rejoin.recovered(0.001, 0.004) == 0.75 and rejoin.recovered(0.001, 0.0) is None
