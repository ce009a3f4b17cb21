"""Checking one announced contribution before it may touch the global state.

`check_announcement` is pure: it decides from the announcement and what the coordinator knows
(run, layout, head, applied ids) whether the contribution may be fetched. `fetch_tensors`
(`fetch_checked` for a delta, which keeps the checked object rather than its tensors) then
reads the object (size-bounded), checks its sha256 against the announcement, decodes it
against the run and the layout (codec, shapes, finite values) and checks that its header names what
the announcement says. Each failure is a `Refused` whose reason a person can act on; the caller
records it and the run goes on.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from diloco.coordinator.policy import Arrival, RoundConfig, staleness_verdict
from diloco.coordinator.timing import Timed, untimed
from diloco.storage import codecs
from diloco.storage.errors import Refused
from diloco.storage.history import sha256_hex
from diloco.storage.keys import SEQ_DIGITS, RunKeys
from diloco.storage.objects import ObjectMissing, ObjectStore, ObjectUnreadable
from diloco.storage.protocol import Announcement, Layout, RunSpec


@dataclass
class PendingDelta:
    """A verified contribution waiting in its fragment's round."""

    entry_id: str
    announcement: Announcement
    arrival: Arrival
    blob: bytes = b""
    """The object as read and checked (`fetch_checked`), still compressed as it travelled (int8: a
    quarter of its decoded size, int4 an eighth): a round holds its pieces so and decodes each one
    when the merge reads it (`decode_piece`). Empty for a genesis proposal, published as it arrives."""


def check_announcement(a: Announcement, *, spec: RunSpec, keys: RunKeys, head: int | None,
                       cfg: RoundConfig) -> None:
    """Refuse what can be refused without reading the object. `head` is None before genesis."""
    if a.run != spec.run:
        raise Refused("misaddressed", f"announcement for run {a.run!r} arrived on run {spec.run!r}'s stream: "
                      "the learner is configured for another run")
    if a.fragment >= spec.num_fragments:
        raise Refused("unknown_fragment", f"fragment {a.fragment} does not exist: run {spec.run!r} has "
                      f"{spec.num_fragments} fragments (0..{spec.num_fragments - 1})")
    if a.kind == "delta" and not a.seq < 10**SEQ_DIGITS:
        raise Refused("bad_message", f"seq {a.seq} from {a.learner} does not fit the {SEQ_DIGITS} digits of an "
                      "object key, so no object of this learner can be at the announced key")
    expected_key = (keys.genesis_params(a.learner, a.fragment) if a.kind == "genesis"
                    else keys.delta(a.fragment, a.learner, a.seq))
    if a.object_key != expected_key:
        raise Refused("misaddressed", f"{a.kind} from {a.learner} points at {a.object_key!r}; "
                      f"a learner may only announce its own object {expected_key!r}")
    if a.size_bytes > spec.max_object_bytes:
        raise Refused("too_large", f"{a.object_key} is announced as {a.size_bytes} bytes, over run {spec.run!r}'s "
                      f"max_object_bytes of {spec.max_object_bytes}: refused unread")
    if a.kind == "genesis":
        return
    if head is None:
        raise Refused("no_genesis", f"fragment {a.fragment} has no version 0 yet, so no delta can be based on it")
    if a.steps < 1:
        raise Refused("empty", f"contribution reports {a.steps} inner steps: nothing to merge")
    ok, _staleness, reason = staleness_verdict(a.base_version, head, cfg)
    if not ok:
        future = a.base_version > head
        hint = ("; no such version was published on this run" if future
                else " (raise --max-staleness to accept contributions this late)")
        raise Refused("future_base" if future else "stale",
                      f"fragment {a.fragment}: {reason.removeprefix('refused: ')}{hint}")


def fetch_tensors(store: ObjectStore, a: Announcement, layout: Layout, max_bytes: int, *,
                  codec: str, timed: Timed = untimed) -> dict[str, torch.Tensor]:
    """Read, check and decode the announced object against the fragment's layout.

    `codec` is the run's codec: a delta must be encoded with it, a genesis proposal with fp32.
    `timed` times the read ("get") and the checks and decoding ("verify")."""
    blob = _read(store, a, max_bytes, timed)
    with timed("verify"):
        return _check_object(blob, a, layout, max_bytes, codec=codec)


