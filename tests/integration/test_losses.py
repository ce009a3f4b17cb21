"""The learners' reported losses are part of the run's history, and `diloco status` says why a learner left.

A real coordinator (stepped in this process) and real learners on a model that no built-in task knows,
against the session's Redis and S3. What `Learner.report(loss=...)` gave must come back from S3 (and from
an export of the run) per learner, be drawn by `diloco plot` without `--task`, and be written as
TensorBoard event files that TensorBoard's own reader reads back. `diloco status --watch` started before
the run exists waits for it; a learner preempted on SIGTERM shows `preempted`, one that closed `left`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diloco.infra.cli import main
from diloco.storage.settings import ENV_REDIS_URL
from diloco.workers.learner import Learner, LearnerConfig
from diloco.workers.losses import read_losses
from harness import Tiny, make_coordinator, start_beside

FAST = LearnerConfig(heartbeat_s=0.05, lease_s=5.0)


@pytest.fixture
def env(endpoints, monkeypatch):  # noqa: ANN001
    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    return endpoints


def joined(endpoints, run_id, coord, name) -> tuple[Learner, torch.optim.Optimizer]:  # noqa: ANN001
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id=name, tokens_per_step=64, config=FAST)
    start_beside(coord, learner)
    return learner, opt


def loss_at(step: int) -> float:
    return 4.0 / (1 + 0.1 * step)


def train(coord, learner: Learner, opt: torch.optim.Optimizer, steps: int) -> None:  # noqa: ANN001
    for _ in range(steps):
        for p in learner.model.parameters():
            p.grad = 0.01 * torch.randn_like(p)
        learner.report(loss=torch.tensor(loss_at(learner.step + 1)))
        opt.step()
        coord.step(block_ms=5)
        time.sleep(0.01)


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_reported_losses_are_stored_plotted_and_written_for_tensorboard(env, run_id, tmp_path, capsys, monkeypatch):
    coord = make_coordinator(env, run_id)
    l0, opt0 = joined(env, run_id, coord, "l0")
    l1, opt1 = joined(env, run_id, coord, "l1")
    try:
        train(coord, l0, opt0, 40)
        train(coord, l1, opt1, 25)
        l0.finish()
        l1.finish()
    finally:
        l0.close()
        l1.close()
        coord.close()

    series, problems = read_losses(coord.store, coord.keys)
    assert problems == [] and [s.learner for s in series] == ["l0", "l1"]
    for s, steps in zip(series, (40, 25), strict=True):
        assert s.steps[-1] == steps and len(s.steps) >= 5 and s.steps == sorted(set(s.steps))
        assert s.tokens == [64 * n for n in s.steps]
        # The last loss reported: a sample taken between report() and optimizer.step() has the next step's.
        assert all(v in (pytest.approx(loss_at(n)), pytest.approx(loss_at(n + 1)))
                   for n, v in zip(s.steps, s.losses, strict=True))
    assert {k.split("/")[-2] for k in coord.store.list(coord.keys.losses_prefix())} == {"l0", "l1"}

    # From S3 alone, and from an export of the run: the PNGs (loss vs time, vs steps and tokens) and
    # TensorBoard's event files.
    monkeypatch.delenv(ENV_REDIS_URL)
    assert main(["export", "--run", run_id, "--dir", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    for source in (["--run", run_id], ["--dir", str(tmp_path / "export")]):
        out, board = tmp_path / f"plots{len(source[1])}", tmp_path / f"board{len(source[1])}"
        assert main(["plot", *source, "--out", str(out), "--tensorboard", str(board)]) == 0
        written = capsys.readouterr().out.split()
        assert {Path(p).name for p in written} >= {"loss.png", "loss_by_step.png"}
        assert (out / "loss_by_step.png").read_bytes().startswith(b"\x89PNG")
        for s in series:
            [folder] = (board / s.learner).iterdir()
            assert folder.name == s.incarnation and str(folder) in written
            events = EventAccumulator(str(folder))
            events.Reload()
            assert set(events.Tags()["scalars"]) == {"loss", "loss_by_tokens"}
            by_step = events.Scalars("loss")
            assert [e.step for e in by_step] == s.steps
            assert [e.value for e in by_step] == pytest.approx(s.losses)
            assert [e.wall_time for e in by_step] == pytest.approx(s.times)
            assert [e.step for e in events.Scalars("loss_by_tokens")] == s.tokens


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_status_waits_for_the_run_and_says_why_a_learner_left(env, run_id, tmp_path, capsys, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="diloco")
    made: list = []

    def sleep(_s: float) -> None:  # the first wait: the run is created; the next: Ctrl-C
        if made:
            raise KeyboardInterrupt
        made.append(make_coordinator(env, run_id))

    with monkeypatch.context() as patched:
        patched.setattr("diloco.infra.watch.cli.time.sleep", sleep)
        assert main(["status", "--run", run_id, "--watch", "--interval", "0.1"]) == 0
    assert f"waiting for run {run_id!r} to appear" in caplog.text
    assert f"run {run_id} " in capsys.readouterr().out

    coord = made[0]
    preempted, opt0 = joined(env, run_id, coord, "spot")
    failed, opt1 = joined(env, run_id, coord, "crashed")
    try:
        train(coord, preempted, opt0, 5)
        train(coord, failed, opt1, 5)
        preempted.finish(preempted=True)  # what SIGTERM with handle_sigterm=True does at a step's end
        failed.close()  # what an exception out of `with learner:` does
        path = tmp_path / "status.json"
        assert main(["status", "--run", run_id, "--json", str(path)]) == 0
        rows = {r["learner"]: r for r in json.loads(path.read_text())["learners"]}
        assert {n: r["state"] for n, r in rows.items()} == {"spot": "preempted", "crashed": "left"}
        assert all(0 <= r["left_age_s"] < 60 and r["step"] == 5 for r in rows.values())
        out = capsys.readouterr().out
        assert "learners: 0 live, 1 preempted, 1 left (joined, not finished), 0 finished" in out

        back, _ = joined(env, run_id, coord, "spot")  # joining again clears the record
        assert main(["status", "--run", run_id, "--json", str(path)]) == 0
        rows = {r["learner"]: r for r in json.loads(path.read_text())["learners"]}
        assert rows["spot"]["state"] == "live" and rows["spot"]["left_age_s"] is None
        back.close()
    finally:
        preempted.close()
        failed.close()
        coord.close()
