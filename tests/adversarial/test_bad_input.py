"""Bad input at the coordinator's door: each kind is refused with a reason, counted, and the run goes on.

Every test drives a real `Coordinator` against the session's real Redis and S3 servers, one
`step()` at a time. A bad contribution and a good one from an honest learner (the real `Uploader`
that learners send with) are on the announcements stream together; one step reads both, checks
them and merges the round. Then `Rig.assert_refused` checks what a user relies on:

- the bad one is refused with the right code, and the reason names what is wrong (object key,
  tensor, versions, stream entry...) in words a person can act on;
- `refused:{code}` and `contributions_refused` went up by exactly one, and the refusal was logged;
- the refusal is on the refusals stream and in the `refused` list of the next committed manifest;
- its stream entry is acknowledged, not left pending;
- the good contribution was merged into a new committed version: the run goes on.

Bad objects are built honestly: a valid delta encoded the way a learner encodes it, then cut
short, altered, encoded against another layout or codec, or patched to hold NaN, and uploaded
under the sender's own key with an announcement that describes the uploaded bytes unless the
test is about an announcement that lies.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from collections.abc import Callable
from dataclasses import replace

import msgpack
import pytest
import torch
import zstandard

from diloco.coordinator.leadership import Fenced
from diloco.coordinator.outer import NesterovState
from diloco.coordinator.publish import commit, commit_existing, roll_forward, write_version
from diloco.coordinator.recovery import reannounce_lost
from diloco.coordinator.state import MAX_REASON_CHARS
from diloco.storage.bus import FIELD, CommitResult
from diloco.storage.errors import Refused
from diloco.storage.history import read_manifest, sha256_hex
from diloco.storage.objects import make_client
from diloco.storage.protocol import SCHEMA_VERSION, Announcement, Refusal, VersionSettings, pack

from harness import Tiny
from rig import BAD, LIMIT, Rig, new_id


def edit_payload(blob: bytes, edit: Callable[[bytearray], None], *, fix_sha: bool = True) -> bytes:
    """The object with its (decompressed) payload edited; the header's payload_sha256 follows the edit
    unless `fix_sha` is False. What an encoder without the finiteness check would write."""
    magic, version, header_len = struct.unpack_from(">4sBI", blob)
    header = msgpack.unpackb(blob[9:9 + header_len], raw=False)
    body = blob[9 + header_len:]
    zstd = header["compression"] == "zstd"
    payload = bytearray(zstandard.ZstdDecompressor().decompress(body) if zstd else body)
    edit(payload)
    if fix_sha:
        header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    packed = msgpack.packb(header, use_bin_type=True)
    body = zstandard.ZstdCompressor().compress(bytes(payload)) if zstd else bytes(payload)
    return struct.pack(">4sBI", magic, version, len(packed)) + packed + body


# ---- truncated object ----------------------------------------------------------------------------

@pytest.mark.parametrize("compress, cut, announced, code, says", [
    (False, "payload", "as uploaded", "bad_framing", ["truncated", "header says payload_bytes="]),
    (True, "payload", "as uploaded", "bad_payload", ["zstd payload", "truncated"]),
    (True, "header", "as uploaded", "bad_header", ["past the end"]),
    (True, "payload", "whole object", "size_mismatch", ["the announcement says"]),
], ids=["raw-payload", "zstd-payload", "header", "upload-cut-short"])
def test_truncated_object_is_refused(make_rig, compress, cut, announced, code, says):
    rig = make_rig(compress=compress)
    before = rig.before()
    cid = new_id()
    whole = rig.delta_blob(cid)
    short = whole[:-8] if cut == "payload" else whole[:24]
    if announced == "as uploaded":
        eid, a = rig.forge(short, cid=cid)
    else:
        eid, a = rig.forge(whole, cid=cid, upload=short)
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code=code, learner=BAD, cid=cid, says=[a.object_key, *says], good=good)


# ---- wrong sha256 --------------------------------------------------------------------------------

def _flip_a_byte(blob: bytes) -> bytes:
    bad = bytearray(blob)
    bad[-3] ^= 0xFF
    return bytes(bad)


@pytest.mark.parametrize("how, code, says", [
    ("altered after upload", "sha256_mismatch", ["altered or corrupted after upload"]),
    ("announcement lies", "sha256_mismatch", ["the announcement says"]),
    ("payload differs from its header", "sha256_mismatch", ["payload sha256", "corrupt or was tampered with"]),
], ids=["altered", "lying-announcement", "payload-vs-header"])
def test_wrong_sha256_is_refused(rig, how, code, says):
    before = rig.before()
    cid = new_id()
    blob = rig.delta_blob(cid)
    if how == "altered after upload":
        eid, a = rig.forge(blob, cid=cid, upload=_flip_a_byte(blob))
    elif how == "announcement lies":
        eid, a = rig.forge(blob, cid=cid, sha256=sha256_hex(b"some other object"))
    else:
        eid, a = rig.forge(edit_payload(blob, lambda p: p.__setitem__(-1, p[-1] ^ 1), fix_sha=False), cid=cid)
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code=code, learner=BAD, cid=cid, says=[a.object_key, *says], good=good)


# ---- wrong shape or dtype ------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["reshaped", "tensor missing", "other fragment's tensors", "fp32 in an int8 run"])
def test_wrong_shape_or_dtype_is_refused(rig, how):
    before = rig.before()
    specs = rig.layout.fragments[0]
    tensors = {s.name: 0.01 * torch.randn(s.shape) for s in specs}
    codec = None
    first, last = specs[0], specs[-1]
    if how == "reshaped":
        tensors[first.name] = tensors[first.name].reshape(-1)
        code, says = "wrong_shape", [first.name, f"expected shape {first.shape}", f"found {(first.numel,)}"]
    elif how == "tensor missing":
        del tensors[last.name]
        code, says = "wrong_shape", [f"missing [{last.name!r}]", "unexpected []"]
    elif how == "other fragment's tensors":
        others = rig.layout.fragments[1]
        tensors = {s.name: torch.zeros(s.shape) for s in others}
        code, says = "wrong_shape", [f"missing [{first.name!r}", f"unexpected [{others[0].name!r}"]
    else:
        codec = "fp32"
        code, says = "wrong_dtype", ["fp32", "'int8'"]
    cid = new_id()
    eid, a = rig.forge(rig.delta_blob(cid, tensors=tensors, codec=codec), cid=cid)
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code=code, learner=BAD, cid=cid, says=[a.object_key, *says], good=good)


# ---- NaN / Inf -----------------------------------------------------------------------------------

def _poison(codec: str, value: float) -> Callable[[bytearray], None]:
    """Put `value` in the first element (fp32, bf16) or the first block's scale (int8, int4)."""
    f32 = struct.pack("<f", value)

    def edit(payload: bytearray) -> None:
        if codec == "bf16":
            payload[0:2] = f32[2:4]  # bfloat16 is the upper half of a float32
        else:
            payload[0:4] = f32
    return edit


