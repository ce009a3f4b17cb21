"""`diloco bench flood`: its windows, and what became of the hostile learner's writes, on a stack of its own."""

from __future__ import annotations

import logging

import pytest

from diloco.infra.bench.flood import FloodConfig, measure

pytestmark = pytest.mark.slow  # a benchmark's harness: `make test-all`


def test_the_flood_bench_steps_every_window_and_reports_what_the_servers_refused(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="diloco.storage.bus")
    config = FloodConfig(made_up_ids=300, junk_stats=3, junk_mb=1.0, window_s=2.5, learners=1)
    result = measure(config, tmp_path)

    assert [w.name for w in result.windows] == ["base", "stats", "ids (flood)", "ids (after)"]
    assert all(w.steps > 0 and w.rss_max_mb >= w.rss_mb > 0 for w in result.windows)
    # The heartbeat script wrote none of the oversize stats; the raw writes went in (the
    # coordinator reads them and skips them); under the live cap every made-up id is live.
    assert result.hostile == {"stats refused": 3, "stats written raw": 3, "ids live": 300}
    # The coordinator read the junk (its round clock reads the live learners' stats) and skipped it:
    # the stats window measures a loop that holds megabytes of it for a moment, not one that never looks.
    assert any("skipping the stats of learner 'mallory'" in r.getMessage() for r in caplog.records)
    after = result.windows[-1]
    assert after.live == after.joined == 300 + 2  # the honest learner and mallory
    assert set(result.ratios()) == {w.name for w in result.windows} and result.ratios()["base"] == (1.0, 1.0)
    assert "ids (after)" in result.table()
