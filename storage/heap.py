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
cgroup, is still free, and `workers.scratch` keeps a freed buffer only then.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

MMAP_THRESHOLD = 32 << 20
"""Allocations up to this size come from the heap (glibc's dynamic threshold stops here on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""The heap keeps up to this much freed memory at its top for reuse before handing it back."""
SPARE_SHARE = 0.25
"""What `spare_memory` wants free, as a share of the memory this process may use: below it, buffers
kept for reuse (`workers.scratch`) are given back."""

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
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only; musl has a mallopt that does nothing)
    except (OSError, AttributeError):
        return "left as is: the C library is not glibc"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "left as is: mallopt refused the thresholds"
    return f"heap allocations up to {MMAP_THRESHOLD >> 20} MiB, up to {TRIM_THRESHOLD >> 20} MiB of freed heap kept"


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