@pytest.mark.parametrize("codec, value", [
    ("fp32", math.nan), ("fp32", math.inf), ("bf16", math.nan), ("bf16", -math.inf), ("int8", math.nan),
    ("int4", math.inf),
])
def test_nan_or_inf_is_refused(make_rig, codec, value):
    rig = make_rig(codec=codec)
    before = rig.before()
    cid = new_id()
    eid, a = rig.forge(edit_payload(rig.delta_blob(cid), _poison(codec, value)), cid=cid)
    _, good = rig.send_good()
    rig.coord.step()
    first = rig.layout.fragments[0][0].name
    rig.assert_refused(before, eid, code="non_finite", learner=BAD, cid=cid, good=good,
                       says=[a.object_key, repr(first), "NaN", "Inf"])


def test_finite_delta_whose_merge_overflows_is_refused(make_rig):
    """Every value is finite, but so large (and so heavily weighted) that the outer step overflows
    float32: refused, instead of a crash at publish that would come back after every restart. (Alone
    in the run's first round: with another learner's piece to measure it by, its norm is bounded
    first, `test_claims.py`.)"""
    rig = make_rig(codec="fp32")
    before = rig.before()
    cid = new_id()
    huge = {s.name: torch.full(s.shape, 3e38) for s in rig.layout.fragments[0]}
    eid, a = rig.forge(rig.delta_blob(cid, tensors=huge), cid=cid, tokens=10**6)
    rig.coord.step()
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="non_finite", learner=BAD, cid=cid, good=good,
                       says=[a.object_key, "overflows float32", "3e+38"])


