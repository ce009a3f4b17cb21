"""The coordinator's metrics without servers: what the Grafana dashboard and the scrape config name
exists, the metrics off path imports nothing of prometheus_client, and each figure is recorded as
docs/metrics.md says."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from diloco.coordinator.metrics import INSTALL_HINT, Metrics, PrometheusMetrics, object_kind
from diloco.coordinator.policy import Arrival, RoundConfig, RoundState
from diloco.infra.local.stack import free_ports
from diloco.storage.errors import ConfigError
from diloco.storage.keys import RunKeys
from diloco.storage.protocol import LearnerStats
from diloco.workers.metrics import LearnerMetrics
from diloco.workers.transfer import TransferStats

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "metrics" / "grafana-dashboard.json"
SCRAPE_CONFIG = ROOT / "infra" / "metrics" / "prometheus.yml"
DOC = ROOT / "docs" / "metrics.md"


def exported_names(metrics: PrometheusMetrics | LearnerMetrics) -> dict[str, str]:
    """Every series name a fresh registry exposes (`name_total`, `name_bucket`, ...) -> its family's type."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for suffix in suffixes.get(family.type, ()):
            names[family.name + suffix] = family.type
    return names


def test_every_metric_the_dashboard_queries_is_exported_and_every_exported_one_is_shown_or_documented():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    panels = dashboard["panels"]
    assert panels and all(p["targets"] and p["gridPos"] and p["title"] for p in panels)
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "run", "instance"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\bdiloco_[a-z_]+", e)}
    exported = exported_names(PrometheusMetrics("unit"))
    assert queried <= exported.keys(), f"not exported: {sorted(queried - exported.keys())}"
    assert all('run=~"$run"' in e for e in exprs), [e for e in exprs if 'run=~"$run"' not in e]
    # As docs/metrics.md names them: counters with _total, histograms by their family's name.
    documented = {n if kind != "histogram" else re.sub(r"_(bucket|sum|count)$", "", n) for n, kind in exported.items()}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in queried}
    # The panels the metrics exist for.
    assert {"diloco_versions_committed", "diloco_round_contributors", "diloco_round_tokens",
            "diloco_grace_wait_seconds", "diloco_merged_staleness_versions", "diloco_contributions_refused",
            "diloco_bytes_read", "diloco_bytes_written", "diloco_live_learners", "diloco_lag_seconds"} <= shown
    doc = DOC.read_text()
    undocumented = sorted(n for n in documented if f"`{n}`" not in doc)
    undocumented += sorted(n for n in exported_names(LearnerMetrics(FakeLearner())) if f"`{n}`" not in doc)
    assert not undocumented, f"docs/metrics.md does not list {undocumented}"


