"""Shared fixtures: one real Redis + S3 stack per session, a fresh bucket and prefix per test.

Tests never touch a Redis or S3 they did not start: `stack` runs on free ports under pytest's
tmp dir. Isolation between tests is by name (a bucket, a prefix and a run id of their own),
never by flushing: a test that needs to stop or kill a server starts its own `LocalStack`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from diloco.infra.local.fleet import Proc, process_env
from diloco.infra.local.stack import LocalStack
from diloco.storage.settings import Endpoints
from harness import TASK, fresh_endpoints
from rig import Rig

_TESTS = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs real Redis and S3 server processes (tests/integration)")
    config.addinivalue_line("markers", "chaos: kills or restarts processes and servers (tests/chaos)")
    config.addinivalue_line("markers", "slow: left out of `make test` to keep it under 8 minutes; `make test-all` "
                            "(and CI) runs them")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path
        if (_TESTS / "integration") in path.parents:
            item.add_marker(pytest.mark.integration)
        if (_TESTS / "chaos") in path.parents:
            item.add_marker(pytest.mark.chaos)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Redis + S3 as real processes for the whole session. Do not stop or restart it in a test."""
    with LocalStack(tmp_path_factory.mktemp("stack")) as s:
        yield s


@pytest.fixture
def endpoints(stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> Endpoints:
    """The session stack with a bucket and a key prefix of this test's own; AWS_* env set for boto3."""
    return fresh_endpoints(stack, monkeypatch)


@pytest.fixture
def run_id() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fleet_env(stack: LocalStack, endpoints: Endpoints, tmp_path: Path) -> Iterator[tuple[dict[str, str], list[Proc]]]:
    """The environment for `diloco` processes on this test's bucket, and a list of processes
    that are SIGKILLed at the end of the test whatever happened."""
    (tmp_path / "task.json").write_text(json.dumps(TASK.to_wire()))
    env = process_env(endpoints.to_env() | {k: v for k, v in stack.env().items() if k.startswith("AWS_")})
    procs: list[Proc] = []
    yield env, procs
    for p in procs:
        p.kill()


@pytest.fixture
def own_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LocalStack, dict[str, str], list[Proc]]]:
    """A stack of this test's own, which it may stop, restart or empty (never the session's); the
    env for `diloco` processes on it (task.json written as for `fleet_env`); and a process list
    SIGKILLed at the end whatever happened."""
    (tmp_path / "task.json").write_text(json.dumps(TASK.to_wire()))
    procs: list[Proc] = []
    with LocalStack(tmp_path / "stack") as stack:
        for name, value in stack.env().items():
            if name.startswith("AWS_"):
                monkeypatch.setenv(name, value)  # for the test's own S3 reads
        try:
            yield stack, process_env(stack.env()), procs
        finally:
            for p in procs:
                p.kill()


# A real coordinator on the session's servers, driven a step at a time (`rig.Rig`), closed after the test.
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


