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
from typing import TYPE_CHECKING

from diloco.coordinator.publish import roll_forward
from diloco.storage import codecs
from diloco.storage.bus import Bus
from diloco.storage.errors import ConfigError, Refused
from diloco.storage.history import read_manifest, sha256_hex
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, ObjectStore, ObjectUnreadable
from diloco.storage.protocol import Announcement, Manifest, ObjectMeta

if TYPE_CHECKING:
    from diloco.coordinator.state import ShardState

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


class Recovery:
    """The coordinator's side of Redis forgetting: it notices an outage or a restart, brings Redis back
    up to S3 before anything more is read or merged, and once every surviving announcement has been
    read, announces again what only S3 still knows (`reannounce_lost`)."""

    def __init__(self, state: ShardState) -> None:
        self.state = state
        self.outage_at: float | None = time.time()
        """When this process noticed a Redis outage (unix), until the sweep for lost announcements. Its
        start counts as one: a learner's announcement may have been lost while no coordinator ran
        (Redis forgot its last writes then, and nobody noticed), and only S3 still knows the piece."""
        self.reconcile_due = False
        """Redis was unreachable or restarted: bring it up to S3 before reading on (`reconcile`)."""
        self.drained = False
        """The last read of the announcements stream returned nothing (the loop's)."""
        self._redis_run_id = self._server_run_id()

    def roll_forward(self) -> dict[int, int]:
        """Bring Redis up to the manifests in S3 (`publish.roll_forward`) and take its heads: a
        fragment whose head moved is reloaded from S3, and an open round keeps only contributions
        not applied since. What the manifests committed again merged is kept as applied
        (`Fragment.applied`)."""
        s = self.state

        def committed(manifest: Manifest) -> None:
            s.fragments[manifest.fragment].record_applied(
                manifest.version, (c.contribution_id for c in manifest.inputs), s.keep_applied)

        heads = roll_forward(s.store, s.bus, list(s.fragments), s.epoch, keep_applied=s.keep_applied,
                             committed=committed)
        for fragment, frag in s.fragments.items():
            if heads.get(fragment, -1) != frag.head:
                frag.forget_head(heads.get(fragment, -1))
            frag.round = [c for c in frag.round if not s.bus.is_applied(c.announcement.contribution_id)]
        return heads

    def rebuild(self) -> None:
        """Redis lost the run's keys: take the lease again, then rebuild heads, applied set, the
        consumer group and the round clock from S3 and from what this process holds."""
        s = self.state
        s.epoch = s.leadership.retake()
        s.metrics.took_lease()
        s.bus.ensure_group()
        heads = self.roll_forward()
        if s.cadence is not None and s.shard.leads:
            s.bus.set_cadence(s.cadence)
        if s.ended is not None:
            s.bus.set_run_end(s.ended, s.epoch)
        again = self.announce_lost(heads)
        self.outage_at, self._redis_run_id = None, self._server_run_id()  # the lost work is looked for already
        s.bus.incr("redis_rebuilds")
        log.warning("rebuilt Redis from S3 at epoch %d: heads %s, %d contribution(s) announced again", s.epoch,
                    heads, again)

    def reconcile(self) -> None:
        """After Redis was unreachable or restarted: it may have forgotten its last writes, commits
        included (a host crash with the AOF synced once a second, a failover to a lagging replica, a
        restore from a snapshot). S3 is the truth: before anything more is read or merged, every
        manifest in S3 above a Redis head is committed again, with its contributions applied and
        their entries acknowledged, so that a forgotten commit is neither merged twice nor left
        behind a head that moved back. Redis that came back empty is rebuilt instead."""
        s = self.state
        if s.bus.wiped():
            self.rebuild()
        else:
            behind = {f: h for f, h in s.bus.heads().items() if f in s.fragments and h < s.fragments[f].head}
            if behind:
                log.warning("Redis forgot commits (heads %s, S3 has %s): committing them again from S3", behind,
                            {f: s.fragments[f].head for f in behind})
            self.roll_forward()
        self.reconcile_due = False

    def outage_noticed(self) -> None:
        """Bring Redis up to S3 again at once, and sweep for lost announcements once every
        announcement that survived has been read again."""
        if self.outage_at is None:
            self.outage_at = time.time()
        self.drained = False
        self.reconcile_due = True

    def notice_restart(self) -> None:
        """A Redis restart can be too short for any command to fail (the adapter retries): notice it
        by the server's run id, so that the sweep for lost announcements runs after it too."""
        if self._redis_run_id is None:
            return
        run_id = self.state.bus.server_run_id()
        if run_id != self._redis_run_id:
            log.warning("Redis restarted (server run id changed): looking for announcements it lost")
            self.outage_noticed()
        self._redis_run_id = run_id

    def sweep_if_due(self) -> None:
        """Redis came back with its data, but it may have lost its last writes (append-only file synced
        once a second): an announcement a learner made just before the crash is then gone, while its
        object is in S3. Once every surviving announcement has been read (`drained`), announce again
        the objects stored before the outage was noticed that nothing accounts for. If Redis came back
        empty, rebuild."""
        if self.outage_at is None or not self.drained:
            return
        if self.state.bus.wiped():
            self.rebuild()
            return
        again = self.announce_lost(self.state.heads(), before=self.outage_at)
        self.outage_at = None
        self.state.bus.incr("outage_sweeps")
        log.info("after the Redis outage: %d lost announcement(s) found in S3 and made again", again)

    def announce_lost(self, heads: dict[int, int], before: float | None = None) -> int:
        """Announce again the recent contribution objects that no manifest, open round or pending
        refusal accounts for (`reannounce_lost`); only those stored before `before` if given."""
        s = self.state
        known = {c.announcement.object_key for f in s.fragments.values() for c in f.round}
        known |= {r.object_key for f in s.fragments.values() for r in f.refused}
        known |= {r.object_key for r in s.unplaced}
        again, unreadable = reannounce_lost(s.store, s.bus, heads, known=known, keep=s.keep_applied,
                                            max_bytes=s.spec.max_object_bytes, before=before, fragments=list(s.fragments))
        s.read_pending = True
        s.bus.incr("reannounced_from_s3", again)
        s.bus.incr("unreadable_in_s3", unreadable)
        return again

    def _server_run_id(self) -> str | None:
        """The Redis server's run id, or None where INFO is not allowed (an ACL without @dangerous):
        restarts are then noticed only by failed commands."""
        try:
            return self.state.bus.server_run_id()
        except ConfigError as exc:
            log.warning("cannot notice short Redis restarts by the server's run id: %s", exc)
            return None
