"""The coordinator process: announcements in, verified rounds, merged versions out.

Loop: read announcements (own pending entries first after a restart) -> check and fetch each one
(in parallel; `intake.Intake`) -> add it to its fragment's round -> ask `decide_round` for every
open round -> merge the due ones (token-weighted, deterministic order) -> outer Nesterov step ->
publish (objects, manifest, fenced Redis commit; `rounds.Rounds`) -> once every learner has
finished, or an operator asked, and nothing is pending: the run's end. Redis that restarted or
lost its data is brought back up to S3 first (`recovery.Recovery`). The parts share one
`state.ShardState`; this module is the loop, the round clock and the run's end. Only the policy
functions decide; the loop and its parts do I/O.

An announcement leaves the pending list exactly once: acknowledged inside the commit of the
version that merged it, or acknowledged together with the record of its refusal. If S3 cannot be
read right now, the entry stays pending and is retried.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Generic, TypeVar

import redis

from diloco.coordinator.config import CoordinatorConfig, RunSettings, settings_differ
from diloco.coordinator.fleet_view import FleetView
from diloco.coordinator.influence import fastest_plausible
from diloco.coordinator.intake import Intake, fetch_pool
from diloco.coordinator.leadership import Fenced, Leadership
from diloco.coordinator.metrics import Metrics
from diloco.coordinator.policy import RoundConfig, budget_spent, link_bound_period, next_cadence, run_end
from diloco.coordinator.recovery import Recovery
from diloco.coordinator.rounds import Rounds
from diloco.coordinator.state import Fragment, ShardState
from diloco.coordinator.timing import PhaseTimes
from diloco.storage.bus import Bus, Fleet, GroupGone
from diloco.storage.crashpoints import crash_point
from diloco.storage.errors import ConfigError, Conflict, StorageUnavailable
from diloco.storage.history import read_layout, read_manifest, read_run_end, read_run_spec
from diloco.storage.keys import Shard
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Cadence, Layout, RunEnd, RunSpec
from diloco.storage.settings import Endpoints

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_READ = 256
"""The most announcements one read of the stream takes (`read_batch_bytes` may allow fewer)."""
TRIM_EVERY_S = 30.0
"""How often the coordinator drops the announcements it is done with (`Bus.trim_announcements`)."""


def recorded_end(store: ObjectStore, bus: Bus) -> RunEnd | None:
    """The run's end: S3's record; or Redis's, written to S3 now, when the coordinator that ended the
    run stopped between the two (`Coordinator._end` writes Redis first)."""
    end = read_run_end(store, bus.keys)
    if end is not None or (end := bus.run_end()) is None:
        return end
    try:
        store.put(bus.keys.finished_record(), end.to_wire(), create_only=True)
        log.warning("run %s: its end was in Redis only (the coordinator that ended it stopped before S3): "
                    "recorded in S3 now", bus.keys.run)
    except Conflict:
        end = read_run_end(store, bus.keys)
    return end


class _OfState(Generic[T]):
    """An attribute of the coordinator that is its `ShardState`'s, read-only."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, coordinator: Coordinator, owner: type | None = None) -> T:
        return getattr(coordinator.state, self.name)

    def __set__(self, coordinator: Coordinator, value: T) -> None:
        raise AttributeError(f"{self.name} is the coordinator's state's: set state.{self.name}")


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
        config = config or CoordinatorConfig()
        self._own_metrics = metrics is None
        self.metrics = metrics if metrics is not None else Metrics.start(config.metrics_port, run)
        shard = config.shard_of_run()
        self.bus = Bus(endpoints, run, shard)
        self.keys = self.bus.keys
        self.store = self.metrics.counting(ObjectStore(endpoints), self.keys)
        self.store.ensure_bucket()
        self.bus.ping()  # both servers answer before the run's settings are written
        self.spec = self._load_or_create(settings, resume=resume or settings is None)
        if shard.count > self.spec.num_fragments:
            raise ConfigError(f"run {run!r} has {self.spec.num_fragments} fragment(s): {shard.count} shards "
                              f"would leave some without any; use at most {self.spec.num_fragments}")
        # The grace window reasons about the learners' overlap: take tau from the run itself.
        round_cfg = replace(config.round, overlap_steps=self.spec.overlap_steps)
        self.leadership = Leadership(self.bus, self.store, config.lease_s)
        epoch = self.leadership.take(standby=config.standby, stop=stop or threading.Event())
        self.bus.ensure_group()
        self.state = ShardState(
            config=config, round_cfg=round_cfg, spec=self.spec, shard=shard, store=self.store, bus=self.bus,
            leadership=self.leadership, metrics=self.metrics, timing=PhaseTimes(),
            view=FleetView(self.bus, config.gone_after_s), epoch=epoch,
            fragments={f: Fragment(head=-1) for f in shard.fragments(self.spec.num_fragments)},
            layout=read_layout(self.store, self.keys),
            ended=recorded_end(self.store, self.bus), cadence=self.bus.cadence(),
            clock_offset_s=self.bus.server_time() - time.time())
        self.recovery = Recovery(self.state)
        self.recovery.roll_forward()  # Redis brought up to the manifests in S3, and the heads taken from it
        self._pool = fetch_pool(config.fetch_threads)
        self.rounds = Rounds(self.state, self.recovery, self._pool)
        self.intake = Intake(self.state, self.rounds, self.recovery, self._pool)
        for fragment, frag in self.fragments.items():
            self.rounds.load_recent(fragment, frag)
        if self.ended is not None and not self.bus.set_run_end(self.ended, epoch):
            raise Fenced(f"another coordinator took run {run!r} over while this one started")
        self.leadership.start_renewing()  # only now: a start-up that failed leaves the lease to lapse
        self._last_cadence_check = 0.0
        self._read_batch: int | None = None  # `_read_count`, once the layout is known
        self._others_tokens: dict[tuple[int, int], int] = {}
        """Merged tokens by (fragment, head) of the other shards' fragments (the leader's token budget)."""
        self.metrics.attach(self)
        log.info("coordinator %s of run %s%s: epoch %d, %d fragments, heads %s", self.leadership.holder, run,
                 f" ({shard})" if shard.count > 1 else "", epoch, self.spec.num_fragments,
                 {f: s.head for f, s in self.fragments.items()})

    # What the tests, the benchmarks and the metrics read: the state's, read-only.
    config = _OfState[CoordinatorConfig]()
    epoch = _OfState[int]()
    fragments = _OfState[dict[int, Fragment]]()
    layout = _OfState[Layout | None]()
    ended = _OfState[RunEnd | None]()
    cadence = _OfState[Cadence | None]()
    view = _OfState[FleetView]()
    timing = _OfState[PhaseTimes]()
    shard = _OfState[Shard]()
    round_cfg = _OfState[RoundConfig]()

    def now(self) -> float:
        """Redis server time (unix seconds): the clock that arrivals, deadlines and decisions share."""
        return self.state.now()

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
                    self.recovery.rebuild()
                if self.recovery.reconcile_due:
                    self.recovery.reconcile()
                if now - last_claim > self.config.claim_idle_s / 2:
                    try:
                        self.intake.take(self.bus.autoclaim(self.config.consumer,
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
                    self.recovery.notice_restart()
                    if not self.shard.leads:
                        self._follow_leader()
                    self.metrics.sample(self.bus, self.now())
                    last_restart_check = now
                self.recovery.sweep_if_due()
                if now - last_trim > TRIM_EVERY_S and self.recovery.outage_at is None and self.shard.leads:
                    self.bus.trim_announcements()
                    last_trim = now
            except (redis.RedisError, StorageUnavailable) as exc:
                # Pending entries stay pending and in-memory rounds stay open: resume when it answers.
                if isinstance(exc, redis.RedisError):
                    self.recovery.outage_noticed()
                log.warning("storage unavailable, retrying in 1s: %s", exc)
                stop.wait(1.0)

    def step(self, block_ms: int = 0) -> None:
        """One iteration: read what arrived, merge every round that is due, and end the run once it is over."""
        try:
            self._step(block_ms)
        except GroupGone as exc:
            self._group_gone(exc)

    def _group_gone(self, exc: GroupGone) -> None:
        """Our consumer group was dropped: by a coordinator of another number of shards, which fenced this
        one (Fenced), or by hand (made again: whatever it had not dealt with is read again)."""
        self.state.check_epoch(str(exc))
        log.warning("%s: making it again", exc)
        self.bus.ensure_group()
        self.state.read_pending = True

    def _step(self, block_ms: int) -> None:
        with self.timing("read"):
            # The learners before the read: one seen finished here announced its final pieces before,
            # so a read that takes in everything up to now has them all.
            # A large fleet is read once in a while (`FleetView.read_if_due`): None when not this step.
            fleet = self.view.read_if_due()
            count = self._read_count()
            if self.state.read_pending:
                entries = self.bus.read_announcements(self.config.consumer, pending=True, count=count)
                self.state.read_pending = len(entries) == count
                complete = False
            else:
                entries = self.bus.read_announcements(self.config.consumer, block_ms=block_ms, count=count)
                complete = len(entries) < count
        self.recovery.drained = not entries and not self.state.read_pending
        retry, self.intake.retry = self.intake.retry, []
        self.intake.take(list(entries) + retry)
        complete = complete and not self.intake.retry
        if fleet is not None:
            self._see_fleet(fleet, complete, self.view.read())
        with self.timing("read"):
            if self.spec.cadence == "clock" and time.monotonic() - self._last_cadence_check > 1.0 and self.shard.leads:
                self._tend_cadence()
        for fragment, frag in self.fragments.items():
            if frag.round:
                self.rounds.maybe_merge(fragment, frag)
        if self.ended is None and fleet is not None and self.shard.leads:
            self._maybe_end(fleet, complete)

    def _follow_leader(self) -> None:
        """A shard other than 0 takes the round clock and the run's end from Redis, where shard 0 keeps them."""
        self.state.cadence = self.bus.cadence() or self.cadence
        self.state.clock_offset_s = self.bus.server_time() - time.time()
        if self.ended is None and (end := self.bus.run_end()) is not None:
            self.state.ended = end
            log.info("run %s was ended by shard 0: %s", self.spec.run, end.reason)

    def _see_fleet(self, fleet: Fleet, complete: bool, now: Fleet) -> None:
        """Take in a fleet read (`FleetView.see`): the learners of the fragments' recent rounds are
        known, and a live learner silent for max_silent_rounds periods is no longer waited for."""
        patience_s = self.round_cfg.max_silent_rounds * self.cadence.period_s if self.cadence else 0.0
        known = frozenset(c.learner for f in self.fragments.values() for r in f.claims for c in r)
        self.view.see(fleet, complete, now, at=self.now(), known=known, patience_s=patience_s)
        self.metrics.fleet(now)

    def _all_merged_tokens(self) -> dict[int, int]:
        """The tokens merged into every fragment of the run: this shard's own, and the other shards' from
        the manifests of their heads in Redis (read once per head)."""
        merged = {f: self.state.merged_tokens(f) for f in self.fragments}
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
        pending = sum(len(f.round) for f in self.fragments.values()) + len(self.intake.retry) + int(not complete)
        asked = fleet.finish_request
        over = run_end(joined=fleet.joined, live=fleet.live, finished=fleet.finished,
                       asked_by=asked.by if asked else None, pending=pending, gone=fleet.gone)
        if over is not None and self.bus.pending_count() == 0:
            self._end(*over)

    def _end(self, by: str, reason: str) -> None:
        """Mark the run finished at the heads: first in Redis, atomically with the heads (a shard's
        commit lands before, in the end's versions, or is refused after: `Bus.end_at_heads`), then
        `finished.msgpack` (create-only: S3 is the truth). A coordinator that was deposed a moment
        ago must not end the run at its stale heads: the script checks its epoch."""
        if not self.state.check_epoch(f"ending the run ({reason})"):
            return  # Redis lost its data: the loop rebuilds it, then the run ends on a later step
        stored = read_run_end(self.store, self.keys)  # a predecessor ended it just before it stopped
        if stored is not None:
            self._adopt_end(stored)
            return
        heads = self.bus.heads()  # this shard's and the others', committed
        end = RunEnd(run=self.spec.run, finished_at=self.now(), by=by, reason=reason,
                     versions=tuple(heads.get(f, -1) for f in range(self.spec.num_fragments)), epoch=self.epoch)
        ended = self.bus.end_at_heads(end, self.epoch)
        if ended is None:
            log.info("a shard committed as the run ended: ending it at the new heads")
            return  # the next step ends it again
        if not ended:
            raise self.state.deposed(f"another coordinator took run {self.spec.run!r} over while this one ended it")
        crash_point("end_in_redis")
        try:
            self.store.put(self.keys.finished_record(), end.to_wire(), create_only=True)
        except Conflict:  # a deposed predecessor's, written since: S3's is the run's end
            stored = read_run_end(self.store, self.keys)
            assert stored is not None
            self._adopt_end(stored)
            return
        self._ended(end)

    def _adopt_end(self, end: RunEnd) -> None:
        """The run's end as S3 records it, copied to Redis (fenced by our epoch)."""
        if not self.bus.set_run_end(end, self.epoch):
            raise self.state.deposed(f"another coordinator took run {self.spec.run!r} over while this one ended it")
        self._ended(end)

    def _ended(self, end: RunEnd) -> None:
        self.state.ended = end
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


    def _block_ms(self) -> int:
        wakes = [f.wake_at for f in self.fragments.values() if f.round and f.wake_at is not None]
        if not wakes:
            return 1000
        return max(0, min(1000, int((min(wakes) - self.now()) * 1000)))

    def _tend_cadence(self) -> None:
        """Publish the round clock: a fixed period, or H steps of the fastest live learner, stretched
        when the learners' links cannot carry a round in `max_link_share` of it (`link_bound_period`);
        re-set by `next_cadence` only when that moves by more than 15% slower or 10% faster, keeping
        the phase."""
        self._last_cadence_check = time.monotonic()
        self.state.clock_offset_s = self.bus.server_time() - time.time()
        period, why = self.config.round_s, "fixed"
        if period <= 0:
            names = self.view.clock_sample(CLOCK_SAMPLE)
            training = [s for s in self.bus.learner_stats(names).values() if s.step_time_s > 0]
            fastest = fastest_plausible([s.step_time_s for s in training], self.round_cfg.max_claim_ratio)
            if fastest is None:
                return
            steps_period = max(self.config.min_round_s, self.spec.sync_every * fastest)
            period, busy = link_bound_period(steps_period, [s.link_round_s for s in training],
                                             self.config.max_link_share)
            why = f"{self.spec.sync_every} steps of the fastest learner"
            if period > steps_period:
                why += (f", stretched {period / steps_period:.2f}x: the learners' links are busy {busy:.2f}s a "
                        f"round, at most max_link_share {self.config.max_link_share:g} of it")
        cadence = next_cadence(self.cadence, period, self.now(), self.spec.num_fragments)
        if cadence is None:
            return
        self.state.cadence = cadence
        self.bus.set_cadence(cadence)
        log.info("round clock: a round every %.2fs per fragment (%s)", period, why)


CLOCK_SAMPLE = 256
"""The most live learners whose stats the round clock reads each second (`Coordinator._tend_cadence`)."""
