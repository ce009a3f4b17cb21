"""The coordinator's Prometheus endpoint tells what happened: scraped over HTTP during and after a
small run of two learners, its figures agree with the heads, the manifests, the refusals and the
objects in S3 (docs/metrics.md).
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.metrics import Metrics, object_kind
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.local.stack import free_ports
from diloco.storage.history import read_manifest
from diloco.workers.metrics import LearnerMetrics
from harness import TINY_RUN, announcements, join, make_coordinator, merged_ids, serving, train, wait_for

RUN = dataclasses.replace(TINY_RUN, cadence="steps")

Samples = list[tuple[str, dict[str, str], float]]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 if there is none)."""
    return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_the_scraped_metrics_agree_with_the_heads_the_manifests_and_the_refusals(endpoints, run_id):
    port, again_port, learner_port = free_ports(3)
    # As `diloco coordinator` does it: a server of the caller's own, which outlives the coordinator.
    metrics = Metrics.start(port, run_id)
    coord = Coordinator(endpoints, run_id, settings=RUN, metrics=metrics,
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0)))
    bus, store, keys = coord.bus, coord.store, coord.keys
    (a, opt_a), (b, opt_b) = join(endpoints, run_id, coord, "a"), join(endpoints, run_id, coord, "b")
    learner_metrics = LearnerMetrics.start(a, learner_port)
    try:
        with serving(coord):
            wait_for("both learners live in the metrics", lambda: value(scrape(port), "diloco_live_learners") == 2,
                     timeout_s=15)
            during = scrape(port)
            assert value(during, "diloco_coordinator_active", run=run_id) == 1
            assert value(during, "diloco_versions_committed_total", run=run_id) == 2  # version 0 of each fragment
            for _ in range(3):
                train(a, opt_a, 4)
                train(b, opt_b, 4)
            # The same announcement delivered again: refused as a duplicate, and counted as one.
            first = next(x for _, x in announcements(bus) if x.kind == "delta")
            copy = bus.announce(first)
            announced = {x.contribution_id for _, x in announcements(bus)}
            wait_for("every contribution merged, the copy refused",
                     lambda: announced <= set(merged_ids(endpoints, run_id)) and bus.pending_count() == 0
                     and bus.counters().get("refused:duplicate") == 1, timeout_s=15)
            heads = bus.heads()
            wait_for("the scraped heads and backlog to catch up", lambda: settled(scrape(port), heads), timeout_s=5)
            live = scrape(port)
            mine = scrape(learner_port)
        m = scrape(port)  # the loop has stopped: every figure is in

        # The coordinator as it ran: heads, epoch, fleet, backlog.
        for f, head in heads.items():
            assert value(live, "diloco_head_version", run=run_id, fragment=str(f)) == head
            assert value(live, "diloco_open_round_contributions", run=run_id, fragment=str(f)) == 0
        assert value(live, "diloco_epoch", run=run_id) == coord.epoch
        assert value(live, "diloco_live_learners", run=run_id) == 2
        assert value(live, "diloco_finished_learners", run=run_id) == 0
        assert value(live, "diloco_pending_announcements", run=run_id) == 0
        assert value(live, "diloco_lag_seconds", run=run_id) == 0
        # Stopped: no longer active, and no heads of its own any more.
        assert value(m, "diloco_coordinator_active", run=run_id) == 0
        assert not [s for s in m if s[0] in ("diloco_head_version", "diloco_epoch")]

        # Versions and merged contributions: what the manifests in S3 say.
        manifests = {f: [read_manifest(store, keys, f, v) for v in range(head + 1)] for f, head in heads.items()}
        deltas = [man for f in manifests for man in manifests[f][1:]]
        assert len(deltas) >= 4, "the run merged too few rounds to tell anything"
        for f, head in heads.items():
            frag = {"run": run_id, "fragment": str(f)}
            assert value(m, "diloco_versions_committed_total", **frag) == head + 1
            assert value(m, "diloco_contributions_merged_total", **frag) == sum(len(x.inputs) for x in manifests[f])
            assert value(m, "diloco_publish_seconds_count", **frag) == head + 1
        inputs = [c for man in deltas for c in man.inputs]
        assert value(m, "diloco_contributions_merged_total") == len(merged_ids(endpoints, run_id)) == len(inputs) + 2
        assert value(m, "diloco_contributions_accepted_total", kind="delta") == len(inputs)
        assert value(m, "diloco_contributions_accepted_total", kind="genesis") == 2

        # Rounds: one observation per delta version (quorum 1, no grace), as the manifests record them.
        assert value(m, "diloco_round_contributors_count") == len(deltas)
        assert value(m, "diloco_round_contributors_sum") == sum(len({c.learner for c in x.inputs}) for x in deltas)
        assert value(m, "diloco_round_tokens_sum") == sum(c.tokens for c in inputs)
        assert value(m, "diloco_merged_staleness_versions_count") == len(inputs)
        assert value(m, "diloco_merged_staleness_versions_sum") == sum(c.staleness for c in inputs)
        assert value(m, "diloco_merge_seconds_count") == len(deltas)
        assert value(m, "diloco_grace_wait_seconds_count") == len(deltas)
        assert value(m, "diloco_grace_wait_seconds_bucket", le="+Inf") == len(deltas)

        # The copy: refused once, as a duplicate; nothing else refused.
        assert value(m, "diloco_contributions_refused_total", code="duplicate") == 1
        assert value(m, "diloco_contributions_refused_total") == 1
        assert value(m, "diloco_duplicates_total", outcome="refused") == 1
        assert value(m, "diloco_stale_dropped_total") == 0

        # Bytes: every contribution object read once (the copy was refused unread); every version object
        # written once, as large as it is in S3.
        assert value(m, "diloco_bytes_read_total", object="contribution") == sum(
            x.size_bytes for eid, x in announcements(bus) if x.kind == "delta" and eid != copy)
        assert value(m, "diloco_bytes_read_total", object="genesis") > 0
        stored: dict[str, int] = {}
        for key, size in store.list_sizes(keys.versions_prefix()):
            stored[object_kind(keys, key)] = stored.get(object_kind(keys, key), 0) + size
        for kind in ("params", "outer_state", "manifest"):
            assert value(m, "diloco_bytes_written_total", object=kind) == stored[kind] > 0, kind

        assert value(m, "diloco_takeovers_total", run=run_id) == 1
        assert {ls.get("run") for _, ls, _ in m} == {run_id}  # nothing but this run

        # A learner's own endpoint: what its heartbeat reports.
        progress, ours = a.progress(), {"run": run_id, "learner": "a"}
        assert value(mine, "diloco_learner_steps_total", **ours) == progress.step == 12
        assert value(mine, "diloco_learner_tokens_total", **ours) == progress.tokens
        assert value(mine, "diloco_learner_contributions_uploaded_total", **ours) == progress.uploaded > 0
        assert value(mine, "diloco_learner_bytes_uploaded_total", **ours) == progress.bytes_uploaded
        for f, version in a.versions.items():
            assert value(mine, "diloco_learner_base_version", fragment=str(f), **ours) == version

        # A coordinator started on the run again, with `metrics_port` in its config: a server of its
        # own, counting from 0 at a new epoch, which it stops when it closes.
        again = make_coordinator(endpoints, run_id, settings=RUN, metrics_port=again_port)
        try:
            restarted = scrape(again_port)
        finally:
            again.close()
        with pytest.raises(urllib.error.URLError):
            scrape(again_port)
        for f, head in heads.items():
            assert value(restarted, "diloco_head_version", fragment=str(f)) == head
        assert value(restarted, "diloco_epoch") == again.epoch > coord.epoch
        assert value(restarted, "diloco_takeovers_total") == 1
        assert value(restarted, "diloco_versions_committed_total") == 0
    finally:
        metrics.stop()
        learner_metrics.stop()
        a.close()
        b.close()


def settled(samples: Samples, heads: dict[int, int]) -> bool:
    """The scrape shows `heads`, and a sample of the backlog (taken about once a second) with nothing left."""
    sampled = {n for n, _, _ in samples} >= {"diloco_pending_announcements", "diloco_lag_seconds"}
    return (sampled and value(samples, "diloco_pending_announcements") == value(samples, "diloco_lag_seconds") == 0
            and all(value(samples, "diloco_head_version", fragment=str(f)) == h for f, h in heads.items()))
