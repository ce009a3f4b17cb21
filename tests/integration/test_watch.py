"""`diloco status` and `diloco plot` on a real run: the figures they show are what the run did.

A real coordinator (driven one step at a time, in this process) and two real learners on the demo
task's model (random gradients: the history is what matters here, not the learning), against the
session's Redis and S3. One learner finishes, the other stays live; a forged contribution is refused.
`diloco status --json` must then show the coordinator's heads, epoch and lease holder, the live and the
finished learner with their heartbeat figures, the refusal, and nothing pending; `diloco plot` must
write five PNGs from S3 alone (the learners reported losses); a run that does not exist is exit 1 with a message.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

import pytest
import torch

from diloco.coordinator.config import RunSettings
from diloco.infra.cli import main
from diloco.infra.local.fleet import wait_until
from diloco.infra.watch.plot import incarnations, read_history, staleness_points
from diloco.storage.history import list_versions, sha256_hex
from diloco.storage.protocol import Announcement
from diloco.storage.settings import ENV_REDIS_URL
from diloco.workers.learner import Learner
from harness import TASK, make_coordinator, start_beside

FORGER = "mallory"
SETTINGS = RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, codec="int8", compress=True, cadence="steps")


def drive(coord, until, steps: int = 80) -> None:  # noqa: ANN001
    for _ in range(steps):
        if until():
            return
        coord.step(block_ms=50)
    assert until(), "the coordinator did not get there"


def joined(endpoints, run_id, coord, name) -> tuple[Learner, torch.optim.Optimizer]:  # noqa: ANN001
    """A learner around the demo task's model (so that `plot --task` can evaluate the run), joined
    with the coordinator stepped meanwhile."""
    model = TASK.make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id=name,
                      tokens_per_step=TASK.tokens_per_step())
    start_beside(coord, learner)
    return learner, opt


def train(learner: Learner, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        for p in learner.model.parameters():
            p.grad = 0.01 * torch.randn_like(p)
        learner.report(loss=3.0 - 0.01 * (learner.step + i))
        opt.step()
    assert learner.uploader.flush(30)


def forge(coord) -> str:  # noqa: ANN001
    """Announce an object that is not a tensor object, under the forger's own key: refused (bad_framing)."""
    blob = b"not a tensor object" * 4
    key = coord.keys.delta(0, FORGER, 1)
    coord.store.put(key, blob)
    cid = uuid.uuid4().hex
    coord.bus.announce(Announcement(kind="delta", run=coord.spec.run, fragment=0, learner=FORGER, seq=1,
                                    contribution_id=cid, base_version=coord.bus.heads()[0], tokens=40, steps=4,
                                    step_time_s=0.01, object_key=key, size_bytes=len(blob), sha256=sha256_hex(blob),
                                    sent_at=0.0))
    return cid


def settled(coord) -> bool:  # noqa: ANN001
    """Every announcement read and dealt with."""
    bus = coord.bus
    groups = bus.r.xinfo_groups(bus.keys.announcements)
    last = groups[0]["last-delivered-id"].decode()
    newest = bus.r.xrevrange(bus.keys.announcements, count=1)
    return bus.pending_count() == 0 and (not newest or newest[0][0].decode() == last)


@pytest.fixture
def env(endpoints, monkeypatch):  # noqa: ANN001
    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    return endpoints


