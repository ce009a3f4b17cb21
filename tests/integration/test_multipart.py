"""Objects over `ObjectStore`'s multipart threshold, against the session's real S3 server (SeaweedFS
or MinIO): still create-only, retried, and never left as an open upload.

A small threshold (6 MiB, parts of 5 MiB: S3's smallest) stands in for the 4 GiB default. Faults are
made with botocore's event hooks on the real client (a lost reply, a part that fails, a rival write
landing just before the Complete); nothing is mocked. The tests share one bucket (SeaweedFS takes a
second to give a new bucket its volume), each under a prefix of its own, and wait 0.1 s instead of
1 s before checking a completed object is still theirs.
"""

from __future__ import annotations

import os
import threading

import botocore.exceptions as bexc
import pytest

import diloco
from diloco.storage.errors import Conflict
from diloco.storage.objects import MAX_PARTS, MIN_PART_BYTES, ObjectStore, make_client
from smalls3 import MiB, PART, THRESHOLD, bucket, calls, endpoints, open_uploads, small_store  # noqa: F401 (fixtures)

BIG = 10 * MiB + 12345  # three parts: 5 MiB, 5 MiB and the rest


def test_a_big_object_goes_up_in_parts_and_reads_back_byte_for_byte(endpoints):
    store, key, data = small_store(endpoints), f"{endpoints.prefix}/big", os.urandom(BIG)
    seen = calls(store)
    store.put(key, data)
    assert seen["CreateMultipartUpload"] == 1 and seen["UploadPart"] == 3 and seen["CompleteMultipartUpload"] == 1
    assert seen["PutObject"] == 0
    # Absent before (one HEAD), still ours after (another, whose ETag matches the Complete's): no
    # read-back of the object.
    assert seen["HeadObject"] == 2 and seen["GetObject"] == 0
    assert store.get(key, max_bytes=BIG) == data
    assert open_uploads(endpoints) == []


def test_every_put_and_part_sends_its_body_at_once_and_names_diloco(endpoints):
    """No `Expect: 100-continue` (a round trip per object, longer on a busy link) and a short
    User-Agent, on the wire to the real server: and the objects still land."""
    store = small_store(endpoints)
    sent: list[tuple[str, dict[str, str]]] = []

    def record(request, event_name: str, **_) -> None:
        sent.append((event_name.rsplit(".", 1)[-1], {k: v.decode() if isinstance(v, bytes) else v
                                                     for k, v in request.headers.items()}))

    store._s3.meta.events.register("before-send.s3", record)
    small, big = os.urandom(1000), os.urandom(BIG)
    store.put(f"{endpoints.prefix}/small", small)
    store.put(f"{endpoints.prefix}/big", big)
    assert store.get(f"{endpoints.prefix}/small", max_bytes=BIG) == small
    assert store.get(f"{endpoints.prefix}/big", max_bytes=BIG) == big
    bodies = [(op, headers) for op, headers in sent if op in ("PutObject", "UploadPart")]
    assert [op for op, _ in bodies] == ["PutObject", "UploadPart", "UploadPart", "UploadPart"], sent
    assert not [op for op, headers in bodies if "Expect" in headers]
    assert all(headers["User-Agent"].startswith(f"diloco/{diloco.__version__} ") for _, headers in sent)


@pytest.mark.parametrize("size", [1024, THRESHOLD])
def test_an_object_up_to_the_threshold_is_one_put(endpoints, size):
    store, key, data = small_store(endpoints), f"{endpoints.prefix}/small", os.urandom(size)
    seen = calls(store)
    store.put(key, data)
    assert dict(seen) == {"PutObject": 1}
    assert store.get(key, max_bytes=size) == data


def test_create_only_refuses_other_bytes_and_keeps_the_first(endpoints):
    store, key = small_store(endpoints), f"{endpoints.prefix}/big"
    first = os.urandom(BIG)
    store.put(key, first)
    for other in (os.urandom(BIG), first[:-1] + bytes([first[-1] ^ 1]), os.urandom(BIG + MiB)):
        with pytest.raises(Conflict):
            store.put(key, other)
    assert store.get(key, max_bytes=BIG) == first
    assert open_uploads(endpoints) == []


def test_the_same_bytes_again_succeed_without_a_second_upload(endpoints):
    """A caller retrying a put whose reply it lost: the object is found and compared, not re-sent."""
    store, key, data = small_store(endpoints), f"{endpoints.prefix}/big", os.urandom(BIG)
    store.put(key, data)
    seen = calls(store)
    store.put(key, data)
    assert seen["UploadPart"] == 0 and seen["GetObject"] == 1
    assert store.get(key, max_bytes=BIG) == data


def test_a_lost_complete_reply_is_retried_and_found_to_be_ours(endpoints):
    """The Complete succeeds but its reply is lost: the retry gets 412 (or NoSuchUpload), the
    comparison finds our own bytes, and the put succeeds."""
    store, key, data = small_store(endpoints), f"{endpoints.prefix}/big", os.urandom(BIG)
    lost: list[int] = []

    def lose_first_reply(**_) -> None:
        if not lost:
            lost.append(1)
            raise bexc.ConnectionClosedError(endpoint_url=endpoints.s3_endpoint or "s3")

    store._s3.meta.events.register("after-call.s3.CompleteMultipartUpload", lose_first_reply)
    seen = calls(store)
    store.put(key, data)
    assert lost and seen["CompleteMultipartUpload"] == 2
    assert store.get(key, max_bytes=BIG) == data
    assert open_uploads(endpoints) == []


