"""The coordinator's Prometheus metrics: `diloco coordinator --metrics-port PORT` serves them at /metrics.

`Metrics` is what the loop (`service.py`) records into, one call at each point where it already
knows a figure: a contribution accepted or refused, a round closing, a merge, a published version,
the fleet it read. The base class does nothing: with the port at 0 (the default) every call is a
no-op and `prometheus_client` is never imported, so the coordinator behaves and performs exactly as
without metrics. `Metrics.start(port, run)` with a port returns `PrometheusMetrics`, which imports
`prometheus_client` then (a ConfigError naming `pip install 'diloco[metrics]'` if it is missing),
records into a `CollectorRegistry` of its own (several coordinators in one process never collide)
and serves it. Every series carries the label `run`. docs/metrics.md lists each metric.

Counters count what this process did since it started (a standby that takes over starts from 0;
Prometheus' `rate` and `increase` handle the reset). The state gauges (heads, epoch, open rounds)
are read from the coordinator's memory when scraped; pending announcements and the lag are sampled
from Redis once a second by the loop, and live learners from the fleet read it does anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import redis

from diloco.coordinator.policy import RoundConfig, RoundState, quorum
from diloco.storage.errors import ConfigError
from diloco.storage.keys import RunKeys
from diloco.storage.protocol import Announcement, Manifest

if TYPE_CHECKING:
    from diloco.coordinator.service import Coordinator
    from diloco.storage.bus import Bus, Fleet

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'diloco[metrics]'"

CONTRIBUTOR_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TOKEN_BUCKETS = (1e2, 1e3, 1e4, 3e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, 3e8, 1e9, 1e10)
GRACE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 16)
MERGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PUBLISH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Metrics off: every method does nothing. `Metrics.start` gives the recording kind when a port is set."""

    enabled = False

    @staticmethod
    def start(port: int, run: str, *, addr: str = "0.0.0.0") -> Metrics:
        """Metrics for `run` served on `addr:port` (/metrics), or the no-op kind for port 0.
        Raises ConfigError if prometheus_client is missing or the port cannot be bound."""
        if not port:
            return Metrics()
        metrics = PrometheusMetrics(run)
        metrics.serve(port, addr)
        return metrics

    def counting(self, store: Any, keys: RunKeys) -> Any:
        """`store` itself, or a wrapper that counts the bytes it reads and writes (by object kind)."""
        return store

    def attach(self, coordinator: Coordinator) -> None:
        """The coordinator holds the run's lease now: its heads, epoch and open rounds are scraped."""

    def detach(self) -> None:
        """The coordinator stopped (or was deposed): no longer active."""

    def took_lease(self) -> None:
        """The lease was taken again (after Redis lost its data)."""

    def accepted(self, a: Announcement) -> None:
        """A contribution passed every check (announcement and object)."""

    def refused(self, code: str, fragment: int | None) -> None:
        """A contribution (or stream entry) was refused with `code`."""

    def repeated(self) -> None:
        """A second copy of a contribution announced again from S3 was acknowledged (not merged twice)."""

    def round_closed(self, state: RoundState, cfg: RoundConfig, now: float) -> None:
        """A round merges now (`now`: Redis time): how long it waited after its quorum."""

    def merged(self, fragment: int, seconds: float) -> None:
        """A round's merge and outer step took `seconds`."""

    def published(self, manifest: Manifest, seconds: float) -> None:
        """This process committed `manifest`'s version; writing and committing it took `seconds`."""

    def fleet(self, fleet: Fleet) -> None:
        """The learners as the last read saw them."""

    def sample(self, bus: Bus, now: float) -> None:
        """Pending announcements and the lag, read from Redis (the loop calls it about once a second)."""

    def stop(self) -> None:
        """Stop serving (the coordinator that started the server calls it when it closes)."""


def object_kind(keys: RunKeys, key: str) -> str:
    """What an object of the run is, for the byte counters: contribution, genesis, params,
    outer_state, manifest, or other (run spec, layout, epoch claims, the run's end)."""
    if keys.parse_delta_key(key) is not None:
        return "contribution"
    if key.startswith(f"{keys.root}genesis/"):
        return "genesis"
    version = keys.parse_version_key(key)
    if version is not None:
        leaf = version[2].split(".")[0]
        return leaf if leaf in ("params", "outer_state", "manifest") else "other"
    return "other"


