"""A learner's id: given, or the stable id its platform gives its slot; never made up."""

from __future__ import annotations

import pytest
import torch

from diloco.storage.errors import ConfigError
from diloco.workers.learner import Learner, stable_learner_id


def test_the_platforms_stable_index_names_the_slot():
    assert stable_learner_id({}) is None
    assert stable_learner_id({"DILOCO_LEARNER_ID": "mine", "JOB_COMPLETION_INDEX": "3"}) == "mine"
    assert stable_learner_id({"JOB_COMPLETION_INDEX": "3", "HOSTNAME": "learners-3-x7k2p"}) == "learner-3"
    task = "sky-managed-2026-11-27-05-14-45-123456_diloco-learner_17-0"
    assert stable_learner_id({"SKYPILOT_TASK_ID": task, "SKYPILOT_NODE_RANK": "1"}) == "learner-17-0-1"


def test_a_learner_without_an_id_is_refused_saying_how_to_give_one(monkeypatch):
    for name in ("DILOCO_LEARNER_ID", "JOB_COMPLETION_INDEX", "SKYPILOT_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="no learner id: pass learner_id= .* or set DILOCO_LEARNER_ID"):
        Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), run="r", tokens_per_step=1)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    assert Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), run="r", tokens_per_step=1).learner_id == \
        "learner-2"