def test_finite_delta_of_float32s_largest_values_beside_an_honest_piece_is_bounded(make_rig):
    """The same delta in a round with an honest piece: its norm counts up to max_claim_ratio x the
    honest piece's, so the merge does not overflow and the honest piece is not held back."""
    rig = make_rig(codec="fp32")
    head = rig.head()
    cid = new_id()
    huge = {s.name: torch.full(s.shape, 3e38) for s in rig.layout.fragments[0]}
    rig.forge(rig.delta_blob(cid, tensors=huge), cid=cid, tokens=10**6)
    _, good = rig.send_good()
    rig.coord.step()
    inputs = {c.learner: c for c in read_manifest(rig.store, rig.keys, 0, head + 1).inputs}
    assert set(inputs) == {"good", BAD}
    assert inputs[BAD].clip * inputs[BAD].norm == pytest.approx(4 * inputs["good"].norm)
    assert "scaled by" in inputs[BAD].bounded


# ---- object over the size limit ------------------------------------------------------------------

@pytest.fixture
def gets(rig: Rig) -> dict[str, object]:
    """Every GetObject the coordinator's S3 client makes: key -> bytes it read from the response body."""
    bodies: dict[str, object] = {}
    events = rig.store._s3.meta.events  # instrumentation of the real client, no stand-in

    def on_params(params, context, **_):
        context["diloco_key"] = params["Key"]

    def on_reply(parsed, context, **_):
        bodies[context["diloco_key"]] = parsed.get("Body")

    events.register("provide-client-params.s3.GetObject", on_params)
    events.register("after-call.s3.GetObject", on_reply)
    return bodies


@pytest.mark.parametrize("announced", ["truthfully", "understated"])
def test_object_over_the_size_limit_is_refused_unread(rig, gets, announced):
    before = rig.before()
    cid = new_id()
    big = rig.delta_blob(cid, padding="x" * (8 * LIMIT))  # a valid object, 8x the run's limit
    assert len(big) > 8 * LIMIT
    if announced == "truthfully":
        eid, a = rig.forge(big, cid=cid)
        says = [a.object_key, f"{len(big)} bytes", f"max_object_bytes of {LIMIT}"]
    else:
        eid, a = rig.forge(big, cid=cid, size_bytes=1000)
        says = [a.object_key, f"{len(big)} bytes", f"{LIMIT}-byte limit"]
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="too_large", learner=BAD, cid=cid, says=says, good=good)
    if announced == "truthfully":
        assert a.object_key not in gets  # refused on the announcement alone
    else:
        assert gets[a.object_key].tell() <= LIMIT + 1  # refused on ContentLength, or after limit + 1 bytes


# ---- unknown run or fragment ---------------------------------------------------------------------

@pytest.mark.parametrize("how", ["other run", "fragment out of range", "object says other run",
                                 "someone else's object"])
def test_unknown_run_or_fragment_is_refused(rig, how):
    before = rig.before()
    cid = new_id()
    blob = rig.delta_blob(cid)
    if how == "other run":
        eid, a = rig.forge(blob, cid=cid, run="other-run")
        code, says = "misaddressed", ["'other-run'", repr(rig.spec.run)]
    elif how == "fragment out of range":
        eid, a = rig.forge(blob, cid=cid, fragment=2)
        code, says = "unknown_fragment", ["fragment 2", "0..1"]
    elif how == "object says other run":
        cid = new_id()
        eid, a = rig.forge(rig.delta_blob(cid, run="other-run"), cid=cid)
        code, says = "misaddressed", [a.object_key, "run='other-run'"]
    else:
        _, theirs = rig.send_good("l1")
        eid, a = rig.forge(blob, cid=cid, object_key=theirs.object_key, size_bytes=theirs.size_bytes,
                           sha256=theirs.sha256)
        code, says = "misaddressed", [theirs.object_key, rig.keys.delta(0, BAD, a.seq)]
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code=code, learner=BAD, cid=cid, says=says, good=good)


# ---- base version from the future, too stale ----------------------------------------------------

def test_base_version_from_the_future_is_refused(rig):
    rig.advance(1)
    before = rig.before()
    eid, a = rig.bad_delta(base_version=2)
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="future_base", learner=BAD, cid=a.contribution_id, good=good,
                       says=["fragment 0", "base version 2", "head 1"])


