"""A version's params and outer state go up as views of their tensors (`codecs.encode_streamed`),
never joined into one buffer, against the session's real S3 server (SeaweedFS or MinIO).

What is read back must be the very bytes `codecs.encode` makes (the format replay and older runs
read), whether the object goes up in one PUT or in parts whose edges cut through tensors; a
create-only put of the same views again is a success found by comparing, of other bytes a Conflict.
"""

from __future__ import annotations


import pytest
import torch

from diloco.coordinator.outer import NesterovState
from diloco.coordinator.publish import decode_state, write_version
from diloco.storage import codecs
from diloco.storage.errors import Conflict
from diloco.storage.history import params_limit, read_params, read_verified, sha256_hex
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Layout, ParamSpec, VersionSettings
from smalls3 import PART, THRESHOLD, bucket, calls, endpoints, open_uploads, small_store  # noqa: F401 (fixtures)

def fragment(seed: int, rows: int = 64) -> dict[str, torch.Tensor]:
    """Tensors of odd sizes (a view's edge is never a part's), one of them a transposed view; ~3 MiB per 64 rows."""
    g = torch.Generator().manual_seed(seed)
    out = {f"blocks.{i}.w": torch.randn(rows, 1531 + i, generator=g) for i in range(8)}
    out["blocks.0.b"] = torch.randn(1531, generator=g)
    out["head.t"] = torch.randn(97, rows, generator=g).t()
    return out


def test_a_params_object_put_from_its_tensors_reads_back_as_the_encoded_bytes(endpoints):
    store, key = ObjectStore(endpoints), f"{endpoints.prefix}/versions/0/1/params"
    tensors = fragment(0)
    meta = {"run": "r", "fragment": 0, "version": 1, "kind": "params"}
    streamed = codecs.encode_streamed(tensors, meta=meta)
    seen = calls(store)
    store.put(key, streamed)
    assert dict(seen) == {"PutObject": 1}
    blob = store.get(key, max_bytes=len(streamed))
    assert blob == codecs.encode(tensors, "fp32", meta=meta)
    assert sha256_hex(blob) == sha256_hex(streamed)
    back, _ = codecs.decode(blob, max_bytes=len(blob))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_params_object_read_into_one_buffer_decodes_into_views_of_it(endpoints, tmp_path):
    """How a version's params are read (`history.read_params`): the object once in memory, not
    twice. `get_buffer` gives the very bytes of `get`, writable; decoded in place, every tensor is a
    view of that buffer; a compressed object decodes into memory of its own, as before."""
    from diloco.storage.localdir import DirStore

    tensors = fragment(1)
    plain = codecs.encode(tensors, "fp32", meta={"kind": "params"})
    packed = codecs.encode(tensors, "int8", compress=True, meta={"kind": "params"})
    for store in (ObjectStore(endpoints), DirStore(tmp_path)):
        for name, blob in (("plain", plain), ("packed", packed)):
            key = f"{endpoints.prefix}/buffer/{name}"
            store.put(key, blob)
            buf = store.get_buffer(key, max_bytes=len(blob))
            assert isinstance(buf, bytearray) and buf == store.get(key, max_bytes=len(blob)) == blob
            start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
            back, _ = codecs.decode(buf, max_bytes=len(plain), in_place=True)
            inside = [start <= t.data_ptr() < start + len(buf) for t in back.values()]
            assert all(inside) if name == "plain" else not any(inside), (name, store)
            assert back.keys() == tensors.keys()
            if name == "plain":
                assert all(torch.equal(back[n], t) for n, t in tensors.items())
            with pytest.raises(codecs.Refused, match="too_large"):
                store.get_buffer(key, max_bytes=len(blob) - 1)


def test_a_streamed_object_over_the_threshold_goes_up_in_parts_cut_across_its_tensors(endpoints):
    store = small_store(endpoints)
    key = f"{endpoints.prefix}/versions/0/1/outer_state"
    tensors = fragment(1, rows=256)  # ~12 MiB: three parts
    streamed = codecs.encode_streamed(tensors, meta={"kind": "outer_state"})
    assert len(streamed) > 2 * PART
    seen = calls(store)
    store.put(key, streamed)
    assert seen["CreateMultipartUpload"] == 1 and seen["UploadPart"] == 3 and seen["PutObject"] == 0
    assert store.get(key, max_bytes=len(streamed)) == bytes(streamed)
    assert open_uploads(endpoints) == []


@pytest.mark.parametrize("threshold", [THRESHOLD, 4 << 30], ids=["multipart", "single"])
def test_the_same_views_again_succeed_by_comparison_and_other_bytes_conflict(endpoints, threshold):
    """A retried put whose reply was lost: the object is found and compared with the views chunk by
    chunk (no upload); views of other values, or the same values in another object, are refused."""
    store = ObjectStore(endpoints, multipart_threshold=threshold, part_bytes=PART)
    key = f"{endpoints.prefix}/versions/0/2/params"
    tensors = fragment(2, rows=192)
    streamed = codecs.encode_streamed(tensors, meta={"version": 2})
    store.put(key, streamed)
    seen = calls(store)
    store.put(key, codecs.encode_streamed(tensors, meta={"version": 2}))
    assert seen["GetObject"] == 1 and seen["UploadPart"] == 0 and seen["PutObject"] <= 1
    other = {n: t.clone() for n, t in tensors.items()}
    other["head.t"][-1, -1] += 1.0  # one value in the last view
    for different in (codecs.encode_streamed(other, meta={"version": 2}),
                      codecs.encode_streamed(tensors, meta={"version": 3})):
        with pytest.raises(Conflict):
            store.put(key, different)
    assert store.get(key, max_bytes=len(streamed)) == bytes(streamed)


def test_a_written_version_reads_back_as_its_tensors_and_its_manifest_shas(endpoints):
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, "r")
    params = fragment(3)
    state = NesterovState(momentum=fragment(4), steps=5, residual=fragment(5))
    layout = Layout(fragments=(tuple(ParamSpec(n, tuple(t.shape), "float32") for n, t in params.items()),))
    manifest = write_version(store, keys, fragment=0, version=1, params=params, state=state, inputs=(), refused=(),
                             settings=VersionSettings(kind="delta", outer_lr=0.7, outer_momentum=0.9), epoch=1)
    assert manifest.params_bytes == len(codecs.encode(params, "fp32", meta={"run": "r", "fragment": 0, "version": 1,
                                                                           "kind": "params"}))
    back = read_params(store, layout, manifest)
    assert back.keys() == params.keys() and all(torch.equal(back[n], t) for n, t in params.items())
    limit = 2 * params_limit(layout, 0)
    loaded = decode_state(read_verified(store, manifest.outer_state_key, manifest.outer_state_sha256,
                                        max_bytes=limit), limit)
    assert loaded.steps == 5
    assert all(torch.equal(loaded.momentum[n], t) for n, t in state.momentum.items())
    assert all(torch.equal(loaded.residual[n], t) for n, t in state.residual.items())
