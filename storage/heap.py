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
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 32 << 20
"""Allocations up to this size come from the heap (glibc's dynamic threshold stops here on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""The heap keeps up to this much freed memory at its top for reuse before handing it back."""

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