def test_base_more_than_max_staleness_behind_is_refused_and_one_at_the_limit_merged(make_rig):
    rig = make_rig(max_staleness=1)
    rig.advance(3)
    before = rig.before()
    eid, a = rig.bad_delta(base_version=1)
    _, at_limit = rig.send_good("l1", base_version=2)
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="stale", learner=BAD, cid=a.contribution_id, good=good,
                       says=["fragment 0", "base version 1", "2 versions behind head 3", "max_staleness 1"])
    merged = read_manifest(rig.store, rig.keys, 0, 4).inputs
    assert {(c.learner, c.staleness) for c in merged} == {("good", 0), ("l1", 1)}
    assert at_limit.contribution_id in {c.contribution_id for c in merged}


# ---- duplicate announcement ----------------------------------------------------------------------

@pytest.mark.parametrize("when", ["in the same read", "after it was applied", "same object, new id"])
def test_duplicate_announcement_is_applied_once(rig, when):
    _, first = rig.send_good("l1")
    if when != "in the same read":
        rig.coord.step()
        assert first.contribution_id in [c.contribution_id for c in read_manifest(rig.store, rig.keys, 0, 1).inputs]
    before = rig.before()
    if when == "same object, new id":
        # A learner may not announce one object twice under two ids: its header names the first.
        replay = replace(first, contribution_id=new_id())
        eid = rig.bus.announce(replay)
        code, cid, says = "misaddressed", replay.contribution_id, [first.object_key, first.contribution_id]
    else:
        eid = rig.xadd({FIELD: first.to_wire()})  # what redis-py does when it retries an XADD
        code, cid, says = "duplicate", first.contribution_id, [first.contribution_id, "l1"]
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code=code, learner="l1", cid=cid, says=says, good=good,
                       copies_merged=1 if when == "in the same read" else 0)
    assert rig.bus.counters()["contributions_applied"] == 2 + 2  # two genesis, l1's once, the good one


# ---- malformed stream entry ----------------------------------------------------------------------

def _wire(rig: Rig, **over) -> bytes:
    a = Announcement(kind="delta", run=rig.spec.run, fragment=0, learner=BAD, seq=1, contribution_id="e" * 32,
                     base_version=0, tokens=40, steps=4, step_time_s=0.01, object_key=rig.keys.delta(0, BAD, 1),
                     size_bytes=100, sha256="0" * 64, sent_at=0.0)
    body = msgpack.unpackb(a.to_wire(), raw=False)
    body.update(over)
    for name in [k for k, v in over.items() if v is None]:
        del body[name]
    return pack(body)


@pytest.mark.parametrize("entry, code, says", [
    (lambda rig: {FIELD: b"\xc1 not msgpack"}, "bad_message", ["not valid msgpack"]),
    (lambda rig: {b"other": b"x"}, "bad_message", ["no 'm' field"]),
    (lambda rig: {FIELD: pack([1, 2])}, "bad_message", ["expected a map"]),
    (lambda rig: {FIELD: _wire(rig, schema=SCHEMA_VERSION + 1)}, "unknown_schema",
     [f"schema version {SCHEMA_VERSION + 1}", "upgrade"]),
    (lambda rig: {FIELD: _wire(rig, sha256=None)}, "bad_message", ["missing fields ['sha256']"]),
    (lambda rig: {FIELD: _wire(rig, fragment="0")}, "bad_message", ["Announcement.fragment", "integer"]),
    (lambda rig: {FIELD: _wire(rig, learner="../root")}, "bad_id", ["'../root'"]),
    # A trailing newline is not part of an id: it would name another object key, another hash field.
    (lambda rig: {FIELD: _wire(rig, learner=f"{BAD}\n")}, "bad_id", [f"'{BAD}\\n'"]),
    (lambda rig: {FIELD: _wire(rig, deadline=math.inf)}, "bad_message", ["deadline", "inf"]),
], ids=["not-msgpack", "no-m-field", "not-a-map", "unknown-schema", "missing-field", "wrong-type", "bad-id",
        "newline-in-id", "infinite-deadline"])
def test_malformed_stream_entry_is_refused(rig, entry, code, says):
    before = rig.before()
    eid = rig.xadd(entry(rig))
    _, good = rig.send_good()
    rig.coord.step()
    # Nothing in the entry can be trusted, so the reason names the entry: XRANGE finds it.
    rig.assert_refused(before, eid, code=code, learner="", cid="", says=[f"stream entry {eid}", *says], good=good)


