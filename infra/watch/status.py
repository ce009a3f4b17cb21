"""`diloco status`: what a run is doing now, read from Redis (the index) and S3 where Redis cannot say.

`read_status` gathers everything into one `RunStatus` (plain dataclasses of numbers and strings, written
as is by `--json`); `render` turns it into text or rich tables. Nothing here writes to Redis or S3, and
nothing imports torch: a status read is a few dozen Redis commands and two or three small S3 requests.

Every age is measured on the Redis server's clock (`TIME`), the clock every process of a run agrees on:
stream entry ids carry it (versions, refusals, announcements), and so do learner leases. Where only a
record's own timestamp exists (a manifest's `committed_at`, an epoch claim's S3 modification time),
that machine's clock is compared with Redis's.

What the learners' heartbeats do not carry is derived or left out, and the view says which:
- A heartbeat records no time, only a lease expiry (Redis `TIME` + the learner's `lease_s`, which
  Redis does not know): a learner's row shows how long its lease has left (or since when it lapsed).
- Staleness: the stats carry no base version. The learner's newest delta announcement per fragment
  does: staleness = the fragment's head now minus that base version.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


from diloco.storage.bus import Bus
from diloco.storage.errors import DilocoError, Refused
from diloco.storage.keys import RunKeys, Shard
from diloco.storage.objects import ObjectMissing, Store
from diloco.storage.protocol import (MAX_MESSAGE_BYTES, MAX_RECORD_BYTES, Announcement, Cadence, LearnerFinished,
                                     Manifest, Refusal, RunEnd, RunSpec, VersionEvent)

REFUSALS_SHOWN = 8
"""The last this many refusals are listed."""
ANNOUNCEMENTS_SCANNED = 2000
"""Staleness is taken from each learner's newest delta among the last this many announcements."""
VERSIONS_SCANNED = 512
"""Head ages come from the last this many entries of the versions stream (else from the manifest)."""


LEARNER_STATES = {
    "live": "its lease is running: it heartbeats",
    "lapsed": "its lease expired without it leaving (killed, hung or cut off from Redis); it may come back",
    "preempted": "it left on SIGTERM (a preemption) with its progress sent, and may come back: the run waits for it",
    "left": "it left without finishing (its training loop raised, or it called close()); the run still counts on it",
    "unknown": "it joined and did not finish, but Redis holds no lease or leaving record of it (forgotten an hour "
               "after its lease lapsed, or Redis lost its data)",
}
"""The states `diloco status` shows a learner in (finished learners are listed apart), for `--help` and docs."""


class RunMissing(DilocoError):
    """Neither S3 nor Redis knows the run."""


@dataclass
class FragmentStatus:
    fragment: int
    head: int | None
    """Latest committed version (None: no version 0 yet)."""
    head_age_s: float | None
    """Seconds since the head was committed."""
    contributions: int | None
    """Contributions the head merged (from its versions stream entry)."""
    next_deadline_in_s: float | None
    """Clock cadence: seconds until the fragment's next round deadline."""


@dataclass
class RoundClock:
    cadence: str
    """'clock' (rounds by Redis time) or 'steps' (every H inner steps, no clock)."""
    sync_every: int
    overlap_steps: int
    period_s: float | None
    """Clock cadence: seconds between two deadlines of a fragment (None: no cadence record yet)."""
    origin: float | None
    next_fragment: int | None
    """The fragment whose deadline comes next."""
    next_deadline_in_s: float | None


@dataclass
class ConsumerStatus:
    name: str
    pending: int
    idle_s: float
    """Seconds since the consumer last read the announcements stream."""


@dataclass
class ShardStatus:
    """One coordinator shard of a run coordinated by several (`coordinator.config.CoordinatorConfig.shards`)."""

    shard: int
    fragments: list[int]
    epoch: int | None
    holder: str | None
    lease_expires_in_s: float | None


@dataclass
class CoordinatorStatus:
    epoch: int | None
    """Current fencing epoch (None: Redis lost it)."""
    holder: str | None
    """Who holds the lease now (None: nobody, the lease lapsed)."""
    lease_expires_in_s: float | None
    holder_since_age_s: float | None
    """Seconds since the current epoch was claimed (its `epochs/` object in S3): the holder's tenure."""
    consumers: list[ConsumerStatus] = field(default_factory=list)
    shards: list[ShardStatus] = field(default_factory=list)
    """Each shard, where the run is coordinated by several (the fields above are then shard 0's)."""


