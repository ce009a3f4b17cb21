"""S3 adapter: a narrow object store over boto3 (AWS S3, MinIO, SeaweedFS, R2...).

Contracts, per method:
- `put(key, data, create_only=True)` is a create-only PUT (`If-None-Match: *`): it either
  creates the object or raises `Conflict`; it never overwrites. Safe to retry: a retry after a
  lost reply finds the object and compares bytes, so a duplicate of our own write is success.
  An object over `multipart_threshold` (default 4 GiB, under S3's 5 GiB single-PUT limit) goes up
  as a multipart upload under the same contract (see `ObjectStore._put_multipart`). `data` is
  bytes or a `Body` (the object as consecutive buffers, e.g. a version's params as views of its
  tensors, `codecs.encode_streamed`): a body is sent, compared and hashed from its buffers, never
  joined into one copy.
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

import bisect
import importlib.metadata
import io
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import boto3
import botocore.exceptions as bexc
from botocore.config import Config
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

from diloco.storage.errors import Conflict, DilocoError, Refused, StorageUnavailable
from diloco.storage.linkuse import LinkUse
from diloco.storage.settings import Endpoints

log = logging.getLogger(__name__)


class ObjectMissing(DilocoError):
    """The object does not exist (yet, or any more)."""


class ObjectUnreadable(DilocoError):
    """S3 refuses to return an object that exists, and retrying will not change that: a 4xx other
    than 'missing' (e.g. InvalidRequest for an object its writer encrypted with a key of its own
    (SSE-C), AccessDenied, InvalidObjectState for an archived one)."""


class Body(Protocol):
    """An object's bytes as consecutive buffers, written without being joined into one: a version's
    params are a header and then views of its tensors' own memory (`codecs.encode_streamed`), so a
    PUT of them costs no copy of the model. The buffers must not change while the body is in use."""

    @property
    def views(self) -> tuple[memoryview, ...]:
        """The object's bytes in order, each a flat byte view (format 'B')."""
        ...

    def __len__(self) -> int:
        """The object's length in bytes: the sum of the views'."""
        ...