def test_sequence_number_beyond_the_key_format_is_refused(rig):
    before = rig.before()
    eid = rig.xadd({FIELD: _wire(rig, seq=10**17, contribution_id="d" * 32)})
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="bad_message", learner=BAD, cid="d" * 32, good=good,
                       says=[f"seq {10**17}", "16 digits"])


def test_refusal_of_an_entry_a_megabyte_long_stays_small(rig):
    before = rig.before()
    cid = new_id()
    eid, a = rig.forge(rig.delta_blob(cid), cid=cid, object_key="k" * ((1 << 20) - 1000))
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="misaddressed", learner=BAD, cid=cid, good=good,
                       says=[f"delta from {BAD} points at 'kkkk", "more characters"])
    assert len(rig.bus.refusals()[-1].reason) < MAX_REASON_CHARS + 100


# ---- announcement whose object is missing ---------------------------------------------------------

def test_announced_object_that_is_missing_is_refused(rig):
    before = rig.before()
    cid = new_id()
    eid, a = rig.forge(rig.delta_blob(cid), cid=cid, upload=b"")
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="missing_object", learner=BAD, cid=cid, good=good,
                       says=[a.object_key, "does not exist"])


# ---- an object S3 will not return --------------------------------------------------------------

def test_an_object_stored_with_a_key_of_its_own_is_refused_and_the_coordinator_goes_on(rig):
    """A learner's PutObject right lets it store its object with SSE-C (an encryption key only it
    holds): the object exists, and S3 refuses every GET without the key. Before, the botocore error
    ended the coordinator's loop, and every successor's on the same pending entry."""
    before = rig.before()
    cid = new_id()
    blob = rig.delta_blob(cid)
    eid, a = rig.forge(blob, cid=cid, upload=b"")
    make_client(rig.endpoints).put_object(Bucket=rig.endpoints.bucket, Key=a.object_key, Body=blob,
                                          SSECustomerAlgorithm="AES256", SSECustomerKey=os.urandom(32))
    _, good = rig.send_good()
    rig.coord.step()
    rig.assert_refused(before, eid, code="unreadable_object", learner=BAD, cid=cid, good=good,
                       says=[a.object_key, "S3 refuses to return it"])


# ---- a planted object in the recovery sweep -------------------------------------------------------

def test_the_sweep_for_lost_announcements_skips_an_object_whose_header_lies(rig):
    """After Redis lost data, the coordinator announces again the contribution objects nobody
    accounts for, from their headers, which their learners wrote: `tokens = inf` (or a string)
    there is counted as unreadable, while the honest object beside it is announced again (int(inf)
    once raised OverflowError out of the sweep, and the coordinator died at every start)."""
    planted = []
    for tokens in (math.inf, "many"):
        cid = new_id()
        planted.append(rig.forge(rig.delta_blob(cid, tokens=tokens), cid=cid)[1])
    honest = rig.forge(rig.delta_blob(cid := new_id(), tokens=40, steps=4, step_time_s=0.01, deadline=0.0,
                                      final=0), cid=cid)[1]
    rig.bus.r.delete(rig.keys.announcements)  # Redis lost them
    again, unreadable = reannounce_lost(rig.store, rig.bus, rig.bus.heads(), known=set(), keep=4, max_bytes=LIMIT)
    assert (again, unreadable) == (1, 2)
    [(_, fields)] = rig.bus.r.xrange(rig.keys.announcements)
    assert Announcement.from_wire(fields[FIELD]).contribution_id == honest.contribution_id
    said = rig.caplog.text
    assert all(f"cannot announce {a.object_key} again" in said for a in planted)
    assert said.count("its header does not describe a contribution") == 2


# ---- a flood of refusals ---------------------------------------------------------------------------

