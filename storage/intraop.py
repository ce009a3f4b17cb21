"""Capping the intra-op threads of the torch ops one thread starts, and no other thread's; pacing
one thread's CPU use.

`omp_set_num_threads` is per thread; `torch.set_num_threads` would also become the default of every
thread started later. A pool of threads that each decode or encode whole tensors gets its
parallelism from the pool: each of them on one intra-op thread, so that N threads do not start N
OpenMP teams whose idle workers spin on the cores the others need (the learner's transfer threads,
`workers.threads`; the coordinator's fetch threads, `coordinator.intake`).

A thread may also be paced (`pace_this_thread`): its heavy work (encoding, decoding, hashing a
fragment) then stops at `pace()` points, each a few milliseconds of work apart, and sleeps whenever
it has used more than its share of a CPU. A token bucket (`Budget`: the thread's own, or one that
several threads spend from together, `share` between them): the thread earns `share` CPU seconds per
second, up to BURST_S in hand, and spends its own CPU time (`time.thread_time`); below zero it sleeps
until it is even again. Occasional small work (a small model's pieces) never waits; a burst (a 31M-value
piece: about half a CPU second) is spread over 1/share times as long, so that a training loop it
shares a core with is slowed by about `share` over several steps instead of twice as long for one
(`workers.threads`). Pacing spreads bursts; it must not hold back work that keeps coming faster than
the share allows, which would only pile up: a thread whose work queues up rushes (`Pacer.rushing`),
unpaced, until it has caught up.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")


def usable_cpu_ids() -> list[int]:
    """The CPUs this process may run on (its affinity, not the machine's), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on."""
    return len(usable_cpu_ids())


def cap_this_thread(threads: int | None) -> bool:
    """Limit torch's intra-op threads for ops started by the calling thread to `threads` (None:
    leave them). False when torch's OpenMP runtime cannot be found (e.g. a non-OpenMP build)."""
    if threads is None:
        return True
    import torch

    torch.get_num_threads()  # torch sets this thread's count on its first parallel op: do that first
    runtime = _openmp()
    if runtime is None:
        log.debug("no OpenMP runtime found: the thread keeps torch's thread count")
        return False
    runtime.omp_set_num_threads(threads)
    return True


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (already in this process: found in its memory map)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if any(n in line for n in _OPENMP_NAMES)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            runtime = ctypes.CDLL(path)
            runtime.omp_set_num_threads  # noqa: B018 (present, or AttributeError)
            return runtime
        except (OSError, AttributeError):
            continue
    return None


BURST_S = 0.05
"""CPU seconds a paced thread may spend at once before it is held to its share."""


class Budget:
    """A token bucket of CPU time that several paced threads spend together (see the module's
    docstring): between them they take `share` of a CPU, not `share` each. Thread-safe."""

    def __init__(self, share: float, *, wall: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"a paced thread's CPU share must be in (0, 1], got {share}")
        self.share = share
        self._wall = wall
        self._lock = threading.Lock()
        self._tokens = BURST_S
        self._last = wall()

    def spend(self, cpu_s: float) -> float:
        """Spend `cpu_s` CPU seconds; the seconds the spender is to sleep until the bucket is even
        again (0: none). Time asleep earns back the debt; an idle stretch earns at most BURST_S."""
        with self._lock:
            now = self._wall()
            self._tokens = min(BURST_S, self._tokens + self.share * (now - self._last)) - cpu_s
            self._last = now
            return -self._tokens / self.share if self._tokens < 0.0 else 0.0


class Pacer:
    """One thread's pacing (see the module's docstring): it spends the thread's own CPU time from
    its `Budget`, a bucket of its own unless one shared with other threads is given. Read its
    figures from any thread."""

    def __init__(self, share: float, *, budget: Budget | None = None, cpu: Callable[[], float] = time.thread_time,
                 wall: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.budget = budget if budget is not None else Budget(share, wall=wall)
        self.share = self.budget.share
        self.slept_s = 0.0
        """Seconds the thread has slept to keep to its share."""
        self.rushing = False
        """Set from any thread: while True the thread works unpaced and spends nothing of the budget
        (its work is queuing up behind the pacing: a burst spread out is one thing, a backlog another)."""
        self.rushed_s = 0.0
        """CPU seconds the thread spent rushing."""
        self._thread_cpu, self._sleep = cpu, sleep
        self._stopped = False
        self._cpu = cpu()

    def stop(self) -> None:
        """No more pacing (from any thread): the next `step` and every one after return at once."""
        self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def step(self) -> None:
        """Spend the CPU time this thread used since its last step; sleep while the budget is below zero."""
        if self._stopped:
            return
        cpu = self._thread_cpu()
        if self.rushing:
            self.rushed_s += cpu - self._cpu
            self._cpu = cpu
            return
        pause = self.budget.spend(cpu - self._cpu)
        self._cpu = cpu
        if pause > 0.0:
            self._sleep(pause)
            self.slept_s += pause


_local = threading.local()


def pace_this_thread(share: float, budget: Budget | None = None) -> Pacer | None:
    """Pace the calling thread's work at `pace()` points to `share` of a CPU (1: not paced), spent
    from `budget` when given (shared with the other threads paced from it: `share` between them).
    Returns its pacer (None when not paced), whose `slept_s` says what the pacing cost the thread."""
    _local.pacer = Pacer(share, budget=budget) if share < 1.0 else None
    return _local.pacer


@contextmanager
def unpaced() -> Iterator[None]:
    """The calling thread's work inside the block is not paced (a learner's proposal of version 0,
    made before its loop trains: there is nothing to leave room for)."""
    pacer = getattr(_local, "pacer", None)
    _local.pacer = None
    try:
        yield
    finally:
        _local.pacer = pacer


def pace() -> None:
    """A point in a long piece of work where the calling thread may wait for its CPU share (a no-op
    unless `pace_this_thread` paced it): between the chunks of an encode or a decode, the parts of
    a hash or a zstd pass (`paced_views`), the slices of an elementwise op (`paced_slices`)."""
    pacer = getattr(_local, "pacer", None)
    if pacer is not None:
        pacer.step()


PACE_ELEMENTS = 1 << 20
"""Elements of a flat tensor op between two `pace()` points in `paced_slices`: a subtraction of
them takes about a millisecond, a fresh buffer's page faults for them a few."""


def paced_slices(n: int, step: int = PACE_ELEMENTS) -> Iterator[slice]:
    """Slices over `n` elements, `step` at a time, with a `pace()` after each: an elementwise op over
    a large tensor done in parts, so that a paced thread keeps to its share inside it (one
    subtraction of a 38.6M-value embedding into fresh memory is over a tenth of a CPU second)."""
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))
        pace()


PACE_BYTES = 1 << 22
"""Bytes a hash or a zstd pass takes between two `pace()` points in `paced_views`: a few milliseconds."""


def paced_views(data: bytes | bytearray | memoryview, step: int = PACE_BYTES) -> Iterator[memoryview]:
    """Flat byte views over `data`, `step` bytes at a time, with a `pace()` after each (no copy): a
    hash or a compression fed in parts, so that a paced thread keeps to its share inside one object
    (hashing or compressing a 31M-value int4 piece in one call takes tens of milliseconds)."""
    with memoryview(data) as whole, whole.cast("B") as flat:
        for start in range(0, len(flat), step):
            yield flat[start:start + step]
            pace()