def test_a_rival_write_just_before_the_complete_wins_and_our_upload_is_aborted(endpoints):
    """The key is absent when we start and appears while our parts go up: the server's
    If-None-Match on CompleteMultipartUpload refuses ours, the rival's object stays, and the upload
    left open by the refused Complete is aborted."""
    store, key = small_store(endpoints), f"{endpoints.prefix}/big"
    ours, theirs = os.urandom(BIG), os.urandom(MiB)
    rival = make_client(endpoints)

    def rival_writes(**_) -> None:
        if not rival_writes.done:
            rival_writes.done = True
            rival.put_object(Bucket=endpoints.bucket, Key=key, Body=theirs, IfNoneMatch="*")

    rival_writes.done = False
    store._s3.meta.events.register("before-call.s3.CompleteMultipartUpload", rival_writes)
    with pytest.raises(Conflict):
        store.put(key, ours)
    assert store.get(key, max_bytes=BIG) == theirs
    assert open_uploads(endpoints) == []


def test_a_failed_upload_is_aborted_and_its_error_surfaces(endpoints):
    store, key = small_store(endpoints), f"{endpoints.prefix}/big"

    def fail_part_two(params, **_) -> None:
        if params.get("PartNumber") == 2:
            raise RuntimeError("part two failed")

    store._s3.meta.events.register("provide-client-params.s3.UploadPart", fail_part_two)
    seen = calls(store)
    with pytest.raises(RuntimeError, match="part two failed"):
        store.put(key, os.urandom(BIG))
    assert seen["AbortMultipartUpload"] == 1
    assert not store.exists(key)
    assert open_uploads(endpoints) == []


@pytest.mark.slow  # 5 s: the race; make test keeps every other multipart test
def test_concurrent_writers_of_one_key_have_one_winner(endpoints):
    """Writers of other bytes whose Completes reach the server together. SeaweedFS checks
    If-None-Match and then writes in two steps, so several Completes can succeed; the check after
    completing turns all but the last into a Conflict."""
    n, key = 4, f"{endpoints.prefix}/raced"
    blobs = [os.urandom(THRESHOLD + MiB) for _ in range(n)]
    barrier, outcome = threading.Barrier(n), [""] * n

    def together(**_) -> None:  # returns None: anything else would stand in for the reply
        barrier.wait(timeout=30)

    def write(i: int) -> None:
        store = small_store(endpoints)
        store._s3.meta.events.register("before-call.s3.CompleteMultipartUpload", together)
        try:
            store.put(key, blobs[i])
            outcome[i] = "created"
        except Conflict:
            outcome[i] = "conflict"
        except Exception as exc:  # noqa: BLE001 (reported by the assert below)
            outcome[i] = repr(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcome) == ["conflict"] * (n - 1) + ["created"], outcome
    assert small_store(endpoints).get(key, max_bytes=THRESHOLD + MiB) == blobs[outcome.index("created")]
    assert open_uploads(endpoints) == []


def test_an_overwriting_put_replaces_a_big_object(endpoints):
    store, key = small_store(endpoints), f"{endpoints.prefix}/big"
    store.put(key, os.urandom(BIG))
    replacement = os.urandom(BIG)
    store.put(key, replacement, create_only=False)
    assert store.get(key, max_bytes=BIG) == replacement


def test_the_server_checks_if_none_match_on_complete(endpoints):
    """What the adapter relies on, asked of the server directly: a Complete with If-None-Match: *
    on a key that exists is refused with 412 and does not replace it."""
    s3, key = make_client(endpoints), f"{endpoints.prefix}/raw"
    s3.put_object(Bucket=endpoints.bucket, Key=key, Body=b"first")
    upload = s3.create_multipart_upload(Bucket=endpoints.bucket, Key=key)["UploadId"]
    etag = s3.upload_part(Bucket=endpoints.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"second")["ETag"]
    with pytest.raises(bexc.ClientError) as refused:
        s3.complete_multipart_upload(Bucket=endpoints.bucket, Key=key, UploadId=upload, IfNoneMatch="*",
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket=endpoints.bucket, Key=key)["Body"].read() == b"first"
    assert open_uploads(endpoints) == [(key, upload)]  # the refused upload stays open (and is seen)...
    s3.abort_multipart_upload(Bucket=endpoints.bucket, Key=key, UploadId=upload)
    assert open_uploads(endpoints) == []  # ...until aborted


def test_part_sizes_follow_s3s_limits(endpoints):
    store = small_store(endpoints)
    assert store._part_size(BIG) == PART
    huge = MAX_PARTS * PART * 3 + 1  # would need 30001 parts of 5 MiB
    size = store._part_size(huge)
    assert size % MiB == 0 and -(-huge // size) <= MAX_PARTS
    with pytest.raises(ValueError, match="part_bytes"):
        ObjectStore(endpoints, part_bytes=MIN_PART_BYTES - 1)
    with pytest.raises(ValueError, match="multipart_threshold"):
        ObjectStore(endpoints, multipart_threshold=6 << 30)
