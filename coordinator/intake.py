"""Checking one announced contribution before it may touch the global state.

`check_announcement` is pure: it decides from the announcement and what the coordinator knows
(run, layout, head, applied ids) whether the contribution may be fetched. `fetch_contribution`
then reads the object (size-bounded), checks its sha256 against the announcement and decodes it
against the layout (shapes, finite values). Each failure is a `Refused` whose reason a person can
act on; the caller records it and the run goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coordinator.policy import Arrival, RoundConfig, staleness_verdict
from storage import codecs
from storage.errors import Refused
from storage.history import sha256_hex
from storage.keys import RunKeys
from storage.objects import ObjectMissing, ObjectStore
from storage.protocol import Announcement, Layout, RunSpec


@dataclass
class Contribution:
    """A verified contribution waiting in its fragment's round."""

    entry_id: str
    announcement: Announcement
    arrival: Arrival
    delta: dict[str, torch.Tensor]


def check_announcement(a: Announcement, *, spec: RunSpec, keys: RunKeys, head: int | None,
                       cfg: RoundConfig) -> None:
    """Refuse what can be refused without reading the object. `head` is None before genesis."""
    if a.run != spec.run:
        raise Refused("misaddressed", f"announcement for run {a.run!r} arrived on run {spec.run!r}'s stream")
    if a.fragment >= spec.num_fragments:
        raise Refused("unknown_fragment", f"fragment {a.fragment} does not exist: run {spec.run!r} has "
                      f"{spec.num_fragments} fragments (0..{spec.num_fragments - 1})")
    if a.size_bytes > spec.max_object_bytes:
        raise Refused("too_large", f"object of {a.size_bytes} bytes exceeds the run's limit of "
                      f"{spec.max_object_bytes} bytes")
    expected_key = (keys.genesis_params(a.learner, a.fragment) if a.kind == "genesis"
                    else keys.delta(a.fragment, a.learner, a.seq))
    if a.object_key != expected_key:
        raise Refused("misaddressed", f"{a.kind} from {a.learner} points at {a.object_key!r}; "
                      f"a learner may only announce its own object {expected_key!r}")
    if a.kind == "genesis":
        return
    if head is None:
        raise Refused("no_genesis", f"fragment {a.fragment} has no version 0 yet, so no delta can be based on it")
    if a.steps < 1:
        raise Refused("empty", f"contribution reports {a.steps} inner steps: nothing to merge")
    ok, _staleness, reason = staleness_verdict(a.base_version, head, cfg)
    if not ok:
        code = "future_base" if a.base_version > head else "stale"
        raise Refused(code, reason.removeprefix("refused: "))


def fetch_tensors(store: ObjectStore, a: Announcement, layout: Layout, max_bytes: int) -> dict[str, torch.Tensor]:
    """Read, check and decode the announced object against the fragment's layout."""
    try:
        blob = store.get(a.object_key, max_bytes=max_bytes)
    except ObjectMissing:
        raise Refused("missing_object", f"announced object {a.object_key} does not exist in the bucket") from None
    if len(blob) != a.size_bytes:
        raise Refused("size_mismatch", f"{a.object_key} is {len(blob)} bytes, the announcement says {a.size_bytes}")
    actual = sha256_hex(blob)
    if actual != a.sha256:
        raise Refused("sha256_mismatch", f"{a.object_key} has sha256 {actual[:16]}..., the announcement "
                      f"says {a.sha256[:16]}...: the object was altered or corrupted after upload")
    tensors, header = codecs.decode(blob, max_bytes=max_bytes, expect=layout.shapes(a.fragment))
    checked = [("run", a.run), ("fragment", a.fragment), ("learner", a.learner)]
    if a.kind == "delta":  # a delta's object names the one contribution it is: re-announcing it under
        # a new id (a replay, to count it twice) or another base (to dodge staleness) is refused.
        # A genesis object may be re-announced by a restarted learner, under a new id.
        checked += [("contribution_id", a.contribution_id), ("base_version", a.base_version)]
    for field_name, want in checked:
        got = header.meta.get(field_name)
        if got is not None and got != want:
            raise Refused("misaddressed", f"{a.object_key} says {field_name}={got!r}, the announcement {want!r}")
    return tensors


def to_arrival(a: Announcement, arrived_at: float) -> Arrival:
    return Arrival(contribution_id=a.contribution_id, learner=a.learner, base_version=a.base_version, tokens=a.tokens,
                   steps=a.steps, arrived_at=arrived_at, step_time_s=a.step_time_s, deadline=a.deadline)
