"""Fragment-sized float32 buffers that the uploader's thread reuses from one piece to the next.

Each piece needs up to two fragments' worth of float32 temporaries: the delta (`global - local`,
`UploadJob.settle`) and, for float32 parameters, what the codec lost of it (the next residual,
`codecs.encode_lost`; a bf16 parameter's is written in bf16, a tensor of its own). Both are freed
after the piece is stored, so without reuse each piece maps them fresh.

A large tensor that a thread other than the main one allocates does not come from glibc's main heap.
A thread's arena grows in heaps of at most 64 MiB, so a larger block is mapped on its own and
unmapped when freed. The kernel faults in and zeroes each 4 KiB page again on its first write. On a
VM whose balloon reports freed memory to the host, each such fault goes to the host as well. For a
GPT-2-small embedding (38.6M values, 154 MB) that is 37,700 faults per tensor. On one CPU, the
learner's transfer threads spent 74-94 ms of CPU a step this way, against 31-36 ms with every
thread on the main arena (`MALLOC_ARENA_MAX=1`: no faults).

`Scratch` keeps the buffers instead. A piece's tensors are views of one flat buffer per use, the
smallest free one that is large enough (fragments are balanced, so one fragment's buffer serves
another's), and the buffer is given back once nothing reads it. At most `keep` buffers wait (and
at most `max_bytes` of them), so what is kept is what the next piece would allocate anyway. The
stager's host buffers (`workers.staging`) are kept the same way.

A kept buffer is memory the process could do without: none is kept, and those kept are freed, while
less than a quarter of the memory the process may use is free (`storage.heap.spare_memory`): a
1B-parameter learner on 24 GB has under 1 GB to spare, and its uploader kept two 252 MB buffers.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping

import torch

from diloco.storage.heap import spare_memory

MIN_ELEMENTS = 1 << 20
"""A buffer of fewer elements is not kept: glibc reuses small blocks by itself."""


class Scratch:
    """Flat float32 CPU buffers taken (`views`) and given back (`give`) by their one user. Thread-safe."""

    def __init__(self, keep: int | None = 2, *, max_bytes: int | None = None, min_elements: int = MIN_ELEMENTS,
                 spare: Callable[[], bool] = spare_memory) -> None:
        self.keep, self.max_bytes, self.min_elements = keep, max_bytes, min_elements
        self.spare = spare
        """Whether memory is plentiful enough to keep a freed buffer (asked at each `give`)."""
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.reused = 0
        """Buffers handed out again instead of allocated."""
        self.released = 0
        """Buffers freed because memory ran short (`spare`), kept ones included."""

    def views(self, shapes: Mapping[str, tuple[int, ...] | torch.Size]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A flat buffer of at least `shapes`' elements, and a contiguous view of it per name in order.
        The contents are undefined: the caller writes every element. Give the buffer back (`give`)
        once no view is read any more."""
        total = sum(math.prod(s) for s in shapes.values())
        base = self._take(total)
        views, at = {}, 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            views[name] = base[at:at + n].view(shape)
            at += n
        return base, views

    def give(self, base: torch.Tensor) -> None:
        """Take back a buffer from `views`. The caller guarantees that nothing reads it, or any view
        of it, from now on: the next `views` overwrites it. One that would pass `keep` or `max_bytes`
        is not kept (freed); while memory is short (`spare`), neither it nor any kept one is."""
        if base.numel() < self.min_elements:
            return
        plenty = self.spare()  # reads the machine's figures: outside the lock
        with self._lock:
            if any(b is base for b in self._free):
                raise ValueError("a scratch buffer given back twice")
            if not plenty:
                self.released += 1 + len(self._free)
                self._free = []
                return
            full = self.keep is not None and len(self._free) >= self.keep
            if full or (self.max_bytes is not None and _bytes(self._free) + _bytes([base]) > self.max_bytes):
                return
            self._free.append(base)

    def _take(self, n: int) -> torch.Tensor:
        if n >= self.min_elements:
            with self._lock:
                fits = [b for b in self._free if b.numel() >= n]
                if fits:
                    best = min(fits, key=torch.Tensor.numel)
                    self._free = [b for b in self._free if b is not best]
                    self.reused += 1
                    return best  # whole: given back whole
        return torch.empty(n, dtype=torch.float32)

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers waiting to be reused."""
        with self._lock:
            return _bytes(self._free)


def _bytes(buffers: list[torch.Tensor]) -> int:
    return sum(b.numel() * b.element_size() for b in buffers)
