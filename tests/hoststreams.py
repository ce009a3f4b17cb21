"""A `workers.hostcopy.Streams` over CPU tensors that records what a device would be asked to do,
and by which thread and at which step: the step hook's stream logic, checked on a machine with no
device (tests/unit/test_hostcopy.py, tests/integration/test_step_hook.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class Stream:
    name: str
    log: list[tuple] = field(repr=False)

    def wait_stream(self, other: Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))


@dataclass
class Event:
    stream: str
    step: int
    """The learner's step when the event was recorded."""
    waits: list[tuple[str, int]] = field(default_factory=list)
    """(thread name, step) of every `synchronize`."""
    clock: Callable[[], int] = field(default=lambda: 0, repr=False)

    def synchronize(self) -> None:
        self.waits.append((threading.current_thread().name, self.clock()))

    def query(self) -> bool:
        return bool(self.waits)


class RecordingStreams:
    def __init__(self, step: Callable[[], int] = lambda: 0) -> None:
        self.step = step
        self.log: list[tuple] = []
        self.events: list[Event] = []
        self._compute, self._side = Stream("compute", self.log), Stream("side", self.log)
        self._on = "compute"

    def current(self) -> Stream:
        return self._compute

    def side(self) -> Stream:
        return self._side

    @contextmanager
    def using(self, stream: Stream) -> Iterator[None]:
        before, self._on = self._on, stream.name
        self.log.append(("using", stream.name))
        try:
            yield
        finally:
            self._on = before
            self.log.append(("done", stream.name))

    def record(self, stream: Stream) -> Event:
        self.log.append(("record", stream.name, self._on))
        event = Event(stream.name, self.step(), clock=self.step)
        self.events.append(event)
        return event

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        self.log.append(("keep_alive", tuple(tensor.shape), stream.name, self._on))

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self.log.append(("host_empty", shape, self._on))
        return torch.empty(shape, dtype=dtype)

    def wait(self, stream: Stream, event: Event) -> None:
        self.log.append(("wait_event", stream.name, event.stream))
