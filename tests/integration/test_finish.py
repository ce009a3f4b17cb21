"""The end of a run: learners' final pieces, the run's end record, and `diloco finish`.

A learner that ends normally sends each fragment's progress since its last send as a final piece
and records that it finished; once every learner that joined has, the coordinator merges what is
open and writes the run's end (`finished.msgpack` and its Redis copy) with each fragment's final
version. An operator can end a run earlier with `diloco finish`. Nothing is merged after the end.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid

import pytest
import torch

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.cli import main as cli_main
from diloco.storage.errors import RunFinished
from diloco.storage.history import read_manifest, read_run_end
from diloco.storage.protocol import FinishRequest
from harness import (TINY_RUN, announcements, join, make_coordinator, serving, tiny_learner, train,
                     wait_for)

STEPS_RUN = dataclasses.replace(TINY_RUN, cadence="steps")  # H = 4: fragment 0 sends at step 4, fragment 1 at 6


def main(argv: list[str]) -> int:
    """`diloco ARGV` in this process, its exit code. cli.main configures logging for the process (it
    quiets botocore and the like): their levels are put back, so later tests see the same logging."""
    noisy = {name: logging.getLogger(name).level for name in ("botocore", "boto3", "urllib3", "s3transfer")}
    try:
        return cli_main(argv)
    finally:
        for name, level in noisy.items():
            logging.getLogger(name).setLevel(level)


def step_until(coord, what: str, condition, steps: int = 100) -> None:  # noqa: ANN001
    for _ in range(steps):
        coord.step(block_ms=20)
        if condition():
            return
    raise AssertionError(f"not after {steps} coordinator steps: {what}")


def manifests(coord) -> dict[int, list]:  # noqa: ANN001
    return {f: [read_manifest(coord.store, coord.keys, f, v) for v in range(head + 1)]
            for f, head in coord.bus.heads().items()}


def sees_end(learner, opt) -> bool:  # noqa: ANN001
    train(learner, opt, 1)
    return learner.run_finished


def merged_ids(coord) -> list[str]:  # noqa: ANN001
    return [c.contribution_id for history in manifests(coord).values() for m in history for c in m.inputs]


@pytest.mark.slow  # 8 s; `make test` keeps the finish command's and the token budget's ends
def test_learners_ending_at_staggered_times_each_send_final_pieces_merged_once_and_the_run_ends(endpoints, run_id):
    # Quorum 3 of 3: a round merges once every learner still in the fleet has sent its piece.
    coord = Coordinator(endpoints, run_id, settings=STEPS_RUN,
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=3, max_grace_s=0.0)))
    (a, opt_a), (b, opt_b), (c, opt_c) = (join(endpoints, run_id, coord, name) for name in "abc")
    try:
        train(a, opt_a, 5)  # fragment 0 sent at step 4: 1 step left on it, 5 on fragment 1
        a.finish()  # its final pieces join b's and c's next rounds
        train(b, opt_b, 7)
        train(c, opt_c, 7)
        step_until(coord, "rounds of a's final pieces with b's and c's", lambda: min(coord.bus.heads().values()) >= 1)
        b.finish()
        step_until(coord, "b's finish seen", lambda: "b" in coord.view.finished)
        assert coord.bus.heads() == {0: 1, 1: 1}  # b's final pieces wait for c's: c trains on
        c.finish()
        step_until(coord, "the run's end", lambda: coord.ended is not None)
    finally:
        for learner in (a, b, c):
            learner.close()  # nothing left to do for a learner that finished
        coord.close()

    finals = {a.contribution_id: a for _, a in announcements(coord.bus) if a.final}
    assert sorted((x.learner, x.fragment, x.steps) for x in finals.values()) == [
        ("a", 0, 1), ("a", 1, 5), ("b", 0, 3), ("b", 1, 1), ("c", 0, 3), ("c", 1, 1)]
    records = coord.bus.finished_learners()
    assert sorted(records) == ["a", "b", "c"]
    assert {cid for r in records.values() for cid in r.final} == set(finals)
    merged = merged_ids(coord)
    assert len(merged) == len(set(merged)), "a contribution was merged twice"
    announced = {x.contribution_id for _, x in announcements(coord.bus)}
    assert announced == set(merged) and coord.bus.refusals() == []
    for history in manifests(coord).values():
        # a's final piece merged with b's and c's pieces of that round; b's and c's final pieces as one round.
        assert len(history) == 3
        first = {(x.learner, x.contribution_id in finals) for x in history[1].inputs}
        assert ("a", True) in first and {("b", False), ("c", False)} <= first
        assert {(x.learner, x.contribution_id in finals) for x in history[2].inputs} == {("b", True), ("c", True)}
        # Nesterov's look-ahead is for the learners that train on from a version: 2 of the 3 after
        # the round a left in, none after the last round (the final model keeps no extrapolation).
        assert [m.settings.lookahead for m in history[1:]] == [2 / 3, 0.0]

    end = read_run_end(coord.store, coord.keys)
    assert end == coord.bus.run_end() == coord.ended
    assert end.by == "learners" and "every learner that joined has finished (a, b, c)" in end.reason
    assert end.versions == tuple(coord.bus.heads()[f] for f in range(2))

    # The first to finish gets the run's final model, not the one of the moment it left.
    final = a.final_state_dict(timeout_s=5)
    assert all(torch.equal(t, b.global_state_dict(list(end.versions))[n]) for n, t in final.items())

    late, _ = tiny_learner(endpoints, run_id, "late")
    with pytest.raises(RunFinished, match="is finished"):
        late.start()
    assert "late" not in coord.bus.fleet().joined


def test_the_rounds_merged_when_an_operator_finishes_the_run_take_no_momentum_push(endpoints, run_id):
    """`diloco finish`: the open rounds merge at once and nobody trains from them, so, like the
    fleet's last pieces, they take none of Nesterov's look-ahead; the rounds before took all of it."""
    coord = Coordinator(endpoints, run_id, settings=STEPS_RUN,
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=2, max_grace_s=0.0)))
    (a, opt_a), (b, opt_b) = (join(endpoints, run_id, coord, name) for name in "ab")
    try:
        for learner, opt in ((a, opt_a), (b, opt_b)):
            train(learner, opt, 6)  # fragment 0 sent at step 4, fragment 1 at 6: a round of both for each
        step_until(coord, "the first rounds", lambda: min(coord.bus.heads().values()) >= 1)
        train(a, opt_a, 4)  # a's next pieces (steps 8 and 10) wait for b's (quorum 2)...
        step_until(coord, "a's pieces in the open rounds",
                   lambda: all(len(f.round) == 1 for f in coord.fragments.values()))
        coord.bus.ask_finish(FinishRequest(run=run_id, asked_at=coord.bus.server_time(), by="the test"))
        step_until(coord, "the run's end", lambda: coord.ended is not None)  # ...until the operator finishes
    finally:
        for learner in (a, b):
            learner.close()
        coord.close()
    for history in manifests(coord).values():
        assert [m.settings.lookahead for m in history[1:]] == [1.0, 0.0]


def train_until_the_run_is_finished(learner, opt, failures: list) -> None:  # noqa: ANN001
    """A training loop that stops once the run is finished, then leaves (`finish` sends nothing then)."""
    try:
        deadline = time.monotonic() + 60
        while not learner.run_finished and time.monotonic() < deadline:
            for p in learner.model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
            time.sleep(0.005)
        learner.finish()
    except BaseException as exc:  # noqa: BLE001 (re-raised in the test)
        failures.append(exc)


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_diloco_finish_merges_what_is_pending_ends_the_run_and_refuses_what_comes_later(
        endpoints, run_id, monkeypatch, capsys):
    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN, keep_serving=True)  # refuses what comes later
    learners = [join(endpoints, run_id, coord, name) for name in ("a", "b")]
    failures: list[BaseException] = []
    threads = [threading.Thread(target=train_until_the_run_is_finished, args=(*lo, failures)) for lo in learners]
    with serving(coord):
        for t in threads:
            t.start()
        wait_for("a few versions", lambda: min(coord.bus.heads().values()) >= 3)
        assert main(["finish", "--run", run_id, "--timeout", "30"]) == 0
        # The command returns once the end is in Redis; the serving thread stores it in S3, then in memory.
        wait_for("the coordinator to record the run's end", lambda: coord.ended is not None)
        end = coord.ended
        assert end is not None and end.by == "operator" and "diloco finish" in end.reason
        printed = capsys.readouterr().out.splitlines()
        assert printed[1:] == [f"fragment {f}: version {v}" for f, v in enumerate(end.versions)]
        for t in threads:
            t.join(timeout=30)
        assert not failures and not any(t.is_alive() for t in threads), failures
        assert all(learner.run_finished for learner, _ in learners)
        wait_for("nothing pending", lambda: coord.bus.pending_count() == 0)

        # A contribution announced now is refused with a reason, and accounted for.
        real = next(a for _, a in announcements(coord.bus) if a.kind == "delta")
        later = dataclasses.replace(real, contribution_id=uuid.uuid4().hex)
        coord.bus.announce(later)
        wait_for("the later contribution's refusal",
                 lambda: any(r.contribution_id == later.contribution_id for r in coord.bus.refusals()))
    refusal = next(r for r in coord.bus.refusals() if r.contribution_id == later.contribution_id)
    assert refusal.code == "run_finished" and "is finished" in refusal.reason
    assert coord.bus.counters()["refused:run_finished"] >= 1
    assert end.versions == tuple(coord.bus.heads()[f] for f in range(2))  # nothing merged after the end
    # What the learners sent before the end is merged once; whatever they sent after it, refused.
    merged = merged_ids(coord)
    assert len(merged) == len(set(merged))
    refused = {r.contribution_id: r.code for r in coord.bus.refusals()}
    for _, a in announcements(coord.bus):
        assert a.contribution_id in merged or refused.get(a.contribution_id) == "run_finished", a
    assert coord.bus.finished_learners() == {}  # they left a finished run: nothing of theirs to record
    coord.close()


def test_diloco_finish_without_a_coordinator_fails_and_the_next_coordinator_finishes_the_run(
        endpoints, run_id, monkeypatch, caplog):
    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    join(endpoints, run_id, coord, "a")[0].close()
    coord.close()  # gives the lease up: nobody coordinates the run
    assert main(["finish", "--run", run_id, "--timeout", "1"]) == 1
    assert "no coordinator holds the run" in caplog.text and "The request stays" in caplog.text
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    step_until(coord, "the run's end", lambda: coord.ended is not None)
    assert coord.ended.by == "operator" and coord.ended.versions == (0, 0)
    coord.close()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_token_budget_ends_the_run_once_every_fragment_merged_it_also_after_a_restart(endpoints, run_id):
    """`--token-budget`: the run ends once every fragment has merged that many tokens, counted in the
    manifests (so a restarted coordinator goes on from its predecessor's count, not from 0), and the
    learners see the run end. Two learners, 10 tokens per step, H = 4, the budget 200: after 10 steps
    each, fragment 0 has merged 2 x 8 steps (160 tokens), fragment 1 2 x 10 (200); fragment 0's
    pieces of step 12 bring it to 240."""
    config = CoordinatorConfig(token_budget=200, round=RoundConfig(min_quorum=2, max_grace_s=0.0))
    coord = Coordinator(endpoints, run_id, settings=STEPS_RUN, config=config)
    (a, opt_a), (b, opt_b) = (join(endpoints, run_id, coord, name) for name in "ab")

    def merged() -> dict[int, int]:
        return {f: history[-1].merged_tokens for f, history in manifests(coord).items()}

    try:
        train(a, opt_a, 10)  # fragment 0 sent at steps 4 and 8, fragment 1 at 6 and 10
        train(b, opt_b, 10)
        step_until(coord, "the pieces of 10 steps merged", lambda: merged() == {0: 160, 1: 200})
        coord.step(block_ms=20)
        assert coord.ended is None and not a.run_finished  # fragment 0 has not merged the budget
        coord.close()
        coord = Coordinator(endpoints, run_id, settings=STEPS_RUN, config=config)  # a restart: 160 and 200 so far
        train(a, opt_a, 4)
        train(b, opt_b, 4)
        step_until(coord, "the run's end", lambda: coord.ended is not None)
        end = read_run_end(coord.store, coord.keys)
        assert end is not None and end.by == "budget" and "200" in end.reason
        assert merged()[0] == 240 and end.versions == tuple(coord.bus.heads()[f] for f in (0, 1))
        # A learner sees the end on its heartbeat, and says so at its next step.
        wait_for("the learners to see the run end", lambda: sees_end(a, opt_a) and sees_end(b, opt_b))
    finally:
        for learner in (a, b):
            learner.close()
        coord.close()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_learner_gone_for_longer_than_gone_after_s_no_longer_holds_the_run_open(endpoints, run_id):
    coord = Coordinator(endpoints, run_id, settings=STEPS_RUN,
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0), gone_after_s=2.0))
    (a, opt_a), (b, opt_b) = (join(endpoints, run_id, coord, name) for name in "ab")
    try:
        train(a, opt_a, 5)
        a.finish(preempted=True)  # left on SIGTERM: it may come back under its id
        train(b, opt_b, 5)
        b.finish()
        step_until(coord, "b's finish seen", lambda: "b" in coord.view.finished)
        left_at = time.monotonic()
        step_until(coord, "the run's end", lambda: coord.ended is not None, steps=400)
        assert time.monotonic() - left_at > 1.0  # a held the run open while it could still come back ...
    finally:
        a.close()
        b.close()
        coord.close()
    # ... and once it was gone for 2 s, the run ended without it, saying so.
    assert coord.ended.by == "learners"
    assert coord.ended.reason.endswith("has finished (b); gone without finishing: a"), coord.ended.reason
