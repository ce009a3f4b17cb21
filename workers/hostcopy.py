"""Copies between the device and the host that the training loop does not wait for.

Reading a parameter into host memory the plain way (`t.to("cpu")`) blocks the Python thread until
the device has run everything queued before it: on a GPU, a sync at every send that leaves the
device idle while the host catches up, then the host idle while the copy crawls through pageable
memory. A snapshot here instead:

1. clones the values on the device, on the compute stream, in queue order (a device-to-device copy:
   the values are those after the optimizer step just queued, and the next step may overwrite the
   parameters without waiting for anything);
2. records an event on the compute stream and hands the clones to a thread of its own (the lander),
   and returns at once;
3. the lander copies the clones into pinned host buffers on a side stream that first waits for that
   event (`non_blocking`), records an event, and marks the clones as used by the side stream, so
   that the caching allocator does not hand their memory out before the copy is done. Pinned memory
   comes from torch's cache, and when more snapshots are alive than ever before, from the driver:
   100 MB of it took 150 ms on an H200, on the training thread when it allocated them there;
4. whoever reads the values (the uploader's thread that computes the delta, the stager's) waits for
   the lander, then for the event: `Snapshot.wait()`, off the training thread or long after.

The other way (a merge): the host computes what to add (`global - anchor`, where both live) into a
pinned buffer, which goes to the device `non_blocking` on the compute stream, where the parameter
is updated in place: `p += value` queued behind the copy. The device never waits for the host and
the host never waits for the device.

On the CPU there are no streams (`HostCopies(cpu)` has none): the clone is the snapshot, `wait`
returns at once, nothing is pinned. The stream logic itself (which stream waits for which, when the
event is recorded, that clones are kept alive) is tested on the CPU through the `Streams` seam with
a recorder; what no machine here can test is real concurrency on a device.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch


class Streams(Protocol):
    """What `HostCopies` needs of a device's streams and events (torch.cuda and alike provide it)."""

    def current(self) -> Any:
        """The compute stream: where the training loop queues its work."""

    def side(self) -> Any:
        """The stream copies to the host are queued on."""

    def using(self, stream: Any) -> Any:
        """A context in which copies are queued on `stream`."""

    def record(self, stream: Any) -> Any:
        """An event recorded on `stream` now (it has `.synchronize()` and `.query()`)."""

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor`, allocated on another stream, is in use by `stream` until its queued work is done."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A host buffer the device copies to and from without staging: pinned memory."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on `stream` from now on waits for `event` (the device waits, not the host)."""


class DeviceStreams:
    """`Streams` of an accelerator (CUDA, or any backend with torch's stream and event API)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = torch.get_device_module(device)
        self._side = self._module.Stream(device=device)

    def current(self) -> Any:
        return self._module.current_stream(self.device)

    def side(self) -> Any:
        return self._side

    def using(self, stream: Any) -> Any:
        return self._module.stream(stream)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)


class Snapshot:
    """Host copies of some parameters (or a state tree's tensors: `HostCopies.tree_to_host`),
    possibly still on their way from the device. Read them with `wait()` (from any thread); never
    changed in place once taken."""

    __slots__ = ("_values", "_event", "_queued", "_error")

    def __init__(self, values: Any, event: Any = None, *, queued: threading.Event | None = None) -> None:
        self._values = values
        self._event = event
        self._queued = queued
        """Set once the lander has queued the copies (`_land`); None: queued when made."""
        self._error: BaseException | None = None

    def wait(self) -> dict[str, torch.Tensor]:
        """The values, once the copies have landed. Raises RuntimeError if they could not be made
        (no pinned memory left, the device lost)."""
        self._wait_queued()
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None
        return self._values

    def _wait_queued(self) -> None:
        if self._queued is not None:
            self._queued.wait()
            if self._error is not None:
                raise RuntimeError(f"a snapshot's copies to the host failed: {self._error!r}") from self._error

    def _land(self, values: dict[str, torch.Tensor] | None, event: Any, error: BaseException | None = None) -> None:
        """The lander queued the copies into `values` (`event` follows them), or failed with `error`."""
        self._values, self._event, self._error = values, event, error
        assert self._queued is not None
        self._queued.set()

    @property
    def unwaited(self) -> Any:
        """The values without waiting for the device: their contents are undefined until `wait()`
        returns (to hand them to the thread that waits)."""
        self._wait_queued()
        return self._values

    @property
    def landed(self) -> bool:
        """The copies are done (reading the values would not wait)."""
        if self._queued is not None and not self._queued.is_set():
            return False
        event = self._event
        return event is None or bool(event.query())


class HostCopies:
    """Snapshots of a device's tensors on the host, and host values staged for the device; see the
    module docstring. `streams=None` on the CPU: copies are plain and immediate."""

    def __init__(self, device: torch.device, streams: Streams | None = None) -> None:
        self.device = device
        self.streams = streams if streams is not None or device.type == "cpu" else DeviceStreams(device)
        self._lander: _Lander | None = None
        self._lock = threading.Lock()

    def snapshot(self, clones: Mapping[str, torch.Tensor]) -> Snapshot:
        """Host copies of `clones`: tensors that the caller made for this (device-side clones of
        parameters, queued on the compute stream) and does not use again, each copied in its own
        dtype. On the CPU they are the snapshot."""
        streams = self.streams
        if streams is None:
            return Snapshot(dict(clones))
        ready = streams.record(streams.current())  # the clones' values are queued before it
        snapshot = Snapshot(None, queued=threading.Event())
        with self._lock:
            if self._lander is None:
                self._lander = _Lander(streams)
                self._lander.start()
            self._lander.jobs.put((snapshot, dict(clones), ready))
        return snapshot

    def close(self) -> None:
        """Stop the lander once it has queued every snapshot's copies (a snapshot's reader waits for
        them), and join it: a thread inside a torch op when the interpreter exits aborts the process."""
        with self._lock:
            lander, self._lander = self._lander, None
        if lander is not None:
            lander.jobs.put(None)
            lander.join()

    def tree_to_host(self, tree: Any) -> Snapshot:
        """A host copy of every tensor in `tree` (dicts, lists and tuples of tensors and plain values:
        a state dict), same dtypes, without waiting: on a device the copies go to pinned memory on
        the side stream, behind what the compute stream has queued. The live tensors must not change
        until the copies are done: call `before_write(snapshot)` before the work that changes them
        (the next optimizer step) is queued. On the CPU the copies are made now."""
        streams = self.streams
        if streams is None:
            return Snapshot(_map_tensors(tree, lambda t: t.detach().clone()))
        side = streams.side()
        side.wait_stream(streams.current())

        def copy(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != self.device.type:  # kept on the host by its optimizer (AdamW's step count)
                return t.detach().clone()
            buffer = streams.host_empty(tuple(t.shape), t.dtype)
            buffer.copy_(t.detach(), non_blocking=True)
            return buffer

        with streams.using(side):
            host = _map_tensors(tree, copy)
            event = streams.record(side)
        return Snapshot(host, event)

    def before_write(self, snapshot: Snapshot) -> None:
        """The tensors `snapshot` copied are about to change: the compute stream waits (on the device)
        for the copies still running; the host waits for nothing."""
        event = snapshot._event
        if self.streams is not None and event is not None:
            self.streams.wait(self.streams.current(), event)

    def reserve(self, tensors: Iterable[torch.Tensor], sets: int = 2) -> None:
        """Pinned host memory for `sets` snapshots of `tensors` (their shapes and dtypes), allocated
        now and handed back to torch's pinned-memory cache: the step hook's snapshots then reuse it
        instead of allocating pinned memory on the training thread (a fresh 100 MB of it takes tens
        of ms)."""
        if self.streams is None:
            return
        held = [self.streams.host_empty(tuple(t.shape), t.dtype) for _ in range(sets) for t in tensors]
        del held

    def host_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An fp32 host buffer to compute values for the device into (pinned on a device)."""
        if self.streams is None:
            return torch.empty(shape, dtype=torch.float32)
        return self.streams.host_empty(shape)

    def for_thread(self) -> Streams | None:
        """Streams for copies made on another thread (`workers.staging`): on a device, a side stream of
        its own, so that its copies never queue behind the snapshots'."""
        if isinstance(self.streams, DeviceStreams):
            return DeviceStreams(self.device)
        return self.streams

    def on_compute(self, value: torch.Tensor) -> torch.Tensor:
        """`value`, already on the device (made on another stream and waited for: `workers.staging`),
        used by the compute stream: its memory is not handed out again before what is queued there
        now is done."""
        if self.streams is not None:
            self.streams.keep_alive(value, self.streams.current())
        return value

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (a host tensor, best from `host_empty`) on the device, queued on the compute
        stream without waiting: what is queued after it there sees it."""
        if self.streams is None:
            return value
        return value.to(self.device, non_blocking=True)


class _Lander(threading.Thread):
    """Queues each snapshot's copies to the host (`HostCopies.snapshot`), in the order they were taken,
    on the side stream: the pinned memory they need is allocated on this thread, never the training
    thread's."""

    def __init__(self, streams: Streams) -> None:
        super().__init__(name="snapshot-lander", daemon=True)
        self.streams = streams
        self.jobs: queue.SimpleQueue[tuple[Snapshot, dict[str, torch.Tensor], Any] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            self._land(*job)
            del job  # holding nothing between jobs: the clones and buffers belong to the snapshot's readers

    def _land(self, snapshot: Snapshot, clones: dict[str, torch.Tensor], ready: Any) -> None:
        streams = self.streams
        side = streams.side()
        try:
            streams.wait(side, ready)
            host: dict[str, torch.Tensor] = {}
            with streams.using(side):
                for name, clone in clones.items():
                    buffer = streams.host_empty(tuple(clone.shape), clone.dtype)
                    buffer.copy_(clone, non_blocking=True)
                    streams.keep_alive(clone, side)  # the device clone goes back to the allocator once copied
                    host[name] = buffer
                event = streams.record(side)
            snapshot._land(host, event)
        except Exception as exc:  # noqa: BLE001 (its reader raises it, the snapshots after it go on)
            snapshot._land(None, None, exc)


def _map_tensors(tree: Any, fn: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree
