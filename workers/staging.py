"""A fetched version's values, made ready to blend before the training loop asks for them.

Taking a version costs arithmetic the training thread should not do: with the rebase rule the value
added to the parameters is `G - anchor` (the new global values minus those of the learner's last
send), a subtraction over the whole fragment, and on a device it must then cross to the device. Done
in the step hook, that is a stall on every step that takes a version (150-200 ms for a 124M model on
a GPU, where a step takes 45 ms).

A thread of its own does it instead (`Stager`), as soon as the fetcher has downloaded a version:

- on a device, the subtraction runs in chunks through two pinned host buffers, allocated once and
  reused, each chunk copied to a device tensor on a stream of the stager's own, and the thread waits
  for the copies: the staged values are on the device before the training loop sees them. Taking
  the version is then one in-place add per parameter, queued on the compute stream (`Replica.blend`).
  Pinned memory: two chunks, whatever the model's size; device memory: the fragments staged and not
  yet taken (usually none or one).
- on the CPU, the difference goes into a buffer reused from one take to the next (`Staged.release`,
  `workers.scratch`): writing into fresh memory costs page faults that a warm buffer does not
  (a 38.6M-float subtraction: 169 ms into fresh memory, 22 ms warm).

A staged value is only right for the anchor it was computed against (`Staged.anchor`: the learner's
snapshot at its send, the same object). When the learner sends the fragment again before taking the
version (a round slower than H steps), the send asks for it again against the new anchor
(`Stager.submit` once more), and the step hook waits a few steps for it rather than compute it on
the training thread (`Slot.pending`); past that, or if the anchor still differs, the hook computes it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from diloco.storage import heap
from diloco.storage.intraop import Pacer, pace, paced_slices
from diloco.workers.hostcopy import HostCopies, Snapshot
from diloco.workers.scratch import Scratch
from diloco.workers.threads import ThreadLimits

log = logging.getLogger(__name__)

POOL_BYTES = 256 << 20
"""At most this much of the CPU path's staged buffers is kept for reuse, over all fragments: a
fresh buffer costs its page faults on the stager's thread, not the loop's, and one per fragment
kept for good would be a second fp32 copy of the model (4 GB at 1B parameters)."""

CHUNK_ELEMS = 1 << 22
"""Elements per pinned chunk (16 MiB of fp32): large enough for full-speed copies, small enough that
two of them are nothing beside the model."""


class Staged:
    """Values to blend into one fragment: where the parameters live, ready to use. `anchor` is the
    snapshot they were computed against (None: the fetched values themselves)."""

    __slots__ = ("version", "anchor", "values", "_give_back")

    def __init__(self, version: int, anchor: Snapshot | None, values: dict[str, torch.Tensor],
                 give_back: Callable[[dict[str, torch.Tensor]], None] | None = None) -> None:
        self.version, self.anchor, self.values, self._give_back = version, anchor, values, give_back

    def release(self) -> None:
        """The values were blended (or will not be): a reused buffer goes back to its fragment's pool."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back(self.values)


