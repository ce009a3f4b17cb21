"""A version's fp32 objects as views of its tensors (`codecs.encode_streamed`), and the reader that
sends them (`objects.ViewsReader`, `objects.window` for the parts of a multipart upload).

The streamed object must be `codecs.encode(..., "fp32")`'s very bytes, whatever the tensors (empty,
0-dim, not contiguous, other dtypes, parameters that require grad): replay and older runs read the
format, and manifests record the sha256 of the whole object.
"""

from __future__ import annotations

import hashlib
import io
import random

import pytest
import torch

from diloco.storage import codecs
from diloco.storage.errors import Conflict, Refused
from diloco.storage.history import sha256_hex
from diloco.storage.localdir import DirStore
from diloco.storage.objects import ViewsReader, views_of, window


def tensor_sets() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    return {
        "none": {},
        "one": {"w": torch.randn(3, 4, generator=g)},
        "empty-ish": {"e": torch.empty(0), "f": torch.empty(3, 0, 2), "s": torch.tensor(2.5), "one": torch.ones(1)},
        "only-empty": {"e": torch.empty(0, 5)},
        "not contiguous": {"t": base.t(), "step": base[:, ::3], "col": base[:, 2],
                           "expanded": torch.ones(3).expand(4, 3)},
        "views with an offset": {"tail": base[3:], "row": base[4]},
        "other dtypes": {"h": torch.randn(5, generator=g).half(), "b": torch.randn(7, generator=g).bfloat16(),
                         "d": torch.randn(2, 3, generator=g, dtype=torch.float64)},
        "parameters": {"p": torch.nn.Parameter(torch.randn(4, 4, generator=g)),
                       "q": torch.nn.Parameter(torch.zeros(2))},
        "many": {f"layer.{i}.weight": torch.randn(i + 1, 3, generator=g) for i in range(40)},
    }


@pytest.mark.parametrize("name", list(tensor_sets()))
def test_the_streamed_object_is_the_encoded_object_byte_for_byte(name):
    tensors = tensor_sets()[name]
    meta = {"run": "r", "fragment": 3, "version": 7, "kind": "params", "x": 0.5}
    blob = codecs.encode(tensors, "fp32", meta=meta)
    streamed = codecs.encode_streamed(tensors, meta=meta)
    assert bytes(streamed) == blob
    assert len(streamed) == len(blob) == sum(v.nbytes for v in streamed.views)
    assert sha256_hex(streamed) == sha256_hex(blob) == hashlib.sha256(blob).hexdigest()
    back, header = codecs.decode(blob, max_bytes=1 << 20)
    assert [s.name for s in header.tensors] == list(tensors)
    for key, t in tensors.items():
        assert torch.equal(back[key], t.detach().float())


def test_a_contiguous_fp32_tensor_is_viewed_not_copied():
    """What the streamed object holds is the tensor's own memory: no copy of a fragment is made."""
    w, other = torch.randn(100, 10), torch.randn(10, 100).t()
    streamed = codecs.encode_streamed({"w": w, "t": other})
    assert streamed.tensors[0].data_ptr() == w.data_ptr()
    assert streamed.tensors[1].data_ptr() != other.data_ptr()  # converted on its own: contiguous, as written
    assert all(v.readonly for v in streamed.views)


def test_the_views_hold_the_memory_they_view():
    """A view kept after the object is gone still reads its bytes, converted copies included."""
    tensors = {"t": torch.randn(300, 7).t(), "h": torch.randn(500).half()}
    kept = codecs.encode_streamed(tensors).views
    churn = [torch.randn(2100) for _ in range(50)]  # allocations that would reuse freed memory
    assert b"".join(kept) == codecs.encode(tensors, "fp32") and churn


def test_the_streamed_object_refuses_what_encode_refuses():
    with pytest.raises(Refused) as refused:
        codecs.encode_streamed({"ok": torch.zeros(3), "bad": torch.tensor([1.0, float("nan")])})
    assert refused.value.code == "non_finite" and "'bad'" in refused.value.reason
    with pytest.raises(Refused):
        codecs.encode_streamed({"inf": torch.tensor([float("inf")], dtype=torch.float64)})
    with pytest.raises(ValueError, match="floating-point"):
        codecs.encode_streamed({"i": torch.arange(3)})
    with pytest.raises(ValueError, match="meta"):
        codecs.encode_streamed({"w": torch.zeros(1)}, meta={"bad": [1]})  # type: ignore[dict-item]


def views(*chunks: bytes) -> tuple[memoryview, ...]:
    return tuple(memoryview(c) for c in chunks)


