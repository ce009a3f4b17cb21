"""A learner's reported losses, kept in the run's history: `losses/{learner}/{seq}` objects (`LossLog`).

The heartbeat carries only a learner's last loss, and Redis keeps only the last heartbeat. So rank 0
also samples its progress (step, tokens, the last loss given to `Learner.report`, Redis time) on a
thread of its own, `LossRecorder`, and writes the samples to S3 as create-only `LossLog` objects:
each time `SAMPLES_PER_LOG` have gathered, and on leaving. `diloco plot` draws them (any model: no task
needed), `diloco export` copies them with the rest of the run, `diloco gc` keeps them (the run's record).

Bounded per learner: a sample is taken at most every `sample_s` and only after a new step with a finite
loss; `sample_s` doubles every `LOGS_PER_LEVEL` objects the learner id has (`pace`; a restart lists its
own and goes on from there). T seconds of training thus make about `16 * log2(T / 4096 s + 1)`
objects of at most 256 samples (~7 kB each): ~70 after a day, ~115 after a week, ~210 after a
year, plus one per restart. The price: a learner killed without leaving (SIGKILL) loses the samples
not written yet, at most `SAMPLES_PER_LOG * sample_s` seconds' worth.

Nothing here may slow or stop training: the thread never raises, a write that fails is logged and
its samples kept for the next one (thinned by half beyond `MAX_BUFFERED`), and leaving waits for the
last write only as long as the learner's other threads (`close_timeout_s`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from diloco.storage.errors import Conflict, Refused
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, Store
from diloco.storage.protocol import MAX_MESSAGE_BYTES, LearnerStats, LossLog

log = logging.getLogger(__name__)

SAMPLES_PER_LOG = 256
"""Samples per LossLog object (the last one of an incarnation may hold fewer)."""
LOGS_PER_LEVEL = 16
"""The sampling interval doubles every this many objects of a learner."""
MAX_BUFFERED = 4 * SAMPLES_PER_LOG
"""While writes fail: beyond this many samples waiting, every other one is dropped."""


def pace(logs: int, base_s: float) -> float:
    """Seconds between two samples for a learner that has `logs` objects already."""
    return base_s * 2 ** (logs // LOGS_PER_LEVEL)


@dataclass
class Sample:
    step: int
    tokens: int
    loss: float
    t: float


class LossRecorder(threading.Thread):
    """Rank 0: samples `progress()` every `pace(...)` seconds until `stop` is set, then takes a last
    sample and writes what is left. `now()` is Redis server time (the clock every process agrees on)."""

    def __init__(self, store: Store, keys: RunKeys, learner: str, progress: Callable[[], LearnerStats],
                 now: Callable[[], float], stop: threading.Event, *, base_s: float = 1.0) -> None:
        super().__init__(name="losses", daemon=True)
        self.store, self.keys, self.learner = store, keys, learner
        self.progress, self.now, self.stop = progress, now, stop
        self.base_s = base_s
        self.logs = 0
        """Objects under this learner's prefix (listed at start) plus those written since."""
        self.written = 0
        self.buffer: list[Sample] = []
        self._last_step = -1
        self._last_seq = 0
        self._incarnation = ""

    def run(self) -> None:
        try:
            self.logs = sum(1 for _ in self.store.list(self.keys.losses_prefix(self.learner)))
        except Exception as exc:  # noqa: BLE001 (S3 unreachable: start from level 0)
            log.warning("could not list the loss logs of learner %s: %s", self.learner, exc)
        while not self.stop.wait(pace(self.logs, self.base_s)):
            self._take()
            if len(self.buffer) >= SAMPLES_PER_LOG:
                self._write()
        self._take()
        self._write()

    def _take(self) -> None:
        try:
            stats = self.progress()
            if stats.step > self._last_step and math.isfinite(stats.loss):
                self.buffer.append(Sample(stats.step, stats.tokens, stats.loss, self.now()))
                self._last_step, self._incarnation = stats.step, stats.incarnation
        except Exception as exc:  # noqa: BLE001 (a loss that cannot be read: no sample)
            log.warning("could not sample learner %s's loss: %s", self.learner, exc)

    def _write(self) -> None:
        """Write the buffer as one LossLog (at most SAMPLES_PER_LOG samples per object); on failure keep it."""
        while self.buffer:
            batch = self.buffer[:SAMPLES_PER_LOG]
            record = LossLog(learner=self.learner, incarnation=self._incarnation,
                             steps=tuple(s.step for s in batch), tokens=tuple(s.tokens for s in batch),
                             losses=tuple(s.loss for s in batch), times=tuple(s.t for s in batch))
            self._last_seq = max(self._last_seq + 1, int(time.time() * 1000))
            try:
                self.store.put(self.keys.loss_log(self.learner, self._last_seq), record.to_wire(), create_only=True)
            except Conflict:
                continue  # another process with this learner id wrote that seq: the next one
            except Exception as exc:  # noqa: BLE001 (never the training loop's problem)
                log.warning("could not store %d loss sample(s) of learner %s (kept for the next write): %s",
                            len(batch), self.learner, exc)
                if len(self.buffer) > MAX_BUFFERED:
                    self.buffer = self.buffer[::2]
                return
            del self.buffer[:len(batch)]
            self.logs += 1
            self.written += 1


# ---- reading -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LossSeries:
    """One incarnation of a learner: its samples in time order."""

    learner: str
    incarnation: str
    steps: list[int]
    tokens: list[int]
    losses: list[float]
    times: list[float]


def read_losses(store: Store, keys: RunKeys, *, threads: int = 8) -> tuple[list[LossSeries], list[str]]:
    """Every learner's loss logs, one series per incarnation (by learner, then first sample), and the
    objects that could not be read (skipped), for a person."""
    listed = [k for k in store.list(keys.losses_prefix()) if keys.parse_loss_key(k) is not None]
    problems: list[str] = []

    def read(key: str) -> LossLog | None:
        try:
            record = LossLog.from_wire(store.get(key, max_bytes=MAX_MESSAGE_BYTES))
        except (ObjectMissing, Refused) as exc:
            problems.append(f"{key}: unreadable ({exc})")
            return None
        if record.learner != keys.parse_loss_key(key)[0]:  # type: ignore[index]
            problems.append(f"{key}: names learner {record.learner!r}")
            return None
        return record

    with ThreadPoolExecutor(threads, thread_name_prefix="losses") as pool:
        records = [r for r in pool.map(read, sorted(listed)) if r is not None]
    merged: dict[tuple[str, str], LossSeries] = {}
    for r in records:
        s = merged.setdefault((r.learner, r.incarnation), LossSeries(r.learner, r.incarnation, [], [], [], []))
        s.steps.extend(r.steps)
        s.tokens.extend(r.tokens)
        s.losses.extend(r.losses)
        s.times.extend(r.times)
    series = sorted(merged.values(), key=lambda s: (s.learner, s.times[0] if s.times else 0.0))
    return [s for s in series if s.steps], problems