def test_a_flood_of_forged_announcements_leaves_a_manifest_of_bounded_size(make_rig):
    """Every refusal since the parent went into the next manifest: ~23k forged announcements made a
    73 MB manifest that committed and that no reader accepted again. Now a manifest lists at most
    `max_refusals_listed` of them (here 5), the last line counting the rest by code; each one is
    still refused, counted and on the refusals stream."""
    rig = make_rig()
    rig.coord.state.config = replace(rig.coord.config, max_refusals_listed=5)
    before = rig.before()
    for i in range(12):
        rig.xadd({FIELD: _wire(rig, fragment=7, contribution_id=f"{i:032x}")})  # no such fragment
    for i in range(3):
        rig.xadd({FIELD: b"\xc1 not msgpack"})
    _, good = rig.send_good()
    rig.coord.step()
    assert rig.head(0) == before.head + 1
    manifest = read_manifest(rig.store, rig.keys, 0, before.head + 1)
    assert good.contribution_id in [c.contribution_id for c in manifest.inputs]
    assert [r.code for r in manifest.refused] == ["unknown_fragment"] * 4 + ["more_refused"]
    assert manifest.refused[-1].reason.startswith("11 more refusals since the parent version (unknown_fragment x8, "
                                                  "bad_message x3)")
    assert rig.bus.counters()["contributions_refused"] == before.counters.get("contributions_refused", 0) + 15
    assert len(rig.bus.refusals()) == before.refusals + 15


def test_a_manifest_too_large_for_its_readers_is_never_written(rig):
    """Whatever fills a manifest, the coordinator does not commit one its readers refuse: it stops
    before writing the version's first object."""
    version = rig.head(0) + 1
    params = {s.name: torch.zeros(s.shape) for s in rig.layout.fragments[0]}
    huge = tuple(Refusal(contribution_id="", learner="", code="bad_message", reason="x" * (1 << 20)) for _ in range(65))
    with pytest.raises(ValueError, match=f"fragment 0 version {version} would be .* bytes, over the 67108864"):
        write_version(rig.store, rig.keys, fragment=0, version=version, params=params, state=NesterovState(),
                      inputs=(), refused=huge, epoch=1,
                      settings=VersionSettings(kind="delta", outer_lr=0.7, outer_momentum=0.9))
    assert list(rig.store.list(rig.keys.version_dir(0, version))) == []


# ---- an entry delivered again ------------------------------------------------------------------------

