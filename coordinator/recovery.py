"""After Redis lost data: find the contributions whose announcements were lost with it.

Three cases: Redis emptied (the coordinator rebuilds it from S3, then looks here); Redis
restarted with its data but without its last second of writes (the append-only file is synced
once a second): once the coordinator has read every announcement that survived, it looks here
for objects stored before the outage; and a coordinator's start, which counts as the end of such
an outage (nobody was there to notice one while no coordinator ran).

Learners store a contribution in S3 before they announce it, and every contribution object
describes itself in its header (run, fragment, learner, contribution id, base version, tokens,
steps, step time, deadline, final). So the bucket knows what Redis forgot: a contribution object that
no recent manifest accounts for (merged or refused) and that the coordinator is not holding in an
open round was announced into the lost stream, or never announced. `reannounce_lost` announces
each such object again, on the learner's behalf, with the ids from its header, marked
`recovered`: it then goes through the same checks as any announcement (one too old is refused as
stale, i.e. dropped and recorded). Should the learner's own announcement turn up too (it was only
late), whichever copy comes second is acknowledged as repeated: merged once, refused never.

Only objects stored after the oldest manifest still within `max_staleness` of the head (minus a
margin for clock skew between S3 and the coordinator) are looked at: anything older would be
refused as stale anyway, and was most likely merged long ago.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from diloco.storage import codecs
from diloco.storage.bus import Bus
from diloco.storage.errors import Refused
from diloco.storage.history import read_manifest, sha256_hex
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, ObjectStore, ObjectUnreadable
from diloco.storage.protocol import Announcement, ObjectMeta

log = logging.getLogger(__name__)

CLOCK_MARGIN_S = 60.0
MAX_MANIFESTS_BACK = 1000
"""The most manifests per fragment `accounted_since` reads beyond the last `keep` + 1."""


def accounted_since(store: ObjectStore, keys: RunKeys, heads: dict[int, int], keep: int) -> tuple[set[str], float]:
    """Object keys that the manifests of each fragment merged or refused, and `since`: the commit time
    of the oldest of the last `keep` + 1 manifests (objects stored before it, less CLOCK_MARGIN_S, are
    not looked at). The manifests read go back past those, until one committed before that margin
    (at most MAX_MANIFESTS_BACK per fragment): every object of the window looked at is then
    accounted for by what merged or refused it, not by Redis's applied set, which keeps only the
    ids of the last versions."""
    accounted: set[str] = set()
    since = time.time()
    for fragment, head in heads.items():
        for version in range(max(0, head - keep), head + 1):
            m = read_manifest(store, keys, fragment, version)
            accounted.update(c.object_key for c in m.inputs)
            accounted.update(r.object_key for r in m.refused if r.object_key)
            since = min(since, m.committed_at)
    for fragment, head in heads.items():
        for version in range(head - keep - 1, max(-1, head - keep - 1 - MAX_MANIFESTS_BACK), -1):
            m = read_manifest(store, keys, fragment, version)
            accounted.update(c.object_key for c in m.inputs)
            accounted.update(r.object_key for r in m.refused if r.object_key)
            if m.committed_at < since - CLOCK_MARGIN_S:
                break
    return accounted, since


def announcement_from_object(key: str, blob: bytes, *, max_bytes: int) -> Announcement:
    """The announcement a learner made (or meant to make) for this stored contribution."""
    meta = ObjectMeta.from_meta(codecs.read_header(blob, max_bytes=max_bytes).meta, key)
    if meta.kind != "delta":
        raise Refused("bad_header", f"{key}: its header describes a {meta.kind!r}, not a delta")
    try:
        return meta.announcement(key, int(key.rsplit("/", 1)[1]), len(blob), sha256_hex(blob), time.time())
    except (ValueError, Refused) as exc:  # a learner wrote the header: any value
        raise Refused("bad_header", f"{key}: its header does not describe a contribution ({exc})") from None


def reannounce_lost(store: ObjectStore, bus: Bus, heads: dict[int, int], *, known: set[str], keep: int,
                    max_bytes: int, before: float | None = None,
                    fragments: Sequence[int] | None = None) -> tuple[int, int]:
    """Announce again every recent contribution object nobody accounts for. `known` holds the
    object keys the coordinator still has in memory (open rounds, refusals not yet in a manifest);
    the announcements still pending in the stream or not yet delivered, and the recent refusals,
    are read here, after the bucket is listed, so that one announced meanwhile is not made again.
    With `before` (unix time, when the coordinator noticed an outage in which Redis kept its data),
    only objects stored before it (plus the clock margin: S3's clock is not ours): objects stored
    later were announced once Redis answered. Any that were announced anyway are refused as
    duplicates.
    `fragments`: only the objects of these (a shard's; `heads` holds theirs); None: every fragment's.
    Returns (announced again, unreadable)."""
    accounted, since = accounted_since(store, bus.keys, heads, keep)
    prefixes = [bus.keys.deltas_prefix()] if fragments is None else [bus.keys.deltas_prefix(f) for f in fragments]
    listed = [item for prefix in prefixes for item in store.list_modified(prefix)]
    accounted |= known | bus.unfinished_object_keys() | bus.refused_object_keys()
    again = unreadable = 0
    for key, modified in listed:
        if key in accounted or modified < since - CLOCK_MARGIN_S or (before is not None
                                                                     and modified > before + CLOCK_MARGIN_S):
            continue
        try:
            a = announcement_from_object(key, store.get(key, max_bytes=max_bytes), max_bytes=max_bytes)
        except (Refused, ObjectMissing, ObjectUnreadable) as exc:
            # Left in the bucket, not merged: counted, and visible in the log with its reason.
            unreadable += 1
            log.warning("cannot announce %s again: %s", key, exc)
            continue
        if bus.is_applied(a.contribution_id):
            continue  # merged in a version older than the manifests read above
        bus.announce(a)
        again += 1
    if again or unreadable:
        log.warning("announced %d contribution(s) again from S3 (%d unreadable) whose announcements Redis lost",
                    again, unreadable)
    return again, unreadable
