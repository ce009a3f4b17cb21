"""Learners' heartbeat stats as their readers meet them: typed, checked, and a liar skipped.

A learner holds valid Redis credentials, so it can write whatever it likes under its stats. The
coordinator sets the round clock from the step times there; a record that is not what a learner
writes must neither crash it (every successor would crash on it too) nor move the clock.
"""

from __future__ import annotations

import logging

import msgpack
import pytest

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.service import Coordinator
from diloco.storage.bus import Bus
from diloco.storage.errors import Refused
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import SCHEMA_VERSION, Cadence, LearnerStats, RunEnd


def test_stats_that_do_not_decode_are_skipped_and_the_clock_follows_the_honest_learners(endpoints, run_id, caplog):
    settings = RunSettings(num_fragments=2, sync_every=10, cadence="clock")
    coord = Coordinator(endpoints, run_id, settings=settings, config=CoordinatorConfig(min_round_s=0.05))
    bus = coord.bus
    try:
        bus.heartbeat("honest", 30.0, LearnerStats(learner="honest", step=7, step_time_s=0.02))
        for liar in ("fast", "garbage", "impostor"):
            bus.heartbeat(liar, 30.0)  # live, like the honest one
        forged = {"schema": SCHEMA_VERSION, "type": "LearnerStats", "learner": "fast", "step_time_s": "fast"}
        bus.r.hset(bus.keys.learner_stats, mapping={
            "fast": msgpack.packb(forged),
            "garbage": b"\xc1\xff",
            # Valid stats, but another learner's name: it would speak for the honest learner.
            "impostor": LearnerStats(learner="honest", step_time_s=1e-9).to_wire(),
        })
        with caplog.at_level(logging.WARNING, logger="diloco.storage.bus"):
            coord.step()
            stats = bus.learner_stats()
        assert set(stats) == {"honest"} and stats["honest"].step == 7
        cadence = bus.cadence()
        assert cadence is not None and cadence.period_s == pytest.approx(10 * 0.02)
        said = caplog.text
        assert "skipping the stats of learner 'fast'" in said and "step_time_s: expected a number" in said
        assert "skipping the stats of learner 'garbage'" in said
        assert "skipping the stats under 'impostor': they name learner 'honest'" in said
    finally:
        coord.close()


def test_junk_stats_rewritten_again_and_again_are_warned_of_once_each_and_not_kept(endpoints, run_id, caplog):
    """A learner that rewrites its stats with megabytes of junk, again and again: each record is
    warned of once, and its reader remembers a 16-byte digest of each, not the junk (it kept every
    record it had warned about, up to 1000 of them: 60 records of 8 MB took the coordinator from 351
    to 870 MB)."""
    bus = Bus(endpoints, run_id)
    try:
        with caplog.at_level(logging.WARNING, logger="diloco.storage.bus"):
            for i in range(12):
                bus.r.hset(bus.keys.learner_stats, "junk", bytes([i]) * (1 << 20))
                assert bus.learner_stats() == {} and bus.learner_stats() == {}  # read twice: warned once
        assert caplog.text.count("skipping the stats of learner 'junk'") == 12
        assert len(bus._warned) == 12 and {len(key) for key in bus._warned} == {16}
    finally:
        bus.close()


def test_the_clock_stretches_for_links_most_learners_report_full_and_not_for_one(endpoints, run_id, caplog):
    """Learners whose links are busy 0.16 s of each round at the default max_link_share 0.5 get
    rounds of 0.32 s, not H steps of the fastest learner's 0.2; one learner of three claiming a
    full link moves nothing."""
    settings = RunSettings(num_fragments=2, sync_every=10, cadence="clock")
    coord = Coordinator(endpoints, run_id, settings=settings, config=CoordinatorConfig(min_round_s=0.05))
    bus = coord.bus
    try:
        for name, busy in (("a", 0.02), ("b", 0.02), ("c", 100.0)):
            bus.heartbeat(name, 30.0, LearnerStats(learner=name, step=7, step_time_s=0.02, link_round_s=busy))
        coord.step()
        assert bus.cadence().period_s == pytest.approx(10 * 0.02)
        for name in ("a", "b"):
            bus.heartbeat(name, 30.0, LearnerStats(learner=name, step=9, step_time_s=0.02, link_round_s=0.16))
        with caplog.at_level(logging.INFO, logger="diloco.coordinator.service"):
            coord._tend_cadence()
        assert bus.cadence().period_s == pytest.approx(0.32)
        assert "stretched 1.60x: the learners' links are busy 0.16s a round, at most max_link_share 0.5" in caplog.text
    finally:
        coord.close()


def test_a_store_counts_the_time_its_transfers_keep_the_link_busy(endpoints, run_id):
    store = ObjectStore(endpoints)
    assert store.link.busy_s() == (0.0, 0.0)
    store.put(f"{run_id}/linkuse", b"x" * 100_000)
    up, down = store.link.busy_s()
    assert up > 0.0 and down == 0.0
    assert store.get(f"{run_id}/linkuse", max_bytes=1 << 20) == b"x" * 100_000
    assert store.link.busy_s()[0] == up and store.link.busy_s()[1] > 0.0


def test_a_heartbeat_reads_the_redis_clock_the_round_clock_and_the_runs_end_in_its_round_trip(endpoints, run_id):
    bus = Bus(endpoints, run_id)
    before = bus.server_time()
    beat = bus.heartbeat("l0", 30.0)
    assert before <= beat.server_time <= bus.server_time()
    assert beat.cadence is None and beat.run_end is None  # no coordinator yet
    cadence = Cadence(origin=before, period_s=5.0)
    bus.set_cadence(cadence)
    end = RunEnd(run=run_id, finished_at=before, by="operator", reason="stopped", versions=(3, 4), epoch=1)
    bus.r.set(bus.keys.finished, end.to_wire())
    beat = bus.heartbeat("l0", 30.0)
    assert (beat.cadence, beat.run_end) == (cadence, end)
    bus.r.set(bus.keys.cadence, b"\x93not a cadence")  # a corrupt clock is refused, the heartbeat written
    with pytest.raises(Refused):
        bus.heartbeat("l1", 30.0)
    assert "l1" in bus.live_learners()
