"""A fetched version's values, made ready to blend before the training loop asks for them.

Taking a version costs arithmetic the training thread should not do: with the rebase rule the value
added to the parameters is `G - anchor` (the new global values minus those of the learner's last
send), a subtraction over the whole fragment, and on a device it must then cross to the device. Done
in the step hook, that is a stall on every step that takes a version (150-200 ms for a 124M model on
a GPU, where a step takes 45 ms).

The fetcher's thread does it instead, as soon as a version has been downloaded (`Stager.stage`):

- on a device, the subtraction runs in chunks through two pinned host buffers, allocated once and
  reused, each chunk copied to a device tensor on a stream of the stager's own, and the thread waits
  for the copies: the staged values are on the device before the training loop sees them. Taking
  the version is then one in-place add per parameter, queued on the compute stream (`Replica.blend`).
  Pinned memory: two chunks, whatever the model's size; device memory: the fragments staged and not
  yet taken (usually none or one).
- on the CPU, the difference goes into a buffer of the fragment's own, reused from one take to the
  next (`Staged.release`): writing into fresh memory costs page faults that a warm buffer does not
  (a 38.6M-float subtraction: 169 ms into fresh memory, 22 ms warm).

A staged value is only used for the anchor it was computed against (`Staged.anchor`: the learner's
snapshot at its send, the same object): when the learner has sent again meanwhile, the step hook
computes the difference itself, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diloco.workers.hostcopy import HostCopies, Snapshot

CHUNK_ELEMS = 1 << 22
"""Elements per pinned chunk (16 MiB of fp32): large enough for full-speed copies, small enough that
two of them are nothing beside the model."""


class Staged:
    """Values to blend into one fragment: where the parameters live, ready to use. `anchor` is the
    snapshot they were computed against (None: the fetched values themselves)."""

    __slots__ = ("version", "anchor", "values", "_pool")

    def __init__(self, version: int, anchor: Snapshot | None, values: dict[str, torch.Tensor],
                 pool: list[dict[str, torch.Tensor]] | None = None) -> None:
        self.version, self.anchor, self.values, self._pool = version, anchor, values, pool

    def release(self) -> None:
        """The values were blended (or will not be): a reused buffer goes back to its fragment."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.append(self.values)


class Stager:
    """Stages fetched versions for one learner's device (see the module docstring). Called from the
    fetcher's thread only; `Staged.release` from the training thread."""

    def __init__(self, copies: HostCopies, *, chunk_elems: int = CHUNK_ELEMS) -> None:
        self.device = copies.device
        self.chunk_elems = chunk_elems
        self._streams = copies.for_thread()  # None on the CPU
        self._chunks: list[torch.Tensor] = []  # two pinned buffers, allocated on first use
        self._events: list[Any] = [None, None]  # the copy out of each chunk buffer, still running
        self._pools: dict[int, list[dict[str, torch.Tensor]]] = {}  # CPU: fragment -> buffers free for reuse
        self._lock = threading.Lock()

    def stage(self, fragment: int, version: int, params: Mapping[str, torch.Tensor], names: Sequence[str],
              anchor: Snapshot | None) -> Staged:
        """`params - anchor` (or `params` where `anchor` is None) for `names`, where the parameters live."""
        if self._streams is None:
            return self._stage_host(fragment, version, params, names, anchor)
        base = anchor.wait() if anchor is not None else None
        values = {n: self._to_device(params[n], None if base is None else base[n]) for n in names}
        for i, event in enumerate(self._events):
            if event is not None:
                event.synchronize()  # this thread waits, not the training loop's
                self._events[i] = None
        return Staged(version, anchor, values)

    def _stage_host(self, fragment: int, version: int, params: Mapping[str, torch.Tensor], names: Sequence[str],
                    anchor: Snapshot | None) -> Staged:
        if anchor is None:
            return Staged(version, None, {n: params[n] for n in names})
        base = anchor.wait()
        with self._lock:
            pool = self._pools.setdefault(fragment, [])
            out = pool.pop() if pool else None
        if out is None or any(out[n].shape != params[n].shape for n in names):
            out = {n: torch.empty(params[n].shape, dtype=torch.float32) for n in names}
        for n in names:
            torch.sub(params[n], base[n], out=out[n])
        return Staged(version, anchor, out, pool)

    def _to_device(self, value: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
        """`value - base` (or `value`) in a new fp32 tensor on the device, through the pinned chunks."""
        streams = self._streams
        side = streams.side()
        with streams.using(side):  # allocated for the side stream: the copies into it are queued there
            out = torch.empty(value.shape, dtype=torch.float32, device=self.device)
        src, flat_out = value.reshape(-1), out.view(-1)
        sub = None if base is None else base.reshape(-1)
        if not self._chunks:
            self._chunks = [streams.host_empty((self.chunk_elems,)) for _ in range(2)]
        n = src.numel()
        for k, start in enumerate(range(0, n, self.chunk_elems)):
            i = k % 2
            if self._events[i] is not None:
                self._events[i].synchronize()  # the chunk buffer's last copy has left it
            stop = min(start + self.chunk_elems, n)
            chunk = self._chunks[i][: stop - start]
            if sub is None:
                chunk.copy_(src[start:stop])
            else:
                torch.sub(src[start:stop], sub[start:stop], out=chunk)
            with streams.using(side):
                flat_out[start:stop].copy_(chunk, non_blocking=True)
                self._events[i] = streams.record(side)
        return out