def test_the_scrape_config_scrapes_the_coordinator_and_its_standby():
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "diloco-coordinator"]
    targets = [t for c in job["static_configs"] for t in c["targets"]]
    assert len(targets) == 2 and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets), targets
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_metrics_off_import_nothing_of_prometheus_client():
    code = """
import sys
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.metrics import Metrics
import diloco.coordinator.service
import diloco.infra.roles.cli
from diloco.workers.metrics import LearnerMetrics
assert LearnerMetrics.start(object(), 0) is None
assert CoordinatorConfig().metrics_port == 0
m = Metrics.start(CoordinatorConfig().metrics_port, "r")
assert not m.enabled and type(m) is Metrics
store = object()
assert m.counting(store, None) is store
for call in (lambda: m.attach(None), m.detach, m.took_lease, lambda: m.accepted(None), lambda: m.refused("stale", 0),
             m.repeated, lambda: m.round_closed(None, None, 0.0), lambda: m.merged(0, 1.0),
             lambda: m.published(None, 1.0), lambda: m.fleet(None), lambda: m.sample(None, 0.0), m.stop):
    assert call() is None
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "prometheus_client")
assert not loaded, loaded
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_port_without_prometheus_client_is_an_error_that_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client raises ImportError
    with pytest.raises(ConfigError, match=re.escape(INSTALL_HINT)):
        Metrics.start(9, "r")


def test_a_bad_port_is_refused():
    with pytest.raises(ConfigError, match="metrics_port"):
        from diloco.coordinator.config import CoordinatorConfig
        CoordinatorConfig(metrics_port=70000)


def test_refusals_stale_drops_and_duplicates_are_counted_by_code():
    m = PrometheusMetrics("r")
    m.refused("stale", 1)
    m.refused("stale", 1)
    m.refused("duplicate", 0)
    m.refused("bad_message", None)
    m.repeated()
    get = m.registry.get_sample_value
    assert get("diloco_contributions_refused_total", {"run": "r", "code": "stale"}) == 2
    assert get("diloco_contributions_refused_total", {"run": "r", "code": "bad_message"}) == 1
    assert get("diloco_stale_dropped_total", {"run": "r", "fragment": "1"}) == 2
    assert get("diloco_duplicates_total", {"run": "r", "outcome": "refused"}) == 1
    assert get("diloco_duplicates_total", {"run": "r", "outcome": "repeated"}) == 1


def arrival(learner: str, at: float, *, final: bool = False) -> Arrival:
    return Arrival(contribution_id=f"{learner}-{at}", learner=learner, base_version=0, tokens=10, steps=1,
                   arrived_at=at, step_time_s=0.1, final=final)


@pytest.mark.parametrize(("arrivals", "live", "waited"), [
    # Quorum 2 of 3 live: reached at b's arrival (12); the round merged at 15.
    ((arrival("a", 10.0), arrival("b", 12.0), arrival("a", 11.0)), 3, 3.0),
    # Only one learner live: quorum lowered to 1, reached at a's first arrival.
    ((arrival("a", 10.0),), 1, 5.0),
    # Quorum never reached (a full round, or the end of the run): no observation.
    ((arrival("a", 10.0),), 3, None),
])
def test_the_grace_wait_is_counted_from_the_quorum(arrivals, live, waited):
    m = PrometheusMetrics("r")
    state = RoundState(fragment=1, head_version=0, arrivals=arrivals, live_learners=live)
    m.round_closed(state, RoundConfig(min_quorum=2), now=15.0)
    labels = {"run": "r", "fragment": "1"}
    assert m.registry.get_sample_value("diloco_grace_wait_seconds_sum", labels) == waited
    assert m.registry.get_sample_value("diloco_grace_wait_seconds_count", labels) == (None if waited is None else 1)


def test_objects_are_counted_by_kind():
    keys = RunKeys("p", "run")
    assert object_kind(keys, keys.delta(1, "a", 7)) == "contribution"
    assert object_kind(keys, keys.genesis_params("a", 0)) == "genesis"
    assert object_kind(keys, keys.genesis_layout("a")) == "genesis"
    assert object_kind(keys, keys.params(0, 3, 2)) == "params"
    assert object_kind(keys, keys.outer_state(0, 3, 2)) == "outer_state"
    assert object_kind(keys, keys.manifest(0, 3)) == "manifest"
    assert object_kind(keys, keys.run_spec()) == "other"
    assert object_kind(keys, keys.epoch_claim(4)) == "other"


def test_a_standby_is_scraped_as_inactive_and_two_registries_do_not_collide():
    [port] = free_ports(1)
    standby = Metrics.start(port, "r")
    other = PrometheusMetrics("r")  # a second coordinator of the same run in this process: its own registry
    try:
        other.refused("stale", 0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert 'diloco_coordinator_active{run="r"} 0.0' in text
        assert "diloco_head_version" in text and 'diloco_head_version{' not in text
        assert 'code="stale"' not in text
    finally:
        standby.stop()


class FakeLearner:
    run, learner_id = "r", "a"

    def __init__(self) -> None:
        self.stats = TransferStats(uploaded=3, coalesced=1, fetched=4)
        self.versions = {0: 2, 1: -1}

    def progress(self) -> LearnerStats:
        return LearnerStats(learner="a", step=12, tokens=120, loss=2.5, step_time_s=0.25, adopted=2, uploaded=3,
                            bytes_uploaded=999)


def test_a_learners_metrics_are_what_its_heartbeat_reports():
    get = LearnerMetrics(FakeLearner()).registry.get_sample_value
    labels = {"run": "r", "learner": "a"}
    assert get("diloco_learner_steps_total", labels) == 12
    assert get("diloco_learner_tokens_total", labels) == 120
    assert get("diloco_learner_loss", labels) == 2.5
    assert get("diloco_learner_step_seconds", labels) == 0.25
    assert get("diloco_learner_contributions_uploaded_total", labels) == 3
    assert get("diloco_learner_contributions_coalesced_total", labels) == 1
    assert get("diloco_learner_versions_fetched_total", labels) == 4
    assert get("diloco_learner_bytes_uploaded_total", labels) == 999
    assert get("diloco_learner_base_version", labels | {"fragment": "0"}) == 2
    assert get("diloco_learner_base_version", labels | {"fragment": "1"}) is None  # not joined yet
