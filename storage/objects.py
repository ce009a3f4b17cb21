"""S3 adapter: a narrow object store over boto3 (AWS S3, MinIO, SeaweedFS, R2...).

Contracts, per method:
- `put(key, data, create_only=True)` is a create-only PUT (`If-None-Match: *`): it either
  creates the object or raises `Conflict`; it never overwrites. Safe to retry: a retry after a
  lost reply finds the object and compares bytes, so a duplicate of our own write is success.
- `get(key, max_bytes)` never reads more than `max_bytes` (+1 to detect overflow) into memory;
  raises `ObjectMissing` if absent, `Refused('too_large')` if bigger, `ObjectUnreadable` if S3
  refuses to return it (e.g. it was stored with a customer-provided encryption key).
- `list(prefix)` is consistent on all servers we support (S3 has been strongly consistent
  since 2020); results are in key order.
Transient errors (connection resets, timeouts, 5xx, throttling) are retried inside the adapter
with bounded exponential backoff and jitter; once the retries are spent, `put`, `get`, `exists`,
`list` and `ensure_bucket` raise `StorageUnavailable`. Anything else surfaces at once. Credentials come
from the standard AWS chain and are never logged.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import boto3
import botocore.exceptions as bexc
from botocore.config import Config
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

from diloco.storage.errors import Conflict, DilocoError, Refused, StorageUnavailable
from diloco.storage.settings import Endpoints

log = logging.getLogger(__name__)


class ObjectMissing(DilocoError):
    """The object does not exist (yet, or any more)."""


class ObjectUnreadable(DilocoError):
    """S3 refuses to return an object that exists, and retrying will not change that: a 4xx other
    than 'missing' (e.g. InvalidRequest for an object its writer encrypted with a key of its own
    (SSE-C), AccessDenied, InvalidObjectState for an archived one)."""


class Store(Protocol):
    """What the history tools need of a bucket: `ObjectStore` (S3) or `storage.localdir.DirStore` (an export)."""

    bucket: str

    def url(self, key: str) -> str: ...
    def put(self, key: str, data: bytes, *, create_only: bool = True) -> None: ...
    def get(self, key: str, *, max_bytes: int) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def list_modified(self, prefix: str) -> Iterator[tuple[str, float]]: ...
    def list_sizes(self, prefix: str) -> Iterator[tuple[str, int]]: ...
    def list_stat(self, prefix: str) -> Iterator[tuple[str, int, float]]: ...
    def delete(self, keys: list[str]) -> None: ...


_TRANSIENT_CODES = {"500", "502", "503", "504", "SlowDown", "InternalError", "ServiceUnavailable",
                    "RequestTimeout", "RequestTimeTooSkewed", "Throttling"}


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (bexc.EndpointConnectionError, bexc.ConnectionClosedError, bexc.ReadTimeoutError,
                        bexc.ConnectTimeoutError, bexc.ResponseStreamingError)):
        return True
    if isinstance(exc, bexc.ClientError):
        err = exc.response.get("Error", {})
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return err.get("Code") in _TRANSIENT_CODES or status in _TRANSIENT_CODES
    return False


def _code(exc: bexc.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


_retry = retry(
    retry=retry_if_exception(_transient),
    wait=wait_random_exponential(multiplier=0.2, max=5.0),
    stop=stop_after_attempt(8),
    reraise=True,
)


def make_client(endpoints: Endpoints, *, timeout_s: float = 30.0):  # noqa: ANN201 (boto3 client type)
    """A boto3 S3 client for the endpoint; checksums only where S3 requires them (servers differ)."""
    config = Config(
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path" if endpoints.s3_endpoint else "auto"},
        retries={"max_attempts": 1, "mode": "standard"},  # we retry ourselves, bounded, in one place
        connect_timeout=min(timeout_s, 10.0),
        read_timeout=timeout_s,
        max_pool_connections=32,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoints.s3_endpoint,
                                          region_name=endpoints.region, config=config)


class ObjectStore:
    """One bucket. Thread-safe (boto3 clients are); create one per process."""

    def __init__(self, endpoints: Endpoints, *, timeout_s: float = 30.0) -> None:
        self.bucket = endpoints.bucket
        self._region = endpoints.region
        self._aws = endpoints.s3_endpoint is None
        self._s3 = make_client(endpoints, timeout_s=timeout_s)
        self._counting = threading.Lock()
        self.bytes_read = 0
        """Bytes of every object body this store has returned from `get` (a learner's bytes down)."""

    def url(self, key: str) -> str:
        """Where `key` is, for messages."""
        return f"s3://{self.bucket}/{key}"

    def _unavailable(self, op: str, key: str, exc: Exception) -> StorageUnavailable:
        return StorageUnavailable(f"S3 {op} s3://{self.bucket}/{key} failed after retries: {exc}")

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist. Idempotent."""
        with self._errors("HEAD", ""):
            self._ensure_bucket()

    @_retry
    def _ensure_bucket(self) -> None:
        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except bexc.ClientError as exc:
            if _code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                raise
            extra = ({"CreateBucketConfiguration": {"LocationConstraint": self._region}}
                     if self._aws and self._region != "us-east-1" else {})
            try:
                self._s3.create_bucket(Bucket=self.bucket, **extra)
            except bexc.ClientError as exc2:
                if _code(exc2) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    @contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        """Transient failures that outlived the retries become StorageUnavailable; others pass."""
        try:
            yield
        except bexc.ClientError as exc:
            if _transient(exc):
                raise self._unavailable(op, key, exc) from exc
            raise
        except bexc.BotoCoreError as exc:
            raise self._unavailable(op, key, exc) from exc

    def put(self, key: str, data: bytes, *, create_only: bool = True) -> None:
        with self._errors("PUT", key):
            try:
                self._put(key, data, create_only)
            except bexc.ClientError as exc:
                if _code(exc) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                    raise
                # Either someone else wrote the key, or our own earlier attempt did and its reply was lost.
                if not self._same_bytes(key, data):
                    raise Conflict(f"s3://{self.bucket}/{key} already exists with other contents") from None

    @_retry
    def _put(self, key: str, data: bytes, create_only: bool) -> None:
        extra = {"IfNoneMatch": "*"} if create_only else {}
        self._s3.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)

    def _same_bytes(self, key: str, data: bytes) -> bool:
        try:
            existing = self.get(key, max_bytes=len(data))
        except (ObjectMissing, Refused):
            return False
        return hashlib.sha256(existing).digest() == hashlib.sha256(data).digest()

    def get(self, key: str, *, max_bytes: int) -> bytes:
        with self._errors("GET", key):
            try:
                data = self._get(key, max_bytes)
                with self._counting:
                    self.bytes_read += len(data)
                return data
            except bexc.ClientError as exc:
                if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                    raise ObjectMissing(f"s3://{self.bucket}/{key} does not exist") from None
                if not _transient(exc):
                    message = str(exc.response.get("Error", {}).get("Message", ""))[:200]
                    raise ObjectUnreadable(f"s3://{self.bucket}/{key}: S3 refuses to return it "
                                           f"({_code(exc)}: {message})") from None
                raise

    @_retry
    def _get(self, key: str, max_bytes: int) -> bytes:
        resp = self._s3.get_object(Bucket=self.bucket, Key=key)
        body = resp["Body"]
        try:
            length = int(resp.get("ContentLength", -1))
            if length > max_bytes:
                raise Refused("too_large", f"s3://{self.bucket}/{key} is {length} bytes, over the {max_bytes}-byte limit")
            data = body.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise Refused("too_large", f"s3://{self.bucket}/{key} is over the {max_bytes}-byte limit")
            return data
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        with self._errors("HEAD", key):
            try:
                self._head(key)
                return True
            except bexc.ClientError as exc:
                if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                    return False
                raise

    @_retry
    def _head(self, key: str) -> None:
        self._s3.head_object(Bucket=self.bucket, Key=key)

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under prefix, in key order (zero-padded keys: numeric order)."""
        for key, _modified in self.list_modified(prefix):
            yield key

    def list_modified(self, prefix: str) -> Iterator[tuple[str, float]]:
        """(key, last-modified unix time on the server's clock) under prefix, in key order."""
        for item in self._list(prefix):
            yield item["Key"], item["LastModified"].timestamp()

    def list_sizes(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size in bytes) under prefix, in key order."""
        for item in self._list(prefix):
            yield item["Key"], int(item["Size"])

    def list_stat(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(key, size in bytes, last-modified unix time on the server's clock) under prefix, in key
        order, from one listing (for a reader that needs both of the same object)."""
        for item in self._list(prefix):
            yield item["Key"], int(item["Size"]), item["LastModified"].timestamp()

    def _list(self, prefix: str) -> Iterator[dict]:
        token: str | None = None
        while True:
            with self._errors("LIST", prefix):
                page = self._list_page(prefix, token)
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    @_retry
    def _list_page(self, prefix: str, token: str | None) -> dict:
        kwargs = {"Bucket": self.bucket, "Prefix": prefix}
        if token:
            kwargs["ContinuationToken"] = token
        return self._s3.list_objects_v2(**kwargs)

    @_retry
    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            chunk = keys[start:start + 1000]
            self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
