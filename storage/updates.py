"""A version as an update of its parent: what a learner downloads to move one version on.

Every committed version's params are stored in full (fp32), for joins, learners that missed
versions, export and replay. But a learner that holds version v-1 of a fragment needs only the
difference, and that difference travels in the run's codec like an outer gradient does (invariant
10: what a learner downloads is compressed like what it uploads).

The global params stay bit-identical everywhere because the quantized update *defines* them:

    u        = (target - parent) + residual        target: the outer step's exact result
    blob     = encode(u, codec)                     the update object, `versions/{f}/{v}/update.{epoch}`
    params   = parent + decode(blob)                on the coordinator, on every learner, in replay
    residual = u - decode(blob)                     kept in the outer state for the next version

`decode` is a fixed elementwise computation (int * scale in fp32) and `+` an elementwise fp32 add,
so the same parent and blob give the same bits on any machine. The quantization error is not lost:
it is the residual (error feedback), added to the next version's update, so the published params
follow the exact outer-optimizer trajectory within one quantization step. The residual is part of
the outer state: replay re-derives it with every version (`coordinator.outer.downstream_step`).

A learner checks the params it computed against the sha256 the manifest records for the full
params object (`params_sha256`), so a chain of updates is taken only if it lands exactly on the
committed version; otherwise it downloads the params.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from diloco.storage import codecs
from diloco.storage.intraop import paced_slices
from diloco.storage.keys import RunKeys


def params_body(params: Mapping[str, Tensor], keys: RunKeys, fragment: int, version: int) -> codecs.Streamed:
    """The params object of a version (fp32, uncompressed) as views of `params` themselves
    (`codecs.encode_streamed`): what the coordinator PUTs and hashes without a copy of the fragment."""
    return codecs.encode_streamed(params, meta={"run": keys.run, "fragment": fragment, "version": version,
                                                "kind": "params"})


def encode_carrying(tensors: Mapping[str, Tensor], residual: Mapping[str, Tensor], codec: str, *, compress: bool,
                    meta: Mapping[str, str | int | float] | None = None, owned: bool = False
                    ) -> tuple[bytes, dict[str, Tensor], dict[str, Tensor]]:
    """Error feedback, both ways: encode `tensors` plus what the codec lost of the previous ones
    (`residual`, empty: nothing yet); return the object, what it decodes to and what it lost (the
    next residual). Over a sequence of sends, the decoded ones add up to the sent ones less the last
    residual: nothing is lost to quantization but the last send's own error. Raises
    Refused("non_finite") if a value is not finite.

    `owned`: `tensors` are the caller's scratch, held by nothing else: the residual is added to them
    and they become the next residual, in place. The same elementwise adds and subtracts either way
    (the same bits); in place, a fragment's worth of memory less at each step."""
    carried = {name: _plus(t, residual.get(name), owned) for name, t in tensors.items()}
    blob, decoded = codecs.encode_decoded(carried, codec, compress=compress, meta=meta)
    # A carried tensor made here (a sum with the residual) is ours to turn into the next residual.
    return blob, decoded, {name: c.sub_(decoded[name]) if owned or name in residual else c - decoded[name]
                           for name, c in carried.items()}


def encode_piece(tensors: Mapping[str, Tensor], residual: Mapping[str, Tensor], codec: str, *, compress: bool,
                 meta: Mapping[str, str | int | float] | None = None,
                 into: Mapping[str, Tensor] | None = None) -> tuple[bytes, dict[str, Tensor]]:
    """`encode_carrying`'s object and next residual (float32), the same bits, without the decoded
    tensors: what a learner sends. Float32 tensors are summed with the residual, encoded and turned
    into what the codec lost a chunk at a time (`codecs.encode_lost`): neither the sum nor the
    decoded values are made whole, two passes over the fragment less. `tensors` and `residual` are
    not changed; the next residual is written into `into`'s tensors when given (`codecs.encode_lost`)."""
    sums, plus = {}, {}
    for name, t in tensors.items():
        r = residual.get(name)
        if r is not None and torch.result_type(t, r) != torch.float32:
            sums[name] = (t + r).float()  # summed in their own dtype first, as encode_carrying sums them
            continue
        sums[name] = t.float()  # t itself when float32
        if r is not None:
            plus[name] = r
    return codecs.encode_lost(sums, codec, plus=plus, compress=compress, meta=meta, into=into)


def _plus(t: Tensor, r: Tensor | None, in_place: bool) -> Tensor:
    """t + r (t itself without r), into t's own memory if `in_place`."""
    if r is None:
        return t
    return t.add_(r) if in_place else t + r


def encode_update(parent: Mapping[str, Tensor], target: Mapping[str, Tensor], residual: Mapping[str, Tensor],
                  codec: str, *, compress: bool, meta: Mapping[str, str | int | float] | None = None
                  ) -> tuple[bytes, dict[str, Tensor], dict[str, Tensor]]:
    """The update object from `parent` towards `target` carrying `residual` (`encode_carrying`), the
    params it defines (`parent + decode(blob)`, exactly what `apply_update` gives a learner) and the
    new residual. Raises Refused("non_finite") if the update is not finite.

    Whole-fragment temporaries are reused in place (the difference becomes the residual, the decoded
    update the params: float addition is commutative, so decoded + parent has parent + decoded's
    bits): two fragments' worth of memory at the peak besides the inputs, not five."""
    update = {name: target[name] - p for name, p in parent.items()}
    blob, decoded, left = encode_carrying(update, residual, codec, compress=compress,
                                          meta=dict(meta or {}) | {"kind": "update"}, owned=True)
    return blob, {name: decoded[name].add_(p) for name, p in parent.items()}, left


def apply_update(parent: Mapping[str, Tensor], blob: bytes, *, max_bytes: int,
                 expect: Mapping[str, tuple[int, ...]], hashed: bool = False) -> dict[str, Tensor]:
    """The params an update object defines on top of `parent` (the version before it). The blob is
    checked like any object from the network (`codecs.decode`); raises Refused if it is not an
    update of these tensors. The decoded update becomes the params in place (decoded + parent:
    parent + decoded's bits, without a second fragment's worth of memory).

    `hashed`: as for `codecs.decode`, or the caller checks the params this returns against their
    recorded sha256 (a learner's take), which no damaged payload passes."""
    decoded, _ = codecs.decode(blob, max_bytes=max_bytes, expect=expect, hashed=hashed)
    params = {}
    for name, p in parent.items():
        into, flat = decoded[name].view(-1), p.reshape(-1)
        for part in paced_slices(into.numel()):
            into[part].add_(flat[part])
        params[name] = decoded[name]
    return params


def chain_worth_it(update_bytes: list[int], params_bytes: int) -> bool:
    """Whether a learner several versions behind takes the updates in between (`update_bytes`, one
    per version) rather than the newest params: while they are fewer bytes."""
    return bool(update_bytes) and all(b > 0 for b in update_bytes) and sum(update_bytes) < params_bytes