PIECES = views(b"", b"DLCO", b"\x01", b"", b"header-bytes", bytes(range(256)) * 3, b"x", b"")
JOINED = b"".join(PIECES)


def test_the_reader_reads_the_views_in_order_whatever_the_read_sizes():
    for size in (1, 2, 3, 7, 64, 1000, len(JOINED), len(JOINED) + 5):
        reader = ViewsReader(PIECES)
        got = b""
        while chunk := reader.read(size):
            got += chunk
        assert got == JOINED and reader.tell() == len(JOINED) == len(reader)
        assert reader.read(10) == b""
    assert ViewsReader(PIECES).read() == JOINED
    assert ViewsReader(()).read() == b"" and len(ViewsReader(())) == 0


def test_the_reader_seeks_and_reads_as_a_file_of_the_joined_bytes_does():
    """Random seeks (from the start, the current position, the end; before the start and past the
    end) and reads, against io.BytesIO over the same bytes."""
    rnd = random.Random(1)
    reader, reference = ViewsReader(PIECES), io.BytesIO(JOINED)
    assert reader.readable() and reader.seekable()
    for _ in range(2000):
        whence = rnd.choice([io.SEEK_SET, io.SEEK_CUR, io.SEEK_END])
        offset = rnd.randint(-len(JOINED) - 10, len(JOINED) + 10)
        if whence == io.SEEK_SET:
            offset = abs(offset)  # BytesIO refuses a negative absolute position; ours clamps it to 0
        expected = reference.seek(max(0, {io.SEEK_SET: 0, io.SEEK_CUR: reference.tell(),
                                          io.SEEK_END: len(JOINED)}[whence] + offset))
        assert reader.seek(offset, whence) == expected
        n = rnd.randint(0, 300)
        assert reader.read(n) == reference.read(n)
        assert reader.tell() == reference.tell()


def test_readinto_fills_the_buffer_across_views():
    reader = ViewsReader(PIECES)
    reader.seek(3)
    buf = bytearray(20)
    assert reader.readinto(buf) == 20 and bytes(buf) == JOINED[3:23]
    reader.seek(len(JOINED) - 4)
    assert reader.readinto(buf) == 4 and bytes(buf[:4]) == JOINED[-4:]


def test_windows_are_the_parts_of_the_joined_bytes():
    """The multipart path sends each part from a window of the views: every cut, across views or not."""
    total = len(JOINED)
    for size in (1, 5, 13, 256, total - 1, total, total + 1):
        parts = [window(PIECES, start, start + size) for start in range(0, total, size)]
        assert [b"".join(p) for p in parts] == [JOINED[s:s + size] for s in range(0, total, size)]
        assert all(ViewsReader(p).read() == JOINED[s:s + size] for p, s in zip(parts, range(0, total, size)))
    assert window(PIECES, 5, 5) == ()


def test_a_streamed_object_goes_into_a_directory_store_and_compares_there(tmp_path):
    store = DirStore(tmp_path)
    tensors = tensor_sets()["many"]
    streamed = codecs.encode_streamed(tensors, meta={"kind": "params"})
    store.put("v/params", streamed)
    assert store.get("v/params", max_bytes=1 << 20) == codecs.encode(tensors, "fp32", meta={"kind": "params"})
    store.put("v/params", streamed)  # the same bytes again: a retried put, success
    store.put("v/params", bytes(streamed))
    with pytest.raises(Conflict):
        store.put("v/params", codecs.encode_streamed(tensors, meta={"kind": "other"}))
    with pytest.raises(Conflict):
        store.put("v/params", bytes(streamed)[:-1])
    assert store.get("v/params", max_bytes=1 << 20) == bytes(streamed)


def test_views_of_bytes_and_of_a_body():
    assert [bytes(v) for v in views_of(b"abc")] == [b"abc"]
    streamed = codecs.encode_streamed({"w": torch.ones(2)})
    assert views_of(streamed) == streamed.views


def test_blake3_of_the_views_is_blake3_of_the_joined_bytes(monkeypatch):
    """`Manifest.params_blake3` is taken over the views of a streamed params object, and a learner's
    take over its own; where the blake3 package is missing none is recorded ("")."""
    import blake3

    from diloco.storage import history

    body = codecs.encode_streamed({"w": torch.randn(300, 7), "b": torch.randn(11)})
    joined = b"".join(bytes(v) for v in views_of(body))
    assert history.blake3_hex(body) == history.blake3_hex(joined) == blake3.blake3(joined).hexdigest()
    assert sha256_hex(body) == hashlib.sha256(joined).hexdigest()
    monkeypatch.setattr(history, "blake3", None)
    assert history.blake3_hex(body) == ""
