"""The tensor object format: round trips within the stated error bounds, and refusal of bad bytes.

Every refusal test crafts the bad object by hand (truncation, flipped bytes, rewritten headers,
payloads with a recomputed sha256) and asserts the stable `code` that operators count.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgpack
import pytest
import torch
import zstandard

from diloco.storage.codecs import CODECS, MAGIC, decode, encode, error_bound, get, read_header
from diloco.storage import codecs
from diloco.storage.errors import Refused

LIMIT = 64 << 20
SHAPES = {"scalar": (), "empty": (0,), "odd": (7,), "matrix": (3, 5), "blocks": (1000,), "odd_blocks": (9, 57)}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(shape, generator=gen) * 3 for name, shape in SHAPES.items()}
    out["half"] = torch.randn(33, generator=gen).half()
    out["double"] = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    out["zeros"] = torch.zeros(70)
    return out


def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (header_len,) = struct.unpack(">I", blob[5:9])
    return msgpack.unpackb(blob[9:9 + header_len]), blob[9 + header_len:]


def _frame(header: dict[str, Any] | bytes, body: bytes, version: int = 1) -> bytes:
    raw = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return MAGIC + bytes([version]) + struct.pack(">I", len(raw)) + raw + body


def _reseal(blob: bytes, edit_payload: Any) -> bytes:
    """Apply `edit_payload(bytearray)` to an uncompressed object and recompute its sha256."""
    header, body = _split(blob)
    payload = bytearray(body)
    edit_payload(payload)
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    return _frame(header, bytes(payload))


def _refused(blob: bytes, code: str, **kwargs: Any) -> Refused:
    with pytest.raises(Refused) as info:
        decode(blob, max_bytes=kwargs.pop("max_bytes", LIMIT), **kwargs)
    assert info.value.code == code, info.value.reason
    return info.value


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element: the absmax of the quantization block it belongs to."""
    flat = x.detach().float().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -len(flat) % block)).view(-1, block)
    return padded.abs().amax(dim=1).repeat_interleave(block)[:len(flat)]


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_within_stated_error_bound(codec: str, compress: bool) -> None:
    tensors = _tensors()
    blob = encode(tensors, codec, compress=compress, meta={"run": "r1", "fragment": 3}, block_size=64)
    out, header = decode(blob, max_bytes=LIMIT, expect={k: tuple(v.shape) for k, v in tensors.items()})
    assert list(out) == list(tensors)
    assert header.codec == codec and header.compression == ("zstd" if compress else "none")
    assert header.meta == {"run": "r1", "fragment": 3}
    for name, x in tensors.items():
        y, ref = out[name], x.float()
        assert y.dtype == torch.float32 and y.shape == x.shape and y.is_contiguous()
        err = (y - ref).abs().reshape(-1)
        if codec == "fp32":
            assert torch.equal(y, ref)
        elif codec == "bf16":
            assert bool((err <= ref.abs().reshape(-1) * 2.0**-8).all())
        else:
            bound = torch.tensor([error_bound(codec, float(a)) for a in _block_absmax(x, 64)])
            assert bool((err <= bound).all()), f"{name}: max excess {float((err - bound).max())}"
    assert torch.equal(out["zeros"], torch.zeros(70))


def test_error_bound_values() -> None:
    assert error_bound("fp32", 5.0) == 0.0
    assert error_bound("bf16", 1.0) == pytest.approx(2.0**-8)
    assert error_bound("int8", 127.0) == pytest.approx(0.5, rel=1e-3)
    assert error_bound("int4", 7.0) == pytest.approx(0.5, rel=1e-3)
    assert error_bound("int2", 1.0) == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(ValueError):
        error_bound("int1", 1.0)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("codec", CODECS)
def test_encoding_is_deterministic_and_leaves_input_alone(codec: str, compress: bool) -> None:
    tensors = _tensors()
    before = {k: v.clone() for k, v in tensors.items()}
    assert encode(tensors, codec, compress=compress) == encode(_tensors(), codec, compress=compress)
    assert all(torch.equal(tensors[k], before[k]) for k in tensors)


@pytest.mark.parametrize(("codec", "limit"), [("int8", 0.01), ("int4", 0.15), ("bf16", 0.005)])
def test_relative_rms_error_on_gaussian_data(codec: str, limit: float) -> None:
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    y, _ = decode(encode({"w": x}, codec), max_bytes=LIMIT)
    rel = float((y["w"] - x).norm() / x.norm())
    assert rel < limit


def test_int4_packs_low_nibble_first_with_scale_before_values() -> None:
    blob = encode({"v": torch.tensor([7.0, -7.0, 0.0])}, "int4", block_size=256)
    _, body = _split(blob)
    assert struct.unpack("<f", body[:4])[0] == 1.0  # absmax 7 / 7
    assert body[4:] == bytes([0x0F | 0x10, 0x08 | 0x80])  # 7+8 low, -7+8 high; 0+8 then pad 8


