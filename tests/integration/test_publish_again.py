"""A round whose publish fails before its manifest merges again, to the same bits.

To keep its memory to one copy of each fragment's state, the coordinator holds a round's pieces
in the codec's bytes (checked and decompressed) and decodes them one at a time as the merge adds them up, and it
lets go of the parent version's params and outer state once the new version is computed. Should
the publish fail before the manifest is written (S3 refuses a PUT, or is unavailable past the
retries), the next step reads the parent again from S3, decodes the pieces again, and publishes the
very same version: the objects the failed attempt left are found byte-identical, and replay
re-derives the version bit for bit. A real coordinator (`rig.Rig`) on the session's real Redis and
S3 servers.
"""

from __future__ import annotations

import dataclasses

from collections import Counter

import botocore.exceptions as bexc
import pytest
import torch

from diloco.infra.history.replay import replay_run
from diloco.storage.history import read_manifest
from diloco.storage.objects import ObjectStore


def test_a_publish_refused_before_its_manifest_merges_again_from_s3_to_the_same_bits(rig, endpoints):
    rig.advance(1)  # a parent with momentum and a downstream residual to read back
    parent = rig.head()
    version = parent + 1
    params_key = rig.keys.params(0, version, rig.coord.epoch)
    state_key = rig.keys.outer_state(0, version, rig.coord.epoch)
    refused: list[str] = []

    def refuse_the_params_once(params, **_) -> None:  # noqa: ANN001
        if params.get("Key") == params_key and not refused:
            refused.append(params_key)
            raise bexc.ClientError({"Error": {"Code": "AccessDenied", "Message": "refused by the test"}}, "PutObject")

    gets: Counter = Counter()

    def count_gets(params, **_) -> None:  # noqa: ANN001
        gets[params.get("Key")] += 1

    events = rig.store._s3.meta.events  # the real client, instrumented: nothing stands in for S3
    events.register("provide-client-params.s3.PutObject", refuse_the_params_once)
    events.register("provide-client-params.s3.GetObject", count_gets)
    _, a = rig.send_good("a")
    _, b = rig.send_good("b")
    with pytest.raises(bexc.ClientError):
        rig.coord.step()
    frag = rig.coord.fragments[0]
    assert refused and rig.head() == parent
    assert frag.params is None and frag.state is None  # the parent was let go of before the publish
    assert {c.announcement.contribution_id for c in frag.round} == {a.contribution_id, b.contribution_id}
    # Pieces held as checked payloads, in the codec's bytes: a fraction of their decoded size.
    assert rig.coord.layout is not None
    decoded = rig.coord.layout.fragment_bytes(0)
    assert all(c.piece is not None and 0 < c.piece.nbytes < decoded for c in frag.round)
    left_behind = ObjectStore(endpoints).get(state_key, max_bytes=1 << 30)

    rig.coord.step()
    assert rig.head() == version and frag.round == []
    manifest = read_manifest(rig.store, rig.keys, 0, version)
    assert {c.contribution_id for c in manifest.inputs} == {a.contribution_id, b.contribution_id}
    # The parent's params and outer state were read again; the pieces were not (the round holds them).
    assert gets[a.object_key] == 1 and gets[b.object_key] == 1
    parent_manifest = read_manifest(rig.store, rig.keys, 0, parent)
    assert gets[parent_manifest.params_key] == 1 and gets[parent_manifest.outer_state_key] == 1
    # The outer state the failed attempt wrote is the committed one, byte for byte.
    assert ObjectStore(endpoints).get(state_key, max_bytes=1 << 30) == left_behind
    report = replay_run(ObjectStore(endpoints), rig.keys, fragment=0)
    assert report.ok and [c.version for c in report.checks] == list(range(version + 1)), report.summary()


def test_an_overflowing_round_refuses_its_largest_piece_and_merges_the_rest(rig):
    """The outer step overflowing float32 needs the pieces again (to find the largest): they are
    decoded again from the round, not read again from S3, and the round merges without the culprit.
    (The norm bound would scale the culprit down first: lifted here, as in a run whose
    --max-norm-ratio is huge. Its claims are cut, and a bounded piece kept out of the momentum moves
    the params once, which 3e38 alone does not overflow: here the buffer takes it, as with
    --bounded-momentum.)"""
    rig.coord.state.round_cfg = dataclasses.replace(rig.coord.round_cfg, max_norm_ratio=1e300, bounded_momentum=True)
    rig.advance(1)
    gets: Counter = Counter()
    rig.store._s3.meta.events.register("provide-client-params.s3.GetObject",
                                       lambda params, **_: gets.update([params.get("Key")]))
    cid = "f" * 32
    blob = rig.delta_blob(cid, tensors={s.name: torch.full(s.shape, 3e38) for s in rig.layout.fragments[0]})
    _, bad = rig.forge(blob, cid=cid, tokens=10**6)
    _, good = rig.send_good()
    head = rig.head()
    rig.coord.step()
    assert rig.head() == head + 1
    manifest = read_manifest(rig.store, rig.keys, 0, head + 1)
    assert [c.contribution_id for c in manifest.inputs] == [good.contribution_id]
    assert [r.contribution_id for r in rig.bus.refusals() if r.code == "non_finite"] == [bad.contribution_id]
    assert gets[good.object_key] == 1 and gets[bad.object_key] == 1
