"""Whether both servers answer, checked once when a learner or a coordinator starts.

A wrong setting ends the process within seconds with one sentence naming it, instead of minutes of
retries and a library's traceback. `check_servers` pings Redis and lists one key under the prefix
in S3 (a HEAD's answer carries no error code, a listing's does). A mistake that retrying cannot
fix (a wrong password, key or secret, a missing bucket, TLS on one side only, an untrusted
certificate, another kind of server on the port) raises `ConfigError` at once. One that may pass
(refused connection, timeout, an unknown host: DNS may lag behind a new server) is retried until
the deadline, so that processes may start a little before their servers, then raises `ConfigError`
too. After start-up the adapters' own retries take over (storage.bus, storage.objects).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bexc
import redis

from diloco.storage.bus import access_refused, connect
from diloco.storage.errors import ConfigError
from diloco.storage.objects import make_client, transient as s3_transient
from diloco.storage.settings import ENV_REDIS_URL, ENV_S3_BUCKET, ENV_S3_ENDPOINT, ENV_S3_REGION, Endpoints, redact_url

log = logging.getLogger(__name__)

TRY_S = 3.0
"""The longest one try at a server may take (connect, TLS handshake, answer)."""
LOG_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class Problem:
    what: str
    """What went wrong and the setting to check, as one sentence."""
    lasting: bool
    """Retrying will not fix it (a setting is wrong)."""
    cause: BaseException | None = field(default=None, compare=False)
    """The error it was read from (shown with `diloco -v`)."""


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, innermost last."""
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


def _has(exc: BaseException, kind: type[BaseException]) -> bool:
    return any(isinstance(e, kind) for e in _chain(exc))


def speaks_tls(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether the server at host:port completes a TLS handshake (its certificate is not checked)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=host):
                return True
    except (OSError, ssl.SSLError):
        return False


