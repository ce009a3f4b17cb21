"""Capping the intra-op threads of the torch ops one thread starts, and no other thread's.

`omp_set_num_threads` is per thread; `torch.set_num_threads` would also become the default of every
thread started later. A pool of threads that each decode or encode whole tensors gets its
parallelism from the pool: each of them on one intra-op thread, so that N threads do not start N
OpenMP teams whose idle workers spin on the cores the others need (the learner's transfer threads,
`workers.threads`; the coordinator's fetch threads, `coordinator.intake`).
"""

from __future__ import annotations

import ctypes
import logging
import os

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
