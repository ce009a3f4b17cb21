"""The event engine, the fleet's failures and the accounting of a job's chip time.

- `Engine`: a clock and a heap of timed callbacks; time jumps from event to event.
- `ChipPool`: the chips, cut into slices (the unit one failure takes out) that are owned by jobs,
  and the failure process. Chip failures are independent and exponential (per-chip MTBI), so the
  fleet's failures are one Poisson process of rate chips / MTBI whose failures hit a uniformly
  drawn chip: a few thousand events a day even at 2.4M chips, and exact. A failure that hits a
  slice already out for repair changes nothing (those chips are not running), which thins the
  process exactly as fewer running chips would.
- `Job`: chips that step in lockstep (the whole fleet, or one learner). It integrates chip time
  into categories as the clock moves: chips of slices in repair, chips paused (restart,
  rescale), and running chips, whose compute is `settled` (whole steps done) or `partial` (the
  step in flight) until a strategy decides its fate (useful, lost, refused, or still pending
  when the simulation ends).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable
from typing import Any

from diloco.infra.goodput.model import CATEGORIES, Model, Result

EPS = 1e-9
"""Tolerance, in steps, when counting the step boundaries before a time (events sit on boundaries)."""


class Engine:
    """Timed callbacks run in time order (ties in the order they were scheduled) up to a horizon."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Call fn(*args) at time t; events past the horizon are dropped (the run ends first)."""
        if t <= self.horizon_s:
            heapq.heappush(self._queue, (t, next(self._order), fn, args))

    def run(self) -> None:
        while self._queue:
            t, _, fn, args = heapq.heappop(self._queue)
            self.now = t
            fn(*args)
        self.now = self.horizon_s


class ChipPool:
    """N chips in slices, slices owned by jobs, and the Poisson process of chip failures."""

    def __init__(self, engine: Engine, model: Model, jobs: int,
                 on_failure: Callable[[int, int], None]) -> None:
        """`on_failure(job, slice)` is called for every failure that hits a slice not in repair;
        slices are shared out to `jobs` jobs in contiguous blocks."""
        self.engine = engine
        self.slices = max(jobs, round(model.chips / model.slice_chips))
        self.chips_per_slice = model.chips / self.slices
        self.owner = [s * jobs // self.slices for s in range(self.slices)]
        self.in_repair: set[int] = set()
        self.failures = 0
        """Failures that hit a running slice (thinned ones are not counted)."""
        self._mean_gap_s = 1.0 / model.failure_rate_per_s
        self._rng = random.Random(model.seed)
        self._on_failure = on_failure

    def job_chips(self, job: int) -> float:
        return self.owner.count(job) * self.chips_per_slice

    def start(self) -> None:
        self._schedule()

    def _schedule(self) -> None:
        self.engine.at(self.engine.now + self._rng.expovariate(1.0) * self._mean_gap_s, self._fire)

    def _fire(self) -> None:
        self._schedule()
        hit = self._rng.randrange(self.slices)
        if hit in self.in_repair:
            return
        self.failures += 1
        self._on_failure(self.owner[hit], hit)


def new_book() -> dict[str, float]:
    return dict.fromkeys(CATEGORIES, 0.0)


class Job:
    """Chips stepping in lockstep; integrates their chip time into a book of CATEGORIES."""

    def __init__(self, chips: float, step_s: float, book: dict[str, float]) -> None:
        self.chips = chips
        """Full size."""
        self.cap = chips
        """Chips in the job now: its full size less slices in repair."""
        self.step_s = step_s
        self.book = book
        self.running = True
        self.origin = 0.0
        """Start of the current run of steps: step boundaries are origin + k * step_s."""
        self.done = 0
        """Steps completed since origin."""
        self.settled = 0.0
        """Chip-seconds of completed steps whose fate is not decided yet."""
        self.settled_steps = 0
        self.partial = 0.0
        """Chip-seconds of the step in flight."""
        self._at = 0.0

    def boundary(self, k: int) -> float:
        """Time of the end of step k of the current run."""
        return self.origin + k * self.step_s

    def advance(self, t: float) -> None:
        """Account chip time up to t (every change of state first advances to its time)."""
        dt = t - self._at
        if dt <= 0:
            return
        self.book["repair"] += (self.chips - self.cap) * dt
        if not self.running:
            self.book["paused"] += self.cap * dt
        else:
            n = math.floor((t - self.origin) / self.step_s + EPS)
            if n > self.done:
                last = self.boundary(n)
                self.settled += self.partial + self.cap * max(0.0, last - self._at)
                self.settled_steps += n - self.done
                self.done = n
                self.partial = self.cap * max(0.0, t - last)
            else:
                self.partial += self.cap * dt
        self._at = t

    def take(self) -> tuple[float, int]:
        """(chip-seconds, steps) settled since the last take: what a send or checkpoint carries."""
        out = (self.settled, self.settled_steps)
        self.settled, self.settled_steps = 0.0, 0
        return out

    def stop(self, t: float, *, lose_settled: bool) -> None:
        """Stop stepping at t (a failure): the step in flight is lost, and so is the settled work
        if `lose_settled` (nothing holds it any more)."""
        self.advance(t)
        self.book["lost"] += self.partial + (self.settled if lose_settled else 0.0)
        self.partial = 0.0
        if lose_settled:
            self.take()
        self.running = False

    def resume(self, t: float) -> None:
        """Start stepping again at t, with a new step origin."""
        self.advance(t)
        self.running, self.origin, self.done = True, t, 0

    def resize(self, t: float, chips: float) -> None:
        """A slice leaves (chips < 0) or comes back from repair (chips > 0) at t."""
        self.advance(t)
        self.cap += chips

    def finish(self, t: float) -> None:
        """The horizon: account up to it; the step in flight is pending (the settled steps are the
        strategy's to judge)."""
        self.advance(t)
        self.book["pending"] += self.partial
        self.partial = 0.0


def shares(book: dict[str, float], total: float) -> dict[str, float]:
    """Each category's share of `total` chip-seconds."""
    return {k: v / total for k, v in book.items()}


def book_result(strategy: str, model: Model, book: dict[str, float], stats: dict[str, float],
                started: float) -> Result:
    """A strategy's Result from its book of chip time over the whole fleet and horizon; `started`
    is the `time.perf_counter()` at which its simulation began."""
    total = model.chips * model.horizon_s
    return Result(strategy=strategy, chips=model.chips, learners=model.learners, goodput=book["useful"] / total,
                  chip_time=shares(book, total), stats=stats, wall_s=time.perf_counter() - started)


def speed_multipliers(model: Model) -> list[float]:
    """Step-time multiplier of each hardware group (= learner): given, or lognormal with
    coefficient of variation speed_cv, drawn from the seed; the fastest is 1."""
    if model.speeds:
        raw = list(model.speeds)
    elif model.speed_cv == 0:
        return [1.0] * model.learners
    else:
        rng = random.Random(f"speeds:{model.seed}")
        sigma = math.sqrt(math.log1p(model.speed_cv ** 2))
        raw = [rng.lognormvariate(0.0, sigma) for _ in range(model.learners)]
    fastest = min(raw)
    return [s / fastest for s in raw]