class _CountingStore:
    """An object store whose successful reads and writes are counted in bytes; anything else is the store's own."""

    def __init__(self, store: Any, keys: RunKeys, count_read: Callable[[str, int], None],
                 count_written: Callable[[str, int], None]) -> None:
        self._store, self._keys, self._read, self._written = store, keys, count_read, count_written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def get(self, key: str, *, max_bytes: int) -> bytes:
        blob = self._store.get(key, max_bytes=max_bytes)
        self._read(object_kind(self._keys, key), len(blob))
        return blob

    def get_buffer(self, key: str, *, max_bytes: int) -> bytearray:
        blob = self._store.get_buffer(key, max_bytes=max_bytes)
        self._read(object_kind(self._keys, key), len(blob))
        return blob

    def put(self, key: str, data: bytes, *, create_only: bool = True) -> None:
        self._store.put(key, data, create_only=create_only)
        self._written(object_kind(self._keys, key), len(data))


class PrometheusMetrics(Metrics):
    """The metrics of one coordinator of `run`, in a registry of their own (`self.registry`)."""

    enabled = True

    def __init__(self, run: str) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise ConfigError(f"metrics need the prometheus_client package: {INSTALL_HINT} "
                              "(or leave --metrics-port at 0)") from None
        self.run = run
        self.registry = prom.CollectorRegistry()
        self._server: Any = None
        self._coordinator: Coordinator | None = None

        def counter(name: str, doc: str, *labels: str) -> Any:
            return prom.Counter(name, doc, ["run", *labels], registry=self.registry)

        def gauge(name: str, doc: str, *labels: str) -> Any:
            return prom.Gauge(name, doc, ["run", *labels], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return prom.Histogram(name, doc, ["run", "fragment"], buckets=buckets, registry=self.registry)

        self.accepted_total = counter("diloco_contributions_accepted", "Contributions that passed every check "
                                      "(announcement and object): a delta joins its fragment's open round, a "
                                      "genesis proposal may become version 0",
                                      "fragment", "kind")
        self.merged_total = counter("diloco_contributions_merged", "Contributions merged into a version this "
                                    "coordinator committed (the inputs of its manifests)", "fragment")
        self.refused_total = counter("diloco_contributions_refused", "Contributions and stream entries refused, "
                                     "by refusal code (PROTOCOL.md#refusal-codes)", "code")
        self.stale_total = counter("diloco_stale_dropped", "Contributions dropped as stale: based more than "
                                   "max_staleness versions behind the head (also in refused, code stale)", "fragment")
        self.duplicates_total = counter("diloco_duplicates", "The same contribution delivered again: refused "
                                        "(code duplicate) or acknowledged as the second copy of one announced "
                                        "again from S3 (repeated)", "outcome")
        self.versions_total = counter("diloco_versions_committed", "Versions this coordinator wrote and "
                                      "committed, version 0 included", "fragment")
        self.takeovers_total = counter("diloco_takeovers", "Times this process took the run's coordinator lease "
                                       "(at start or after a standby wait: a new epoch; again after Redis lost "
                                       "its data)")
        self.bytes_read_total = counter("diloco_bytes_read", "Bytes read from S3, by object kind: contribution, "
                                        "genesis, params, outer_state, manifest, other", "object")
        self.bytes_written_total = counter("diloco_bytes_written", "Bytes written to S3, by object kind: params, "
                                           "outer_state, manifest, other", "object")
        self.round_contributors = histogram("diloco_round_contributors", "Distinct learners in each merged round",
                                            CONTRIBUTOR_BUCKETS)
        self.round_tokens = histogram("diloco_round_tokens", "Tokens each merged round carried (as the merge "
                                      "counted them)", TOKEN_BUCKETS)
        self.grace_wait = histogram("diloco_grace_wait_seconds", "Seconds a round stayed open after its quorum "
                                    "(the K-th distinct learner's arrival) until it merged", GRACE_BUCKETS)
        self.staleness = histogram("diloco_merged_staleness_versions", "Staleness of each merged contribution: "
                                   "versions between its base and the head it was merged into", STALENESS_BUCKETS)
        self.merge_seconds = histogram("diloco_merge_seconds", "Seconds a round's merge, scale and outer step took",
                                       MERGE_BUCKETS)
        self.publish_seconds = histogram("diloco_publish_seconds", "Seconds publishing a version took: its "
                                         "objects, manifest and Redis commit", PUBLISH_BUCKETS)
        self.live_learners = gauge("diloco_live_learners", "Learners with a live heartbeat")
        self.finished_learners = gauge("diloco_finished_learners", "Learners that finished the run")
        self.pending = gauge("diloco_pending_announcements", "Announcements not merged or refused yet: read and "
                             "pending in the consumer group (open rounds, retries, other consumers) or not read yet")
        self.lag = gauge("diloco_lag_seconds", "Age of the oldest announcement not merged or refused yet (Redis "
                         "time; 0 if none)")
        self.registry.register(_StateCollector(self))

    # ---- serving ---------------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        import prometheus_client as prom

        try:
            self._server, _thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc}") from None
        log.info("serving Prometheus metrics of run %s on http://%s:%d/metrics", self.run, addr, port)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # ---- recording -------------------------------------------------------------------------------
    def counting(self, store: Any, keys: RunKeys) -> Any:
        read, written = self.bytes_read_total, self.bytes_written_total
        return _CountingStore(store, keys, lambda kind, n: read.labels(self.run, kind).inc(n),
                              lambda kind, n: written.labels(self.run, kind).inc(n))

    def attach(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self.took_lease()

    def detach(self) -> None:
        self._coordinator = None

    def took_lease(self) -> None:
        self.takeovers_total.labels(self.run).inc()

    def accepted(self, a: Announcement) -> None:
        self.accepted_total.labels(self.run, str(a.fragment), a.kind).inc()

    def refused(self, code: str, fragment: int | None) -> None:
        self.refused_total.labels(self.run, code).inc()
        if code == "stale":
            self.stale_total.labels(self.run, str(fragment)).inc()
        elif code == "duplicate":
            self.duplicates_total.labels(self.run, "refused").inc()

    def repeated(self) -> None:
        self.duplicates_total.labels(self.run, "repeated").inc()

    def round_closed(self, state: RoundState, cfg: RoundConfig, now: float) -> None:
        reached_at = quorum(state, cfg).reached_at
        if reached_at is not None:  # else it merges without a quorum: full, or the run is ending
            self.grace_wait.labels(self.run, str(state.fragment)).observe(max(0.0, now - reached_at))

    def merged(self, fragment: int, seconds: float) -> None:
        self.merge_seconds.labels(self.run, str(fragment)).observe(seconds)

    def published(self, manifest: Manifest, seconds: float) -> None:
        fragment = str(manifest.fragment)
        self.versions_total.labels(self.run, fragment).inc()
        self.merged_total.labels(self.run, fragment).inc(len(manifest.inputs))
        self.publish_seconds.labels(self.run, fragment).observe(seconds)
        if manifest.settings.kind != "delta":
            return  # version 0: the proposed parameters, no round
        self.round_contributors.labels(self.run, fragment).observe(len({c.learner for c in manifest.inputs}))
        self.round_tokens.labels(self.run, fragment).observe(sum(c.tokens for c in manifest.inputs))
        staleness = self.staleness.labels(self.run, fragment)
        for c in manifest.inputs:
            staleness.observe(c.staleness)

    def fleet(self, fleet: Fleet) -> None:
        self.live_learners.labels(self.run).set(len(fleet.live))
        self.finished_learners.labels(self.run).set(len(fleet.finished))

    def sample(self, bus: Bus, now: float) -> None:
        try:
            backlog = bus.backlog()
        except redis.RedisError as exc:  # the loop notices outages itself; a metric just misses a sample
            log.debug("metrics: cannot read the announcements' backlog: %s", exc)
            return
        self.pending.labels(self.run).set(backlog.waiting)
        self.lag.labels(self.run).set(backlog.lag_s(now) or 0.0)


class _StateCollector:
    """The gauges read from the coordinator's memory at each scrape: no I/O, no call from the loop."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        run, coordinator = self._metrics.run, self._metrics._coordinator
        active = GaugeMetricFamily("diloco_coordinator_active", "1 while this process coordinates the run (holds "
                                   "its lease), 0 while it stands by or after it stopped", labels=["run"])
        epoch = GaugeMetricFamily("diloco_epoch", "The fencing epoch this coordinator commits with", labels=["run"])
        heads = GaugeMetricFamily("diloco_head_version", "Each fragment's head version, as this coordinator holds "
                                  "it", labels=["run", "fragment"])
        rounds = GaugeMetricFamily("diloco_open_round_contributions", "Contributions waiting in each fragment's "
                                   "open round", labels=["run", "fragment"])
        active.add_metric([run], 0.0 if coordinator is None else 1.0)
        if coordinator is not None:
            epoch.add_metric([run], coordinator.epoch)
            for fragment, frag in list(coordinator.fragments.items()):
                if frag.head >= 0:
                    heads.add_metric([run, str(fragment)], frag.head)
                rounds.add_metric([run, str(fragment)], len(frag.round))
        yield from (active, epoch, heads, rounds)
