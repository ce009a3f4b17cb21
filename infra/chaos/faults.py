"""The chaos suite's faults: a seeded schedule of what to break when, and the corrupt objects.

`schedule(seed, seconds)` is a pure function, like torchft's EventInjector: the same seed gives
the same list of `Fault(at_s, kind, target)`, and the runner (infra/chaos/suite.py) only carries it
out. Faults come in two weights:

- heavy ones take a server or the coordinator away for a while (`coordinator_kill`,
  `redis_restart`, `s3_restart`), or take Redis back in time (`redis_rollback`: restored from a
  snapshot a few seconds old, it forgets every write since, commits included). They get windows
  of their own, one after the other, so that each one's recovery is seen separately; every heavy
  kind is scheduled at least once before more are drawn at random. The first coordinator episode
  kills it at every commit step in a row: each successor is armed to die at the next step.
- light ones hit one learner or add bad input (`learner_kill`, `learner_term`, `corrupt_object`,
  `hostile`). They fall anywhere, also inside heavy windows; every one of them, every corruption
  variant and every hostile variant, comes at least once.

`forge(variant, shapes, ...)` makes the bytes of a corrupt contribution and the size and sha256
its announcement claims. Each variant is caught by a different check of the coordinator.
`hostile:<variant>` is a learner with valid credentials that lies or floods (HOSTILE; what it sends
and what must become of it is in infra/chaos/hostile.py).
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import torch
import zstandard

from diloco.storage import codecs
from diloco.storage.crashpoints import POINTS
from diloco.storage.history import sha256_hex

CORRUPTIONS: dict[str, frozenset[str]] = {
    "truncated": frozenset({"bad_framing", "bad_payload"}),  # the end of the object cut off
    "flipped": frozenset({"sha256_mismatch"}),  # bytes flipped after the announced sha256 was taken
    "nan": frozenset({"non_finite"}),  # a well-formed object full of NaN
    "wrong_shape": frozenset({"wrong_shape"}),  # tensors of other shapes than the layout's
}
"""Corruption variant -> the refusal codes that may catch it."""

HOSTILE: dict[str, str] = {
    "lying_tokens": "a well-formed delta claiming 2**64-1 tokens in 1 step",
    "many_pieces": "sixteen copies of one well-formed delta sent into one round, each an honest-looking piece",
    "lying_deadline": "a well-formed delta sent for the deadline 1e15 (31 million years away)",
    "lying_heartbeat": "heartbeats claiming 1e-9 s inner steps, and stats that do not decode",
    "oversize": "an announcement over max_object_bytes, and an object larger than announced",
    "undecodable": "random bytes announced with their true size and sha256",
    "flood": "a burst of announcements of other learners' objects and of objects never stored",
    "sse_c": "a well-formed delta stored encrypted with a key of the sender's own (SSE-C)",
    "made_up_ids": "learner ids that join and heartbeat for a while and never contribute",
}
"""Hostile variant -> what the hostile learner sends (infra/chaos/hostile.py says what must become of it)."""
BOUNDED = frozenset({"lying_tokens", "many_pieces", "lying_deadline", "lying_heartbeat", "made_up_ids"})
"""Hostile variants that are taken in, with their influence bounded, rather than refused."""

@dataclass(frozen=True, slots=True)
class FaultKind:
    """A kind of fault the schedule draws. The runner carries out each kind by its name
    (infra/chaos/suite.py checks that it knows every kind registered here before a run starts)."""

    name: str
    heavy: bool = False
    """Takes a server or the coordinator away: a window of its own (`window_s`), one after the other."""
    window_s: float = 0.0
    """How long a heavy fault takes to play out, roughly (with its recovery), before the next one."""
    down_s: tuple[float, float] | None = None
    """Drawn for each fault: how long the server stays down (redis_rollback: the seconds of writes
    Redis forgets)."""
    on_learner: bool = False
    """Its target is one of the run's learners."""
    variants: tuple[str, ...] = ()
    """Its target is a variant, each counted separately (`coordinator_kill:fetched`, ...)."""


