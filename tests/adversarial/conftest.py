"""Fixtures of the hostile-learner group: `rig` and `make_rig` (a `rig.Rig` each, closed after the test)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest

from diloco.storage.settings import Endpoints
from rig import Rig


@pytest.fixture
def make_rig(endpoints: Endpoints, run_id: str, caplog: pytest.LogCaptureFixture) -> Iterator[Callable[..., Rig]]:
    caplog.set_level(logging.WARNING, logger="diloco.coordinator")
    rigs: list[Rig] = []

    def make(**kw) -> Rig:
        rigs.append(Rig(endpoints, run_id, caplog, **kw))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    return make_rig()


