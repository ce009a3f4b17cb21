"""What the tests of big objects share (tests/integration/test_multipart.py, test_streamed_put.py):
one bucket on the session's real S3 server for the whole file (SeaweedFS takes a second to give a
new bucket its volume), a prefix of each test's own in it, a multipart threshold of 6 MiB with
parts of 5 MiB (S3's smallest) in place of the 4 GiB default, and a count of the S3 calls a store
makes. Import the fixtures into the test module."""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from diloco.infra.local.stack import LocalStack
from diloco.storage import objects
from diloco.storage.objects import ObjectStore, make_client
from diloco.storage.settings import Endpoints
from harness import fresh_endpoints

MiB = 1 << 20
THRESHOLD, PART = 6 * MiB, 5 * MiB


@pytest.fixture(scope="module")
def bucket(stack: LocalStack) -> Iterator[Endpoints]:
    with pytest.MonkeyPatch.context() as mp:
        yield fresh_endpoints(stack, mp)


@pytest.fixture
def endpoints(bucket: Endpoints, monkeypatch: pytest.MonkeyPatch) -> Endpoints:
    """The module's bucket with a prefix of the test's own (in place of conftest's fresh bucket);
    a completed upload is checked to be still ours after 0.1 s instead of 1 s."""
    monkeypatch.setattr(objects, "_SETTLE_S", 0.1)
    return dataclasses.replace(bucket, prefix=f"t{uuid.uuid4().hex[:12]}")


def small_store(endpoints: Endpoints) -> ObjectStore:
    return ObjectStore(endpoints, multipart_threshold=THRESHOLD, part_bytes=PART)


def calls(store: ObjectStore) -> Counter:
    """S3 operations the store's client makes from now on, by name."""
    seen: Counter = Counter()

    def count(event_name: str, **_) -> None:
        seen[event_name.rsplit(".", 1)[-1]] += 1

    store._s3.meta.events.register("before-call.s3", count)
    return seen


def open_uploads(endpoints: Endpoints) -> list[tuple[str, str]]:
    """Multipart uploads not completed nor aborted under the test's prefix."""
    reply = make_client(endpoints).list_multipart_uploads(Bucket=endpoints.bucket, Prefix=f"{endpoints.prefix}/")
    return [(u["Key"], u["UploadId"]) for u in reply.get("Uploads", [])]