@dataclass
class LearnerStatus:
    learner: str
    state: str
    """One of LEARNER_STATES."""
    lease_left_s: float | None
    """Seconds until the lease expires; negative: since it lapsed. Each heartbeat renews it."""
    step: int | None
    tokens: int | None
    loss: float | None
    step_time_s: float | None
    adopted: int | None
    uploaded: int | None
    upload_failed: int | None
    bytes_up: int | None
    bytes_down: int | None
    """Bytes it read from S3 (versions, manifests, the run's records)."""
    wall_s: float | None
    staleness: int | None
    """Largest over fragments of (head now - base version of its newest delta announcement)."""
    staleness_by_fragment: dict[str, int] = field(default_factory=dict)
    last_sent_age_s: float | None = None
    """Seconds since its newest announcement (among the last ANNOUNCEMENTS_SCANNED)."""
    incarnation: str = ""
    pid: int | None = None
    left_age_s: float | None = None
    """'preempted' and 'left': seconds since it left."""


@dataclass
class FinishedLearner:
    learner: str
    finished_age_s: float
    steps: int
    final_pieces: int


@dataclass
class RecentRefusal:
    age_s: float | None
    code: str
    learner: str
    reason: str
    contribution_id: str


@dataclass
class PendingStatus:
    stream_length: int
    pending: int
    """Delivered to the coordinator, not acknowledged yet."""
    undelivered: int | None
    """Not read by the coordinator yet (None: this Redis does not say)."""
    oldest_pending_age_s: float | None
    lag_s: float | None
    """Age of the oldest announcement not dealt with (pending or undelivered): the coordinator's lag."""
    group: bool
    """The coordinator's consumer group exists."""


@dataclass
class EndStatus:
    by: str
    reason: str
    versions: list[int]
    age_s: float | None


@dataclass
class RunStatus:
    run: str
    prefix: str
    redis: str
    """Redis URL without password."""
    read_at: float
    """Redis server time of the read (unix seconds)."""
    exists_in_s3: bool
    spec: dict[str, object] | None
    heads_from: str
    """'redis', or 's3' when Redis holds no heads (rebuilt by the next coordinator)."""
    fragments: list[FragmentStatus]
    clock: RoundClock | None
    coordinator: CoordinatorStatus
    learners: list[LearnerStatus]
    finished_learners: list[FinishedLearner]
    refusals: list[RecentRefusal]
    refused_total: int
    refused_by_code: dict[str, int]
    pending: PendingStatus
    counters: dict[str, int]
    finished: EndStatus | None
    finish_requested_by: str | None
    notes: list[str] = field(default_factory=list)
    """What the view could not read or had to derive, for a person."""

    @property
    def live(self) -> list[LearnerStatus]:
        return [row for row in self.learners if row.state == "live"]

    def to_json(self) -> dict:
        return asdict(self)


# ---- reading -----------------------------------------------------------------------------------------

def _entry_time(entry_id: bytes | str) -> float:
    """A stream entry id's time part (Redis server time, unix seconds)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0]) / 1000.0


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _read_spec(store: Store, keys: RunKeys) -> RunSpec | None:
    try:
        return RunSpec.from_wire(store.get(keys.run_spec(), max_bytes=MAX_RECORD_BYTES))
    except ObjectMissing:
        return None


def _read_end(store: Store, keys: RunKeys) -> RunEnd | None:
    try:
        return RunEnd.from_wire(store.get(keys.finished_record(), max_bytes=MAX_MESSAGE_BYTES))
    except ObjectMissing:
        return None


def _s3_heads(store: Store, keys: RunKeys, fragments: int) -> dict[int, int]:
    """Each fragment's highest version with a manifest, by listing (when Redis holds no heads)."""
    heads: dict[int, int] = {}
    for key in store.list(keys.versions_prefix()):
        parsed = keys.parse_version_key(key)
        if parsed and parsed[2] == "manifest" and parsed[0] < fragments:
            heads[parsed[0]] = max(parsed[1], heads.get(parsed[0], -1))
    return heads


def _head_events(bus: Bus, heads: dict[int, int]) -> dict[int, tuple[float, int]]:
    """Per fragment whose head is among the last versions stream entries: (commit time, contributions)."""
    found: dict[int, tuple[float, int]] = {}
    for entry_id, body in bus.newest(bus.keys.versions, VERSIONS_SCANNED):
        try:
            event = VersionEvent.from_wire(body)
        except Refused:
            continue
        if heads.get(event.fragment) == event.version and event.fragment not in found:
            found[event.fragment] = (_entry_time(entry_id), len(event.contributions))
        if len(found) == len(heads):
            break
    return found


def _manifest_time(store: Store, keys: RunKeys, fragment: int, version: int) -> tuple[float, int] | None:
    try:
        m = Manifest.from_wire(store.get(keys.manifest(fragment, version), max_bytes=MAX_RECORD_BYTES))
    except (ObjectMissing, Refused):
        return None
    return m.committed_at, len(m.inputs)


