"""Where the coordinator's time goes: seconds per phase, summed since the coordinator started.

The loop times each of its phases (reading announcements, fetching and verifying objects, merging,
the outer step, encoding, writing, committing) with `PhaseTimes`, and `diloco bench coordinator`
reports the split. Phases that run on the fetch threads ("get", "verify", and "tensors": a round's
tensors merged, `TimedPool`) add thread-seconds, which overlap each other and the loop's own
phases; the others are the loop's wall time ("fetch_wait" is the loop waiting for the fetch
threads, "merge" includes waiting for the tensors).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

Timed = Callable[[str], AbstractContextManager[None]]
"""`timed("phase")` is a context manager that adds the time spent inside it to that phase."""


def untimed(_phase: str) -> AbstractContextManager[None]:
    """A `Timed` that records nothing (the default of functions that accept one)."""
    return nullcontext()


@dataclass
class PhaseTimes:
    """Seconds per phase: elapsed, and CPU of the thread that ran it (a phase that waits on
    other threads, or on a server, shows little CPU). Thread-safe; call the instance as a `Timed`."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            with self._lock:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
                self.cpu_seconds[phase] = self.cpu_seconds.get(phase, 0.0) + cpu

    def snapshot(self) -> dict[str, tuple[float, float]]:
        """(seconds, CPU seconds) per phase so far."""
        with self._lock:
            return {phase: (s, self.cpu_seconds[phase]) for phase, s in self.seconds.items()}

    def since(self, before: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """(seconds, CPU seconds) per phase spent since `before` (an earlier `snapshot()`), phases
        with none left out."""
        out = {}
        for phase, (s, cpu) in self.snapshot().items():
            s0, cpu0 = before.get(phase, (0.0, 0.0))
            if s > s0:
                out[phase] = (s - s0, cpu - cpu0)
        return out


class TimedPool(Executor):
    """`pool`, each task it runs timed as `phase` on the thread that runs it."""

    def __init__(self, pool: Executor, timed: Timed, phase: str) -> None:
        self._pool, self._timed, self._phase = pool, timed, phase

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        def run() -> Any:
            with self._timed(self._phase):
                return fn(*args, **kwargs)
        return self._pool.submit(run)