FAULT_KINDS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("learner_kill", on_learner=True),
    FaultKind("learner_term", on_learner=True),
    FaultKind("coordinator_kill", heavy=True, window_s=10.0, variants=POINTS),
    FaultKind("redis_restart", heavy=True, window_s=4.0, down_s=(0.2, 1.5)),
    FaultKind("redis_rollback", heavy=True, window_s=10.0, down_s=(3.0, 6.0)),
    FaultKind("s3_restart", heavy=True, window_s=9.0, down_s=(2.0, 4.0)),
    FaultKind("corrupt_object", variants=tuple(CORRUPTIONS)),
    FaultKind("hostile", variants=tuple(HOSTILE)),
)}
"""Every kind of fault, by name: adding one is a registration here and its way of being carried out
in the runner."""
KINDS = tuple(FAULT_KINDS)
HEAVY = tuple(k.name for k in FAULT_KINDS.values() if k.heavy)
VARIANTS: dict[str, tuple[str, ...]] = {k.name: k.variants for k in FAULT_KINDS.values() if k.variants}
"""Kinds whose target is a variant, counted separately: `coordinator_kill:fetched`, ..."""

CHAIN_S = 2.5
"""Coordinator kills at every commit step come one after the other, this far apart."""
LIGHT_GAP_S = 4.0
"""Mean gap between two light faults."""
QUIET_END = 0.15
"""The last share of the run has no new heavy fault, so the last one can play out."""


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    """Seconds after the fleet is up."""
    kind: str
    target: str = ""
    """A learner for learner faults, a commit step for coordinator_kill, a variant for corrupt_object
    and hostile."""
    down_s: float = 0.0
    """redis_restart, s3_restart: how long the server stays down; redis_rollback: how many seconds
    of writes Redis forgets."""

    @property
    def label(self) -> str:
        """What the fault is counted as: its kind, or kind:variant for kinds with variants."""
        return f"{self.kind}:{self.target}" if self.kind in VARIANTS else self.kind


def labels(kinds: tuple[str, ...] = KINDS) -> list[str]:
    """Every label a run with these kinds must fire at least once."""
    return [f"{k}:{v}" if k in VARIANTS else k for k in kinds for v in VARIANTS.get(k, ("",))]


def schedule(seed: int, seconds: float, kinds: tuple[str, ...] = KINDS, *,
             learners: tuple[str, ...] = ("l0", "l1", "l2")) -> list[Fault]:
    """The faults of a run of `seconds`, sorted by time; the same for the same arguments.

    Every label of `labels(kinds)` is scheduled at least once, however short the run: when the
    heavy windows do not fit, they shrink (the runner then waits for one fault to play out before
    the next), they are never dropped.
    """
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    rng = random.Random(seed)
    return sorted(_heavy(rng, seconds, [k for k in kinds if k in HEAVY])
                  + _light(rng, seconds, [k for k in kinds if k not in HEAVY], learners),
                  key=lambda f: (f.at_s, f.kind, f.target))


def _variants(rng: random.Random, kind: str) -> list[str]:
    variants = list(VARIANTS.get(kind, ("",)))
    rng.shuffle(variants)
    return variants


def _with_target(rng: random.Random, at_s: float, kind: str, target: str) -> Fault:
    down_s = FAULT_KINDS[kind].down_s
    if down_s is not None:
        return Fault(at_s, kind, down_s=round(rng.uniform(*down_s), 2))
    return Fault(at_s, kind, target)


def _heavy(rng: random.Random, seconds: float, kinds: list[str]) -> list[Fault]:
    # The mandatory ones: one episode per kind. The coordinator is killed at every commit step in
    # a row (CHAIN_S apart): each armed successor dies in turn, and the episode ends with a plain one.
    episodes = [(k, _variants(rng, k)) for k in kinds]
    rng.shuffle(episodes)
    end = seconds * (1 - QUIET_END)
    need = sum(FAULT_KINDS[k].window_s + CHAIN_S * (len(vs) - 1) for k, vs in episodes)
    scale = min(1.0, end / need) if need else 1.0
    faults, t = [], 1.0
    for kind, targets in episodes:
        for i, target in enumerate(targets):
            faults.append(_with_target(rng, round(t + i * CHAIN_S * scale, 2), kind, target))
        t += (FAULT_KINDS[kind].window_s + CHAIN_S * (len(targets) - 1)) * scale
    while kinds:
        kind = rng.choice(kinds)
        t += rng.uniform(0.0, 2.0)
        if t > end:
            break
        faults.append(_with_target(rng, round(t, 2), kind, rng.choice(VARIANTS.get(kind, ("",)))))
        t += FAULT_KINDS[kind].window_s
    return faults


