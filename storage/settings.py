"""Where the servers are: read once from the environment, passed explicitly afterwards.

The same variable names are printed by `diloco stack up`, set by `infra/local/docker-compose.yml`
and read here. S3 credentials are never read here: boto3 takes them from the standard AWS chain
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws, instance roles). The Redis URL may carry a
password (`rediss://user:password@host:port/0`): `redact_url` is the only form of it that may be
logged or printed, and `Endpoints`' repr uses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import unquote

from diloco.storage.errors import ConfigError

ENV_REDIS_URL = "DILOCO_REDIS_URL"
ENV_S3_ENDPOINT = "DILOCO_S3_ENDPOINT"
ENV_S3_BUCKET = "DILOCO_S3_BUCKET"
ENV_S3_PREFIX = "DILOCO_S3_PREFIX"
ENV_S3_REGION = "DILOCO_S3_REGION"

REDACTED = "***"


def redact_url(url: str) -> str:
    """`url` without its secrets, for logs and messages: the password in the user part and the value
    of any query parameter whose name contains "password" become `***`. Works on the raw text (a
    password with an unescaped `#`, `?` or `@` still ends at the last `@`), erring towards hiding more."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return REDACTED
    userinfo, at, rest = rest.rpartition("@")
    if at:
        user, has_password, _ = userinfo.partition(":")
        rest = f"{user}:{REDACTED}@{rest}" if has_password else f"{userinfo}@{rest}"
    location, question, query = rest.partition("?")
    query, hash_, _fragment = query.partition("#")
    params = [f"{name}={REDACTED}" if "password" in unquote(name).lower() else f"{name}{eq}{value}"
              for name, eq, value in (p.partition("=") for p in query.split("&") if p)]
    return f"{scheme}://{location}{question}{'&'.join(params)}{hash_ and '#' + REDACTED}"


REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
"""The Redis URLs a run may name: one server (TCP, TLS, a socket), or a Redis Cluster through any of
its nodes (`+cluster`: every key of a run shares one hash tag, so each run lives on one node's slot)."""


@dataclass(frozen=True, slots=True, repr=False)
class Endpoints:
    redis_url: str
    """Redis URL, e.g. redis://localhost:6379/0, rediss://:password@host:6380/0 or, for a Redis Cluster
    through one of its nodes, redis+cluster://host:7000; "" for a process that
    reads S3 only (`diloco replay`), which then cannot open a `Bus`."""
    bucket: str
    """S3 bucket that holds every run's objects."""
    s3_endpoint: str | None = None
    """S3 endpoint URL (MinIO, SeaweedFS, R2...); None means AWS S3 itself."""
    prefix: str = "diloco"
    """Key prefix inside the bucket; runs live under {prefix}/{run}/."""
    region: str = "us-east-1"
    """S3 region (signature v4 needs one even for MinIO)."""

    def __post_init__(self) -> None:
        if self.redis_url and not self.redis_url.startswith(REDIS_SCHEMES):
            raise ConfigError(f"{ENV_REDIS_URL} must be a {', '.join(REDIS_SCHEMES)} URL, "
                              f"got {redact_url(self.redis_url)!r}")
        if not self.bucket:
            raise ConfigError(f"no bucket: set {ENV_S3_BUCKET}")
        if self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ConfigError(f"{ENV_S3_PREFIX} must not start or end with '/', got {self.prefix!r}")

    def __repr__(self) -> str:
        return (f"Endpoints(redis_url={redact_url(self.redis_url)!r}, bucket={self.bucket!r}, "
                f"s3_endpoint={self.s3_endpoint!r}, prefix={self.prefix!r}, region={self.region!r})")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, *, redis: bool = True) -> Endpoints:
        """The endpoints the environment names. With `redis=False` (tools that read S3 only),
        DILOCO_REDIS_URL may be missing."""
        env = dict(os.environ if env is None else env)
        required = (ENV_REDIS_URL, ENV_S3_BUCKET) if redis else (ENV_S3_BUCKET,)
        missing = [k for k in required if not env.get(k)]
        if missing:
            raise ConfigError(
                f"missing {', '.join(missing)}: run `eval $(diloco stack up)` for a local stack, "
                "or point them at your Redis and bucket (see README)"
            )
        return cls(
            redis_url=env.get(ENV_REDIS_URL, ""),
            bucket=env[ENV_S3_BUCKET],
            s3_endpoint=env.get(ENV_S3_ENDPOINT) or None,
            prefix=env.get(ENV_S3_PREFIX) or "diloco",
            region=env.get(ENV_S3_REGION) or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        )

    def to_env(self) -> dict[str, str]:
        env = {ENV_S3_BUCKET: self.bucket, ENV_S3_PREFIX: self.prefix, ENV_S3_REGION: self.region}
        if self.redis_url:
            env[ENV_REDIS_URL] = self.redis_url
        if self.s3_endpoint:
            env[ENV_S3_ENDPOINT] = self.s3_endpoint
        return env
