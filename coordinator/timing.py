"""Where the coordinator's time goes: seconds and calls per phase, summed since the process started.

The loop times each of its phases (reading announcements, fetching and verifying objects, merging,
the outer step, encoding, writing, committing) with `PhaseTimes`, and `diloco bench coordinator`
reports the split. Phases that run on the fetch threads ("get", "verify") add thread-seconds,
which overlap each other and the loop's own phases; the others are the loop's wall time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

Timed = Callable[[str], AbstractContextManager[None]]
"""`timed("phase")` is a context manager that adds the time spent inside it to that phase."""


def untimed(_phase: str) -> AbstractContextManager[None]:
    """A `Timed` that records nothing (the default of functions that accept one)."""
    return nullcontext()


@dataclass
class PhaseTimes:
    """Seconds and calls per phase. Thread-safe; call the instance as a `Timed`."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            with self._lock:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
                self.calls[phase] = self.calls.get(phase, 0) + 1

    def snapshot(self) -> dict[str, float]:
        """Seconds per phase so far."""
        with self._lock:
            return dict(self.seconds)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """Seconds per phase spent since `before` (an earlier `snapshot()`), phases with none left out."""
        now = self.snapshot()
        return {phase: s - before.get(phase, 0.0) for phase, s in now.items() if s > before.get(phase, 0.0)}