@pytest.mark.parametrize("n", [512, 511])
@pytest.mark.parametrize("block", [256, 7])
def test_every_int4_byte_decodes_to_its_nibbles_or_is_refused_and_the_norm_agrees(n: int, block: int) -> None:
    """Each of the 256 byte values, at the start of the codes and as the last byte (the pad nibble of
    an odd count): decode gives low nibble - 8, then high nibble - 8, times the scale, or refuses the
    byte as "bad_payload"; checked_norm (the coordinator's check of a piece) refuses the same bytes and
    otherwise gives the norm of what decode gives. Both read 4-bit codes through a byte table."""
    blob = encode({"w": torch.randn(n, generator=torch.Generator().manual_seed(0))}, "int4", block_size=block)
    blocks = -(-n // block)
    for at in (4 * blocks, -1):
        for byte in range(256):
            edited = _reseal(blob, lambda p: p.__setitem__(at, byte))
            low, high = byte & 0x0F, byte >> 4
            pad = at == -1 and n % 2 == 1
            good = low != 0 and (high == 8 if pad else high != 0)
            opened = codecs.open_object(edited, max_bytes=LIMIT)
            if not good:
                _refused(edited, "bad_payload")
                with pytest.raises(Refused):
                    codecs.checked_norm(opened)
                continue
            w = decode(edited, max_bytes=LIMIT)[0]["w"]
            scales = torch.frombuffer(bytearray(_split(edited)[1][:4 * blocks]), dtype=torch.float32)
            first = n - 1 - (n - 1) % 2 if at == -1 else 0
            values = [low - 8.0] if pad else [low - 8.0, high - 8.0]
            expect = [float(torch.tensor(v) * scales[(first + i) // block]) for i, v in enumerate(values)]
            assert w[first:first + len(expect)].tolist() == expect
            assert codecs.checked_norm(opened) == pytest.approx(float(w.double().norm()), rel=1e-6)  # decode rounds each product to float32


def test_int2_packs_four_ternary_codes_per_byte_lowest_bits_first() -> None:
    blob = encode({"v": torch.tensor([2.0, -2.0, 0.4, 1.2, -1.6])}, "int2", block_size=256)
    _, body = _split(blob)
    assert struct.unpack("<f", body[:4])[0] == 2.0  # absmax / 1
    # codes v + 1: 2, 0, 1 (0.4 / 2 rounds to 0), 2 (1.2 / 2 rounds to 1); then 0 (-0.8 -> -1) and pads of 1
    assert body[4:] == bytes([2 | 0 << 2 | 1 << 4 | 2 << 6, 0 | 1 << 2 | 1 << 4 | 1 << 6])
    out, _ = decode(blob, max_bytes=LIMIT)
    assert out["v"].tolist() == [2.0, -2.0, 0.0, 2.0, -2.0]


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_quantized_values_decode_to_the_correctly_rounded_product_of_value_and_scale(codec: str) -> None:
    """Bit for bit float32(value * scale), as the format says, whatever kernels compute it; a
    short last block included. Replay of old versions depends on these exact bits."""
    x = torch.randn(9, 57, generator=torch.Generator().manual_seed(3)) * 1e-3
    blob = encode({"v": x}, codec, block_size=64)
    _, body = _split(blob)
    n, blocks = x.numel(), -(-x.numel() // 64)
    scales = torch.frombuffer(bytearray(body[:4 * blocks]), dtype=torch.float32).double()
    codes = torch.frombuffer(bytearray(body[4 * blocks:]), dtype=torch.uint8)
    if codec == "int8":
        values = codes.view(torch.int8).double()
    elif codec == "int4":
        values = torch.stack((codes & 15, codes >> 4), dim=1).view(-1)[:n].double() - 8
    else:
        values = torch.stack([(codes >> (2 * j)) & 3 for j in range(4)], dim=1).view(-1)[:n].double() - 1
    # A float64 product of a 4-bit or 8-bit integer and a float32 is exact: one rounding, to float32.
    expected = (values * scales.repeat_interleave(64)[:n]).float()
    out, _ = decode(blob, max_bytes=LIMIT)
    assert torch.equal(out["v"].reshape(-1).view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_zero_block_has_scale_zero_and_decodes_to_zeros(codec: str) -> None:
    x = torch.cat([-torch.zeros(4), torch.tensor([1.0, -2.0, 0.5, 0.0])])  # block 0 is all -0.0
    blob = encode({"v": x}, codec, block_size=4)
    _, body = _split(blob)
    assert body[:4] == bytes(4)  # +0.0, not -0.0
    assert struct.unpack("<f", body[4:8])[0] == pytest.approx(2.0 / {"int8": 127, "int4": 7, "int2": 1}[codec], rel=1e-7)
    out, _ = decode(blob, max_bytes=LIMIT)
    assert torch.equal(out["v"][:4], torch.zeros(4))


def test_decoded_tensors_are_writable_and_do_not_alias_the_input() -> None:
    for codec in CODECS:
        blob = bytearray(encode({"w": torch.ones(100)}, codec))
        out, _ = decode(blob, max_bytes=LIMIT)
        before = out["w"].clone()
        assert torch.equal(before, torch.ones(100)) or codec.startswith(("sparse", "sign"))  # they keep some of the 100
        blob[-200:] = bytes(200)  # scribble over the source buffer
        assert torch.equal(out["w"], before)
        out["w"].add_(1)  # writable


def test_read_header_describes_the_layout() -> None:
    header = read_header(encode({"a": torch.ones(3), "b": torch.ones(2, 2)}, "int8", block_size=2), max_bytes=LIMIT)
    assert header.block_size == 2
    assert [(s.name, s.shape, s.offset, s.nbytes) for s in header.tensors] == [
        ("a", (3,), 0, 2 * 4 + 3), ("b", (2, 2), 11, 2 * 4 + 4)]
    assert header.payload_bytes == 23
    assert read_header(encode({"a": torch.ones(3)}, "bf16"), max_bytes=LIMIT).block_size == 0


# --- refusals on encode ------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_refuses_non_finite(codec: str, bad: float) -> None:
    x = torch.randn(300)
    x[299] = bad
    with pytest.raises(Refused) as info:
        encode({"w": x}, codec)
    assert info.value.code == "non_finite"


def test_encode_refuses_values_beyond_bfloat16_range() -> None:
    with pytest.raises(Refused) as info:
        encode({"w": torch.tensor([3.4e38])}, "bf16")
    assert info.value.code == "non_finite"


@pytest.mark.parametrize("kwargs", [{"codec": "int3"}, {"codec": "int8", "block_size": 0},
                                    {"meta": {"ok": [1, 2]}}, {"meta": {"flag": True}}])
def test_encode_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        encode({"w": torch.ones(3)}, **kwargs)
    with pytest.raises(ValueError):
        encode({"w": torch.ones(3, dtype=torch.int64)})


# --- refusals on decode: framing and size ------------------------------------------------------


def test_refuses_object_over_max_bytes() -> None:
    blob = encode({"w": torch.ones(100)})
    _refused(blob, "too_large", max_bytes=len(blob) - 1)
    decode(blob, max_bytes=len(blob))


def test_refuses_declared_payload_over_max_bytes() -> None:
    blob = encode({"w": torch.zeros(100_000)}, compress=True)  # ~400 kB of zeros compress to little
    _refused(blob, "too_large", max_bytes=100_000)


@pytest.mark.parametrize("cut", [0, 3, 8, 20])
def test_refuses_truncated_framing(cut: int) -> None:
    blob = encode({"w": torch.ones(10)})
    code = "bad_framing" if cut < 9 else "bad_header"
    _refused(blob[:cut], code)


def test_refuses_truncated_payload() -> None:
    blob = encode({"w": torch.randn(1000)})
    _refused(blob[:-1], "bad_framing")
    _refused(blob + b"\0", "bad_framing")
    _refused(encode({"w": torch.randn(1000)}, compress=True)[:-10], "bad_payload")


def test_refuses_bad_magic_and_unknown_version() -> None:
    header, body = _split(encode({"w": torch.ones(3)}))
    _refused(b"XLCO" + _frame(header, body)[4:], "bad_framing")
    _refused(_frame(header, body, version=2), "bad_framing")


def test_refuses_implausible_header_length() -> None:
    blob = encode({"w": torch.ones(3)})
    _refused(blob[:5] + struct.pack(">I", (1 << 20) + 1) + blob[9:], "bad_header")
    _refused(blob[:5] + struct.pack(">I", len(blob)) + blob[9:], "bad_header")


def test_refuses_flipped_payload_byte() -> None:
    blob = bytearray(encode({"w": torch.randn(100)}, "int8"))
    blob[-5] ^= 0x01
    _refused(bytes(blob), "sha256_mismatch")


def test_hashed_skips_only_the_payload_sha256() -> None:
    """A caller that checked the whole object against a recorded sha256 (`hashed`) has the payload's
    own digest taken on trust; every other check of the values stands."""
    values = torch.tensor([1.0, -2.0, 3.0, 0.5])
    blob = bytearray(encode({"w": values}))  # fp32, uncompressed: the payload is the last 16 bytes
    blob[-4:] = struct.pack("<f", 4.0)
    _refused(bytes(blob), "sha256_mismatch")
    tensors, _ = decode(bytes(blob), max_bytes=LIMIT, hashed=True)
    assert tensors["w"].tolist() == [1.0, -2.0, 3.0, 4.0]
    blob[-4:] = struct.pack("<f", float("nan"))
    _refused(bytes(blob), "non_finite", hashed=True)
    _refused(bytes(blob[:-2]), "bad_framing", hashed=True)
    _refused(encode({"w": values}), "wrong_shape", hashed=True, expect={"w": (5,)})


def test_refuses_flipped_header_byte() -> None:
    blob = bytearray(encode({"w": torch.randn(100)}, "int4"))
    blob[9] = 0xC1  # msgpack's one never-used byte, where the header map starts
    _refused(bytes(blob), "bad_header")


def test_any_single_byte_corruption_is_refused_or_harmless() -> None:
    tensors = {"a": torch.randn(5), "b": torch.randn(2, 3)}
    for codec in CODECS:
        for compress in (False, True):
            blob = encode(tensors, codec, compress=compress, meta={"run": "r"}, block_size=4)
            clean, _ = decode(blob, max_bytes=LIMIT)
            for i in range(len(blob)):
                bad = bytearray(blob)
                bad[i] ^= 0xFF
                try:
                    out, _ = decode(bytes(bad), max_bytes=LIMIT)
                except Refused:
                    continue
                assert all(torch.equal(out[k], clean[k]) for k in clean), (codec, compress, i)


# --- refusals on decode: header schema ---------------------------------------------------------


def _edit(header: dict[str, Any], key: str, value: Any) -> None:
    header[key] = value


HEADER_EDITS = {
    "unknown codec": lambda h: _edit(h, "codec", "int3"),
    "unknown compression": lambda h: _edit(h, "compression", "lz4"),
    "missing field": lambda h: h.pop("meta"),
    "unknown field": lambda h: _edit(h, "extra", 1),
    "payload_bytes as str": lambda h: _edit(h, "payload_bytes", "23"),
    "bool for int": lambda h: _edit(h["tensors"][0], "offset", False),
    "sha not hex": lambda h: _edit(h, "payload_sha256", "Z" * 64),
    "block_size for int8 is 0": lambda h: _edit(h, "block_size", 0),
    "meta with a list": lambda h: _edit(h, "meta", {"a": [1]}),
    "tensors not a list": lambda h: _edit(h, "tensors", {}),
    "negative dim": lambda h: _edit(h["tensors"][0], "shape", [-3]),
    "absurd dim": lambda h: _edit(h["tensors"][0], "shape", [1 << 50]),
    "too many dims": lambda h: _edit(h["tensors"][0], "shape", [1] * 17),
    "shape not a list": lambda h: _edit(h["tensors"][0], "shape", 3),
    "nbytes wrong for shape": lambda h: _edit(h["tensors"][0], "shape", [4]),
    "overlap": lambda h: _edit(h["tensors"][1], "offset", h["tensors"][1]["offset"] - 1),
    "gap": lambda h: _edit(h["tensors"][1], "offset", h["tensors"][1]["offset"] + 1),
    "payload not covered": lambda h: _edit(h, "payload_bytes", h["payload_bytes"] + 1),
    "duplicate names": lambda h: _edit(h["tensors"][1], "name", "a"),
    "tensor entry extra key": lambda h: _edit(h["tensors"][0], "dtype", "f4"),
    "ExtType in meta": lambda h: _edit(h, "meta", {"x": msgpack.ExtType(1, b"boom")}),
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS), ids=list(HEADER_EDITS))
def test_refuses_bad_header(edit: str) -> None:
    header, body = _split(encode({"a": torch.ones(3), "b": torch.ones(5)}, "int8"))
    HEADER_EDITS[edit](header)
    reason = _refused(_frame(header, body), "bad_header").reason
    assert reason  # a sentence for a person, not empty


@pytest.mark.parametrize("raw", [msgpack.packb([1, 2]), msgpack.packb({1: 2}), msgpack.packb({"a": b"x"}),
                                 msgpack.packb({"codec": "fp32"}) + b"\x00", b"\xc1"])
def test_refuses_header_that_is_not_a_plain_map(raw: bytes) -> None:
    _refused(_frame(raw, b""), "bad_header")


# --- refusals on decode: payload ---------------------------------------------------------------


def test_refuses_nan_in_fp32_payload_with_valid_sha() -> None:
    blob = _reseal(encode({"w": torch.ones(4)}), lambda p: p.__setitem__(slice(4, 8), struct.pack("<f", float("nan"))))
    _refused(blob, "non_finite")


def test_refuses_inf_in_bf16_payload_with_valid_sha() -> None:
    blob = _reseal(encode({"w": torch.ones(4)}, "bf16"), lambda p: p.__setitem__(slice(2, 4), b"\x80\x7f"))
    _refused(blob, "non_finite")


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
@pytest.mark.parametrize(("scale", "code"), [(float("nan"), "non_finite"), (float("inf"), "non_finite"),
                                            (3e38, "non_finite"), (-1.0, "bad_payload")])
def test_refuses_bad_scale_with_valid_sha(codec: str, scale: float, code: str) -> None:
    if codec == "int2" and scale == 3e38:
        pytest.skip("int2's qmax is 1: no finite scale overflows value * scale")
    blob = encode({"w": torch.randn(600)}, codec, block_size=256)  # 3 scales, then values
    _refused(_reseal(blob, lambda p: p.__setitem__(slice(4, 8), struct.pack("<f", scale))), code)


def test_refuses_out_of_range_codes_with_valid_sha() -> None:
    int8 = encode({"w": torch.randn(10)}, "int8", block_size=256)
    _refused(_reseal(int8, lambda p: p.__setitem__(6, 0x80)), "bad_payload")  # int8 -128
    int4 = encode({"w": torch.randn(10)}, "int4", block_size=256)
    _refused(_reseal(int4, lambda p: p.__setitem__(6, p[6] & 0xF0)), "bad_payload")  # nibble 0
    odd = encode({"w": torch.randn(9)}, "int4", block_size=256)
    _refused(_reseal(odd, lambda p: p.__setitem__(-1, (p[-1] & 0x0F) | 0x90)), "bad_payload")  # pad nibble 9
    int2 = encode({"w": torch.randn(8)}, "int2", block_size=256)
    _refused(_reseal(int2, lambda p: p.__setitem__(4, p[4] | 0x03)), "bad_payload")  # code 3
    short = encode({"w": torch.randn(5)}, "int2", block_size=256)
    _refused(_reseal(short, lambda p: p.__setitem__(-1, (p[-1] & 0x03) | 0x08)), "bad_payload")  # pad code 2


def test_refuses_zip_bomb() -> None:
    honest = encode({"w": torch.zeros(250)})  # claims 1000 bytes
    header, _ = _split(honest)
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(64 << 20))  # 64 MiB of zeros, ~2 kB
    header["compression"] = "zstd"
    reason = _refused(_frame(header, bomb), "bad_payload", max_bytes=1 << 20).reason
    assert "more than" in reason


def test_refuses_zstd_payload_shorter_than_declared_or_with_trailing_data() -> None:
    header, body = _split(encode({"w": torch.randn(250)}))
    header["compression"] = "zstd"
    _refused(_frame(header, zstandard.ZstdCompressor().compress(body[:-4])), "bad_payload")
    _refused(_frame(header, zstandard.ZstdCompressor().compress(body) + b"junk"), "bad_payload")
    _refused(_frame(header, b"not zstd at all"), "bad_payload")


# --- refusals on decode: expected layout -------------------------------------------------------


def test_refuses_unexpected_layout() -> None:
    blob = encode({"a": torch.ones(3, 4), "b": torch.ones(2)}, "int4")
    reason = _refused(blob, "wrong_shape", expect={"a": (4, 3), "b": (2,)}).reason
    assert "(4, 3)" in reason and "(3, 4)" in reason
    _refused(blob, "wrong_shape", expect={"a": (3, 4)})
    _refused(blob, "wrong_shape", expect={"a": (3, 4), "b": (2,), "c": (1,)})
    out, _ = decode(blob, max_bytes=LIMIT, expect={"b": (2,), "a": (3, 4)})
    assert set(out) == {"a", "b"}


def test_a_codec_is_one_registered_object_every_reader_then_knows() -> None:
    """What adding a codec takes: one object registered by name (here a float16 codec)."""
    probe = codecs.register(codecs.Floats("fp16", torch.float16, 2.0**-11))
    try:
        x = {"w": torch.linspace(-3, 3, 101), "b": torch.tensor(0.1)}
        blob = encode(x, "fp16", compress=True, meta={"run": "r"})
        header = read_header(blob, max_bytes=1 << 20)
        assert header.codec == "fp16" and header.payload_bytes == 2 * 102
        out, _ = decode(blob, max_bytes=1 << 20, expect={"w": (101,), "b": ()})
        assert all((out[n] - x[n]).abs().max() <= error_bound("fp16", 3.0) for n in x)
        with pytest.raises(ValueError, match="registered already"):
            codecs.register(probe)
    finally:
        del codecs._REGISTRY["fp16"]
    with pytest.raises(Refused) as refused:
        read_header(blob, max_bytes=1 << 20)
    assert refused.value.code == "bad_header" and "unknown codec 'fp16'" in refused.value.reason
    with pytest.raises(ValueError, match="unknown codec 'fp16'; this build has fp32, bf16, int8, int4, int2, sparse, sparse16, sign8"):
        encode(x, "fp16")


# --- the sparse codec ----------------------------------------------------------------------------


def test_sparse_keeps_the_largest_sixty_fourth_of_each_block_and_packs_its_positions_in_12_bits() -> None:
    x = torch.zeros(130)
    x[[3, 70, 100, 129]] = torch.tensor([-7.0, 7.0, 3.5, 1.0])  # block 64: keep 1, 1, then ceil(2/64) = 1
    blob = encode({"v": x}, "sparse", block_size=64)
    _, body = _split(blob)
    assert struct.unpack("<3f", body[:12]) == (1.0, 1.0, pytest.approx(1.0 / 7))  # absmax / 7 per block
    # Positions within their block: 3, 70 - 64 = 6, 129 - 128 = 1, two to three bytes, then a pad of 0.
    assert body[12:18] == bytes([3, 6 << 4, 0, 1, 0, 0])
    assert body[18:] == bytes([(8 - 7) | (8 + 7) << 4, (8 + 7) | 8 << 4])  # int4 nibbles, pad 8
    out, _ = decode(blob, max_bytes=LIMIT)
    expected = torch.zeros(130)
    expected[[3, 70, 129]] = torch.tensor([-7.0, 7.0, 1.0])  # 100 (3.5) lost to 70 (7.0) in block 1
    assert torch.equal(out["v"], expected)


def test_sparse_breaks_ties_toward_the_lower_position_and_is_that_small() -> None:
    out, _ = decode(encode({"v": torch.ones(4096 * 3 + 100)}, "sparse"), max_bytes=LIMIT)
    kept = out["v"].nonzero().view(-1).tolist()
    assert kept == [*range(64), *range(4096, 4096 + 64), *range(8192, 8192 + 64), *range(12288, 12288 + 2)]
    # 4 bytes of scale, 64 positions of 12 bits and 64 values of 4 bits per 4096 elements: 0.26 bits each.
    assert codecs.tensor_nbytes("sparse", (4096 * 256,), 4096) == 256 * (4 + 96 + 32)
    assert codecs.tensor_nbytes("sparse16", (4096 * 256,), 4096) == 256 * (4 + 384 + 128)  # 1 bit an element


def test_sparse_with_error_feedback_sends_everything_over_enough_sends() -> None:
    """What a send drops is carried into the next (storage.updates.encode_carrying): over sends of
    the same tensor, the decoded ones add up to the sent ones less one residual."""
    from diloco.storage.updates import encode_carrying

    gen = torch.Generator().manual_seed(0)
    sent, got, residual, norms = torch.zeros(8192), torch.zeros(8192), {}, []
    for _ in range(400):
        x = torch.randn(8192, generator=gen)
        _, decoded, residual = encode_carrying({"w": x}, residual, "sparse", compress=True)
        sent += x
        got += decoded["w"]
        norms.append(float(residual["w"].norm()))
    assert torch.allclose(got + residual["w"], sent, atol=1e-3)
    # The residual levels off (what is sent grows as the residual does), where the sum keeps growing.
    assert max(norms[300:]) < 1.25 * max(norms[100:200]) and float(sent.norm()) > 3 * norms[-1]


@pytest.mark.parametrize(("edit", "says"), [
    (lambda p: p.__setitem__(12, 64), "past its end"),  # block 0's position 3 -> 64
    (lambda p: p.__setitem__(17, 1), "pad index"),
    (lambda p: p.__setitem__(19, 0x08 | 0x10), "pad codes"),
    (lambda p: p.__setitem__(18, 0x00 | 0xF0), "code 0"),
])
def test_sparse_refuses_positions_and_codes_no_encoder_writes(edit, says) -> None:  # noqa: ANN001
    x = torch.zeros(130)
    x[[3, 70, 129]] = torch.tensor([-7.0, 7.0, 1.0])
    blob = encode({"v": x}, "sparse", block_size=64)
    assert says in _refused(_reseal(blob, edit), "bad_payload").reason


def test_sparse_refuses_positions_out_of_order_within_a_block() -> None:
    x = torch.zeros(128)
    x[[5, 9]] = torch.tensor([1.0, -1.0])  # one block of 128: keeps 2, at 5 and 9
    blob = encode({"v": x}, "sparse", block_size=128)
    assert _split(blob)[1][4:7] == bytes([5, 9 << 4, 0])
    swapped = _reseal(blob, lambda p: p.__setitem__(slice(4, 7), bytes([9, 5 << 4, 0])))
    assert "not ascending" in _refused(swapped, "bad_payload").reason


def test_sparse_block_size_is_at_most_4096() -> None:
    with pytest.raises(ValueError, match="1..4096"):
        encode({"v": torch.ones(3)}, "sparse", block_size=8192)
    header, body = _split(encode({"v": torch.ones(3)}, "sparse"))
    assert header["block_size"] == 4096
    header["block_size"] = 8192
    assert "1..4096" in _refused(_frame(header, body), "bad_header").reason


# --- the sign codec --------------------------------------------------------------------------------


def test_sign8_keeps_the_largest_eighth_of_each_block_as_signs_times_their_mean_magnitude() -> None:
    x = torch.zeros(20)
    x[[1, 5, 10, 17]] = torch.tensor([-4.0, 2.0, 1.0, -3.0])  # block 8: keep 1, 1, then ceil(4/8) = 1
    blob = encode({"v": x}, "sign8", block_size=8)
    _, body = _split(blob)
    assert struct.unpack("<3f", body[:12]) == (4.0, 1.0, 3.0)  # the mean |x| of each block's kept
    # int2's bytes: codes value + 1, four to a byte, element j of a byte in bits 2j..2j+1; pad code 1.
    assert body[12:] == bytes([0b01010001, 0b01010101, 0b01100101, 0b01010101, 0b01010001])
    out, _ = decode(blob, max_bytes=LIMIT)
    expected = torch.zeros(20)
    expected[[1, 10, 17]] = torch.tensor([-4.0, 1.0, -3.0])  # 5 (2.0) lost to 1 (-4.0) in block 0
    assert torch.equal(out["v"], expected)
    assert codecs.tensor_nbytes("sign8", (4096 * 256,), 4096) == 256 * (4 + 1024)  # 2 bits, before zstd


def test_sign8_scale_is_the_mean_of_the_kept_and_breaks_ties_toward_the_lower_position() -> None:
    x = torch.tensor([1.0, -3.0, 3.0, 0.5, 2.0, 0.0, 0.0, 0.0] * 2 + [5.0] * 16)
    out, _ = decode(encode({"v": x}, "sign8", block_size=16), max_bytes=LIMIT)
    # Block 0 keeps 2 of 16: the two 3.0s at 1 and 2 (not those at 9 and 10); block 1 keeps 2 of sixteen 5.0s.
    assert out["v"].nonzero().view(-1).tolist() == [1, 2, 16, 17]
    assert out["v"][[1, 2, 16, 17]].tolist() == [-3.0, 3.0, 5.0, 5.0]


def test_sign8_is_under_a_bit_an_element_with_zstd_and_carries_what_it_drops() -> None:
    from diloco.storage.updates import encode_carrying

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=gen)
    assert 8 * len(encode({"w": x}, "sign8", compress=True)) < 0.9 * x.numel()
    sent, got, residual = torch.zeros(8192), torch.zeros(8192), {}
    for _ in range(200):
        x = torch.randn(8192, generator=gen)
        _, decoded, residual = encode_carrying({"w": x}, residual, "sign8", compress=True)
        sent += x
        got += decoded["w"]
    assert torch.allclose(got + residual["w"], sent, atol=1e-3)
    assert float(residual["w"].norm()) < 0.3 * float(sent.norm())


def test_sign8_refuses_a_block_with_more_nonzero_codes_than_it_keeps() -> None:
    x = torch.zeros(16)
    x[3] = 1.0  # one block of 16 keeps 2
    blob = encode({"v": x}, "sign8", block_size=16)
    assert _split(blob)[1][4:] == bytes([0b10010101, 0b01010101, 0b01010101, 0b01010101])
    ok = _reseal(blob, lambda p: p.__setitem__(5, 0b01010110))  # a second sign: 2 of 2
    assert decode(ok, max_bytes=LIMIT)[0]["v"].count_nonzero() == 2
    three = _reseal(ok, lambda p: p.__setitem__(6, 0b01010100))
    assert "3 nonzero values (at most 2 kept)" in _refused(three, "bad_payload").reason


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("compress", [False, True])
def test_encode_decoded_gives_encodes_object_and_decodes_tensors_bit_for_bit(codec: str, compress: bool) -> None:
    """What error feedback takes as sent, from the encoder's own values: the same bytes `encode`
    writes, and every bit `decode` gives (signed zeros included), in tensors of its own."""
    tensors = _tensors(3)
    tensors["signed_zeros"] = torch.tensor([-0.0, 0.0, -1e-9, 1e-9, -0.0] * 20)  # round to -0.0 and 0.0
    tensors["tiny"] = torch.randn(300) * 1e-40  # subnormal values and scales
    tensors["wide"] = torch.cat([torch.randn(600) * 1e30, torch.zeros(5000), torch.randn(9) * 1e-30])
    meta = {"run": "r", "fragment": 1}
    before = {k: v.clone() for k, v in tensors.items()}
    blob, decoded = codecs.encode_decoded(tensors, codec, compress=compress, meta=meta)
    assert blob == encode(tensors, codec, compress=compress, meta=meta)
    want, _ = decode(blob, max_bytes=LIMIT)
    assert list(decoded) == list(want)
    for name, t in want.items():
        got = decoded[name]
        assert got.dtype == torch.float32 and got.shape == t.shape, name
        assert torch.equal(got.view(torch.int32), t.view(torch.int32)), name
        got.add_(1.0)  # its own memory: the input does not change
    assert all(torch.equal(tensors[k], before[k]) for k in tensors)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("chunk", [8, 1 << 18])
def test_encode_lost_gives_what_the_codec_lost_of_each_tensor_plus_its_residual(codec: str, chunk: int,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Error feedback's encoder: for each tensor plus its residual (or alone), the bytes `encode`
    writes for the sum and the sum less `encode_decoded`'s values, bit for bit, whether a blocked
    codec takes many small chunks (odd blocks too, a chunk's codes starting mid-tensor) or a tensor
    at once; the inputs do not change."""
    monkeypatch.setattr(codecs, "CHUNK_ELEMENTS", chunk)
    tensors = {name: t.float() for name, t in _tensors(4).items()}
    tensors["signed_zeros"] = torch.tensor([-0.0, 0.0, -1e-9, 1e-9, -0.0] * 20)
    tensors["tiny"] = torch.randn(300) * 1e-40
    tensors["long"] = torch.randn(5003)
    tensors["strided"] = torch.randn(40, 30).t()
    gen = torch.Generator().manual_seed(9)
    plus = {name: torch.randn(t.shape, generator=gen) * 0.1 for name, t in tensors.items() if name not in ("odd", "zeros")}
    plus["long"] = plus["long"].bfloat16()  # a residual kept in a model's dtype
    before = {name: t.clone() for name, t in (tensors | {f"plus {k}": v for k, v in plus.items()}).items()}
    sums = {name: t + plus[name] if name in plus else t for name, t in tensors.items()}
    for block in ([None] if not codecs.get(codec).max_block else [None, 7, 64]):
        blob, decoded = codecs.encode_decoded(sums, codec, compress=True, block_size=block)
        got_blob, lost = codecs.encode_lost(tensors, codec, plus=plus, compress=True, block_size=block)
        assert got_blob == blob
        for name, s in sums.items():
            want = s - decoded[name]
            assert lost[name].dtype == torch.float32 and lost[name].shape == s.shape
            assert torch.equal(lost[name].view(torch.int32), want.view(torch.int32)), (name, block)
        # Written into a narrower float (a bf16 model's residual): the float32 loss rounded, the same bits.
        for dtype in (torch.bfloat16, torch.float16):
            into = {name: torch.full(t.shape, float("nan"), dtype=dtype) for name, t in tensors.items()}
            narrow_blob, narrow = codecs.encode_lost(tensors, codec, plus=plus, compress=True, block_size=block,
                                                     into=into)
            assert narrow_blob == blob
            for name, t in narrow.items():
                assert t is into[name] and torch.equal(t.view(torch.int16), lost[name].to(dtype).view(torch.int16)), \
                    (name, block, dtype)
    after = tensors | {f"plus {k}": v for k, v in plus.items()}
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_blocked_codec_writes_the_same_bytes_whatever_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder takes a tensor a chunk of whole blocks at a time: the chunk size changes nothing."""
    tensors = {"a": torch.randn(10_001), "b": torch.randn(77, 13)}
    for codec in ("int8", "int4", "int2", "sign8"):
        for block in (5, 64, 256):
            monkeypatch.setattr(codecs, "CHUNK_ELEMENTS", 1 << 18)
            whole = codecs.encode_decoded(tensors, codec, block_size=block)
            monkeypatch.setattr(codecs, "CHUNK_ELEMENTS", 3)
            chunked = codecs.encode_decoded(tensors, codec, block_size=block)
            assert chunked[0] == whole[0], (codec, block)
            assert all(torch.equal(chunked[1][k], whole[1][k]) for k in tensors)


def test_encode_lost_takes_float32_tensors_and_residuals_of_their_shape() -> None:
    for bad, plus in ((torch.randn(8).half(), None), (torch.randn(8, dtype=torch.float64), None),
                      (torch.randn(8), torch.randn(9))):
        with pytest.raises(ValueError, match="float32 tensors"):
            codecs.encode_lost({"w": bad}, "int4", plus={} if plus is None else {"w": plus})


@pytest.mark.parametrize("top", [3.4028234e38, 3.0e38, 1.0e38])
@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_encode_decoded_refuses_what_decode_would_refuse(codec: str, top: float) -> None:
    """Blocks near float32's largest values: where a scale times qmax overflows, decode refuses the
    object (`non_finite`, int8 at the largest float32 here); so does encode_decoded, instead of
    handing error feedback an Inf. Elsewhere both take it."""
    huge = {"w": torch.tensor([top, -1.0, 2.0])}
    try:
        want = decode(encode(huge, codec), max_bytes=LIMIT)[0]
    except Refused as exc:
        with pytest.raises(Refused) as encoding:
            codecs.encode_decoded(huge, codec)
        assert encoding.value.code == exc.code == "non_finite"
        return
    assert torch.equal(codecs.encode_decoded(huge, codec)[1]["w"], want["w"])


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("block", [2, 7, 64, 256])
def test_decode_checked_gives_decode_bits(codec: str, block: int) -> None:
    """What a coordinator's merge decodes a piece with, once `checked_norm` passed it at arrival:
    `decode`'s tensors bit for bit, whole blocks and a short last one, signed zeros included."""
    g = torch.Generator().manual_seed(block)
    tensors = {"w": torch.randn(33, 17, generator=g) * 1e-3, "b": torch.randn(5, generator=g),
               "z": torch.tensor([0.0, -0.0, 0.0, 1e-30, -2.5])}
    blob = encode(tensors, codec, block_size=block if get(codec).max_block else None)
    opened = codecs.open_object(blob, max_bytes=LIMIT)
    codecs.checked_norm(opened)
    whole = codecs.decode_opened(opened)
    for name, decoder in codecs.tensor_decoders(opened, checked=True).items():
        got = decoder()
        assert got.shape == whole[name].shape and torch.equal(got.view(torch.int32), whole[name].view(torch.int32))


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "sign8"])
def test_each_tensor_decodes_alone_as_the_whole_object_decodes_it(codec: str) -> None:
    """The coordinator reads a piece a tensor at a time (`tensor_decoders`): the same tensors, in the
    header's order, and a bad tensor refused when it is read, as `decode_opened` refuses it."""
    g = torch.Generator().manual_seed(5)
    blob = encode({"b": torch.randn(9, generator=g), "a": torch.randn(40, 70, generator=g)}, codec, compress=True)
    opened = codecs.open_object(blob, max_bytes=LIMIT)
    whole, alone = codecs.decode_opened(opened), codecs.tensor_decoders(opened)
    assert list(alone) == list(whole) == ["b", "a"]
    assert all(torch.equal(alone[name](), whole[name]) for name in whole)
    trusted = codecs.tensor_decoders(opened, checked=True)  # after checked_norm: the same tensors
    assert all(torch.equal(trusted[name](), whole[name]) for name in whole)
    if codec == "int4":
        bad = codecs.open_object(_reseal(encode({"b": torch.randn(9), "a": torch.randn(8)}, codec),
                                         lambda p: p.__setitem__(-1, 0x00)), max_bytes=LIMIT)
        decoders = codecs.tensor_decoders(bad)
        assert decoders["b"]().shape == (9,)  # the other tensor's bad code is not read
        with pytest.raises(Refused):
            decoders["a"]()