def _clock(spec: RunSpec | None, cadence: Cadence | None, now: float) -> tuple[RoundClock | None, dict[int, float]]:
    """The round clock and, under clock cadence, each fragment's next deadline (Redis time)."""
    if spec is None:
        return None, {}
    deadlines: dict[int, float] = {}
    if spec.cadence == "clock" and cadence is not None:
        deadlines = {f: cadence.next_deadline(f, spec.num_fragments, now) for f in range(spec.num_fragments)}
    nxt = min(deadlines, key=deadlines.get) if deadlines else None  # type: ignore[arg-type]
    return RoundClock(cadence=spec.cadence, sync_every=spec.sync_every, overlap_steps=spec.overlap_steps,
                      period_s=cadence.period_s if cadence else None, origin=cadence.origin if cadence else None,
                      next_fragment=nxt, next_deadline_in_s=None if nxt is None else deadlines[nxt] - now), deadlines


def _coordinator(bus: Bus, store: Store, now: float, num_fragments: int) -> CoordinatorStatus:
    keys = bus.keys
    layout = Shard(0, bus.shard_count() or 1).layout()
    rows = [ShardStatus(s.index, s.fragments(num_fragments), *bus.leadership(s)) for s in layout]
    epoch, holder, expires_in_s = rows[0].epoch, rows[0].holder, rows[0].lease_expires_in_s
    since = None
    if epoch is not None:
        claim = keys.epoch_claim(epoch)
        for key, modified in store.list_modified(keys.epochs_prefix()):
            if key == claim:
                since = max(0.0, now - modified)
    consumers = [ConsumerStatus(name, pending, idle_s) for name, pending, idle_s in bus.consumers()]
    return CoordinatorStatus(epoch=epoch, holder=holder, lease_expires_in_s=expires_in_s, holder_since_age_s=since,
                             consumers=consumers, shards=rows if len(rows) > 1 else [])


def _pending(bus: Bus, now: float) -> PendingStatus:
    b = bus.backlog()
    return PendingStatus(stream_length=b.stream_length, pending=b.pending, undelivered=b.undelivered,
                         oldest_pending_age_s=None if b.oldest_pending_at is None else max(0.0, now - b.oldest_pending_at),
                         lag_s=b.lag_s(now), group=b.group)


def _latest_sends(bus: Bus) -> dict[str, tuple[float, dict[int, int]]]:
    """Per learner: the time of its newest announcement and, per fragment, the base version of its
    newest delta, among the last ANNOUNCEMENTS_SCANNED announcements."""
    out: dict[str, tuple[float, dict[int, int]]] = {}
    for entry_id, body in bus.newest(bus.keys.announcements, ANNOUNCEMENTS_SCANNED):
        try:
            a = Announcement.from_wire(body)
        except Refused:
            continue
        when, bases = out.setdefault(a.learner, (_entry_time(entry_id), {}))
        if a.kind == "delta" and a.fragment not in bases:
            bases[a.fragment] = a.base_version
    return out


def _refusals(bus: Bus, now: float, count: int) -> list[RecentRefusal]:
    rows = []
    for entry_id, body in bus.newest(bus.keys.refusals, count):
        try:
            r = Refusal.from_wire(body)
        except Refused as exc:
            rows.append(RecentRefusal(now - _entry_time(entry_id), exc.code, "?", f"unreadable refusal: {exc.reason}", ""))
            continue
        rows.append(RecentRefusal(max(0.0, now - _entry_time(entry_id)), r.code, r.learner, r.reason, r.contribution_id))
    return rows