def _light(rng: random.Random, seconds: float, kinds: list[str], learners: tuple[str, ...]) -> list[Fault]:
    must = [(k, v) for k in kinds for v in _variants(rng, k)]
    rng.shuffle(must)
    if not kinds:
        return []
    extra = rng.choices(kinds, k=max(0, math.floor(seconds / LIGHT_GAP_S) - len(must)))
    picks = must + [(k, rng.choice(VARIANTS.get(k, ("",)))) for k in extra]
    step = seconds / (len(picks) + 1)
    faults = []
    for i, (kind, variant) in enumerate(picks):
        at_s = round((i + 1) * step + rng.uniform(-0.3, 0.3) * step, 2)
        faults.append(Fault(at_s, kind, rng.choice(learners) if FAULT_KINDS[kind].on_learner else variant))
    return faults


# ---- corrupt objects --------------------------------------------------------------------------

def forge(variant: str, shapes: Mapping[str, tuple[int, ...]], *, codec: str, compress: bool,
          meta: Mapping[str, str | int | float], seed: int) -> tuple[bytes, int, str]:
    """(object bytes, size_bytes, sha256) of a corrupt contribution to a fragment with these shapes.

    The announced size and sha256 are those of the uploaded bytes, except for `flipped`, whose
    bytes were altered after the sha256 was taken: each variant then passes every check before
    the one meant to catch it (see CORRUPTIONS).
    """
    gen = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=gen) * 1e-3 for name, shape in shapes.items()}
    if variant == "truncated":
        good = codecs.encode(delta, codec, compress=compress, meta=dict(meta))
        body_at = 9 + int.from_bytes(good[5:9], "big")  # framing (9 bytes) + header: cut the payload only
        bad = good[:len(good) - max(1, (len(good) - body_at) // 2)]
        return bad, len(bad), sha256_hex(bad)
    if variant == "flipped":
        good = codecs.encode(delta, codec, compress=compress, meta=dict(meta))
        bad = bytearray(good)
        for i in range(len(bad) - 16, len(bad), 3):
            bad[i] ^= 0xFF
        return bytes(bad), len(good), sha256_hex(good)
    if variant == "nan":
        bad = _nan_object(shapes, codec=codec, compress=compress, meta=meta)
        return bad, len(bad), sha256_hex(bad)
    if variant == "wrong_shape":
        other = {name: torch.zeros(*shape, 2) for name, shape in shapes.items()}
        bad = codecs.encode(other, codec, compress=compress, meta=dict(meta))
        return bad, len(bad), sha256_hex(bad)
    raise ValueError(f"unknown corruption {variant!r}; known: {', '.join(CORRUPTIONS)}")


def _nan_object(shapes: Mapping[str, tuple[int, ...]], *, codec: str, compress: bool,
                meta: Mapping[str, str | int | float]) -> bytes:
    """A well-formed object in `codec` whose values (fp32, bf16) or block scales (int8, int4) are NaN,
    with a header that matches the payload (the encoder refuses NaN, so the payload is rewritten
    and the header rebuilt)."""
    plain = codecs.encode({name: torch.zeros(shape) for name, shape in shapes.items()}, codec, meta=dict(meta))
    header = codecs.read_header(plain, max_bytes=len(plain))
    payload = bytearray(plain[len(plain) - header.payload_bytes:])
    nan = {"bf16": b"\xc0\x7f"}.get(codec, struct.pack("<f", math.nan))
    for t in header.tensors:
        blocks = -(-math.prod(t.shape) // header.block_size) if header.block_size else 0
        size = 4 * blocks if blocks else t.nbytes  # the scales of a quantized tensor, else every value
        payload[t.offset:t.offset + size] = nan * (size // len(nan))
    body = zstandard.ZstdCompressor().compress(bytes(payload)) if compress else bytes(payload)
    raw = msgpack.packb({
        "codec": codec, "compression": "zstd" if compress else "none", "payload_bytes": len(payload),
        "payload_sha256": sha256_hex(payload), "block_size": header.block_size, "meta": dict(meta),
        "tensors": [{"name": t.name, "shape": list(t.shape), "offset": t.offset, "nbytes": t.nbytes}
                    for t in header.tensors],
    }, use_bin_type=True)
    return codecs.MAGIC + bytes([codecs.FORMAT_VERSION]) + len(raw).to_bytes(4, "big") + raw + body