def fetch_checked(store: ObjectStore, a: Announcement, layout: Layout, max_bytes: int, *,
                  codec: str, timed: Timed = untimed) -> tuple[bytes, float]:
    """`fetch_tensors`' read and every one of its checks, decoding included, but the object is what
    is returned, with the L2 norm of its delta: a delta waits for its round in the few bytes it
    travelled in, not as a fragment's worth of fp32 tensors, and is decoded again when the round
    merges (`decode_piece`)."""
    blob = _read(store, a, max_bytes, timed)
    with timed("verify"):
        tensors = _check_object(blob, a, layout, max_bytes, codec=codec)
        return blob, l2_norm(tensors)


def l2_norm(tensors: dict[str, torch.Tensor]) -> float:
    """The L2 norm of a piece's tensors together, in float64."""
    return math.sqrt(math.fsum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
                               for t in tensors.values()))


def decode_piece(blob: bytes, layout: Layout, fragment: int, max_bytes: int) -> dict[str, torch.Tensor]:
    """The tensors of a piece `fetch_checked` returned. Decoding is deterministic and checks again
    what it checked then (sha256 of the payload, shapes, finite values): the same tensors."""
    return codecs.decode(blob, max_bytes=max_bytes, expect=layout.shapes(fragment))[0]


def _read(store: ObjectStore, a: Announcement, max_bytes: int, timed: Timed) -> bytes:
    """The announced object's bytes (size-bounded); Refused if it is missing or unreadable."""
    with timed("get"):
        try:
            return store.get(a.object_key, max_bytes=max_bytes)
        except ObjectMissing:
            raise Refused("missing_object", f"announced object {a.object_key} does not exist in the bucket "
                          "(never uploaded, or deleted since)") from None
        except ObjectUnreadable as exc:
            raise Refused("unreadable_object", f"announced object {a.object_key} cannot be read: {exc}; "
                          "a learner must store its objects so that the run's readers can read them") from None


def _check_object(blob: bytes, a: Announcement, layout: Layout, max_bytes: int, *,
                 codec: str) -> dict[str, torch.Tensor]:
    """The tensors of `blob`, the object `a` announces, once every check has passed (see `fetch_tensors`)."""
    if len(blob) != a.size_bytes:
        raise Refused("size_mismatch", f"{a.object_key} is {len(blob)} bytes, the announcement says {a.size_bytes}")
    actual = sha256_hex(blob)
    if actual != a.sha256:
        raise Refused("sha256_mismatch", f"{a.object_key} has sha256 {actual[:16]}..., the announcement "
                      f"says {a.sha256[:16]}...: the object was altered or corrupted after upload")
    try:
        header = codecs.read_header(blob, max_bytes=max_bytes)
        want = codec if a.kind == "delta" else "fp32"
        if header.codec != want:
            raise Refused("wrong_dtype", f"{a.kind} encoded as {header.codec}, but run {a.run!r} takes "
                          f"{a.kind}s encoded as {want!r}")
        tensors, header = codecs.decode(blob, max_bytes=max_bytes, expect=layout.shapes(a.fragment))
    except Refused as exc:
        raise Refused(exc.code, f"{a.object_key}: {exc.reason}") from None
    labels: dict[str, str | int] = {"run": a.run, "fragment": a.fragment, "learner": a.learner, "kind": a.kind}
    if a.kind == "delta":  # a delta's object names the one contribution it is: re-announcing it under
        # a new id (a replay, to count it twice) or another base (to dodge staleness) is refused.
        # A genesis object may be re-announced by a restarted learner, under a new id.
        labels |= {"contribution_id": a.contribution_id, "base_version": a.base_version}
    for field_name, want_value in labels.items():
        got = header.meta.get(field_name)
        if got is not None and got != want_value:
            raise Refused("misaddressed", f"{a.object_key} says {field_name}={got!r}, the announcement "
                          f"{want_value!r}: an object may only be announced as what it was encoded for")
    return tensors


def to_arrival(a: Announcement, arrived_at: float) -> Arrival:
    return Arrival(contribution_id=a.contribution_id, learner=a.learner, base_version=a.base_version, tokens=a.tokens,
                   steps=a.steps, arrived_at=arrived_at, step_time_s=a.step_time_s, deadline=a.deadline,
                   final=a.final)