def test_an_entry_delivered_again_while_its_round_is_open_stays_pending_and_merges_once(make_rig):
    """The coordinator re-reads its own pending entries after a restart of its read and after a
    Redis outage (and claims idle ones). An entry whose contribution waits in an open round was then
    refused as a duplicate and acknowledged: the contribution lived in memory only, and a crash
    before the round merged lost it."""
    rig = make_rig(min_quorum=2)
    for learner in ("good", "other"):
        rig.bus.heartbeat(learner, 60.0)  # two live learners: the round waits for both
    before = rig.before()
    eid, a = rig.send_good("good")
    rig.coord.step()
    assert rig.head(0) == before.head  # the round is open, waiting for its quorum
    rig.coord.state.read_pending = True  # what the coordinator sets after a Redis outage: re-read our pending entries
    rig.coord.step()
    pending = rig.bus.r.xpending_range(rig.keys.announcements, rig.keys.GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [eid]  # still pending: not acknowledged as a duplicate
    assert len(rig.bus.refusals()) == before.refusals
    _, other = rig.send_good("other")
    rig.coord.step()
    manifest = read_manifest(rig.store, rig.keys, 0, before.head + 1)
    assert sorted(c.contribution_id for c in manifest.inputs) == sorted([a.contribution_id, other.contribution_id])
    assert rig.bus.r.xpending_range(rig.keys.announcements, rig.keys.GROUP, "-", "+", 10) == []


def test_roll_forward_commits_a_manifest_that_names_an_applied_contribution_again(rig):
    """A history that already names a contribution twice (written by a coordinator that trusted a
    Redis which forgot a commit) must not keep every later coordinator from starting: a manifest
    in S3 is committed whatever Redis's applied set says (S3 is the truth)."""
    _, a = rig.send_good()
    rig.coord.step()
    head = rig.head(0)
    merged = read_manifest(rig.store, rig.keys, 0, head)
    assert rig.bus.is_applied(a.contribution_id)
    params = {s.name: torch.zeros(s.shape) for s in rig.layout.fragments[0]}
    write_version(rig.store, rig.keys, fragment=0, version=head + 1, params=params, state=NesterovState(),
                  inputs=merged.inputs, refused=(), settings=merged.settings, epoch=rig.coord.epoch)
    heads = roll_forward(rig.store, rig.bus, range(2), rig.coord.epoch, keep_applied=5)
    assert heads[0] == rig.head(0) == head + 1


def test_a_deposed_coordinator_committing_its_successors_version_is_fenced(rig):
    """A deposed coordinator whose manifest write loses to its successor's adopts that version and
    commits it with its own, older epoch: Redis answered ALREADY (the same version, the same bytes)
    and it went on publishing. The epoch is checked first: FENCED."""
    rig.send_good()
    rig.coord.step()
    manifest = read_manifest(rig.store, rig.keys, 0, rig.head(0))
    assert commit(rig.bus, manifest, epoch=rig.coord.epoch, ack_ids=[], keep_applied=5) is CommitResult.ALREADY  # our own retry
    assert commit(rig.bus, manifest, epoch=rig.coord.epoch + 1, ack_ids=[], keep_applied=5) is CommitResult.FENCED
    with pytest.raises(Fenced, match="another coordinator holds the run"):  # what `_adopt_written` calls
        commit_existing(rig.bus, manifest, epoch=rig.coord.epoch + 1, keep_applied=5)


def test_a_contribution_this_coordinator_committed_is_a_duplicate_even_if_redis_forgot_it(rig):
    """Redis's applied set is a cache of what the manifests in S3 name: a contribution the coordinator
    committed itself is refused as a duplicate when announced again, even once Redis has lost it."""
    before = rig.before()
    eid, a = rig.send_good()
    rig.coord.step()
    assert rig.head(0) == before.head + 1
    rig.bus.r.srem(rig.keys.applied, a.contribution_id)  # Redis forgot that it was applied
    again = rig.bus.announce(a)
    _, good = rig.send_good()
    rig.coord.step()
    [refusal] = rig.bus.refusals()[before.refusals:]
    assert (refusal.code, refusal.contribution_id) == ("duplicate", a.contribution_id), refusal
    ids = [c.contribution_id for v in range(1, rig.head(0) + 1) for c in read_manifest(rig.store, rig.keys, 0, v).inputs]
    assert ids.count(a.contribution_id) == 1 and good.contribution_id in ids and again != eid


def test_a_piece_based_on_a_successors_version_is_left_to_the_successor(rig):
    """A coordinator that was deposed a moment ago reads a piece based on a version its successor has
    published since: it must not refuse it as from the future (and acknowledge it: the honest piece
    would be lost), but stop, fenced, leaving the entry pending for the successor."""
    head = rig.head(0)
    rig.bus.r.incr(rig.keys.epoch)  # a successor took the run over...
    rig.bus.r.hset(rig.keys.heads, 0, head + 1)  # ... and published version head + 1
    cid = new_id()
    eid, _ = rig.forge(rig.delta_blob(cid, learner="good", base_version=head + 1), cid=cid, learner="good",
                       base_version=head + 1)
    with pytest.raises(Fenced):
        rig.coord.step()
    assert rig.bus.refusals() == []
    pending = rig.bus.r.xpending_range(rig.keys.announcements, rig.keys.GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [eid]


def test_a_sweep_for_lost_announcements_makes_none_again_for_pieces_merged_long_ago(rig):
    """The sweep looks at objects stored since shortly before the oldest of the last versions; those
    merged further back within that margin are accounted for by their manifests, not by Redis's
    applied set (which keeps only the last versions' ids): nothing is announced again."""
    rig.advance(12)
    assert rig.coord.recovery.announce_lost(rig.coord.state.heads()) == 0
    assert rig.bus.counters().get("reannounced_from_s3", 0) == 0


def test_a_params_object_changed_in_the_bucket_is_refused_on_export_and_nothing_is_written(rig, tmp_path,
                                                                                            monkeypatch):
    """Anyone holding the bucket's credentials can overwrite a version's params: taking the model out
    checks each params object against its manifest's sha256 and refuses, writing nothing."""
    from diloco.infra.cli import main as diloco
    from diloco.storage.global_model import load_global

    manifest = read_manifest(rig.store, rig.keys, 1, 0)
    blob = bytearray(rig.store.get(manifest.params_key, max_bytes=LIMIT))
    blob[-1] ^= 0xFF
    rig.store.put(manifest.params_key, bytes(blob), create_only=False)
    for name, value in rig.endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    assert diloco(["model", "export", "--run", rig.keys.run, "--out", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(Refused, match="sha256_mismatch"):
        load_global(rig.keys.run, Tiny(), endpoints=rig.endpoints)