def views_of(data: bytes | Body) -> tuple[memoryview, ...]:
    """The bytes of `data`, bytes or a `Body`, as flat byte views (no copy)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return (memoryview(data).cast("B"),)
    return data.views


def _read_into(buf: bytearray, chunks: Iterator[bytes], where: str) -> bytearray:
    """Fill `buf` (the object's announced size) from `chunks`; a body of another size is a broken
    read (ResponseStreamingError: retried)."""
    got = 0
    with memoryview(buf) as view:
        for chunk in chunks:
            if got + len(chunk) > len(buf):
                break
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        else:
            if got == len(buf):
                return buf
    raise bexc.ResponseStreamingError(error=f"{where}: the body is not the {len(buf)} bytes its length says")


class Store(Protocol):
    """What the history tools need of a bucket: `ObjectStore` (S3) or `storage.localdir.DirStore` (an export)."""

    bucket: str

    def url(self, key: str) -> str: ...
    def put(self, key: str, data: bytes | Body, *, create_only: bool = True) -> None: ...
    def get(self, key: str, *, max_bytes: int) -> bytes: ...
    def get_buffer(self, key: str, *, max_bytes: int) -> bytearray: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def list_modified(self, prefix: str) -> Iterator[tuple[str, float]]: ...
    def list_sizes(self, prefix: str) -> Iterator[tuple[str, int]]: ...
    def list_stat(self, prefix: str) -> Iterator[tuple[str, int, float]]: ...
    def delete(self, keys: list[str]) -> None: ...


_TRANSIENT_CODES = {"500", "502", "503", "504", "SlowDown", "InternalError", "ServiceUnavailable",
                    "RequestTimeout", "RequestTimeTooSkewed", "Throttling"}


def transient(exc: BaseException) -> bool:
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


_MISSING_CODES = ("NoSuchKey", "404", "NotFound")
_PRECONDITION_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict")

_MiB = 1 << 20
_GiB = 1 << 30
MIN_PART_BYTES = 5 * _MiB
"""S3's smallest part (every part of a multipart upload but the last)."""
MAX_PART_BYTES = 5 * _GiB
"""S3's largest part, and its largest single PUT."""
MAX_PARTS = 10_000
_COMPARE_CHUNK = 8 * _MiB
_READ_CHUNK = 1 * _MiB
_SETTLE_S = 1.0
"""How long a create-only multipart put waits after completing before it checks the object is
still its own (see `ObjectStore._put_multipart`)."""


_retry = retry(
    retry=retry_if_exception(transient),
    wait=wait_random_exponential(multiplier=0.2, max=5.0),
    stop=stop_after_attempt(8),
    reraise=True,
)

# Cleaning up after a failure: a few quick tries only, never delaying the original error for long.
_retry_cleanup = retry(
    retry=retry_if_exception(transient),
    wait=wait_random_exponential(multiplier=0.2, max=1.0),
    stop=stop_after_attempt(3),
    reraise=True,
)


class ViewsReader(io.RawIOBase):
    """A seekable read-only file over consecutive byte views (the bytes of an object, or of one part
    of it), so that botocore streams them without a bytes copy (it reads at most 1 MiB at a time:
    hashing for the signature, sending). A fresh reader starts at byte 0: a retried request takes a
    new one."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        super().__init__()
        self._views = [v for v in views if v.nbytes]
        self._starts = list(itertools.accumulate((v.nbytes for v in self._views), initial=0))
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:  # noqa: ANN001 (any writable buffer)
        out = memoryview(buffer).cast("B")
        done = 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while done < out.nbytes and 0 <= i < len(self._views):
            at = self._pos - self._starts[i]
            piece = self._views[i][at:at + out.nbytes - done]
            out[done:done + piece.nbytes] = piece
            done += piece.nbytes
            self._pos += piece.nbytes
            i += 1
        return done

    def __len__(self) -> int:
        return self._starts[-1]


def same_stream(read: Callable[[int], bytes], views: Sequence[memoryview]) -> bool:
    """Whether reading a stored object through `read(n)` (at most n bytes; b"" at its end) gives
    exactly the bytes `views` make up: compared chunk by chunk as they come (memory: one chunk), the
    first difference ends the read. `ObjectStore` and `localdir.DirStore` compare a refused
    create-only write with it."""
    want = ViewsReader(views)
    while want.tell() < len(want):
        chunk = read(min(_COMPARE_CHUNK, len(want) - want.tell()))
        if not chunk or want.read(len(chunk)) != chunk:
            return False
    return not read(1)


def window(views: Sequence[memoryview], start: int, stop: int) -> tuple[memoryview, ...]:
    """Bytes [start, stop) of the object `views` make up, as views of theirs (no copy): a part of a
    multipart upload."""
    out = []
    offset = 0
    for v in views:
        lo, hi = max(start, offset), min(stop, offset + v.nbytes)
        if lo < hi:
            out.append(v[lo - offset:hi - offset])
        offset += v.nbytes
    return tuple(out)


def _user_agent() -> str:
    try:
        return f"diloco/{importlib.metadata.version('diloco')}"
    except importlib.metadata.PackageNotFoundError:  # a checkout on the path, not installed
        return "diloco"


USER_AGENT = _user_agent()
"""What every S3 request of ours says it is (`make_client`)."""


def make_client(endpoints: Endpoints, *, timeout_s: float = 30.0):  # noqa: ANN201 (boto3 client type)
    """A boto3 S3 client for the endpoint; checksums only where S3 requires them (servers differ).

    Lean on a thin link: a PUT sends its body at once, without `Expect: 100-continue` (botocore's
    default for a PutObject or UploadPart: the body waits for the server's go-ahead, a round trip
    per object and longer on a link busy the other way: 8% of a 17 kB piece's PUT on a 0.156 Mbit/s
    link that is downloading a version. What the go-ahead saves is the body of a PUT the server
    refuses, a wrong credential: `check_servers` refuses those at start), and the User-Agent names
    diloco and its version (about 30 bytes, not 190, on every request; server logs tell diloco's
    requests apart)."""
    config = Config(
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path" if endpoints.s3_endpoint else "auto"},
        retries={"max_attempts": 1, "mode": "standard"},  # we retry ourselves, bounded, in one place
        connect_timeout=min(timeout_s, 10.0),
        read_timeout=timeout_s,
        max_pool_connections=32,
        user_agent=USER_AGENT,
    )
    client = boto3.session.Session().client("s3", endpoint_url=endpoints.s3_endpoint,
                                            region_name=endpoints.region, config=config)
    for operation in ("PutObject", "UploadPart"):
        client.meta.events.register(f"before-sign.s3.{operation}", _send_body_at_once)
    return client


def _send_body_at_once(request, **_: object) -> None:  # noqa: ANN001 (botocore's AWSRequest)
    """botocore's `before-sign` hook: drop the `Expect: 100-continue` header it adds (`make_client`)."""
    if "Expect" in request.headers:
        del request.headers["Expect"]


class ObjectStore:
    """One bucket. Thread-safe (boto3 clients are); create one per process."""

    def __init__(self, endpoints: Endpoints, *, timeout_s: float = 30.0, multipart_threshold: int = 4 * _GiB,
                 part_bytes: int = 256 * _MiB) -> None:
        """`multipart_threshold`: objects longer than this go up as a multipart upload (at most 5 GiB,
        S3's single-PUT limit). `part_bytes`: the part size of a multipart upload (5 MiB to 5 GiB),
        grown for an object that would need more than S3's 10000 parts."""
        if not 0 <= multipart_threshold <= MAX_PART_BYTES:
            raise ValueError(f"multipart_threshold must be 0..{MAX_PART_BYTES} bytes (S3's single-PUT limit), "
                             f"not {multipart_threshold}")
        if not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES:
            raise ValueError(f"part_bytes must be {MIN_PART_BYTES}..{MAX_PART_BYTES} (S3's part sizes), "
                             f"not {part_bytes}")
        self.multipart_threshold = multipart_threshold
        self.part_bytes = part_bytes
        self.bucket = endpoints.bucket
        self._region = endpoints.region
        self._aws = endpoints.s3_endpoint is None
        self._s3 = make_client(endpoints, timeout_s=timeout_s)
        self._counting = threading.Lock()
        self.bytes_read = 0
        """Bytes of every object body this store has returned from `get` (a learner's bytes down)."""
        self.link = LinkUse()
        """The seconds its PUTs (up) and GETs (down) kept the link in use (`storage.linkuse`)."""

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
            if transient(exc):
                raise self._unavailable(op, key, exc) from exc
            raise
        except bexc.BotoCoreError as exc:
            raise self._unavailable(op, key, exc) from exc

    def put(self, key: str, data: bytes | Body, *, create_only: bool = True) -> None:
        with self.link.busy("up"), self._errors("PUT", key):
            try:
                if len(data) <= self.multipart_threshold:
                    self._put(key, data, create_only)
                    return
                # A big object that is there already (most often our own, whose reply was lost
                # before this put was retried) is compared rather than uploaded again.
                if not (create_only and self._seen(key)):
                    self._put_multipart(key, data, create_only)
                    return
            except bexc.ClientError as exc:
                if _code(exc) not in _PRECONDITION_CODES:
                    raise
            # Either someone else wrote the key, or our own earlier attempt did and its reply was lost.
            if not self._same_bytes(key, data):
                raise Conflict(f"s3://{self.bucket}/{key} already exists with other contents") from None

    @_retry
    def _put(self, key: str, data: bytes | Body, create_only: bool) -> None:
        extra = {"IfNoneMatch": "*"} if create_only else {}
        body = data if isinstance(data, bytes) else ViewsReader(views_of(data))  # each try reads from byte 0
        self._s3.put_object(Bucket=self.bucket, Key=key, Body=body, ContentLength=len(data), **extra)

    def _put_multipart(self, key: str, data: bytes | Body, create_only: bool) -> None:
        """CreateMultipartUpload, UploadPart per slice, CompleteMultipartUpload (with
        `If-None-Match: *` when create_only); AbortMultipartUpload on any failure before the
        upload completed (best effort: logged, never raised over the original error).

        Create-only: S3 checks `If-None-Match` when the upload completes, which is when the object
        appears. If the key exists, AWS, MinIO and SeaweedFS 4.48 answer 412 PreconditionFailed
        and leave the upload open (we abort it), and `put` compares bytes as for a single PUT. A
        retried Complete whose first try did complete gets 412 (create-only) or NoSuchUpload:
        both end in the same comparison, so our own object counts as success.

        Remaining race, on SeaweedFS (4.48): its Complete checks If-None-Match and then writes, in
        two steps (a single PUT does both in one), so Completes that reach it together can all
        pass the check and each replace the last: 16 writers released together at the Complete
        had several successes in 2 rounds of 8. AWS documents the check as part of the Complete;
        MinIO was not tried. So after completing we wait `_SETTLE_S` and HEAD the key: if its
        ETag is no longer the one our Complete returned and its bytes are not ours, another
        writer replaced our object and we raise `Conflict` (with this, every round above had one
        success, the stored object's writer). The race stays open only for a rival Complete that
        passed its check before ours was written and yet lands more than `_SETTLE_S` after ours
        returned. Keys with a single writer (the learner or the epoch in their name: every big
        object of the protocol) never meet it.

        Each step is retried on transient errors, a part from its first byte. Parts are read
        through views of `data`'s buffers: the object is never copied. A CreateMultipartUpload whose
        reply was lost leaves an upload we never learn of: only a bucket lifecycle rule
        (AbortIncompleteMultipartUpload) removes such leftovers.
        """
        views, total = views_of(data), len(data)
        size = self._part_size(total)
        upload_id = self._create_upload(key)
        try:
            parts = []
            for number, start in enumerate(range(0, total, size), start=1):
                etag = self._upload_part(key, upload_id, number, window(views, start, start + size))
                parts.append({"PartNumber": number, "ETag": etag})
            try:
                etag = self._complete_upload(key, upload_id, parts, create_only)
            except bexc.ClientError as exc:
                if _code(exc) != "NoSuchUpload":
                    raise
                # Completed by an earlier try whose reply was lost, or aborted by someone else.
                if self._same_bytes(key, data):
                    return
                if create_only and self.exists(key):
                    raise Conflict(f"s3://{self.bucket}/{key} already exists with other contents") from None
                raise StorageUnavailable(f"S3 multipart upload to s3://{self.bucket}/{key} vanished before it "
                                         f"completed (aborted by a lifecycle rule or another client?)") from exc
        except BaseException:
            self._abort_upload(key, upload_id)
            raise
        if create_only:
            time.sleep(_SETTLE_S)
            now = self._etag(key)
            if now is not None and now != etag and not self._same_bytes(key, data):
                raise Conflict(f"s3://{self.bucket}/{key} was created at the same time by another writer, "
                               f"whose object replaced ours")

    def _seen(self, key: str) -> bool:
        """A HEAD found `key` (an answer other than found or missing counts as not seen: it is only
        a shortcut, the Complete's If-None-Match is what keeps create-only)."""
        try:
            return self.exists(key)
        except bexc.ClientError:
            return False

    def _part_size(self, nbytes: int) -> int:
        """`part_bytes`, or more (whole MiBs) for an object that would need over S3's 10000 parts."""
        fewest = -(-nbytes // MAX_PARTS)
        size = max(self.part_bytes, -(-fewest // _MiB) * _MiB)
        if size > MAX_PART_BYTES:
            raise ValueError(f"{nbytes} bytes is over S3's largest object "
                             f"({MAX_PARTS} parts of {MAX_PART_BYTES} bytes)")
        return size

    @_retry
    def _create_upload(self, key: str) -> str:
        return self._s3.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]

    @_retry
    def _upload_part(self, key: str, upload_id: str, number: int, part: tuple[memoryview, ...]) -> str:
        reader = ViewsReader(part)
        resp = self._s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                    Body=reader, ContentLength=len(reader))
        return resp["ETag"]

    @_retry
    def _complete_upload(self, key: str, upload_id: str, parts: list[dict], create_only: bool) -> str | None:
        """The ETag of the object made."""
        extra = {"IfNoneMatch": "*"} if create_only else {}
        return self._s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts}, **extra).get("ETag")

    def _etag(self, key: str) -> str | None:
        """The ETag a HEAD of `key` shows; None if the key is missing."""
        with self._errors("HEAD", key):
            try:
                return self._head_etag(key)
            except bexc.ClientError as exc:
                if _code(exc) in _MISSING_CODES:
                    return None
                raise

    @_retry
    def _head_etag(self, key: str) -> str | None:
        return self._s3.head_object(Bucket=self.bucket, Key=key).get("ETag")

    def _abort_upload(self, key: str, upload_id: str) -> None:
        """Best effort: a failure here is logged, never raised over the error that led to it."""
        try:
            self._abort(key, upload_id)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not abort multipart upload %s of s3://%s/%s (it stays open until a lifecycle "
                        "rule removes it): %s", upload_id, self.bucket, key, exc)

    @_retry_cleanup
    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except bexc.ClientError as exc:
            if _code(exc) not in ("NoSuchUpload", "404"):  # completed or aborted already: nothing left
                raise

    def _same_bytes(self, key: str, data: bytes | Body) -> bool:
        """Whether `key` holds exactly `data`: the object is streamed in 8 MiB chunks and each chunk
        compared with ours as it comes, so memory stays one chunk whatever the size, the first
        difference ends the read and a different ContentLength ends it unread. Missing: False."""
        try:
            with self._reading(key):
                return self._stream_equal(key, views_of(data))
        except ObjectMissing:
            return False

    @contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        """A GET's errors as `get` raises them: ObjectMissing, ObjectUnreadable (S3 refuses it for
        good), StorageUnavailable (transient past the retries)."""
        with self.link.busy("down"), self._errors("GET", key):
            try:
                yield
            except bexc.ClientError as exc:
                if _code(exc) in _MISSING_CODES:
                    raise ObjectMissing(f"s3://{self.bucket}/{key} does not exist") from None
                if not transient(exc):
                    message = str(exc.response.get("Error", {}).get("Message", ""))[:200]
                    raise ObjectUnreadable(f"s3://{self.bucket}/{key}: S3 refuses to return it "
                                           f"({_code(exc)}: {message})") from None
                raise

    @_retry
    def _stream_equal(self, key: str, views: tuple[memoryview, ...]) -> bool:
        resp = self._s3.get_object(Bucket=self.bucket, Key=key)
        body = resp["Body"]

        def read(n: int) -> bytes:
            chunk = body.read(n)
            with self._counting:
                self.bytes_read += len(chunk)
            return chunk

        try:
            if int(resp.get("ContentLength", -1)) not in (-1, sum(v.nbytes for v in views)):
                return False
            return same_stream(read, views)  # each try compares from byte 0
        finally:
            body.close()

    def get(self, key: str, *, max_bytes: int) -> bytes:
        with self._reading(key):
            data = self._get(key, max_bytes, False)
        with self._counting:
            self.bytes_read += len(data)
        return data

    def get_buffer(self, key: str, *, max_bytes: int) -> bytearray:
        """`get` into one writable buffer of the object's size, filled chunk by chunk: a large object
        is held once while it is read, not twice (an uncompressed one then decodes into views of it,
        `codecs.decode(in_place=True)`)."""
        with self._reading(key):
            data = self._get(key, max_bytes, True)
        with self._counting:
            self.bytes_read += len(data)
        return data

    @_retry
    def _get(self, key: str, max_bytes: int, into_buffer: bool) -> bytes | bytearray:
        resp = self._s3.get_object(Bucket=self.bucket, Key=key)
        body = resp["Body"]
        try:
            length = int(resp.get("ContentLength", -1))
            if length > max_bytes:
                raise Refused("too_large", f"s3://{self.bucket}/{key} is {length} bytes, over the {max_bytes}-byte limit")
            if into_buffer and length >= 0:
                return _read_into(bytearray(length), body.iter_chunks(_READ_CHUNK), f"s3://{self.bucket}/{key}")
            data = body.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise Refused("too_large", f"s3://{self.bucket}/{key} is over the {max_bytes}-byte limit")
            return bytearray(data) if into_buffer else data
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        with self._errors("HEAD", key):
            try:
                self._head(key)
                return True
            except bexc.ClientError as exc:
                if _code(exc) in _MISSING_CODES:
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