def status_json(tmp_path: Path, run_id: str) -> dict:
    path = tmp_path / f"status-{uuid.uuid4().hex[:6]}.json"
    assert main(["status", "--run", run_id, "--json", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_status_shows_what_the_run_did_and_plot_draws_it(env, run_id, tmp_path, capsys, caplog, monkeypatch):
    endpoints = env
    caplog.set_level(logging.INFO, logger="diloco")
    coord = make_coordinator(endpoints, run_id, settings=SETTINGS)
    bus = coord.bus
    l0, opt0 = joined(endpoints, run_id, coord, "l0")
    l1, opt1 = joined(endpoints, run_id, coord, "l1")
    try:
        for _ in range(2):
            train(l0, opt0, 4)
            train(l1, opt1, 4)
            drive(coord, lambda: settled(coord))
        forged = forge(coord)
        drive(coord, lambda: bus.counters().get("contributions_refused", 0) == 1 and settled(coord))
        train(l0, opt0, 6)
        l1.finish()  # final pieces, then recorded as finished
        drive(coord, lambda: settled(coord))
        for _ in range(3):
            coord.step(block_ms=50)
        reported = l0.progress()
        assert wait_until(lambda: (bus.learner_stats()["l0"].step, bus.learner_stats()["l0"].uploaded) == (
            reported.step, reported.uploaded), 10), "l0's heartbeat did not come"

        stats = bus.learner_stats()["l0"]  # l0 trains no more: only its bytes down may still grow (fetches)
        data = status_json(tmp_path, run_id)
        heads = bus.heads()
        assert {f["fragment"]: f["head"] for f in data["fragments"]} == heads and min(heads.values()) >= 1
        assert all(f["head_age_s"] is not None and 0 <= f["head_age_s"] < 60 for f in data["fragments"])
        assert data["heads_from"] == "redis" and data["exists_in_s3"] and data["finished"] is None
        assert data["spec"]["num_fragments"] == 2 and data["clock"]["cadence"] == "steps"
        c = data["coordinator"]
        assert c["epoch"] == coord.epoch and c["holder"] == coord.leadership.holder
        assert 0 < c["lease_expires_in_s"] <= coord.config.lease_s and c["holder_since_age_s"] is not None
        assert [x["name"] for x in c["consumers"]] == [coord.config.consumer]

        [live] = data["learners"]
        assert live["learner"] == "l0" and live["state"] == "live" and 0 < live["lease_left_s"] <= 10
        assert (live["step"], live["tokens"], live["uploaded"], live["bytes_up"]) == (
            l0.step, l0.step * TASK.tokens_per_step(), stats.uploaded, stats.bytes_uploaded)
        assert live["step"] == 14 and live["bytes_up"] > 0 and live["bytes_down"] >= stats.bytes_downloaded > 0
        assert live["loss"] == pytest.approx(l0.last_loss)
        # Staleness: each fragment's head now minus the base version of l0's newest delta announcement.
        bases = {}
        for _, a in reversed(bus.announcement_entries()):
            if isinstance(a, Announcement) and a.learner == "l0" and a.kind == "delta":
                bases.setdefault(a.fragment, a.base_version)
        assert live["staleness_by_fragment"] == {str(f): heads[f] - b for f, b in sorted(bases.items())}
        assert live["staleness"] == max(heads[f] - b for f, b in bases.items())

        [done] = data["finished_learners"]
        assert done["learner"] == "l1" and done["steps"] == l1.step == 8 and done["final_pieces"] >= 1

        [refusal] = data["refusals"]
        assert (refusal["learner"], refusal["code"], refusal["contribution_id"]) == (FORGER, "bad_framing", forged)
        assert data["refused_total"] == 1 and data["refused_by_code"] == {"bad_framing": 1}
        p = data["pending"]
        assert p["group"] and p["pending"] == 0 and p["undelivered"] == 0 and p["lag_s"] is None
        assert p["stream_length"] == len(bus.announcement_entries())
        assert data["counters"] == bus.counters()

        # The plain view (stdout is not a terminal here) says the same.
        out = capsys.readouterr().out
        assert f"run {run_id} " in out and "RUNNING" in out
        assert "learners: 1 live, 1 finished" in out and "bad_framing" in out
        assert f"coordinator: epoch {coord.epoch}, lease held by {coord.leadership.holder}" in out

        # --watch without a terminal prints a plain view per read, until Ctrl-C (exit 0).
        def interrupt(_s: float) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr("diloco.infra.watch.cli.time.sleep", interrupt)
        assert main(["status", "--run", run_id, "--watch", "--interval", "0.5"]) == 0
        assert capsys.readouterr().out.count(f"run {run_id} ") == 1
    finally:
        l0.close()
        l1.close()
        coord.close()

    # Plot reads S3 only: no Redis needed.
    monkeypatch.delenv(ENV_REDIS_URL)
    task_path = tmp_path / "task.json"
    task_path.write_text(json.dumps(TASK.to_wire()))
    started = time.monotonic()
    assert main(["plot", "--run", run_id, "--out", str(tmp_path / "plots"), "--task", str(task_path),
                 "--evals", "5"]) == 0
    written = capsys.readouterr().out.split()
    names = ["loss.png", "versions.png", "staleness.png", "bytes_per_token.png", "loss_by_step.png"]
    assert [Path(p).name for p in written] == names
    for p in written:
        blob = Path(p).read_bytes()
        assert blob.startswith(b"\x89PNG\r\n\x1a\n") and len(blob) > 10_000, p
    assert "eval 5/5" in caplog.text and time.monotonic() - started < 30

    history = read_history(coord.store, coord.keys)
    assert len(history.commits) == sum(len(list_versions(coord.store, coord.keys, f)) for f in (0, 1))
    assert {i.learner for i in incarnations(history)} == {"l0", "l1"}
    assert all(s >= 0 for _, _, s in staleness_points(history))
    assert [(r.code, r.learner) for c in history.commits for r in c.refused] == [("bad_framing", FORGER)]


def test_a_run_that_does_not_exist_is_exit_1_with_a_message(env, caplog, tmp_path):
    with caplog.at_level(logging.ERROR, logger="diloco"):
        assert main(["status", "--run", "no-such-run", "--json", str(tmp_path / "s.json")]) == 1
    assert "run 'no-such-run' does not exist: no run spec at s3://" in caplog.text
    assert not (tmp_path / "s.json").exists()
