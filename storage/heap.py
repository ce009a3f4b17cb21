"""Keeping freed memory for the next piece: glibc's malloc tuned for a process that decodes,
encodes and merges fragment-sized tensors over and over.

By default glibc serves an allocation of more than 128 KiB with a fresh mmap, and hands memory freed
at the top of its heap back to the OS once more than 128 KiB of it are free. Its dynamic threshold
raises both after the first large free, but a round frees a fragment's worth of tensors at once, so
the heap is trimmed after every piece and the next one's tensors are fresh pages again: every page
faulted in and zeroed by the kernel. On a 2-core machine that doubled the coordinator's decode of an
int4 piece (2.5 ms against 1.25 ms for 4 MB of fp32) and cost a learner's int4 encode of 32M floats
a quarter of its time (226 ms against 167 ms).

`reuse_freed_memory` sets the two thresholds where glibc's own dynamic rule tops out: allocations
up to MMAP_THRESHOLD come from the heap, and up to TRIM_THRESHOLD of freed heap is kept for reuse
rather than returned. Bigger tensors are still mapped and unmapped each time, as is any block over
64 MiB that a thread other than the main one allocates (its arena's heaps are at most that):
`workers.scratch` keeps the uploader's. Every `diloco`
command but `learner` calls it at start (`infra.cli`); a `Learner` calls it when it joins unless
`LearnerConfig.reuse_freed_memory` is off (`diloco learner --no-reuse-freed-memory`). A process
started with glibc's own variables for these set (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
MALLOC_TOP_PAD_), or with another allocator preloaded, keeps its own choice; so does one whose C
library is not glibc.

Keeping buffers trades memory for CPU, which a process near its memory's end cannot afford (a
1B-parameter learner on 24 GB has under 1 GB to spare; its uploader kept two 252 MB buffers):
`spare_memory` says whether a quarter of what the process may use, on the machine or in its memory
cgroup, is still free, and `workers.scratch` keeps a freed buffer only then. `fit` goes further for
a process this module tuned: while memory is short its malloc gives freed memory back (blocks over
1 MiB mapped on their own, unmapped when freed; `malloc_trim` at most once a second hands back the
free pages inside its heaps), and keeps it again once memory is plentiful. A 1B-parameter learner
on 24 GB, killed for memory, was once sampled resident 3.3 GB above its live tensors (0.3-0.6 GB in
the runs after).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
import time

MMAP_THRESHOLD = 32 << 20
"""Allocations up to this size come from the heap (glibc's dynamic threshold stops here on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""The heap keeps up to this much freed memory at its top for reuse before handing it back."""
SPARE_SHARE = 0.25
"""What `spare_memory` wants free, as a share of the memory this process may use: below it, buffers
kept for reuse (`workers.scratch`) are given back."""

GIVE_BACK_MMAP_THRESHOLD = 1 << 20
"""While memory is short (`fit`), allocations over this size are mapped on their own: freed, they go
back to the OS at once."""
GIVE_BACK_TRIM_THRESHOLD = 128 << 10
"""While memory is short, freed heap above this at a heap's top goes back (glibc's default)."""
TRIM_EVERY_S = 1.0
"""While memory is short, `fit` trims the heaps at most this often."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def reuse_freed_memory(environ: dict[str, str] | None = None) -> str:
    """Set glibc's thresholds (module docstring); returns what was done, for a debug log."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return "left as is: not Linux"
    if mine := [name for name in _USER_SETTINGS if name in env]:
        return f"left as is: {', '.join(mine)} set"
    if any(name in env.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return "left as is: another allocator is preloaded"
    libc = _glibc()
    if libc is None:
        return "left as is: the C library is not glibc"
    with _tuning.lock:
        if not _set_thresholds(libc, MMAP_THRESHOLD, TRIM_THRESHOLD):
            return "left as is: mallopt refused the thresholds"
        _tuning.tuned, _tuning.giving_back = True, False
    return f"heap allocations up to {MMAP_THRESHOLD >> 20} MiB, up to {TRIM_THRESHOLD >> 20} MiB of freed heap kept"


class _Tuning:
    """What this module did to the process's malloc (`reuse_freed_memory`, `fit`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tuned = False
        """`reuse_freed_memory` set the thresholds: `fit` may move them."""
        self.giving_back = False
        """Memory was short at the last `fit`: the give-back thresholds are set."""
        self.trimmed_at = -math.inf


_tuning = _Tuning()


def fit(spare: bool | None = None) -> bool:
    """Fit the process's malloc to the memory left, in a process `reuse_freed_memory` tuned: while
    memory is short (`spare`, else `spare_memory()`, is False) freed memory goes back to the OS
    (GIVE_BACK_MMAP_THRESHOLD and GIVE_BACK_TRIM_THRESHOLD, and `malloc_trim` at most every
    TRIM_EVERY_S); once it is plentiful again the reuse thresholds are back. Cheap: call it where a
    thread has just freed a fragment's worth. Returns whether memory is plentiful."""
    spare = spare_memory() if spare is None else spare
    if not _tuning.tuned:
        return spare
    libc = _glibc()
    assert libc is not None  # tuned: it was found
    with _tuning.lock:
        if spare:
            if _tuning.giving_back and _set_thresholds(libc, MMAP_THRESHOLD, TRIM_THRESHOLD):
                _tuning.giving_back = False
            return True
        if not _tuning.giving_back:
            _tuning.giving_back = _set_thresholds(libc, GIVE_BACK_MMAP_THRESHOLD, GIVE_BACK_TRIM_THRESHOLD)
        now = time.monotonic()
        if now - _tuning.trimmed_at < TRIM_EVERY_S:
            return False
        _tuning.trimmed_at = now
    libc.malloc_trim(0)  # outside the lock: it walks every heap
    return False


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, if it is glibc (musl has a mallopt that does nothing)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _set_thresholds(libc: ctypes.CDLL, mmap_threshold: int, trim_threshold: int) -> bool:
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def memory_left() -> tuple[int, int] | None:
    """(bytes this process could still allocate before the machine or its memory cgroup runs short,
    the memory it may use in all), or None where that is not known (not Linux). The machine's from
    /proc/meminfo (MemAvailable, MemTotal); a cgroup's with a limit below that (v2 memory.max, v1
    memory.limit_in_bytes) less what its tasks use but could not give back (its usage less the
    inactive page cache, as container runtimes count a working set)."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            info = {line.split(b":")[0]: int(line.split()[1]) * 1024 for line in fh if line.startswith(b"Mem")}
        left, total = info[b"MemAvailable"], info[b"MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None
    limited = _cgroup_left()
    if limited is not None and limited[1] < total:
        left, total = min(left, limited[0]), limited[1]
    return max(0, left), total


def _cgroup_left() -> tuple[int, int] | None:
    """(limit - working set, limit) of this process's memory cgroup, v2 or v1; None if it has no limit."""
    found = _cgroup()
    return None if found is None else _read_cgroup((found[0],), *found[1:])


@functools.cache
def _cgroup() -> tuple[str, str, str, str] | None:
    """This process's memory cgroup: its directory and the names of its limit, usage and inactive
    page cache figures (v2 or v1), looked up once; None where there is none to read."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path"
            root, names = "/sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root, names = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                    "total_inactive_file")
        else:
            continue
        for d in (root + path.rstrip("/"), root):  # a cgroup namespace shows its own as the root
            if os.path.exists(f"{d}/{names[0]}"):
                return d, *names
    return None


def _read_cgroup(dirs: tuple[str, ...], limit_file: str, usage_file: str, inactive: str) -> tuple[int, int] | None:
    """(limit - working set, limit) from the first of `dirs` whose figures read; None if none does or
    the limit is "max" (none)."""
    for d in dirs:
        try:
            with open(f"{d}/{limit_file}") as fh:
                raw = fh.read().strip()
            if raw == "max":
                return None
            limit = int(raw)
            with open(f"{d}/{usage_file}") as fh:
                usage = int(fh.read())
            with open(f"{d}/memory.stat") as fh:
                stat = dict(line.split() for line in fh if line.strip())
            return limit - (usage - int(stat.get(inactive, 0))), limit
        except (OSError, ValueError):
            continue
    return None


def spare_memory() -> bool:
    """Whether at least SPARE_SHARE of the memory this process may use is free (`memory_left`): then a
    freed buffer may be kept for reuse. True where that is not known."""
    left = memory_left()
    return left is None or left[0] >= SPARE_SHARE * left[1]
