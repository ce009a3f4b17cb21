"""A learner's own state across preemption (`workers/state.py`): saved under its id when it leaves
on SIGTERM and every `state_every` sends, restored when the same id rejoins, refused with a reason
(and a fresh start) when it does not fit, bounded per learner and collected by gc.

Real Redis and S3; the coordinator steps in this process.
"""

from __future__ import annotations

import logging

import pytest
import torch

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.history.archive import export_run
from diloco.infra.history.gc import collect
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.workers.learner import Learner, LearnerConfig
from diloco.workers.state import KEEP, LearnerState, latest_key
from harness import TINY_RUN, Tiny, make_coordinator, start_beside, train


class Position:
    """A user's own state: where its data stream is."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


def make(endpoints, run_id, name="a", model=None, **config):  # noqa: ANN001, ANN201
    torch.manual_seed(0)
    model = model or Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))
    position = Position()
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id=name, tokens_per_step=10,
                      config=LearnerConfig(**config), state={"schedule": schedule, "data": position})
    return learner, opt, schedule, position


def steps(learner, opt, schedule, position, n) -> None:  # noqa: ANN001
    for _ in range(n):
        train(learner, opt, 1)
        schedule.step()
        position.batches += 1


def states(endpoints, run_id, name="a") -> list[str]:  # noqa: ANN001
    keys = RunKeys(endpoints.prefix, run_id)
    return list(ObjectStore(endpoints).list(keys.learner_states_prefix(name)))


def test_a_preempted_learner_resumes_its_optimizer_schedule_step_and_data_where_it_left(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id)
    learner, opt, schedule, position = make(endpoints, run_id, state_every=1)
    start_beside(coord, learner)
    assert learner.restored_from is None  # nothing saved yet: a fresh start
    steps(learner, opt, schedule, position, 13)
    saved_moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    learner.finish(preempted=True)  # SIGTERM: progress sent, state saved, not finished
    assert len(states(endpoints, run_id)) <= KEEP  # a save every send of fragment 0, the older ones deleted

    again, opt2, schedule2, position2 = make(endpoints, run_id)  # the replacement: the same id, a new process
    start_beside(coord, again)
    assert again.restored_from == latest_key(ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id), "a")
    assert (again.step, again.tokens) == (13, 130)
    assert schedule2.last_epoch == 13 and position2.batches == 13
    moments = opt2.state_dict()["state"]
    assert all(torch.equal(moments[k]["exp_avg"], v) for k, v in saved_moments.items())
    assert all(float(moments[k]["step"]) == 13 for k in moments)  # AdamW's bias correction goes on
    steps(again, opt2, schedule2, position2, 3)  # and it trains on
    assert again.step == 16
    again.finish()
    coord.close()


def test_saved_states_keep_to_their_share_of_the_link_and_the_state_on_sigterm_is_always_saved(endpoints, run_id,
                                                                                                caplog, monkeypatch):
    from diloco.workers import state as state_module

    monkeypatch.setattr(state_module, "STATE_FREE_S", 0.0)  # no upload is too quick to ration here
    coord = make_coordinator(endpoints, run_id)
    # A share no upload can keep to: every save due is skipped, and said once.
    thin, opt, schedule, position = make(endpoints, run_id, name="thin", state_every=1, state_link_share=1e-9)
    start_beside(coord, thin)
    with caplog.at_level(logging.INFO, logger="diloco.workers.keeper"):
        steps(thin, opt, schedule, position, 13)
    assert states(endpoints, run_id, "thin") == [] and thin.keeper.skipped >= 2
    assert sum("state not saved" in r.getMessage() for r in caplog.records) == 1
    thin.finish(preempted=True)  # SIGTERM: saved whatever the link
    assert len(states(endpoints, run_id, "thin")) == 1
    # No limit: a save at every send of fragment 0.
    free, opt, schedule, position = make(endpoints, run_id, name="free", state_every=1, state_link_share=1.0)
    start_beside(coord, free)
    steps(free, opt, schedule, position, 13)
    assert free.keeper.skipped == 0 and free.keeper.saver.saved >= 2
    free.finish()
    coord.close()


def test_a_state_the_run_no_longer_accepts_or_cannot_read_is_not_restored_and_says_why(endpoints, run_id, caplog):
    coord = make_coordinator(endpoints, run_id)
    learner, opt, schedule, position = make(endpoints, run_id)
    start_beside(coord, learner)
    steps(learner, opt, schedule, position, 5)
    learner.finish(preempted=True)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)

    saved = LearnerState.from_bytes(store.get(latest_key(store, keys, "a"), max_bytes=1 << 24))
    assert saved.step == 5 and saved.user["data"] == {"batches": 5}

    # Garbage planted as the newest state: refused with a reason, the learner starts afresh.
    store.put(keys.learner_state("a", 10**6), b"not a state", create_only=True)
    with caplog.at_level(logging.WARNING, logger="diloco.workers.learner"):
        again, opt2, schedule2, position2 = make(endpoints, run_id)
        start_beside(coord, again)
    assert again.restored_from is None and again.step == 0 and position2.batches == 0
    assert "starts afresh" in caplog.text and "not a readable learner state" in caplog.text
    steps(again, opt2, schedule2, position2, 2)  # the run goes on
    again.finish(preempted=True)  # and saves a good state after the bad one
    assert LearnerState.from_bytes(store.get(latest_key(store, keys, "a"), max_bytes=1 << 24)).step == 2
    coord.close()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_state_too_old_is_not_restored_however_many_versions_the_run_moved_on_it_is(endpoints, run_id, caplog):
    coord = Coordinator(endpoints, run_id, settings=TINY_RUN,
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0, max_staleness=1)))
    learner, opt, schedule, position = make(endpoints, run_id)
    other, opt_b, schedule_b, position_b = make(endpoints, run_id, name="b")
    start_beside(coord, learner)
    start_beside(coord, other)
    steps(learner, opt, schedule, position, 4)
    learner.finish(preempted=True)
    for _ in range(4):  # b moves every fragment's head well past a's base (max_staleness 1)
        steps(other, opt_b, schedule_b, position_b, 6)
        for _ in range(20):
            coord.step(block_ms=20)
    again, *_ = make(endpoints, run_id)
    start_beside(coord, again)
    assert again.restored_from is not None and again.step == 4  # the versions moved on: the moments still help
    again.close()
    with caplog.at_level(logging.WARNING, logger="diloco.workers.learner"):
        late, *_ = make(endpoints, run_id, state_max_age_s=0.001)  # away longer than state_max_age_s
        start_beside(coord, late)
    assert late.restored_from is None and late.step == 0
    assert "more than state_max_age_s" in caplog.text
    for x in (late, other):
        x.close()
    coord.close()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_without_save_state_nothing_is_saved_export_skips_states_and_gc_keeps_only_the_newest(endpoints, run_id,
                                                                                               tmp_path):
    coord = make_coordinator(endpoints, run_id)
    off, opt, schedule, position = make(endpoints, run_id, name="off", save_state=False, state_every=1)
    on, opt_b, schedule_b, position_b = make(endpoints, run_id, name="on", state_every=1)
    start_beside(coord, off)
    start_beside(coord, on)
    steps(off, opt, schedule, position, 9)
    steps(on, opt_b, schedule_b, position_b, 9)
    off.finish(preempted=True)
    on.finish(preempted=True)
    assert states(endpoints, run_id, "off") == []
    assert 1 <= len(states(endpoints, run_id, "on")) <= KEEP
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    export_run(store, keys, tmp_path / "export")  # the run's history, not a restart's state
    exported = [p for p in (tmp_path / "export").rglob("*") if p.is_file()]
    assert exported and not [p for p in exported if "/learners/" in p.as_posix()]
    collect(store, keys, keep_last=1, min_age_s=0.0)
    assert len(states(endpoints, run_id, "on")) == 1  # the newest: what a restart resumes from
    coord.close()