def speaks_plain_redis(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether the server at host:port answers a plaintext PING as Redis does (+PONG, or -NOAUTH...)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False


# ---- Redis -------------------------------------------------------------------------------------

def redis_problem(exc: BaseException, url: str) -> Problem:
    """What a failed PING of the Redis at `url` means (the URL is only parsed, never shown with its password)."""
    where = f"Redis at {redact_url(url)}"
    parts = urlsplit(url)
    host, port, tls = parts.hostname or "", parts.port or 6379, parts.scheme.startswith("rediss")
    if (refused := access_refused(exc)) is not None:
        return Problem(f"{where} {refused}", lasting=True)
    if isinstance(exc, (redis.exceptions.InvalidResponse, redis.exceptions.ResponseError)):
        return Problem(f"{where}: the server on that port is not Redis, or not one this client can use "
                       f"({exc}): check the host and port in {ENV_REDIS_URL}", lasting=True)
    if _has(exc, socket.gaierror):
        return Problem(f"{where}: unknown host {host!r}: check the host in {ENV_REDIS_URL}", lasting=False)
    if _has(exc, ConnectionRefusedError):
        return Problem(f"{where} refused the connection: is Redis running, and are the host and port in "
                       f"{ENV_REDIS_URL} right?", lasting=False)
    if tls and isinstance(exc, redis.TimeoutError) and speaks_plain_redis(host, port):
        return Problem(f"{where}: the server speaks plaintext, not TLS: use redis:// in {ENV_REDIS_URL}", lasting=True)
    if tls and _has(exc, ssl.SSLError):
        return Problem(f"{where}: the TLS handshake failed ({_chain(exc)[-1]}): is the port in {ENV_REDIS_URL} a "
                       "TLS port, or should the URL be redis://?", lasting=True)
    if not tls and _has(exc, ConnectionResetError) and speaks_tls(host, port):
        return Problem(f"{where}: the server speaks TLS only: use rediss:// in {ENV_REDIS_URL} (with "
                       "ssl_ca_certs=<CA file>&ssl_cert_reqs=required if its CA is a private one)", lasting=True)
    if isinstance(exc, redis.TimeoutError):
        return Problem(f"{where} did not answer within {TRY_S:.0f}s: check the host and port in {ENV_REDIS_URL}, "
                       "and that no firewall drops the connection", lasting=False)
    return Problem(f"{where}: {exc}: check {ENV_REDIS_URL}", lasting=False)


def check_redis(url: str) -> Problem | None:
    """PING the Redis at `url` once; None if it answered."""
    try:
        client = connect(url, timeout_s=TRY_S)
    except redis.RedisError as exc:  # a cluster's map is read at once
        return replace(redis_problem(exc, url), cause=exc)
    except ConfigError as exc:  # a +cluster URL names a server that is not in a cluster
        return Problem(str(exc), lasting=True, cause=exc)
    try:
        client.ping()
        return None
    except redis.RedisError as exc:
        return replace(redis_problem(exc, url), cause=exc)
    finally:
        client.close()


# ---- S3 ----------------------------------------------------------------------------------------

def _s3_where(endpoints: Endpoints) -> str:
    return f"S3 at {endpoints.s3_endpoint}" if endpoints.s3_endpoint else f"AWS S3 ({endpoints.region})"


def s3_problem(exc: BaseException, endpoints: Endpoints, access_key: str | None = None) -> Problem:
    """What a failed listing of the bucket means."""
    where, bucket = _s3_where(endpoints), endpoints.bucket
    parts = urlsplit(endpoints.s3_endpoint or "https://s3.amazonaws.com")
    host, https = parts.hostname or "", parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    if isinstance(exc, bexc.NoCredentialsError):
        return Problem("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
                       lasting=True)
    if isinstance(exc, bexc.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        key = f" {access_key!r}" if access_key else ""
        known = {
            "InvalidAccessKeyId": f"{where} does not know the access key{key}: check AWS_ACCESS_KEY_ID",
            "SignatureDoesNotMatch": f"{where} refused the signature made with access key{key}: check "
                                     "AWS_SECRET_ACCESS_KEY",
            "NoSuchBucket": f"{where} has no bucket {bucket!r}: check {ENV_S3_BUCKET} (a coordinator creates it "
                            "when it first starts)",
            "AccessDenied": f"{where} denied access key{key} listing bucket {bucket!r}: check {ENV_S3_BUCKET} and "
                            "the key's permissions (list, get, put and delete objects)",
            "AuthorizationHeaderMalformed": f"{where} refused the request's region {endpoints.region!r}: check "
                                            f"{ENV_S3_REGION}",
            "PermanentRedirect": f"{where}: bucket {bucket!r} is in another region: check {ENV_S3_REGION}",
        }
        if code in known:
            return Problem(known[code], lasting=True)
        message = str(exc.response.get("Error", {}).get("Message", ""))[:200]
        return Problem(f"{where} answered {code or 'an error'} ({message}) listing bucket {bucket!r}: check "
                       f"{ENV_S3_ENDPOINT} and {ENV_S3_BUCKET}", lasting=not s3_transient(exc))
    if isinstance(exc, bexc.SSLError):
        if _has(exc, ssl.SSLCertVerificationError):
            return Problem(f"{where} presented a TLS certificate this client does not trust "
                           f"({_chain(exc)[-1]}): set AWS_CA_BUNDLE to its CA file", lasting=True)
        if not speaks_tls(host, port):
            return Problem(f"{where}: the server does not speak TLS: use http:// in {ENV_S3_ENDPOINT}", lasting=True)
        return Problem(f"{where}: the TLS handshake failed ({_chain(exc)[-1]}): check {ENV_S3_ENDPOINT}",
                       lasting=True)
    if _has(exc, socket.gaierror):
        return Problem(f"{where}: unknown host {host!r}: check {ENV_S3_ENDPOINT}", lasting=False)
    if _has(exc, ConnectionRefusedError):
        return Problem(f"{where} refused the connection: is the S3 server running, and are the host and port in "
                       f"{ENV_S3_ENDPOINT} right?", lasting=False)
    if not https and _has(exc, ConnectionResetError) and speaks_tls(host, port):
        return Problem(f"{where}: the server speaks TLS: use https:// in {ENV_S3_ENDPOINT}", lasting=True)
    if isinstance(exc, (bexc.ConnectTimeoutError, bexc.ReadTimeoutError)):
        return Problem(f"{where} did not answer within {TRY_S:.0f}s: check {ENV_S3_ENDPOINT}, and that no "
                       "firewall drops the connection", lasting=False)
    return Problem(f"{where}: {exc}: check {ENV_S3_ENDPOINT}", lasting=False)


def check_s3(client, endpoints: Endpoints, *, bucket_may_be_missing: bool = False) -> Problem | None:  # noqa: ANN001
    """List at most one key under the prefix once; None if S3 answered (a missing bucket too, with
    `bucket_may_be_missing`: a coordinator creates it)."""
    try:
        client.list_objects_v2(Bucket=endpoints.bucket, Prefix=endpoints.prefix + "/", MaxKeys=1)
        return None
    except (bexc.BotoCoreError, bexc.ClientError) as exc:
        if (bucket_may_be_missing and isinstance(exc, bexc.ClientError)
                and exc.response.get("Error", {}).get("Code") == "NoSuchBucket"):
            return None
        credentials = boto3.session.Session().get_credentials() if isinstance(exc, bexc.ClientError) else None
        return replace(s3_problem(exc, endpoints, credentials.access_key if credentials else None), cause=exc)


# ---- both --------------------------------------------------------------------------------------

def check_servers(endpoints: Endpoints, *, timeout_s: float = 10.0, stop: threading.Event | None = None,
                  bucket_may_be_missing: bool = False) -> bool:
    """Wait until Redis (if the endpoints name one) and S3 both answer: True once they do, False if
    `stop` was set first. Raises ConfigError naming the setting to check for a lasting problem at
    once, and for a passing one still there after `timeout_s` (the last try may end up to TRY_S later)."""
    deadline = time.monotonic() + timeout_s
    s3 = make_client(endpoints, timeout_s=TRY_S)
    delay, said_at, said = 0.25, -LOG_EVERY_S, ""
    while True:
        problems = [p for p in (check_redis(endpoints.redis_url) if endpoints.redis_url else None,
                                check_s3(s3, endpoints, bucket_may_be_missing=bucket_may_be_missing)) if p]
        if not problems:
            return True
        first = next((p for p in problems if p.lasting), problems[0])
        left = deadline - time.monotonic()
        if first.lasting or left <= 0:
            waited = "" if first.lasting else f" (for {timeout_s:g}s; --reach-timeout-s waits longer)"
            raise ConfigError(first.what + waited) from first.cause
        if first.what != said or time.monotonic() - said_at >= LOG_EVERY_S:
            log.warning("storage unreachable, retrying for up to %.0fs more (reach_timeout_s): %s", left, first.what)
            said, said_at = first.what, time.monotonic()
        pause = min(delay, left)
        if stop is None:
            time.sleep(pause)  # a learner's SIGTERM handler raises Preempted out of it
        elif stop.wait(pause):
            return False
        delay = min(delay * 2, 2.0)