class Slot:
    """Where one fetched version's staged value waits for the step hook: filled by the stager's
    thread, claimed once by the hook (or released unclaimed when a newer version replaces it). Each
    request for a value has a generation: a value computed for an older request (against an anchor
    replaced since) is released, not offered."""

    __slots__ = ("_lock", "_staged", "_asked", "_answered", "_closed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: Staged | None = None
        self._asked = self._answered = 0
        self._closed = False

    @property
    def pending(self) -> bool:
        """A value was asked for and is not computed yet."""
        return self._asked != self._answered

    def ask(self) -> int | None:
        """A new request (the anchor changed): drops the value held; None once claimed."""
        with self._lock:
            if self._closed:
                return None
            old, self._staged = self._staged, None
            self._asked += 1
            generation = self._asked
        if old is not None:
            old.release()
        return generation

    def offer(self, staged: Staged | None, generation: int) -> None:
        """The stager's answer to request `generation` (None: nothing to stage)."""
        with self._lock:
            drop = staged
            if not self._closed and generation == self._asked:
                drop, self._staged, self._answered = self._staged, staged, generation
        if drop is not None:
            drop.release()

    def claim(self) -> Staged | None:
        """The step hook takes the version: the value if one is ready (it is the hook's to release)."""
        with self._lock:
            self._closed = True
            staged, self._staged = self._staged, None
            self._answered = self._asked
        return staged

    def release(self) -> None:
        """Not taken after all."""
        staged = self.claim()
        if staged is not None:
            staged.release()


AnchorOf = Callable[[int, int], "tuple[Snapshot | None, Sequence[str]] | None"]
"""(fragment, version) -> the anchor to stage the version against and the fragment's parameter
names, or None when the version will not be taken (older than the learner's base)."""


class Stager(threading.Thread):
    """Stages fetched versions for one learner's device on a thread of its own (see the module
    docstring): `submit` from any thread; `Staged.release` from the training thread."""

    def __init__(self, copies: HostCopies, anchor_of: AnchorOf | None = None, *, chunk_elems: int = CHUNK_ELEMS,
                 limits: ThreadLimits = ThreadLimits()) -> None:
        super().__init__(name="stager", daemon=True)
        self.anchor_of = anchor_of
        self.limits = limits
        """What this thread may take of the machine (`workers.threads`), applied as it starts."""
        self.pacer: Pacer | None = None
        """Its pacer, once started, when its work is paced (`ThreadLimits.share`)."""
        self.cpu_s = 0.0
        """This thread's CPU time, in total."""
        self._jobs: dict[int, tuple[int, Mapping[str, torch.Tensor], Slot, int]] = {}  # fragment -> newest request
        self._cond = threading.Condition()
        self._closed = False
        self.device = copies.device
        self.chunk_elems = chunk_elems
        self._streams = copies.for_thread()  # None on the CPU
        self._chunks: list[torch.Tensor] = []  # two pinned buffers, allocated on first use
        self._events: list[Any] = [None, None]  # the copy out of each chunk buffer, still running
        self.scratch = Scratch(keep=None, max_bytes=POOL_BYTES, min_elements=0)
        """The CPU path's buffers free for reuse, over all fragments (`workers.scratch`)."""

    def submit(self, fragment: int, version: int, params: Mapping[str, torch.Tensor], slot: Slot) -> None:
        """Stage `version` of `fragment` into `slot` against the fragment's anchor of the moment it is
        computed; a newer request for the fragment replaces one not started."""
        generation = slot.ask()
        if generation is None:
            return  # taken already
        with self._cond:
            replaced = self._jobs.pop(fragment, None)
            self._jobs[fragment] = (version, params, slot, generation)
            self._cond.notify_all()
        if replaced is not None and replaced[2] is not slot:
            replaced[2].offer(None, replaced[3])

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def run(self) -> None:
        self.pacer = self.limits.apply()
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    jobs, self._jobs = list(self._jobs.values()), {}
                    for _, _, slot, generation in jobs:
                        slot.offer(None, generation)
                    return
                fragment = next(iter(self._jobs))
                version, params, slot, generation = self._jobs.pop(fragment)
            cpu = time.thread_time()
            staged = None
            try:
                what = self.anchor_of(fragment, version) if self.anchor_of is not None else None
                if what is not None and slot.pending:
                    staged = self.stage(fragment, version, params, what[1], what[0])
            except Exception as exc:  # noqa: BLE001 (the step hook computes it instead)
                log.warning("fragment %d: version %d could not be made ready here (%s): the training loop will "
                            "compute it", fragment, version, exc)
            slot.offer(staged, generation)
            self.cpu_s += time.thread_time() - cpu
            del params, staged
            heap.fit()

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
        buffer, out = self.scratch.views({n: params[n].shape for n in names})
        for n in names:
            into, got, had = out[n].view(-1), params[n].reshape(-1), base[n].reshape(-1)
            for part in paced_slices(into.numel()):
                torch.sub(got[part], had[part], out=into[part])
        return Staged(version, anchor, out, functools.partial(self._give_back, buffer))

    def _give_back(self, buffer: torch.Tensor, _values: dict[str, torch.Tensor]) -> None:
        """A released value's buffer goes back for reuse while the kept ones hold under POOL_BYTES."""
        self.scratch.give(buffer)

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
            pace()
        return out


