"""Helpers shared by the integration tests (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from coordinator.service import Coordinator


@contextmanager
def serving(coord: Coordinator) -> Iterator[None]:
    """The coordinator's loop in a background thread; its exception, if any, fails the test."""
    stop, failure = threading.Event(), []

    def loop() -> None:
        try:
            coord.serve(stop)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the test's thread)
            failure.append(exc)

    thread = threading.Thread(target=loop, name="coordinator", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
    if failure:
        raise failure[0]
