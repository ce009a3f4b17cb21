"""A wrong storage setting ends `diloco learner` and `diloco coordinator` within seconds, with one
line that names the setting to check and no traceback (`-v` shows it).

Each case starts both roles as processes against real servers: the session stack (plaintext Redis,
S3 over HTTP) and a Redis of this module's own that requires a password and speaks TLS only (needs
a redis-server built with TLS: the cases that use it skip without one, as tests/integration/
test_security.py does). A mistake retrying cannot fix exits at once; a server that does not answer
(refused, unknown host) is retried for `--reach-timeout-s` first (10 s by default).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from diloco.infra.local.fleet import diloco_command, process_env
from diloco.infra.local.stack import LocalStack, StackError, find_redis_server, free_ports

STARTUP_S = 25.0
"""The most starting a role may take before it reaches the servers: importing torch takes 3-5 s on an
idle machine, far longer on a busy one. A mistake found at once is also told apart by its log: it has
no line of retrying."""
QUICK = {"DILOCO_REACH_TIMEOUT_S": "1"}
"""For the cases retried until the deadline: the default one is tested once (test_default_deadline)."""


@dataclass(frozen=True)
class Servers:
    env: dict[str, str]
    """The session stack's settings and credentials."""
    tls: LocalStack | None
    """The password-and-TLS Redis (None without a redis-server built with TLS)."""

    def need_tls(self) -> LocalStack:
        if self.tls is None:
            if os.environ.get("DILOCO_TEST_REQUIRE_TLS"):
                pytest.fail("DILOCO_TEST_REQUIRE_TLS is set but no redis-server with TLS was found")
            pytest.skip("no redis-server built with TLS")
        return self.tls


