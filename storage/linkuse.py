"""How busy a process's link to S3 is: the seconds each direction had a transfer in flight.

A learner reports the seconds of each round period its busier direction is in use
(`LearnerStats.link_round_s`), and the coordinator's round clock stretches when the fleet's links
cannot carry a round's pieces and versions in a share of its period
(`coordinator.policy.link_bound_period`): on a link that is nearly full, pieces queue behind each
other, miss their round, are merged as rounds of their own (one more version each for every
learner to download) and go stale: the fleet falls behind the versions it is sent.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DIRECTIONS = ("up", "down")

LINK_WINDOW_S = 10.0
"""The shortest window a learner measures its link's load over (`LearnerStats.link_round_s`): two
round periods, or this when they are shorter."""


class LinkUse:
    """Seconds during which at least one transfer was in flight, per direction ('up': PUTs, 'down':
    GETs): the union of the transfers' intervals, so that concurrent transfers count once. A
    transfer's retries and their pauses count: the link did not carry it meanwhile. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._active = dict.fromkeys(DIRECTIONS, 0)
        self._since = dict.fromkeys(DIRECTIONS, 0.0)
        self._busy = dict.fromkeys(DIRECTIONS, 0.0)

    @contextmanager
    def busy(self, direction: str) -> Iterator[None]:
        """The link is in use `direction`-wards for the block's duration."""
        with self._lock:
            if self._active[direction] == 0:
                self._since[direction] = self._clock()
            self._active[direction] += 1
        try:
            yield
        finally:
            with self._lock:
                self._active[direction] -= 1
                if self._active[direction] == 0:
                    self._busy[direction] += self._clock() - self._since[direction]

    def busy_s(self) -> tuple[float, float]:
        """(up, down): seconds in use so far, a transfer still in flight counted up to now."""
        with self._lock:
            now = self._clock()
            up, down = (self._busy[d] + (now - self._since[d] if self._active[d] else 0.0) for d in DIRECTIONS)
            return up, down


class LinkLoad:
    """The seconds of each round period the busier direction of a link is in use, from samples of
    `LinkUse.busy_s` taken now and then (a learner's heartbeats), each with the round period in
    force: its share of the last `window_s` seconds times their mean period. Reported so, a
    learner's figure does not depend on the clock it was measured under, and a clock set from it
    does not chase its own changes (a share measured under short rounds, applied to a clock that
    has stretched since, would stretch it again). Thread-safe."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, tuple[float, float], float]] = deque()
        self._lock = threading.Lock()
        self._last = 0.0

    def update(self, now: float, busy_s: tuple[float, float], period_s: float, window_s: float) -> float:
        """Add the sample (`now`, `busy_s`, `period_s`: the round period since the last sample) and
        return the link's seconds per round over the samples of at least the last `window_s` seconds
        (all of them while there are fewer); 0 from one sample, or without a period."""
        with self._lock:
            if self._samples and now < self._samples[-1][0]:
                return self._last  # out of order (another thread's sample came first): not counted
            self._samples.append((now, busy_s, period_s))
            while len(self._samples) > 2 and self._samples[1][0] <= now - window_s:
                self._samples.popleft()
            t0, first, _ = self._samples[0]
            if now <= t0:
                return 0.0
            share = min(1.0, max(0.0, *((b - a) / (now - t0) for a, b in zip(first, busy_s, strict=True))))
            later = list(self._samples)[1:]
            spans = [(t - before[0], p) for before, (t, _, p) in zip(self._samples, later)]
            self._last = share * sum(dt * p for dt, p in spans) / (now - t0)
            return self._last
