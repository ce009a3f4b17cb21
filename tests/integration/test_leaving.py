"""What a learner sends on its way out of a run.

`send_progress` sends each fragment's progress since its last send, and the learner trains on;
`finish` (the end of a `with learner:` block) sends it as final pieces (test_finish.py). A
learner that leaves on an exception (`close`) sends nothing more, and one refused at join never
counted as joined: neither records a finish.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from diloco.storage.errors import ConfigError
from diloco.storage.history import read_manifest
from diloco.workers.learner import Learner
from harness import TINY_RUN, announcements, join, make_coordinator, tiny_learner, train

STEPS_RUN = dataclasses.replace(TINY_RUN, cadence="steps")  # H = 4: fragment 0 sends at step 4, fragment 1 at 6


def deltas(coord) -> list:  # noqa: ANN001
    return [a for _, a in announcements(coord.bus) if a.kind == "delta"]


def test_send_progress_sends_each_fragments_unsent_steps_and_they_are_merged(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner, opt = join(endpoints, run_id, coord, "a")
    try:
        train(learner, opt, 5)  # fragment 0 sent at step 4; fragment 1 never (due at 6)
        assert [(a.fragment, a.steps) for a in deltas(coord)] == [(0, 4)]
        learner.send_progress()
    finally:
        learner.close()
    sent = sorted((a.fragment, a.steps, a.tokens) for a in deltas(coord))
    assert sent == [(0, 1, 10), (0, 4, 40), (1, 5, 50)]  # the step after fragment 0's send; all 5 of fragment 1
    for _ in range(20):
        coord.step(block_ms=50)
    merged = [(f, c.steps) for f in (0, 1) for v in range(1, coord.bus.heads()[f] + 1)
              for c in read_manifest(coord.store, coord.keys, f, v).inputs]
    assert sorted(merged) == [(0, 1), (0, 4), (1, 5)]
    coord.close()


def test_close_sends_nothing_more(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner, opt = join(endpoints, run_id, coord, "quiet")
    train(learner, opt, 3)  # nothing due yet
    learner.close()
    assert deltas(coord) == []
    coord.close()


def in_with_block(coord, learner, body) -> BaseException | None:  # noqa: ANN001
    """Run `with learner: body()` in a thread while the coordinator steps; what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            with learner:
                body()
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive():
        coord.step(block_ms=50)
    return raised[0] if raised else None


def test_a_learner_leaving_on_an_exception_sends_nothing_final_and_does_not_finish(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner, opt = tiny_learner(endpoints, run_id, "crash")

    def body() -> None:
        train(learner, opt, 5)  # fragment 0 sent at step 4
        raise RuntimeError("the training loop failed")

    assert isinstance(in_with_block(coord, learner, body), RuntimeError)
    assert [(a.fragment, a.steps, a.final) for a in deltas(coord)] == [(0, 4, False)]
    assert coord.bus.finished_learners() == {} and "crash" not in coord.bus.live_learners()
    coord.close()


def test_a_learner_refused_at_join_neither_joins_nor_finishes(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    join(endpoints, run_id, coord, "a")[0].close()
    wider = torch.nn.Sequential(torch.nn.Linear(4, 8))
    other = Learner(wider, torch.optim.SGD(wider.parameters(), lr=0.1), run=run_id, endpoints=endpoints,
                    learner_id="misfit")
    raised = in_with_block(coord, other, lambda: None)
    assert isinstance(raised, ConfigError) and "does not fit run" in str(raised)
    fleet = coord.bus.fleet()
    assert "misfit" not in fleet.joined | fleet.finished | fleet.live
    alive = {t.name for t in threading.enumerate() if t.is_alive()}
    assert not alive & {"heartbeat", "fetcher", "uploader-misfit"}, "a refused learner left threads running"
    assert not [a for _, a in announcements(coord.bus) if a.learner == "misfit"]
    coord.close()
