"""A learner's Prometheus endpoint (optional): its steps, tokens, loss, sends and downloads at /metrics.

`LearnerMetrics.start(learner, port)` serves, in a registry of its own, what the learner's next
heartbeat would report (`Learner.progress()`), its transfer counters (`Learner.stats`) and the
version each fragment descends from (`Learner.versions`), all read from memory when scraped: the
training loop does nothing for it. Port 0 returns None and imports nothing of `prometheus_client`;
a port without the package is a ConfigError naming `pip install 'diloco[metrics]'`. Every series
carries the labels `run` and `learner` (docs/metrics.md#learners).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from diloco.storage.errors import ConfigError
from diloco.storage.protocol import LearnerStats

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'diloco[metrics]'"


class _Watched(Protocol):
    """What the endpoint reads of a learner (`workers.learner.Learner` has it all)."""

    run: str
    learner_id: str
    stats: Any  # workers.transfer.TransferStats

    def progress(self) -> LearnerStats: ...

    @property
    def versions(self) -> dict[int, int]: ...


class LearnerMetrics:
    """The metrics of one learner, served on a port until `stop()`."""

    def __init__(self, learner: _Watched) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise ConfigError(f"learner metrics need the prometheus_client package: {INSTALL_HINT} "
                              "(or leave the metrics port at 0)") from None
        self.learner = learner
        self.registry = prom.CollectorRegistry()
        self.registry.register(_LearnerCollector(learner))
        self._server: Any = None

    @staticmethod
    def start(learner: _Watched, port: int, *, addr: str = "0.0.0.0") -> LearnerMetrics | None:
        """Serve `learner`'s metrics on `addr:port` (/metrics); None for port 0 (off)."""
        if not port:
            return None
        metrics = LearnerMetrics(learner)  # the clear error if prometheus_client is missing
        import prometheus_client as prom

        try:
            metrics._server, _thread = prom.start_http_server(port, addr=addr, registry=metrics.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve learner metrics on {addr}:{port}: {exc}") from None
        log.info("serving Prometheus metrics of learner %s on http://%s:%d/metrics", learner.learner_id, addr, port)
        return metrics

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


COUNTERS: dict[str, tuple[str, Callable[[LearnerStats, Any], float]]] = {
    "diloco_learner_steps": ("Inner steps of this incarnation", lambda p, s: p.step),
    "diloco_learner_tokens": ("Tokens of those steps", lambda p, s: p.tokens),
    "diloco_learner_versions_adopted": ("Global versions merged into the local model", lambda p, s: p.adopted),
    "diloco_learner_steps_through": ("Inner steps trained between a send and the take of a version after it",
                                     lambda p, s: p.steps_through),
    "diloco_learner_contributions_uploaded": ("Contributions stored and announced", lambda p, s: p.uploaded),
    "diloco_learner_contributions_dropped": ("Contributions dropped after the upload deadline (S3 or Redis down)",
                                             lambda p, s: p.upload_failed),
    "diloco_learner_contributions_coalesced": ("Contributions added into a queued one not stored yet",
                                               lambda p, s: s.coalesced),
    "diloco_learner_upload_retries": ("Failed upload attempts retried", lambda p, s: s.upload_retries),
    "diloco_learner_bytes_uploaded": ("Bytes of contribution objects stored", lambda p, s: p.bytes_uploaded),
    "diloco_learner_bytes_downloaded": ("Bytes of every object read from S3 (versions, manifests, the run's records)",
                                        lambda p, s: p.bytes_downloaded),
    "diloco_learner_versions_fetched": ("Global versions downloaded and verified", lambda p, s: s.fetched),
    "diloco_learner_fetch_failures": ("Version downloads that failed (retried)", lambda p, s: s.fetch_failed),
    "diloco_learner_sync_seconds": ("Seconds the training loop spent in the learner's step hook",
                                    lambda p, s: p.sync_s),
}
GAUGES: dict[str, tuple[str, Callable[[LearnerStats, Any], float]]] = {
    "diloco_learner_loss": ("The last loss given to Learner.report (NaN: none)", lambda p, s: p.loss),
    "diloco_learner_step_seconds": ("Moving average of an inner step's wall time", lambda p, s: p.step_time_s),
}


class _LearnerCollector:
    def __init__(self, learner: _Watched) -> None:
        self._learner = learner

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        learner = self._learner
        labels = ["run", "learner"]
        values = [learner.run, learner.learner_id]
        progress, stats = learner.progress(), learner.stats
        for name, (doc, get) in COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, get(progress, stats))
            yield family
        for name, (doc, get) in GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, get(progress, stats))
            yield family
        base = GaugeMetricFamily("diloco_learner_base_version", "The global version each fragment's local values "
                                 "descend from", labels=[*labels, "fragment"])
        for fragment, version in sorted(learner.versions.items()):
            if version >= 0:
                base.add_metric([*values, str(fragment)], version)
        yield base