def _learners(bus: Bus, heads: dict[int, int], now: float,
              notes: list[str]) -> tuple[list[LearnerStatus], list[FinishedLearner], str | None]:
    fleet = bus.fleet()
    expiry = bus.heartbeat_expiry()
    stats = bus.learner_stats()
    finished: dict[str, LearnerFinished] = {}
    for name, record in bus.finished_learners().items():
        if isinstance(record, Refused):
            notes.append(f"the finish record of learner {name!r} does not decode: {record.reason}")
        else:
            finished[name] = record
    sends = _latest_sends(bus)
    left_run = bus.left_learners()
    names = sorted(set(fleet.live) | (set(fleet.joined) - set(finished)))
    rows = []
    for name in names:
        s = stats.get(name)
        left = expiry[name] - now if name in expiry else None
        gone = left_run.get(name)
        state = "live" if name in fleet.live else ("preempted" if gone.preempted else "left") if gone is not None \
            else "lapsed" if left is not None else "unknown"
        when, bases = sends.get(name, (None, {}))
        stale = {str(f): heads[f] - base for f, base in sorted(bases.items()) if f in heads}
        rows.append(LearnerStatus(
            learner=name, state=state, lease_left_s=left,
            step=s.step if s else None, tokens=s.tokens if s else None, loss=_finite(s.loss) if s else None,
            step_time_s=s.step_time_s if s else None, adopted=s.adopted if s else None,
            uploaded=s.uploaded if s else None, upload_failed=s.upload_failed if s else None,
            bytes_up=s.bytes_uploaded if s else None, bytes_down=s.bytes_downloaded if s else None,
            wall_s=s.wall_s if s else None,
            staleness=max(stale.values()) if stale else None, staleness_by_fragment=stale,
            last_sent_age_s=None if when is None else max(0.0, now - when),
            incarnation=s.incarnation if s else "", pid=s.pid if s else None,
            left_age_s=None if gone is None or state == "live" else max(0.0, now - gone.left_at)))
    rows.sort(key=lambda r: (r.state != "live", r.learner))
    done = [FinishedLearner(name, max(0.0, now - f.finished_at), f.steps, len(f.final))
            for name, f in sorted(finished.items())]
    request = fleet.finish_request.by if fleet.finish_request is not None else None
    return rows, done, request


def read_status(bus: Bus, store: Store, *, refusals: int = REFUSALS_SHOWN) -> RunStatus:
    """Everything `diloco status` shows about `bus.run`, read now. Raises RunMissing if neither S3
    (no run spec) nor Redis (no heads, no epoch) knows the run."""
    keys = bus.keys
    spec = _read_spec(store, keys)
    heads = bus.heads()
    if spec is None and not heads and bus.epoch() is None and bus.shard_count() is None:
        raise RunMissing(f"run {keys.run!r} does not exist: no run spec at {store.url(keys.run_spec())} and no "
                         f"keys named {keys.heads.removesuffix('heads')}* in Redis at {bus.url}: wrong run id, "
                         "bucket, DILOCO_S3_PREFIX or DILOCO_REDIS_URL?")
    now = bus.server_time()
    notes: list[str] = []
    if spec is None:
        notes.append(f"no run spec at {store.url(keys.run_spec())}: Redis knows the run, S3 does not")
    num_fragments = spec.num_fragments if spec else (max(heads) + 1 if heads else 0)
    heads_from = "redis"
    if not heads and spec is not None and (found := _s3_heads(store, keys, num_fragments)):
        heads, heads_from = found, "s3"
        notes.append("Redis holds no heads (lost its data?): heads are the manifests in S3; the next "
                     "coordinator rebuilds Redis from them")
    events = _head_events(bus, heads)
    end = bus.run_end() or _read_end(store, keys)
    clock, deadlines = _clock(spec, bus.cadence(), now)
    if end is not None:
        deadlines = {}  # a finished run merges nothing more: no round is due
        if clock is not None:
            clock.next_fragment = clock.next_deadline_in_s = None
    fragments = []
    for f in range(num_fragments):
        head = heads.get(f)
        age = contributions = None
        if head is not None:
            if f in events:
                age, contributions = now - events[f][0], events[f][1]
            elif (found := _manifest_time(store, keys, f, head)) is not None:
                age, contributions = now - found[0], found[1]
        fragments.append(FragmentStatus(f, head, None if age is None else max(0.0, age), contributions,
                                        deadlines[f] - now if f in deadlines else None))
    learners, finished_learners, request = _learners(bus, heads, now, notes)
    counters = bus.counters()
    return RunStatus(
        run=keys.run, prefix=keys.prefix, redis=bus.url, read_at=now, exists_in_s3=spec is not None,
        spec=None if spec is None else {"num_fragments": spec.num_fragments, "sync_every": spec.sync_every,
                                        "overlap_steps": spec.overlap_steps, "codec": spec.codec,
                                        "compress": spec.compress, "merge_rule": spec.merge_rule,
                                        "cadence": spec.cadence, "created_at": spec.created_at},
        heads_from=heads_from, fragments=fragments, clock=clock, coordinator=_coordinator(bus, store, now, num_fragments),
        learners=learners, finished_learners=finished_learners, refusals=_refusals(bus, now, refusals),
        refused_total=counters.get("contributions_refused", 0),
        refused_by_code=_by_code(counters.items()), pending=_pending(bus, now), counters=counters,
        finished=None if end is None else EndStatus(end.by, end.reason, list(end.versions),
                                                    max(0.0, now - end.finished_at)),
        finish_requested_by=request, notes=notes)


def _by_code(counters: Iterable[tuple[str, int]]) -> dict[str, int]:
    return {name.removeprefix("refused:"): n for name, n in sorted(counters) if name.startswith("refused:") and n}
