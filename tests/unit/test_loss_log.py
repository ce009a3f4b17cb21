"""A learner's loss log (`workers/losses.py`): bounded per learner, never in the training loop's way.

The recorder runs against a `DirStore` (the export directory's store, same contracts as the bucket:
create-only writes, bounded reads), with a made-up progress and clock; a store whose root is a file
fails every write, as a real unreachable store would.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from diloco.storage.errors import Refused
from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.protocol import LearnerStats, LossLog
from diloco.workers import losses
from diloco.workers.losses import LOGS_PER_LEVEL, SAMPLES_PER_LOG, LossRecorder, pace, read_losses

KEYS = RunKeys("diloco", "r1")


class Progress:
    """A learner's progress as its heartbeat reports it: one step (loss 10 / step) per call."""

    def __init__(self, incarnation: str = "aaaa") -> None:
        self.step, self.incarnation = 0, incarnation

    def __call__(self) -> LearnerStats:
        self.step += 1
        return LearnerStats(learner="l0", step=self.step, tokens=100 * self.step, loss=10.0 / self.step,
                            incarnation=self.incarnation)


def recorder(store, progress, stop=None) -> LossRecorder:  # noqa: ANN001
    clock = iter(range(10**9))
    return LossRecorder(store, KEYS, "l0", progress, lambda: 1.8e9 + next(clock), stop or threading.Event(),
                        base_s=0.001)


def test_the_sampling_interval_doubles_every_level_of_objects() -> None:
    assert [pace(n, 1.0) for n in (0, LOGS_PER_LEVEL - 1, LOGS_PER_LEVEL, 3 * LOGS_PER_LEVEL)] == [1, 1, 2, 8]


def test_samples_go_out_in_objects_of_a_bounded_size_and_read_back_in_order(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    rec = recorder(store, Progress())
    for _ in range(2 * SAMPLES_PER_LOG + 10):
        rec._take()
        if len(rec.buffer) >= SAMPLES_PER_LOG:
            rec._write()
    rec._write()  # leaving: the rest
    keys = list(store.list(KEYS.losses_prefix("l0")))
    assert len(keys) == 3 == rec.logs and all(KEYS.parse_loss_key(k)[0] == "l0" for k in keys)
    [series], problems = read_losses(store, KEYS)
    assert problems == [] and series.incarnation == "aaaa"
    assert series.steps == list(range(1, 2 * SAMPLES_PER_LOG + 11))
    assert series.tokens == [100 * s for s in series.steps] and series.losses == [10.0 / s for s in series.steps]
    assert series.times == sorted(series.times)


def test_a_restarted_learner_goes_on_at_its_level(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    for n in range(LOGS_PER_LEVEL):
        store.put(KEYS.loss_log("l0", n + 1), LossLog("l0", "old", (1,), (1,), (1.0,), (1.0,)).to_wire())
    stop = threading.Event()
    stop.set()  # leaves at once: lists, takes one sample and writes it
    rec = recorder(store, Progress("new"), stop)
    rec.run()
    assert rec.logs == LOGS_PER_LEVEL + 1 and pace(rec.logs, 1.0) == 2.0
    series, _ = read_losses(store, KEYS)
    assert [(s.incarnation, len(s.steps)) for s in series] == [("old", LOGS_PER_LEVEL), ("new", 1)]


def test_a_step_without_a_new_finite_loss_is_not_sampled(tmp_path: Path) -> None:
    stats = LearnerStats(learner="l0", step=3, loss=math.nan)
    rec = recorder(DirStore(tmp_path), lambda: stats)
    rec._take()
    assert rec.buffer == []
    stats = LearnerStats(learner="l0", step=3, loss=1.0)
    rec._take()
    rec._take()  # the same step again
    assert len(rec.buffer) == 1


def test_a_store_that_fails_costs_samples_never_an_exception(tmp_path: Path, caplog, monkeypatch) -> None:  # noqa: ANN001
    # Small logs: the same bound, without serialising thousands of 256-sample logs (5 s).
    monkeypatch.setattr(losses, "SAMPLES_PER_LOG", 8)
    monkeypatch.setattr(losses, "MAX_BUFFERED", 32)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    rec = recorder(DirStore(blocker), Progress())
    for _ in range(3 * losses.MAX_BUFFERED):
        rec._take()
        rec._write()
    assert rec.written == 0 and len(rec.buffer) <= losses.MAX_BUFFERED + 1
    assert "could not store" in caplog.text
    rec.progress = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))  # reading the loss fails
    rec._take()
    assert "could not sample" in caplog.text


def test_a_loss_log_is_checked_like_every_record() -> None:
    ok = LossLog("l0", "x", (1, 2), (10, 20), (2.0, 1.5), (1.0, 2.0))
    assert LossLog.from_wire(ok.to_wire()) == ok
    with pytest.raises(ValueError, match="different lengths"):
        LossLog("l0", "x", (1, 2), (10,), (2.0, 1.5), (1.0, 2.0))
    with pytest.raises(ValueError, match="non-finite"):
        LossLog("l0", "x", (1,), (10,), (math.inf,), (1.0,))
    with pytest.raises(Refused):
        LossLog("../l0", "x", (), (), (), ())
    assert KEYS.parse_loss_key(KEYS.loss_log("l0", 7)) == ("l0", 7)
    assert KEYS.parse_loss_key(KEYS.delta(0, "l0", 7)) is None
