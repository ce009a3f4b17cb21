"""The coordinator process: announcements in, verified rounds, merged versions out.

Loop: read announcements (own pending entries first after a restart) -> check and fetch each one
(in parallel) -> add it to its fragment's round -> ask `decide_round` for every open round ->
merge the due ones (token-weighted, deterministic order) -> outer Nesterov step -> publish
(objects, manifest, fenced Redis commit) -> once every learner has finished, or an operator asked,
and nothing is pending: the run's end. Only the policy functions decide; this module does I/O.

An announcement leaves the pending list exactly once: acknowledged inside the commit of the
version that merged it, or acknowledged together with the record of its refusal. If S3 cannot be
read right now, the entry stays pending and is retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
import torch

from diloco.coordinator.config import CoordinatorConfig, RunSettings, settings_differ
from diloco.coordinator.fleet_view import FleetView
from diloco.coordinator.influence import (Claim, clip_norms, count_claims, fastest_plausible, plausible_deadline,
                                          usual_fleet)
from diloco.coordinator.intake import (PendingDelta, check_announcement, decode_piece, fetch_checked, fetch_tensors,
                                      to_arrival)
from diloco.coordinator.leadership import Fenced, Leadership
from diloco.coordinator.metrics import Metrics
from diloco.coordinator.outer import (NesterovState, downstream_step, outer_step, round_delta,
                                      scale_update, update_norm)
from diloco.coordinator.policy import (RECENT_ROUNDS, Arrival, RoundSize, RoundState, decide_round,
                                       merge_order, merge_weights, next_cadence, round_size, round_step, run_end,
                                       budget_spent, served_deadline, staleness_verdict, usual_pieces)
from diloco.coordinator.publish import (commit, commit_existing, decode_state, listed_refusals, roll_forward,
                                        write_version)
from diloco.coordinator.recovery import reannounce_lost
from diloco.coordinator.timing import PhaseTimes
from diloco.storage.bus import Bus, CommitResult, Fleet, GroupGone
from diloco.storage.crashpoints import crash_point
from diloco.storage.errors import ConfigError, Conflict, Refused, StorageUnavailable
from diloco.storage.history import read_layout, read_manifest, read_params, read_run_end, read_run_spec, read_verified
from diloco.storage.objects import ObjectMissing, ObjectStore
from diloco.storage.protocol import (MAX_RECORD_BYTES, Announcement, Cadence, Contribution, Layout, Manifest,
                                     Refusal, RunEnd, RunSpec, VersionSettings)
from diloco.storage.settings import Endpoints

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 2000
"""A refusal's reason quotes what it refuses (keys, names), which the sender chose: it is cut to this
length so that refusal records and the manifests that list them stay small."""
MAX_READ = 256
"""The most announcements one read of the stream takes (`read_batch_bytes` may allow fewer)."""
MAX_ROUND_PIECES = 4096
"""The most pieces one version merges: its manifest lists each (a few hundred bytes apiece), and must
stay well within the 64 MiB its readers accept, refusals included."""
MAX_RECOVERED_IDS = 100_000
"""How many contribution ids announced again from S3 the coordinator remembers (`Coordinator._recovered`)."""
TRIM_EVERY_S = 30.0
"""How often the coordinator drops the announcements it is done with (`Bus.trim_announcements`)."""
MAX_KEY_CHARS = 1024
"""A refusal's object key is the announced one, cut to S3's own limit on key length."""


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def _absmax(tensors: dict[str, torch.Tensor]) -> float:
    return max((float(t.abs().max()) for t in tensors.values() if t.numel()), default=0.0)


class _Pieces(Sequence[dict[str, torch.Tensor]]):
    """A round's pieces, each decoded when it is read: `outer.merge_deltas` reads them in order and
    adds each to the sum as it comes, so a merge holds the sum and one decoded piece, while the
    round waits with its pieces as they travelled (`PendingDelta.blob`)."""

    def __init__(self, blobs: list[bytes], decode: Callable[[bytes], dict[str, torch.Tensor]]) -> None:
        self._blobs, self._decode = blobs, decode

    def __len__(self) -> int:
        return len(self._blobs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override] (no slices)
        return self._decode(self._blobs[i])


@dataclass
class Fragment:
    """In-memory state of one fragment: its head and the open round."""

    head: int
    params: dict[str, torch.Tensor] | None = None
    state: NesterovState | None = None
    round: list[PendingDelta] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    wake_at: float | None = None
    last_reason: str = ""
    merged_deadline: float = 0.0
    """The latest clock deadline a round merged here served (0: none since this coordinator started)."""
    recent: list[RoundSize] = field(default_factory=list)
    """The last rounds merged here (`policy.round_step`'s usual round)."""
    claims: list[tuple[Claim, ...]] = field(default_factory=list)
    """What the pieces of the same rounds counted (`influence.count_claims` weighs a claim against them)."""
    pieces: dict[str, int] = field(default_factory=dict)
    """Each learner's usual piece (`policy.usual_pieces`) as of its last round in `claims` before it
    finished: a learner that finished keeps that share of the usual round for the rest of the run
    (`influence.usual_fleet`), not its final sliver of a piece. Since this coordinator started."""
    merged_tokens: int | None = None
    """The tokens merged into the fragment up to its head (`Manifest.merged_tokens`); None: read from
    the head's manifest when needed (the head moved by another path than our own commit)."""
    committed: list[frozenset[str]] = field(default_factory=list)
    """The contribution ids of the last versions this process committed here (max_staleness + 1 of
    them): applied, since their manifests are in S3, whatever Redis says (it may forget its last
    writes); anything older would be refused as stale."""


class Coordinator:
    def __init__(self, endpoints: Endpoints, run: str, *, settings: RunSettings | None = None,
                 config: CoordinatorConfig | None = None, stop: threading.Event | None = None,
                 metrics: Metrics | None = None, resume: bool = False) -> None:
        """Create or load the run, take the coordinator lease (waiting for it if another coordinator
        holds it; `stop` ends the wait) and bring Redis up to date with the manifests in S3. Metrics
        go to `metrics`, or to a server of this coordinator's own on `config.metrics_port` (0: none).

        `settings` create the run; for a run that exists they must be its stored settings (a
        ConfigError prints both), unless `resume` (or `settings` is None): then the stored ones
        are run. The run is created only once both Redis and S3 have answered."""
        self.config = config or CoordinatorConfig()
        self._own_metrics = metrics is None
        self.metrics = metrics if metrics is not None else Metrics.start(self.config.metrics_port, run)
        self.store = ObjectStore(endpoints)
        self.shard = self.config.shard_of_run()
        """The fragments this coordinator merges; shard 0 also keeps the run's clock and ends it."""
        self.bus = Bus(endpoints, run, self.shard)
        self.keys = self.bus.keys
        self.store = self.metrics.counting(self.store, self.keys)
        self.store.ensure_bucket()
        self.bus.ping()  # both servers answer before the run's settings are written
        self.spec = self._load_or_create(settings, resume=resume or settings is None)
        if self.shard.count > self.spec.num_fragments:
            raise ConfigError(f"run {run!r} has {self.spec.num_fragments} fragment(s): {self.shard.count} shards "
                              f"would leave some without any; use at most {self.spec.num_fragments}")
        self.owned = self.shard.fragments(self.spec.num_fragments)
        """The fragments this shard merges."""
        # The grace window reasons about the learners' overlap: take tau from the run itself.
        self.round_cfg = replace(self.config.round, overlap_steps=self.spec.overlap_steps)
        self._keep_applied = self.round_cfg.max_staleness + 1
        """Versions per fragment whose contributions Redis's applied set keeps: older ones are stale."""
        self.leadership = Leadership(self.bus, self.store, self.config.lease_s)
        self.epoch = self.leadership.take(standby=self.config.standby, stop=stop or threading.Event())
        self.bus.ensure_group()
        heads = roll_forward(self.store, self.bus, self.owned, self.epoch, keep_applied=self._keep_applied)
        self.layout: Layout | None = read_layout(self.store, self.keys)
        self.fragments = {f: Fragment(head=heads.get(f, -1)) for f in self.owned}
        self.view = FleetView(self.bus, self.config.gone_after_s)
        """The learners as the loop last saw them: live, sending, finished, waited for."""
        for fragment, frag in self.fragments.items():
            self._load_recent(fragment, frag)
        self.sync_time_s = 0.0
        self.ended: RunEnd | None = read_run_end(self.store, self.keys)
        """The run's end once it is finished: every contribution is refused from then on."""
        if self.ended is not None and not self.bus.set_run_end(self.ended, self.epoch):
            raise Fenced(f"another coordinator took run {run!r} over while this one started")
        self.cadence: Cadence | None = self.bus.cadence()
        self._clock_offset_s = self.bus.server_time() - time.time()
        self.leadership.start_renewing()  # only now: a start-up that failed leaves the lease to lapse
        self._last_cadence_check = 0.0
        self._pool = ThreadPoolExecutor(self.config.fetch_threads, thread_name_prefix="fetch")
        self.timing = PhaseTimes()
        """(seconds, CPU seconds) per phase of the loop since start (`coordinator/timing.py`)."""
        self._retry: list[tuple[str, Announcement]] = []
        self._unplaced: list[Refusal] = []  # refusals of entries that name no fragment of the run
        self._read_pending = True
        self._read_batch: int | None = None  # `_read_count`, once the layout is known
        # When this process noticed a Redis outage (unix), until the sweep for lost announcements. Its
        # start counts as one: a learner's announcement may have been lost while no coordinator ran
        # (Redis forgot its last writes then, and nobody noticed), and only S3 still knows the piece.
        self._outage_at: float | None = time.time()
        self._recovered: dict[str, None] = {}
        """Contribution ids taken in from a `recovered` announcement (bounded): the learner's own copy,
        should it come too, is acknowledged as repeated."""
        self._reconcile_due = False  # Redis was unreachable or restarted: bring it up to S3 before reading on
        self._drained = False  # the last read of the announcements stream returned nothing
        self._redis_run_id = self._server_run_id()
        self.metrics.attach(self)
        self._others_tokens: dict[tuple[int, int], int] = {}
        """Merged tokens by (fragment, head) of the other shards' fragments (the leader's token budget)."""
        log.info("coordinator %s of run %s%s: epoch %d, %d fragments, heads %s", self.leadership.holder, run,
                 f" ({self.shard})" if self.shard.count > 1 else "", self.epoch, self.spec.num_fragments,
                 {f: s.head for f, s in self.fragments.items()})

    def _load_or_create(self, settings: RunSettings | None, *, resume: bool) -> RunSpec:
        spec = read_run_spec(self.store, self.keys)
        if spec is None:
            spec = (settings or RunSettings()).spec(self.keys.run)
            try:
                self.store.put(self.keys.run_spec(), spec.to_wire(), create_only=True)
                log.info("created run %s: %s", spec.run, spec)
                return spec
            except Conflict:  # another coordinator created it a moment ago
                spec = read_run_spec(self.store, self.keys)
                assert spec is not None
        differ = settings_differ(spec, settings) if settings is not None else {}
        if differ and not resume:
            raise ConfigError(f"run {spec.run!r} exists with other settings than these: "
                              + ", ".join(f"{k} {stored!r} (given {given!r})" for k, (stored, given) in differ.items())
                              + ". Give the stored ones, or --resume to run it as it is stored")
        if differ:
            log.warning("run %s resumed as stored: %s", spec.run,
                        ", ".join(f"{k} {stored!r} (given {given!r}, not used)" for k, (stored, given) in differ.items()))
        return spec

    # ---- the loop ----------------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Run until `stop` is set or the run is finished (unless `keep_serving`), then hand the lease
        over. Raises Fenced if another coordinator takes over."""
        try:
            self._serve(stop)
        except Fenced:
            self.close(release=False)
            raise
        self.close(release=True)

    def close(self, *, release: bool = True) -> None:
        """Stop renewing the lease (and give it up at once, so that a standby need not wait for it to lapse)."""
        self.leadership.close(release=release)
        self._pool.shutdown(wait=True)
        self.metrics.detach()
        if self._own_metrics:
            self.metrics.stop()

    def _serve(self, stop: threading.Event) -> None:
        last_claim = last_restart_check = 0.0
        last_trim = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            try:
                if self.leadership.check():
                    self._rebuild()
                if self._reconcile_due:
                    self._reconcile()
                if now - last_claim > self.config.claim_idle_s / 2:
                    try:
                        self._intake(self.bus.autoclaim(self.config.consumer,
                                                        min_idle_ms=int(self.config.claim_idle_s * 1000)))
                    except GroupGone as exc:
                        self._group_gone(exc)
                    last_claim = now
                self.step(block_ms=self._block_ms())
                if self.ended is not None and not self.config.keep_serving:
                    log.info("run %s is finished (%s): the coordinator's work is done", self.spec.run,
                             self.ended.reason)
                    return
                if now - last_restart_check > 1.0:
                    self._notice_restart()
                    if not self.shard.leads:
                        self._follow_leader()
                    self.metrics.sample(self.bus, self.now())
                    last_restart_check = now
                if self._outage_at is not None and self._drained:
                    self._sweep_after_outage(self._outage_at)
                    self._outage_at = None
                if now - last_trim > TRIM_EVERY_S and self._outage_at is None and self.shard.leads:
                    self.bus.trim_announcements()
                    last_trim = now
            except (redis.RedisError, StorageUnavailable) as exc:
                # Pending entries stay pending and in-memory rounds stay open: resume when it answers.
                if isinstance(exc, redis.RedisError):
                    self._outage_noticed()
                log.warning("storage unavailable, retrying in 1s: %s", exc)
                stop.wait(1.0)

    def _rebuild(self) -> None:
        """Redis lost the run's keys: take the lease again, then rebuild heads, applied set, the
        consumer group and the round clock from S3 and from what this process holds."""
        self.epoch = self.leadership.retake()
        self.metrics.took_lease()
        self.bus.ensure_group()
        heads = self._roll_forward()
        if self.cadence is not None and self.shard.leads:
            self.bus.set_cadence(self.cadence)
        if self.ended is not None:
            self.bus.set_run_end(self.ended, self.epoch)
        again = self._announce_lost(heads)
        self._outage_at, self._redis_run_id = None, self._server_run_id()  # the lost work is looked for already
        self.bus.incr("redis_rebuilds")
        log.warning("rebuilt Redis from S3 at epoch %d: heads %s, %d contribution(s) announced again", self.epoch,
                    heads, again)

    def _roll_forward(self) -> dict[int, int]:
        """Bring Redis up to the manifests in S3 (`publish.roll_forward`) and take its heads: a
        fragment whose head moved is reloaded from S3, and an open round keeps only contributions
        not applied since."""
        heads = roll_forward(self.store, self.bus, self.owned, self.epoch, keep_applied=self._keep_applied)
        for fragment, frag in self.fragments.items():
            if heads.get(fragment, -1) != frag.head:
                frag.head, frag.params, frag.state, frag.merged_tokens = heads.get(fragment, -1), None, None, None
            frag.round = [c for c in frag.round if not self.bus.is_applied(c.announcement.contribution_id)]
        return heads

    def _reconcile(self) -> None:
        """After Redis was unreachable or restarted: it may have forgotten its last writes, commits
        included (a host crash with the AOF synced once a second, a failover to a lagging replica, a
        restore from a snapshot). S3 is the truth: before anything more is read or merged, every
        manifest in S3 above a Redis head is committed again, with its contributions applied and
        their entries acknowledged, so that a forgotten commit is neither merged twice nor left
        behind a head that moved back. Redis that came back empty is rebuilt instead."""
        if self.bus.wiped():
            self._rebuild()
        else:
            behind = {f: h for f, h in self.bus.heads().items() if f in self.fragments and h < self.fragments[f].head}
            if behind:
                log.warning("Redis forgot commits (heads %s, S3 has %s): committing them again from S3", behind,
                            {f: self.fragments[f].head for f in behind})
            self._roll_forward()
        self._reconcile_due = False

    def _outage_noticed(self) -> None:
        """Bring Redis up to S3 again at once, and sweep for lost announcements once every
        announcement that survived has been read again."""
        if self._outage_at is None:
            self._outage_at = time.time()
        self._drained = False
        self._reconcile_due = True

    def _server_run_id(self) -> str | None:
        """The Redis server's run id, or None where INFO is not allowed (an ACL without @dangerous):
        restarts are then noticed only by failed commands."""
        try:
            return self.bus.server_run_id()
        except ConfigError as exc:
            log.warning("cannot notice short Redis restarts by the server's run id: %s", exc)
            return None

    def _notice_restart(self) -> None:
        """A Redis restart can be too short for any command to fail (the adapter retries): notice it
        by the server's run id, so that the sweep for lost announcements runs after it too."""
        if self._redis_run_id is None:
            return
        run_id = self.bus.server_run_id()
        if run_id != self._redis_run_id:
            log.warning("Redis restarted (server run id changed): looking for announcements it lost")
            self._outage_noticed()
        self._redis_run_id = run_id

    def _sweep_after_outage(self, outage_at: float) -> None:
        """Redis came back with its data, but it may have lost its last writes (append-only file synced
        once a second): an announcement a learner made just before the crash is then gone, while its
        object is in S3. Once every surviving announcement has been read, announce again the objects
        stored before the outage was noticed that nothing accounts for. If Redis came back empty, rebuild."""
        if self.bus.wiped():
            self._rebuild()
            return
        again = self._announce_lost(self._heads(), before=outage_at)
        self.bus.incr("outage_sweeps")
        log.info("after the Redis outage: %d lost announcement(s) found in S3 and made again", again)

    def _heads(self) -> dict[int, int]:
        return {f: frag.head for f, frag in self.fragments.items() if frag.head >= 0}

    def _announce_lost(self, heads: dict[int, int], before: float | None = None) -> int:
        """Announce again the recent contribution objects that no manifest, open round or pending
        refusal accounts for (`coordinator.recovery`); only those stored before `before` if given."""
        known = {c.announcement.object_key for f in self.fragments.values() for c in f.round}
        known |= {r.object_key for f in self.fragments.values() for r in f.refused}
        known |= {r.object_key for r in self._unplaced}
        again, unreadable = reannounce_lost(self.store, self.bus, heads, known=known,
                                            keep=self.round_cfg.max_staleness + 1,
                                            max_bytes=self.spec.max_object_bytes, before=before, fragments=self.owned)
        self._read_pending = True
        self.bus.incr("reannounced_from_s3", again)
        self.bus.incr("unreadable_in_s3", unreadable)
        return again

    def step(self, block_ms: int = 0) -> None:
        """One iteration: read what arrived, merge every round that is due, and end the run once it is over."""
        try:
            self._step(block_ms)
        except GroupGone as exc:
            self._group_gone(exc)

    def _group_gone(self, exc: GroupGone) -> None:
        """Our consumer group was dropped: by a coordinator of another number of shards, which fenced this
        one (Fenced), or by hand (made again: whatever it had not dealt with is read again)."""
        current = self.bus.epoch()
        if current is not None and current != self.epoch:
            self.leadership.deposed()
            raise Fenced(f"another coordinator holds {self.shard} of run {self.spec.run!r} (epoch {current}, "
                         f"ours {self.epoch}): {exc}") from None
        log.warning("%s: making it again", exc)
        self.bus.ensure_group()
        self._read_pending = True

    def _step(self, block_ms: int) -> None:
        with self.timing("read"):
            # The learners before the read: one seen finished here announced its final pieces before,
            # so a read that takes in everything up to now has them all.
            # A large fleet is read once in a while (`FleetView.read_if_due`): None when not this step.
            fleet = self.view.read_if_due()
            count = self._read_count()
            if self._read_pending:
                entries = self.bus.read_announcements(self.config.consumer, pending=True, count=count)
                self._read_pending = len(entries) == count
                complete = False
            else:
                entries = self.bus.read_announcements(self.config.consumer, block_ms=block_ms, count=count)
                complete = len(entries) < count
        self._drained = not entries and not self._read_pending
        retry, self._retry = self._retry, []
        self._intake(list(entries) + retry)
        complete = complete and not self._retry
        if fleet is not None:
            self._see_fleet(fleet, complete, self.view.read())
        with self.timing("read"):
            if self.spec.cadence == "clock" and time.monotonic() - self._last_cadence_check > 1.0 and self.shard.leads:
                self._tend_cadence()
        for fragment, frag in self.fragments.items():
            if frag.round:
                self._maybe_merge(fragment, frag)
        if self.ended is None and fleet is not None and self.shard.leads:
            self._maybe_end(fleet, complete)

    def _follow_leader(self) -> None:
        """A shard other than 0 takes the round clock and the run's end from Redis, where shard 0 keeps them."""
        self.cadence = self.bus.cadence() or self.cadence
        self._clock_offset_s = self.bus.server_time() - time.time()
        if self.ended is None and (end := self.bus.run_end()) is not None:
            self.ended = end
            log.info("run %s was ended by shard 0: %s", self.spec.run, end.reason)

    def _see_fleet(self, fleet: Fleet, complete: bool, now: Fleet) -> None:
        """Take in a fleet read (`FleetView.see`): the learners of the fragments' recent rounds are
        known, and a live learner silent for max_silent_rounds periods is no longer waited for."""
        patience_s = self.round_cfg.max_silent_rounds * self.cadence.period_s if self.cadence else 0.0
        known = frozenset(c.learner for f in self.fragments.values() for r in f.claims for c in r)
        self.view.see(fleet, complete, now, at=self.now(), known=known, patience_s=patience_s)
        self.metrics.fleet(now)

    def _merged_tokens(self, fragment: int, frag: Fragment) -> int:
        """The tokens merged into `fragment` up to its head (`Manifest.merged_tokens`)."""
        if frag.merged_tokens is None:
            frag.merged_tokens = (read_manifest(self.store, self.keys, fragment, frag.head).merged_tokens
                                  if frag.head >= 0 else 0)
        return frag.merged_tokens

    def _all_merged_tokens(self) -> dict[int, int]:
        """The tokens merged into every fragment of the run: this shard's own, and the other shards' from
        the manifests of their heads in Redis (read once per head)."""
        merged = {f: self._merged_tokens(f, frag) for f, frag in self.fragments.items()}
        for f, head in self.bus.heads().items():
            if f not in merged and 0 <= f < self.spec.num_fragments:
                if (f, head) not in self._others_tokens:
                    self._others_tokens = {k: v for k, v in self._others_tokens.items() if k[0] != f}
                    self._others_tokens[(f, head)] = read_manifest(self.store, self.keys, f, head).merged_tokens
                merged[f] = self._others_tokens[(f, head)]
        return {f: merged.get(f, 0) for f in range(self.spec.num_fragments)}

    def _maybe_end(self, fleet: Fleet, complete: bool) -> None:
        """Finish the run once `policy.run_end` says it is over and no announcement is pending in the
        stream either (none left to another consumer), or once every fragment has merged the token
        budget (`policy.budget_spent`; what is in flight is not merged then)."""
        if self.config.token_budget > 0:
            spent = budget_spent(self._all_merged_tokens(), self.config.token_budget)
            if spent is not None:
                self._end("budget", spent)
                return
        pending = sum(len(f.round) for f in self.fragments.values()) + len(self._retry) + int(not complete)
        asked = fleet.finish_request
        over = run_end(joined=fleet.joined, live=fleet.live, finished=fleet.finished,
                       asked_by=asked.by if asked else None, pending=pending, gone=fleet.gone)
        if over is not None and self.bus.pending_count() == 0:
            self._end(*over)

    def _end(self, by: str, reason: str) -> None:
        """Mark the run finished: `finished.msgpack` (create-only: S3 is the truth), then its copy in
        Redis, fenced by our epoch. A coordinator that was deposed a moment ago must not end the run
        at its stale heads: it checks its epoch first."""
        current = self.bus.epoch()
        if current is None:
            return  # Redis lost its data: the loop rebuilds it, then the run ends on a later step
        if current != self.epoch:
            self.leadership.deposed()
            raise Fenced(f"another coordinator holds run {self.spec.run!r} (epoch {current}, ours {self.epoch})")
        # The other shards' heads are Redis's: nothing is pending in any shard's group (`_maybe_end`), so
        # each committed its last round, the head and the acknowledgements in one script.
        heads = {**self.bus.heads(), **{f: frag.head for f, frag in self.fragments.items()}}
        end = RunEnd(run=self.spec.run, finished_at=self.now(), by=by, reason=reason,
                     versions=tuple(heads.get(f, -1) for f in range(self.spec.num_fragments)), epoch=self.epoch)
        try:
            self.store.put(self.keys.finished_record(), end.to_wire(), create_only=True)
        except Conflict:
            stored = read_run_end(self.store, self.keys)  # a predecessor ended it just before it stopped
            assert stored is not None
            end = stored
        if not self.bus.set_run_end(end, self.epoch):
            self.leadership.deposed()
            raise Fenced(f"another coordinator took run {self.spec.run!r} over while this one ended it")
        self.ended = end
        log.info("run %s finished: %s; final versions %s", self.spec.run, end.reason,
                 {f: v for f, v in enumerate(end.versions)})

    def _read_count(self) -> int:
        """Announcements per read: as many of the largest fragment as `read_batch_bytes` holds, 1 to
        MAX_READ. Worked out once the layout is known (it is fixed for the life of a run)."""
        if self.layout is None:
            return MAX_READ
        if self._read_batch is None:
            largest = max(self.layout.fragment_bytes(f) for f in range(len(self.layout.fragments)))
            self._read_batch = max(1, min(MAX_READ, self.config.read_batch_bytes // largest))
        return self._read_batch

    def now(self) -> float:
        """Redis server time (unix seconds): the clock that arrivals, deadlines and decisions share."""
        return time.time() + self._clock_offset_s

    def _block_ms(self) -> int:
        wakes = [f.wake_at for f in self.fragments.values() if f.round and f.wake_at is not None]
        if not wakes:
            return 1000
        return max(0, min(1000, int((min(wakes) - self.now()) * 1000)))

    def _tend_cadence(self) -> None:
        """Publish the round clock: a fixed period, or H steps of the fastest live learner (re-set
        by `next_cadence` only when that moves by more than 30% slower or 10% faster, keeping the phase)."""
        self._last_cadence_check = time.monotonic()
        self._clock_offset_s = self.bus.server_time() - time.time()
        period = self.config.round_s
        if period <= 0:
            names = self.view.clock_sample(CLOCK_SAMPLE)
            steps = [s.step_time_s for s in self.bus.learner_stats(names).values() if s.step_time_s > 0]
            if not steps:
                return
            fastest = fastest_plausible(steps, self.round_cfg.max_claim_ratio)
            if fastest is None:
                return
            period = max(self.config.min_round_s, self.spec.sync_every * fastest)
        cadence = next_cadence(self.cadence, period, self.now(), self.spec.num_fragments)
        if cadence is None:
            return
        self.cadence = cadence
        self.bus.set_cadence(cadence)
        log.info("round clock: a round every %.2fs per fragment (%s)", period,
                 "fixed" if self.config.round_s > 0 else f"{self.spec.sync_every} steps of the fastest learner")

    # ---- intake ------------------------------------------------------------------------------
    def _mine(self, item: Announcement | Refused) -> bool:
        """Whether this shard deals with an entry: one for a fragment it owns; shard 0 also refuses the
        ones that name no fragment of the run or do not decode."""
        if isinstance(item, Refused) or not 0 <= item.fragment < self.spec.num_fragments:
            return self.shard.leads
        return self.shard.owns(item.fragment)

    def _intake(self, entries: list) -> None:
        to_fetch: list[tuple[str, Announcement]] = []
        foreign: list[str] = []
        seen = {c.announcement.contribution_id for f in self.fragments.values() for c in f.round}
        held = {c.entry_id for f in self.fragments.values() for c in f.round}
        with self.timing("check"):
            ids = [item.contribution_id for _, item in entries if not isinstance(item, Refused)]
            # Applied: what Redis says, and what this process committed (in S3, whatever Redis forgot).
            ours = set().union(*(c for frag in self.fragments.values() for c in frag.committed))
            applied = self.bus.applied_among(ids) | (ours & set(ids))
            for entry_id, item in entries:
                if entry_id in held:
                    # The same entry again (the re-read of our pending entries after a restart or a
                    # Redis outage, a claim) while its contribution waits in an open round or in this
                    # batch: not a duplicate to refuse and acknowledge, which would leave the
                    # contribution in memory only. It stays pending until its round commits.
                    continue
                held.add(entry_id)
                if not self._mine(item):
                    foreign.append(entry_id)
                    continue
                if isinstance(item, Refused):
                    self._refuse(entry_id, None, item)
                    continue
                if item.kind == "genesis" and self.fragments.get(item.fragment, Fragment(-1)).head >= 0:
                    self._superseded(entry_id, item)
                    continue
                try:
                    self._check(item, seen, applied)
                except Refused as exc:
                    if exc.code == "duplicate" and (item.recovered or item.contribution_id in self._recovered):
                        self._repeated(entry_id, item)
                    elif exc.code == "future_base" and self._behind(item):
                        pass  # left pending: read again once this process has caught up
                    else:
                        self._refuse(entry_id, item, exc)
                    continue
                seen.add(item.contribution_id)
                if item.recovered:
                    self._recovered[item.contribution_id] = None
                    while len(self._recovered) > MAX_RECOVERED_IDS:
                        del self._recovered[next(iter(self._recovered))]
                to_fetch.append((entry_id, item))
            self.bus.ack(foreign)  # another shard's: it reads them through its own group
        futures = [(eid, a, self._pool.submit(self._fetch, a)) for eid, a in to_fetch]
        for entry_id, a, future in futures:
            try:
                with self.timing("fetch_wait"):
                    fetched = future.result()
            except Refused as exc:
                self._refuse(entry_id, a, exc)
                continue
            except StorageUnavailable as exc:
                log.warning("S3 unavailable reading %s, will retry: %s", a.object_key, exc)
                self._retry.append((entry_id, a))
                continue
            except Exception as exc:  # noqa: BLE001
                # Whatever one learner's object does, the coordinator goes on: refused, logged with
                # its traceback; every later coordinator would otherwise die on the same entry.
                log.exception("reading %s from %s failed unexpectedly", a.object_key, a.learner)
                self._refuse(entry_id, a, Refused("unreadable_object", f"{a.object_key} could not be read: "
                                                  f"{type(exc).__name__}: {exc}"))
                continue
            if a.kind == "genesis":
                self._genesis(entry_id, a, fetched)
            else:
                blob, norm = fetched
                now = self.now()
                arrival = to_arrival(a, now)
                arrival = replace(arrival, norm=norm, deadline=plausible_deadline(
                    arrival.deadline, now=now, cadence=self.cadence, fragment=a.fragment,
                    num_fragments=self.spec.num_fragments, final=a.final))
                self.view.sent(a.learner, now)
                self.fragments[a.fragment].round.append(PendingDelta(entry_id, a, arrival, blob))
            self.metrics.accepted(a)

    def _behind(self, a: Announcement) -> bool:
        """A base ahead of our head is a version this process has not seen: forged, or published by
        a coordinator that took the run over (raises Fenced), or committed again from S3 since.
        True (and Redis is brought up to S3 before reading on) if Redis's head has it."""
        current = self.bus.epoch()
        if current is not None and current != self.epoch:
            self.leadership.deposed()
            raise Fenced(f"another coordinator holds run {self.spec.run!r} (epoch {current}, ours {self.epoch}): "
                         f"{a.learner} sent a piece based on its version {a.base_version} of fragment {a.fragment}")
        if self.bus.heads().get(a.fragment, -1) < a.base_version:
            return False
        self._reconcile_due = self._read_pending = True
        return True

    def _check(self, a: Announcement, seen: set[str], applied: set[str]) -> None:
        """Refuse a duplicate (`seen` in an open round or this batch, or `applied`), then whatever
        `check_announcement` refuses."""
        if a.contribution_id in seen or a.contribution_id in applied:
            where = "is already in an open round" if a.contribution_id in seen else "was applied in a committed version"
            raise Refused("duplicate", f"contribution {a.contribution_id} from {a.learner} {where}: this is "
                          "the same announcement delivered again, and it is applied at most once")
        if self.ended is not None:
            raise Refused("run_finished", f"run {self.spec.run!r} is finished ({self.ended.reason}): nothing is "
                          f"merged after its final versions {list(self.ended.versions)}")
        frag = self.fragments.get(a.fragment)
        head = None if frag is None or frag.head < 0 else frag.head
        check_announcement(a, spec=self.spec, keys=self.keys, head=head, cfg=self.round_cfg)

    def _fetch(self, a: Announcement) -> dict[str, torch.Tensor] | tuple[bytes, float]:
        """A genesis proposal's tensors (published as it arrives), or a delta's checked object, which
        waits in its round as it travelled (`PendingDelta.blob`), and its norm."""
        layout = self.layout
        if a.kind == "genesis" and layout is None:
            layout = self._adopt_layout(a.learner)
        assert layout is not None
        fetch = fetch_tensors if a.kind == "genesis" else fetch_checked
        return fetch(self.store, a, layout, self.spec.max_object_bytes, codec=self.spec.codec, timed=self.timing)

    def _adopt_layout(self, learner: str) -> Layout:
        """The first genesis fixes the run's layout (create-only: concurrent proposals, one winner)."""
        try:
            blob = self.store.get(self.keys.genesis_layout(learner), max_bytes=MAX_RECORD_BYTES)
        except ObjectMissing:
            raise Refused("missing_object", f"{learner} proposed version 0 but its layout "
                          f"{self.keys.genesis_layout(learner)} does not exist") from None
        proposed = Layout.from_wire(blob)
        if len(proposed.fragments) != self.spec.num_fragments:
            raise Refused("bad_layout", f"{learner} proposed {len(proposed.fragments)} fragments, "
                          f"run {self.spec.run!r} has {self.spec.num_fragments}")
        try:
            self.store.put(self.keys.layout(), proposed.to_wire(), create_only=True)
        except Conflict:
            pass
        layout = read_layout(self.store, self.keys)
        assert layout is not None
        self.layout = layout
        return layout

    def _repeated(self, entry_id: str, a: Announcement) -> None:
        """The second copy of a contribution that was announced again from S3 (`recovery`): the learner's
        announcement was late, not lost. Not an error: acknowledged and counted, merged once."""
        log.info("contribution %s from %s: announced by the learner and again from S3; the second copy is "
                 "acknowledged", a.contribution_id, a.learner)
        self.bus.ack([entry_id])
        self.bus.incr("repeated_after_recovery")
        self.metrics.repeated()

    def _superseded(self, entry_id: str, a: Announcement) -> None:
        """A genesis proposal for a fragment that already has version 0: not an error, not a contribution."""
        log.info("fragment %d already has a version; %s's initial parameters are not needed", a.fragment, a.learner)
        self.bus.ack([entry_id])
        self.bus.incr("genesis_superseded")

    def _refuse(self, entry_id: str | None, a: Announcement | None, exc: Refused) -> None:
        """Record a refusal (stream, counters, ack) and list it in the next manifest: its fragment's,
        or the next one committed if the entry names no fragment of this run."""
        refusal = Refusal(contribution_id=a.contribution_id if a else "", learner=a.learner if a else "",
                          object_key=_clip(a.object_key, MAX_KEY_CHARS) if a else "",
                          code=exc.code, reason=_clip(exc.reason, MAX_REASON_CHARS))
        log.warning("refused %s from %s (entry %s): %s", exc.code, refusal.learner or "?", entry_id, refusal.reason)
        self.bus.refuse(entry_id, refusal)
        self.metrics.refused(exc.code, a.fragment if a is not None else None)
        if self.ended is not None:
            return  # no manifest follows the end: the refusals stream and the counters keep it
        frag = self.fragments.get(a.fragment) if a is not None else None
        (frag.refused if frag is not None else self._unplaced).append(refusal)

    # ---- merging -----------------------------------------------------------------------------
    def _genesis(self, entry_id: str, a: Announcement, tensors: dict[str, torch.Tensor]) -> None:
        frag = self.fragments[a.fragment]
        if frag.head >= 0:
            self._superseded(entry_id, a)
            return
        c = PendingDelta(entry_id, a, to_arrival(a, self.now()))
        self._publish(a.fragment, frag, [c], [1.0], tensors, NesterovState(), self._settings("genesis"), [c.arrival])

    def _maybe_merge(self, fragment: int, frag: Fragment) -> None:
        arrivals = tuple(c.arrival for c in frag.round)
        # The fleet is the live learners and those with a piece in the round: one that sent its piece
        # and left (its lease gone) must not stand in for one still live whose piece is on its way.
        arrived = {a.learner for a in arrivals}
        gone = {a.learner for a in arrivals if a.final} | (arrived & self.view.finished)
        live = len((self.view.waited | arrived) - gone)
        state = RoundState(fragment=fragment, head_version=frag.head, arrivals=arrivals, live_learners=live,
                           sync_time_s=self.sync_time_s, period_s=self.cadence.period_s if self.cadence else 0.0,
                           merged_deadline=frag.merged_deadline, finished=self.view.finished,
                           finish_asked=self.view.finish_asked is not None)
        decision = decide_round(self.now(), state, self.round_cfg)
        frag.wake_at = decision.wake_at
        if decision.reason != frag.last_reason:
            log.debug("fragment %d: %s", fragment, decision.reason)
            frag.last_reason = decision.reason
        cap = self._round_cap(fragment)
        if not decision.merge and len(frag.round) < cap:
            return
        reason = decision.reason if decision.merge else (
            f"merge: the round holds {len(frag.round)} pieces, as many as it may ({cap}: --max-round-bytes over "
            f"the fragment's size, at most {MAX_ROUND_PIECES}); the earliest {cap} merge, the rest wait")
        log.info("fragment %d v%d: %s", fragment, frag.head + 1, reason)
        self.metrics.round_closed(state, self.round_cfg, self.now())
        with self.timing("load"):
            self._ensure_loaded(fragment, frag)
        crash_point("fetched")
        assert frag.params is not None and frag.state is not None
        senders = usual_fleet(self.view.waited - gone, arrived=frozenset(arrived), sent=self.view.last_piece,
                              merged=frozenset(c.learner for r in frag.claims for c in r) | frag.pieces.keys(),
                              finished=self.view.finished)
        while frag.round:
            started = time.monotonic()
            taking = sorted(frag.round, key=lambda c: (c.arrival.arrived_at, c.entry_id))[:cap]
            # Each piece as the merge counts it: one learner's claims bounded by the others' (`influence`).
            counted = count_claims([c.arrival for c in taking], frag.claims,
                                   self.round_cfg.max_claim_ratio)
            notes = {a.contribution_id: note for a, note in counted if note}
            ordered = merge_order(tuple(a for a, _ in counted))
            by_id = {c.announcement.contribution_id: c for c in taking}
            contributions = [by_id[a.contribution_id] for a in ordered]
            # ... and how far they move the model: one learner's pieces together by the others' norms.
            clips = clip_norms(ordered, frag.claims, self.round_cfg.max_norm_ratio)
            for a in ordered:
                if clips[a.learner][1]:
                    notes[a.contribution_id] = "; ".join(n for n in (notes.get(a.contribution_id), clips[a.learner][1]) if n)
            usual, interval = self._usual_pieces(frag, senders)
            rate = max(usual.values(), default=0) if interval > 0 else 0
            weights = [w * clips[a.learner][0] for w, a in
                       zip(merge_weights(ordered, frag.head, self.round_cfg, usual, rate), ordered, strict=True)]
            published, settings = self._step_round(fragment, frag, contributions, weights, ordered, usual, interval,
                                                   rate)
            self.metrics.merged(fragment, time.monotonic() - started)
            if published is not None:
                for cid, note in notes.items():
                    log.warning("fragment %d: %s's piece %s bounded: %s", fragment, by_id[cid].announcement.learner,
                                cid, note)
                params, state, blob = published
                # The parent is not needed any more, unless this publish fails before its manifest is
                # written: then the next merge reads it again from S3 (`_ensure_loaded`). Meanwhile its
                # params, momentum and residual are three fragments' worth of memory less.
                frag.params = frag.state = None
                self._publish(fragment, frag, contributions, weights, params, state, settings, ordered, notes,
                              update=blob, clips={g: c for g, (c, _) in clips.items()}, usual=usual)
                return
            self._refuse_overflow(fragment, frag, contributions)

    def _usual_pieces(self, frag: Fragment, fleet: frozenset[str]) -> tuple[dict[str, int], int]:
        """Each learner of the `fleet` of live learners that send pieces with its usual piece
        (`policy.usual_pieces`), and the interval of steps that makes a whole one (H; the fleet's rate,
        `policy.merge_weights`, is its fastest learner's usual piece). ({}, 0) when rounds are not
        scaled; an interval of 0 when the clock has a fixed period (`round_s`: each learner counts 1)."""
        if not self.config.scale_rounds:
            return {}, 0
        interval = self.spec.sync_every if self.config.round_s <= 0 else 0
        finished = {n: p for n, p in frag.pieces.items() if n in self.view.finished}
        usual = usual_pieces(fleet, frag.claims, interval, finished)
        frag.pieces |= {c.learner: usual[c.learner] for r in frag.claims for c in r
                        if c.learner in usual and c.learner not in self.view.finished}
        return usual, interval

    def _step_round(self, fragment: int, frag: Fragment, contributions: list[PendingDelta], weights: list[float],
                    ordered: tuple[Arrival, ...], usual: dict[str, int], interval: int, rate: int
                    ) -> tuple[tuple[dict[str, torch.Tensor], NesterovState, bytes | None] | None, VersionSettings]:
        """Merge the round's pieces (in merge order, with their weights), take the outer step (scaled
        against the round's usual size for the fleet's `usual` pieces, `_usual_pieces`) and the
        downstream step: the version's params, outer state and update object (None if the step
        overflowed float32), and the settings its manifest records. These configure the merge itself:
        a replay's `apply_round` runs the same merge, scale and outer step from them.

        Each whole-fragment temporary goes as soon as it has been used, not at the end of the round:
        each piece once added to the sum (the merge decodes them one at a time, `_Pieces`), the
        merged update once stepped with, the outer step's exact result when this returns."""
        settings = replace(self._settings("delta"), rate_steps=rate)
        with self.timing("merge"):
            update = round_delta(self._pieces(fragment, contributions), weights, settings)
            if self.config.scale_rounds:
                norm = update_norm(update)
                step = round_step(round_size(ordered, norm), frag.recent, usual, interval)
                settings = replace(settings, round_scale=step.scale, progress=step.progress, update_norm=norm)
                update = scale_update(update, step.scale)
        with self.timing("outer"):
            target, state = outer_step(frag.params, frag.state, update, settings)
            del update
            return self._downstream(fragment, frag, target, state, settings), settings

    def _pieces(self, fragment: int, contributions: list[PendingDelta]) -> _Pieces:
        """The pieces' deltas, decoded as they are read (`intake.decode_piece`)."""
        layout, limit = self.layout, self.spec.max_object_bytes
        assert layout is not None
        return _Pieces([c.blob for c in contributions], lambda blob: decode_piece(blob, layout, fragment, limit))

    def _downstream(self, fragment: int, frag: Fragment, target: dict[str, torch.Tensor], state: NesterovState,
                    settings: VersionSettings) -> tuple[dict[str, torch.Tensor], NesterovState, bytes | None] | None:
        """The params the round publishes and its update object (`outer.downstream_step`); None if the
        outer step overflowed float32."""
        if not (_finite(target) and _finite(state.momentum)):
            return None
        meta = {"run": self.spec.run, "fragment": fragment, "version": frag.head + 1}
        try:
            return downstream_step(frag.params, target, state, settings, compress=self.spec.compress, meta=meta)
        except Refused:
            return None

    def _round_cap(self, fragment: int) -> int:
        """The most pieces a round of `fragment` holds before it merges: as many decoded deltas as
        `max_round_bytes` holds, at most MAX_ROUND_PIECES (so that its manifest stays small). The
        round holds them compressed and decodes one at a time: the bound is a generous one."""
        if self.layout is None:
            return MAX_ROUND_PIECES
        return max(1, min(MAX_ROUND_PIECES, self.config.max_round_bytes // max(1, self.layout.fragment_bytes(fragment))))

    def _refuse_overflow(self, fragment: int, frag: Fragment, contributions: list[PendingDelta]) -> None:
        """Each delta is finite, yet the outer step overflowed float32: refuse the largest one (the
        first in merge order on a tie) and let the others merge without it."""
        largest = [_absmax(delta) for delta in self._pieces(fragment, contributions)]  # one decoded at a time
        culprit, absmax = max(zip(contributions, largest), key=lambda pair: pair[1])
        frag.round = [c for c in frag.round if c is not culprit]
        a = culprit.announcement
        self._refuse(culprit.entry_id, a, Refused(
            "non_finite", f"{a.object_key}: merging it into fragment {fragment} version {frag.head} overflows "
            f"float32 (its largest |value| is {absmax:.3g}): the learner has likely diverged"))

    def _adopt_written(self, fragment: int, frag: Fragment, version: int) -> None:
        """The manifest of `version` exists already: a deposed coordinator wrote it just before its
        commit was fenced. It is committed (S3 is the truth): commit it in Redis with our epoch,
        start from it, and keep only the round's contributions it did not merge."""
        manifest = read_manifest(self.store, self.keys, fragment, version)
        log.warning("fragment %d version %d was written by the coordinator of epoch %d: adopting it", fragment,
                    version, manifest.epoch)
        commit_existing(self.bus, manifest, epoch=self.epoch, keep_applied=self._keep_applied)
        merged = {c.contribution_id for c in manifest.inputs}
        frag.round = [c for c in frag.round if c.announcement.contribution_id not in merged]
        frag.head, frag.params, frag.state, frag.wake_at = version, None, None, None
        frag.merged_tokens = manifest.merged_tokens
        self.bus.incr("versions_adopted")

    def _ensure_loaded(self, fragment: int, frag: Fragment) -> None:
        if frag.params is not None:
            return
        assert self.layout is not None
        manifest = read_manifest(self.store, self.keys, fragment, frag.head)
        frag.params = read_params(self.store, self.layout, manifest)
        limit = 2 * self.layout.fragment_bytes(fragment) + (1 << 20)
        frag.state = decode_state(read_verified(self.store, manifest.outer_state_key, manifest.outer_state_sha256,
                                                max_bytes=limit), limit)
        if not frag.recent:
            self._load_recent(fragment, frag, manifest)

    def _load_recent(self, fragment: int, frag: Fragment, head: Manifest | None = None) -> None:
        """The fragment's last RECENT_ROUNDS merged rounds and their claims, oldest first, from their
        manifests, and when their learners last sent: a restarted or standby coordinator scales
        rounds, counts claims and knows which of its fleet send pieces as its predecessor did."""
        rounds: list[RoundSize] = []
        claims: list[tuple[Claim, ...]] = []
        manifest = head if head is not None or frag.head < 1 else read_manifest(self.store, self.keys, fragment,
                                                                                  frag.head)
        while manifest is not None and manifest.settings.kind == "delta" and len(rounds) < RECENT_ROUNDS:
            rounds.append(round_size(manifest.inputs, manifest.settings.update_norm))
            claims.append(tuple(Claim(c.learner, c.tokens, c.steps, c.norm) for c in manifest.inputs))
            for c in manifest.inputs:
                self.view.sent(c.learner, manifest.committed_at)
            previous = manifest.version - 1
            manifest = read_manifest(self.store, self.keys, fragment, previous) if previous > 0 else None
        frag.recent, frag.claims = rounds[::-1], claims[::-1]

    def _settings(self, kind: str) -> VersionSettings:
        """What the manifest of a version of this `kind` records, and what its merge is configured by."""
        return self.config.settings(self.round_cfg, kind, self.spec.codec)

    def _publish(self, fragment: int, frag: Fragment, contributions: list[PendingDelta], weights: list[float],
                 params: dict[str, torch.Tensor], state: NesterovState, settings: VersionSettings, counted: list[Arrival],
                 notes: dict[str, str] | None = None, update: bytes | None = None,
                 clips: dict[str, float] | None = None, usual: dict[str, int] | None = None) -> None:
        """Write and commit the next version of `fragment` from `contributions` (in merge order, each
        with its weight and its `counted` arrival: the tokens and steps it weighed by, and its norm;
        `clips`: what each learner's pieces were scaled by; `usual`: each learner's usual piece, when
        the weights were raised to the fleet's rate)."""
        t0 = time.monotonic()
        version = frag.head + 1
        notes, clips = notes or {}, clips or {}
        inputs = tuple(
            Contribution(contribution_id=c.announcement.contribution_id, learner=c.announcement.learner,
                  seq=c.announcement.seq, object_key=c.announcement.object_key, sha256=c.announcement.sha256,
                  base_version=c.announcement.base_version,
                  staleness=staleness_verdict(c.announcement.base_version, frag.head, self.round_cfg)[1]
                  if c.announcement.kind == "delta" else 0,
                  tokens=n.tokens, steps=n.steps, weight=w, stream_id=c.entry_id,
                  bounded=notes.get(c.announcement.contribution_id, ""), norm=n.norm,
                  clip=clips.get(n.learner, 1.0), usual=(usual or {}).get(n.learner, 0) if settings.rate_steps else 0)
            for c, w, n in zip(contributions, weights, counted, strict=True))
        refused = listed_refusals([*frag.refused, *self._unplaced], self.config.max_refusals_listed)
        merged_tokens = self._merged_tokens(fragment, frag) + sum(c.tokens for c in inputs)
        try:
            manifest = write_version(self.store, self.keys, fragment=fragment, version=version, params=params,
                                     state=state, inputs=inputs, refused=refused, settings=settings,
                                     epoch=self.epoch, timed=self.timing, update=update, merged_tokens=merged_tokens)
        except Conflict:
            self._adopt_written(fragment, frag, version)
            return
        with self.timing("commit"):
            result = commit(self.bus, manifest, epoch=self.epoch, ack_ids=[c.entry_id for c in contributions],
                            keep_applied=self._keep_applied)
        crash_point("committed")
        if result is CommitResult.WIPED:
            self._rebuild()  # rolls our manifest forward: it is the latest in S3
        elif result is CommitResult.FENCED:
            self.leadership.deposed()
            raise Fenced(f"commit of fragment {fragment} version {version} refused: another coordinator holds "
                         f"run {self.spec.run!r} now (this one had epoch {self.epoch})")
        elif result is CommitResult.HEAD_MOVED and self.bus.heads().get(fragment, -1) < frag.head:
            # Redis forgot commits (restored from an older snapshot, failed over to a lagging replica)
            # before this process noticed it restarted: bring it up to S3, our manifest included.
            log.warning("commit of fragment %d version %d: Redis's head is behind ours, it forgot commits: "
                        "committing them again from S3", fragment, version)
            self._outage_noticed()
            self._reconcile()
            if self.bus.heads().get(fragment) != version:
                raise Fenced(f"commit of fragment {fragment} version {version}: Redis's head is "
                             f"{self.bus.heads().get(fragment)} after committing the manifests in S3")
        elif result not in (CommitResult.COMMITTED, CommitResult.ALREADY):
            raise Fenced(f"commit of fragment {fragment} version {version} refused by Redis: {result.name}")
        merged = {c.announcement.contribution_id for c in contributions}
        frag.round = [c for c in frag.round if c.announcement.contribution_id not in merged]
        frag.refused, self._unplaced = [], []
        frag.merged_deadline = served_deadline(frag.merged_deadline, counted)
        if manifest.settings.kind == "delta":
            frag.recent = [*frag.recent, round_size(counted, manifest.settings.update_norm)][-RECENT_ROUNDS:]
            frag.claims = [*frag.claims, tuple(Claim(a.learner, a.tokens, a.steps, a.norm) for a in counted)
                           ][-RECENT_ROUNDS:]
        frag.committed = [*frag.committed, frozenset(merged)][-(self.round_cfg.max_staleness + 1):]
        frag.head, frag.params, frag.state, frag.wake_at = version, params, state, None
        frag.merged_tokens = manifest.merged_tokens
        elapsed = time.monotonic() - t0
        self.sync_time_s = elapsed if self.sync_time_s == 0 else 0.8 * self.sync_time_s + 0.2 * elapsed
        log.info("committed fragment %d version %d from %d contribution(s) in %.3fs", fragment, version,
                 len(contributions), elapsed)
        self.metrics.published(manifest, elapsed)


CLOCK_SAMPLE = 256
"""The most live learners whose stats the round clock reads each second (`Coordinator._tend_cadence`)."""