@pytest.fixture(scope="module")
def servers(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    try:
        find_redis_server(tls=True)
    except StackError:
        yield Servers(stack.env(), None)
        return
    with LocalStack(tmp_path_factory.mktemp("tls"), redis_user="trainer", redis_password=secrets.token_urlsafe(18),
                    redis_tls=True) as tls:
        yield Servers(stack.env(), tls)


def _closed_port() -> int:
    return free_ports(1)[0]


def _tls_url(s: Servers, password: str | None = None, *, scheme: str = "rediss", trust: bool = True) -> str:
    tls = s.need_tls()
    query = f"?ssl_ca_certs={tls.redis_ca}&ssl_cert_reqs=required" if trust else ""
    return f"{scheme}://trainer:{password or tls.redis_password}@127.0.0.1:{tls.redis_port}/0{query}"


# name -> (what to change in the environment, what the last line must name, whether the coordinator fails too)
CASES: dict[str, tuple[Callable[[Servers], dict[str, str]], str, bool]] = {
    "redis refused": (lambda s: QUICK | {"DILOCO_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0"},
                      "refused the connection: is Redis running, and are the host and port in DILOCO_REDIS_URL", True),
    "redis unknown host": (lambda s: QUICK | {"DILOCO_REDIS_URL": "redis://no-such-host.invalid:6379/0"},
                           "unknown host 'no-such-host.invalid': check the host in DILOCO_REDIS_URL", True),
    "redis wrong password": (lambda s: {"DILOCO_REDIS_URL": _tls_url(s, "not-the-password")},
                             "refused the user or password", True),
    "rediss to a plaintext redis": (lambda s: {"DILOCO_REDIS_URL": s.env["DILOCO_REDIS_URL"].replace("redis:", "rediss:")},
                                    "the server speaks plaintext, not TLS: use redis:// in DILOCO_REDIS_URL", True),
    "redis to a TLS-only redis": (lambda s: {"DILOCO_REDIS_URL": _tls_url(s, scheme="redis", trust=False)},
                                  "the server speaks TLS only: use rediss:// in DILOCO_REDIS_URL", True),
    "untrusted redis certificate": (lambda s: {"DILOCO_REDIS_URL": _tls_url(s, trust=False)},
                                    "presented a TLS certificate this client does not trust", True),
    "redis url names the s3 port": (lambda s: {"DILOCO_REDIS_URL": "redis://" + s.env["DILOCO_S3_ENDPOINT"][7:] + "/0"},
                                    "is not Redis, or not one this client can use", True),
    "s3 unknown access key": (lambda s: {"AWS_ACCESS_KEY_ID": "nobody"},
                              "does not know the access key 'nobody': check AWS_ACCESS_KEY_ID", True),
    "s3 wrong secret": (lambda s: {"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
                        "refused the signature made with access key 'diloco': check AWS_SECRET_ACCESS_KEY", True),
    # The coordinator creates a missing bucket; a learner names it.
    "s3 missing bucket": (lambda s: {"DILOCO_S3_BUCKET": "no-such-bucket"},
                          "has no bucket 'no-such-bucket': check DILOCO_S3_BUCKET", False),
    "https to an http s3": (lambda s: {"DILOCO_S3_ENDPOINT": s.env["DILOCO_S3_ENDPOINT"].replace("http:", "https:")},
                            "the server does not speak TLS: use http:// in DILOCO_S3_ENDPOINT", True),
    # Any TLS server shows it: the TLS-only Redis stands in for an S3 behind HTTPS.
    "http to a TLS server": (lambda s: {"DILOCO_S3_ENDPOINT": f"http://127.0.0.1:{s.need_tls().redis_port}"},
                             "the server speaks TLS: use https:// in DILOCO_S3_ENDPOINT", True),
    "s3 refused": (lambda s: QUICK | {"DILOCO_S3_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"},
                   "refused the connection: is the S3 server running, and are the host and port in "
                   "DILOCO_S3_ENDPOINT", True),
    "s3 unknown host": (lambda s: QUICK | {"DILOCO_S3_ENDPOINT": "http://no-such-host.invalid:9000"},
                        "unknown host 'no-such-host.invalid': check DILOCO_S3_ENDPOINT", True),
}
SLOW = {"redis refused", "redis unknown host", "rediss to a plaintext redis", "untrusted redis certificate", "redis url names the s3 port",
        "s3 unknown access key", "http to a TLS server", "s3 refused", "s3 unknown host", "redis wrong password",
        "redis to a TLS-only redis", "https to an http s3", "s3 missing bucket"}
"""Kinds that add little to the others (`make test-all` runs them): `make test` keeps one, refused at
once (s3 wrong secret); the retried kinds are all in `make test-slow`, so that `make test` stays
under 8 minutes."""


def role_argv(role: str, *extra: str) -> list[str]:
    run = ("--run", f"t-{secrets.token_hex(4)}")
    more = ("--learner-id", "l0", "--steps", "3") if role == "learner" else ()
    return diloco_command(*extra, role, *run, *more)


@dataclass
class Ended:
    role: str
    rc: int
    elapsed_s: float
    stderr: str

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""


def run_roles(env: dict[str, str], roles: tuple[str, ...], *extra: str, timeout_s: float = 60.0) -> list[Ended]:
    """Start each role at once with `env` over the session stack's; wait for all of them."""
    started = [(role, time.monotonic(), subprocess.Popen(role_argv(role, *extra), env=process_env(env), text=True,
                                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
               for role in roles]
    out = []
    for role, t0, p in started:
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            pytest.fail(f"diloco {role} still running after {timeout_s:.0f}s:\n{err[-3000:]}")
        out.append(Ended(role, p.returncode, time.monotonic() - t0, err))
    return out


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_a_wrong_setting_ends_both_roles_with_one_line_naming_it(servers, case):
    change, names, coordinator_fails = CASES[case]
    env = servers.env | change(servers)
    reach_s = float(env.get("DILOCO_REACH_TIMEOUT_S", 10))
    for ended in run_roles(env, ("learner", "coordinator") if coordinator_fails else ("learner",)):
        assert ended.rc == 1, (ended.role, ended.stderr[-3000:])
        assert names in ended.last_line, (ended.role, ended.stderr[-3000:])
        assert "Traceback" not in ended.stderr, (ended.role, ended.stderr[-3000:])
        assert ended.elapsed_s < STARTUP_S + reach_s + 4, (ended.role, ended.elapsed_s)
        if "DILOCO_REACH_TIMEOUT_S" in env:  # retried until the deadline
            assert "(for 1s; --reach-timeout-s waits longer)" in ended.last_line, ended.last_line
        else:  # not retried at all
            assert "retrying" not in ended.stderr and "waits longer" not in ended.stderr, ended.stderr[-3000:]
        if servers.tls is not None:
            assert servers.tls.redis_password not in ended.stderr


@pytest.mark.slow  # 10 s of retries per role
def test_default_deadline_is_about_ten_seconds(servers):
    env = servers.env | {"DILOCO_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0"}
    for ended in run_roles(env, ("learner", "coordinator")):
        assert ended.rc == 1 and "(for 10s; --reach-timeout-s waits longer)" in ended.last_line, ended.stderr[-3000:]
        assert "storage unreachable, retrying" in ended.stderr  # said while it waits
        assert 10 <= ended.elapsed_s < STARTUP_S + 14, (ended.role, ended.elapsed_s)


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_verbose_shows_the_traceback(servers):
    env = servers.env | {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    for ended in run_roles(env, ("learner", "coordinator"), "-v"):
        assert ended.rc == 1, ended.stderr[-3000:]
        assert "Traceback" in ended.stderr and "SignatureDoesNotMatch" in ended.stderr, ended.stderr[-3000:]
        assert "check AWS_SECRET_ACCESS_KEY" in ended.stderr


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_sigterm_while_waiting_for_the_servers_leaves_at_once(servers):
    env = process_env(servers.env | {"DILOCO_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0",
                                     "DILOCO_REACH_TIMEOUT_S": "120"})
    procs = {role: subprocess.Popen(role_argv(role), env=env, text=True, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE) for role in ("learner", "coordinator")}
    try:
        for role, p in procs.items():
            assert p.stderr is not None
            seen = ""
            while "storage unreachable" not in seen:  # it is in its start-up retries
                line = p.stderr.readline()
                assert line, f"{role} exited {p.wait()} before waiting for Redis:\n{seen}"
                seen += line
        for role, p in procs.items():
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            rc = p.wait(timeout=30)
            # Both leave as stopped, not done (143: "run me again"): exit 0 is for a run that ended.
            assert rc == 143, (role, rc)
            assert time.monotonic() - t0 < 3, (role, time.monotonic() - t0)
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()
