"""Learners and servers failing under a live run: preemption, S3 down, Redis restarted or emptied.

The session stack must never be stopped, so the tests that stop a server start a `LocalStack` of
their own. The coordinator and the learners are real `diloco` processes; the test only looks at
Redis and S3 from outside, and kills or restarts servers for real.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from diloco.storage import codecs
from diloco.storage.bus import Bus
from diloco.storage.history import latest_version, read_layout, read_manifest, sha256_hex
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement
from diloco.storage.settings import Endpoints
from rig import Rig
from harness import (announcements, join, make_coordinator, merged_ids, serving, spawn_coordinator, spawn_learner,
                     train, wait_for)

RUN = "faults"


def steps_of(bus: Bus, learner: str) -> int:
    return stats.step if (stats := bus.learner_stats().get(learner)) else 0


def assert_every_announcement_applied_once(endpoints: Endpoints) -> None:
    """Nothing lost, nothing applied twice: every delta announced is in exactly one manifest, or was
    dropped as stale with its reason (a learner whose pieces were queued through an outage may come
    back more than max_staleness versions behind: a recorded outcome, not a loss)."""
    bus, store = Bus(endpoints, RUN), ObjectStore(endpoints)
    wait_for("the coordinator to drain", lambda: bus.pending_count() == 0)
    applied: list[str] = []
    stale = {r.contribution_id for r in bus.refusals(count=10**6) if r.code == "stale"}
    for f in range(2):
        for v in range((latest_version(store, bus.keys, f) or 0) + 1):
            manifest = read_manifest(store, bus.keys, f, v)
            applied += [c.contribution_id for c in manifest.inputs]
            stale |= {r.contribution_id for r in manifest.refused if r.code == "stale"}
    assert len(applied) == len(set(applied)), "a contribution was applied twice"
    announced = {a.contribution_id for _, a in announcements(bus) if a.kind == "delta"}
    unaccounted = announced - set(applied) - stale
    print(f"{len(announced)} announced: {len(announced & set(applied))} applied, {len(announced & stale)} dropped as stale")
    assert not unaccounted, f"{len(unaccounted)} announced contribution(s) neither applied nor dropped as stale"


def test_heartbeats_expire_on_the_redis_clock(endpoints, run_id):
    bus = Bus(endpoints, run_id)
    bus.heartbeat("short", 1.0)
    bus.heartbeat("long", 30.0)
    assert set(bus.live_learners()) == {"short", "long"}
    time.sleep(1.2)
    assert bus.live_learners() == ["long"]


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_sigterm_learner_finishes_its_uploads_leaves_and_exits_143(endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    procs.append(spawn_coordinator(run_id, env, tmp_path))
    learner = spawn_learner(run_id, env, tmp_path, "spot", steps=5000, slowdown=2.0)
    procs.append(learner)
    bus = Bus(endpoints, run_id)
    wait_for("the learner to train 40 steps", lambda: steps_of(bus, "spot") >= 40, procs=procs)
    assert "spot" in bus.live_learners()
    t0 = time.monotonic()
    assert learner.terminate(timeout_s=30) == 143, learner.tail()  # preempted: "run me again"
    print(f"preempted learner exited {time.monotonic() - t0:.2f}s after SIGTERM")
    assert "SIGTERM" in learner.tail(50)
    assert "spot" not in bus.live_learners()  # it announced leaving instead of letting its lease lapse
    assert bus.learner_stats()["spot"].upload_failed == 0
    ours = [a.contribution_id for _, a in announcements(bus) if a.learner == "spot" and a.kind == "delta"]
    assert ours
    # The learner left on purpose: only the coordinator must stay up.
    wait_for("its last contributions to be merged", lambda: set(ours) <= set(merged_ids(endpoints, run_id)),
             procs=procs[:1])


@pytest.mark.slow  # 20 s, 8 of them with S3 down: `make test-slow` (the chaos run stops S3 too)
def test_s3_down_for_a_while_training_goes_on_and_nothing_is_lost(own_stack, tmp_path):
    stack, env, procs = own_stack
    procs.append(spawn_coordinator(RUN, env, tmp_path))
    learner = spawn_learner(RUN, env, tmp_path, "l0", steps=100_000, slowdown=2.0)
    procs.append(learner)
    bus = Bus(stack.endpoints, RUN)
    wait_for("two versions", lambda: bus.heads() and min(bus.heads().values()) >= 2, procs=procs)
    stack.stop_s3()
    down_at_step = steps_of(bus, "l0")
    time.sleep(8.0)  # S3 is down: uploads fail and are retried, the loop must not wait for them
    during = steps_of(bus, "l0")
    heads_before = bus.heads()
    stack.start_s3()
    print(f"learner trained {during - down_at_step} steps while S3 was down")
    assert during - down_at_step >= 20, "training stalled while S3 was down"
    wait_for("new versions after S3 came back", lambda: min(bus.heads().values()) > min(heads_before.values()) + 1,
             procs=procs)
    assert learner.terminate() == 143, learner.tail()
    stats = bus.learner_stats()["l0"]
    assert stats.upload_failed == 0, stats
    assert procs[0].alive(), procs[0].tail()
    assert_every_announcement_applied_once(stack.endpoints)


@pytest.mark.slow  # make test-slow (CI runs it after make test)
def test_redis_restarted_then_emptied_both_sides_go_on(own_stack, tmp_path):
    stack, env, procs = own_stack
    coordinator = spawn_coordinator(RUN, env, tmp_path, "--lease-s", "2")
    learner = spawn_learner(RUN, env, tmp_path, "l0", steps=100_000, slowdown=2.0)
    procs.extend([coordinator, learner])
    bus = Bus(stack.endpoints, RUN)
    wait_for("two versions", lambda: bus.heads() and min(bus.heads().values()) >= 2, procs=procs)

    stack.kill_redis()  # SIGKILL; its append-only file brings everything back
    time.sleep(2.0)
    stack.start_redis()
    restarted = bus.heads()
    wait_for("versions after the restart", lambda: min(bus.heads().values()) >= min(restarted.values()) + 2,
             procs=procs)

    store = ObjectStore(stack.endpoints)
    stack.wipe_redis()  # everything Redis knew is gone
    wait_for("the coordinator to rebuild Redis from S3", lambda: bus.counters().get("redis_rebuilds", 0) >= 1,
             procs=procs)
    in_s3 = {f: latest_version(store, bus.keys, f) for f in range(2)}
    assert all(bus.heads()[f] >= in_s3[f] for f in range(2)), (bus.heads(), in_s3)
    wait_for("versions after the wipe", lambda: min(bus.heads().values()) >= min(in_s3.values()) + 2, procs=procs)
    wait_for("the learner's heartbeat after the wipe", lambda: "l0" in bus.learner_stats(), procs=procs)
    adopted = bus.learner_stats()["l0"].adopted
    wait_for("the learner to take new versions", lambda: bus.learner_stats()["l0"].adopted > adopted, procs=procs)
    assert learner.terminate() == 143, learner.tail()
    assert coordinator.alive(), coordinator.tail()
    assert_every_announcement_applied_once(stack.endpoints)


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_announcements_lost_with_redis_are_found_in_s3_and_merged_once(own_stack):
    stack, _env, _procs = own_stack
    endpoints = stack.endpoints
    coord = make_coordinator(endpoints, RUN, lease_s=1.0)
    learner, opt = join(endpoints, RUN, coord, "l0")
    train(learner, opt, 4)  # fragment 0's delta, merged into version 1
    for _ in range(5):
        coord.step(block_ms=50)
    assert coord.bus.heads()[0] == 1
    train(learner, opt, 4)  # more, for both fragments: announced, but the coordinator does not read them before ...
    unread = [a.contribution_id for _, a in announcements(coord.bus)
              if a.kind == "delta" and not coord.bus.is_applied(a.contribution_id)]
    assert len(unread) == 2
    # ... and one stored by a learner that died before it could announce it.
    store, keys = ObjectStore(endpoints), coord.keys
    layout = read_layout(store, keys)
    orphan_key = keys.delta(1, "gone", 7)
    meta = {"run": RUN, "fragment": 1, "learner": "gone", "kind": "delta", "contribution_id": "d" * 32,
            "base_version": 0, "tokens": 40, "steps": 4, "step_time_s": 0.1, "deadline": 0.0}
    store.put(orphan_key, codecs.encode({s.name: torch.full(s.shape, 0.01) for s in layout.fragments[1]}, "fp32",
                                        meta=meta))
    stack.wipe_redis()  # ... Redis loses everything

    with serving(coord):
        bus = Bus(endpoints, RUN)
        wait_for("the lost contributions to be merged",
                 lambda: {*unread, "d" * 32} <= set(merged_ids(endpoints, RUN)))
    counters = bus.counters()
    assert counters["redis_rebuilds"] == 1 and counters["reannounced_from_s3"] == 3, counters
    applied = [c.contribution_id for f in range(2) for v in range(bus.heads()[f] + 1)
               for c in read_manifest(store, keys, f, v).inputs]
    assert len(applied) == len(set(applied)), "a contribution was applied twice"
    assert {*unread, "d" * 32} <= set(applied)
    learner.close()


@pytest.mark.slow  # test_announcements_lost_with_redis_are_found_in_s3_and_merged_once covers the same in `make test`
def test_an_announcement_lost_in_a_redis_restart_is_found_in_s3_and_merged(own_stack):
    """Redis restarts with its data but not its last writes (appendfsync everysec): here, a
    contribution stored in S3 whose announcement never made it. Once the coordinator has read the
    surviving announcements it sweeps S3 for objects stored before the outage and merges it."""
    stack, _env, _procs = own_stack
    endpoints = stack.endpoints
    coord = make_coordinator(endpoints, RUN, lease_s=5.0)
    learner, opt = join(endpoints, RUN, coord, "l0")
    train(learner, opt, 4)
    for _ in range(5):
        coord.step(block_ms=50)
    store, keys = ObjectStore(endpoints), coord.keys
    layout = read_layout(store, keys)
    lost = "e" * 32
    meta = {"run": RUN, "fragment": 0, "learner": "l1", "kind": "delta", "contribution_id": lost,
            "base_version": coord.bus.heads()[0], "tokens": 40, "steps": 4, "step_time_s": 0.1, "deadline": 0.0}
    store.put(keys.delta(0, "l1", 1), codecs.encode({s.name: torch.full(s.shape, 0.01) for s in layout.fragments[0]},
                                                    "fp32", meta=meta))
    with serving(coord):
        time.sleep(0.5)
        stack.kill_redis()
        time.sleep(2.0)
        stack.start_redis()
        bus = Bus(endpoints, RUN)
        wait_for("the lost announcement to be made again and merged", lambda: lost in merged_ids(endpoints, RUN),
                 timeout_s=60)
    counters = bus.counters()
    assert counters["outage_sweeps"] >= 1 and counters["reannounced_from_s3"] == 1, counters
    assert counters.get("redis_rebuilds", 0) == 0, counters  # Redis kept its data: no rebuild
    applied = [c.contribution_id for f in range(2) for v in range(bus.heads()[f] + 1)
               for c in read_manifest(store, keys, f, v).inputs]
    assert applied.count(lost) == 1
    learner.close()


def commit_after_a_snapshot(rig: Rig, stack, snapshot) -> tuple[int, Announcement, Announcement]:  # noqa: ANN001
    """Two live learners' pieces merged into the next version of fragment 0, Redis snapshotted to
    `snapshot` in between: the first piece was read and held (pending, not acknowledged), the second
    not sent. Returns the head before, and the two announcements."""
    for learner in ("good", "other"):
        rig.bus.heartbeat(learner, 600.0)  # two live learners: a round waits for both
    head = rig.head(0)
    _, first = rig.send_good("good")
    rig.coord.step()  # read, held in the open round: pending, unacknowledged
    stack.snapshot_redis(snapshot)
    _, second = rig.send_good("other")
    rig.coord.step()
    assert rig.head(0) == head + 1  # committed: both applied, both entries acknowledged
    return head, first, second


@pytest.mark.slow  # 9 s; `make test` keeps a commit refused because Redis forgot the head
def test_a_redis_that_forgot_a_commit_is_brought_up_to_s3_and_nothing_is_merged_twice(own_stack, caplog, tmp_path):
    """Redis restored from an older snapshot (or failed over to a lagging replica) forgets the
    commit of a version whose manifest is in S3, and the entry of one of its contributions is
    pending again. Before, the live coordinator trusted Redis's applied set: it merged that
    contribution a second time into a new manifest, was refused HEAD_MOVED and exited, and every
    later coordinator failed to roll forward (ALREADY_APPLIED). S3 is the truth: the coordinator
    commits the forgotten version again from its manifest and goes on."""
    stack, _env, _procs = own_stack
    caplog.set_level(logging.WARNING, logger="diloco.coordinator")
    rig = Rig(stack.endpoints, RUN, caplog, min_quorum=2)
    try:
        head, first, second = commit_after_a_snapshot(rig, stack, tmp_path / "snapshot")
        stack.restore_redis(tmp_path / "snapshot")  # forgets that commit; `first` is pending again
        assert rig.head(0) == head and not rig.bus.is_applied(first.contribution_id)
        with serving(rig.coord):
            wait_for("Redis to be brought up to S3", lambda: rig.head(0) == head + 1)
            rig.bus.heartbeat("good", 600.0)  # the snapshot predates nothing of theirs; keep them live
            rig.bus.heartbeat("other", 600.0)
            rig.send_good("good")
            _, later = rig.send_good("other")
            wait_for("the next round to merge", lambda: rig.bus.is_applied(later.contribution_id))
        ids = [c.contribution_id for v in range(1, rig.head(0) + 1)
               for c in read_manifest(rig.store, rig.keys, 0, v).inputs]
        assert ids.count(first.contribution_id) == 1 and ids.count(second.contribution_id) == 1, ids
        assert rig.bus.r.xpending_range(rig.keys.announcements, rig.keys.GROUP, "-", "+", 10) == []
        assert "Redis forgot commits" in caplog.text
    finally:
        rig.close()


@pytest.mark.slow  # a stack of its own (10 s): make test stays under 8 minutes, make test-slow runs it
def test_a_redis_restored_under_a_successor_merges_nothing_of_the_versions_it_read_again(own_stack, caplog, tmp_path):
    """`diloco chaos --seconds 600 --seed 7`: a coordinator died once its manifest was written; its
    successor committed that version from S3 as it started; then Redis was restored from a snapshot
    older than the commit, and one of the version's contributions came back pending and not applied
    before the successor noticed the restart. Checking Redis alone, it merged that contribution into
    its next version: applied twice. It knows what the manifests it read merged (`Fragment.applied`):
    the contribution is refused as a duplicate. (The snapshot here predates the successor's lease too,
    so its next commit is fenced: the test stops before it.)"""
    stack, _env, _procs = own_stack
    caplog.set_level(logging.WARNING, logger="diloco.coordinator")
    rig = Rig(stack.endpoints, RUN, caplog, min_quorum=2)
    try:
        head, first, second = commit_after_a_snapshot(rig, stack, tmp_path / "snapshot")
        rig.restart()  # the successor reads the head's manifest as it starts
        stack.restore_redis(tmp_path / "snapshot")  # forgets the commit: `first` is pending again
        assert rig.head(0) == head and not rig.bus.is_applied(first.contribution_id)
        for learner in ("good", "other"):
            rig.bus.heartbeat(learner, 600.0)
        third_entry, _ = rig.send_good("other")
        # Before its loop notices the restart: its own pending entry again (`first`), then `third`.
        # Had `first` been taken, the round would hold both learners and merge them.
        rig.coord.step()
        rig.coord.step()
        assert f"contribution {first.contribution_id} from good was applied in a committed version" in caplog.text
        assert latest_version(rig.store, rig.keys, 0) == head + 1  # nothing merged with it
        pending = rig.bus.r.xpending_range(rig.keys.announcements, rig.keys.GROUP, "-", "+", 10)
        assert [p["message_id"].decode() for p in pending] == [third_entry]  # `first` acknowledged, refused
    finally:
        rig.close()


def test_a_fragment_whose_load_stopped_halfway_is_loaded_again_whole(endpoints, caplog):
    """A merge reads the fragment's params, then its outer state; in `diloco chaos` S3 went away
    between the two reads, and the next round's merge found params without a state and the
    coordinator exited on an assertion. The two are taken together: a fragment holding one without
    the other is loaded again, whole (the state of such a fragment is set here by hand)."""
    rig = Rig(endpoints, f"halfway-{time.time_ns()}", caplog)
    try:
        head = rig.head(0)
        rig.send_good("good")
        rig.coord.step()
        assert rig.head(0) == head + 1
        frag = rig.coord.fragments[0]
        assert frag.params is not None
        frag.state = None  # params read, the state's GET failed
        rig.send_good("good")
        rig.coord.step()
        assert rig.head(0) == head + 2 and frag.state is not None
    finally:
        rig.close()


def test_a_commit_refused_because_redis_forgot_the_head_before_the_coordinator_noticed_brings_it_up_to_s3(
        own_stack, caplog, tmp_path):
    """Redis restored from an older snapshot between two merges, before the coordinator noticed the
    restart: its next commit finds Redis's head behind its own (HEAD_MOVED). Before, it exited; now it
    commits the forgotten versions from S3, its own new manifest included, and goes on."""
    stack, _env, _procs = own_stack
    caplog.set_level(logging.WARNING, logger="diloco.coordinator")
    rig = Rig(stack.endpoints, RUN, caplog)
    try:
        head = rig.head(0)
        stack.snapshot_redis(tmp_path / "snapshot")
        _, first = rig.send_good("good")
        rig.coord.step()
        assert rig.head(0) == head + 1
        stack.restore_redis(tmp_path / "snapshot")  # forgets that commit and the announcement
        _, second = rig.send_good("good")
        rig.coord.step()  # merges onto head + 1, which Redis no longer has
        assert rig.head(0) == head + 2
        ids = [c.contribution_id for v in range(1, head + 3) for c in read_manifest(rig.store, rig.keys, 0, v).inputs]
        assert ids == [first.contribution_id, second.contribution_id], ids
        assert rig.bus.is_applied(first.contribution_id) and rig.bus.is_applied(second.contribution_id)
        assert "Redis's head is behind ours" in caplog.text
    finally:
        rig.close()


def test_a_contribution_whose_announcement_was_lost_while_no_coordinator_ran_is_merged_at_start(endpoints, run_id):
    """Between two coordinators, a learner stored a contribution and Redis lost its announcement: the
    next coordinator's start sweeps S3 once it has read every surviving announcement, as after an
    outage, and merges it exactly once. The learner's own announcement, turning up late, is then
    acknowledged as repeated: not merged again, not refused."""
    first = make_coordinator(endpoints, run_id, lease_s=2.0)
    learner, opt = join(endpoints, run_id, first, "l0")
    train(learner, opt, 4)
    for _ in range(5):
        first.step(block_ms=50)
    first.close()
    store, keys = ObjectStore(endpoints), first.keys
    layout = read_layout(store, keys)
    lost = "f" * 32
    base = first.bus.heads()[1]
    meta = {"run": run_id, "fragment": 1, "learner": "l1", "kind": "delta", "contribution_id": lost,
            "base_version": base, "tokens": 40, "steps": 4, "step_time_s": 0.1, "deadline": 0.0}
    blob = codecs.encode({s.name: torch.full(s.shape, 0.01) for s in layout.fragments[1]}, "fp32", meta=meta)
    store.put(keys.delta(1, "l1", 1), blob)
    second = make_coordinator(endpoints, run_id, lease_s=2.0)
    bus = Bus(endpoints, run_id)
    with serving(second):
        wait_for("the lost contribution to be found in S3 and merged", lambda: lost in merged_ids(endpoints, run_id),
                 timeout_s=60)
        late = Announcement(kind="delta", run=run_id, fragment=1, learner="l1", seq=1, contribution_id=lost,
                            base_version=base, tokens=40, steps=4, step_time_s=0.1, object_key=keys.delta(1, "l1", 1),
                            size_bytes=len(blob), sha256=sha256_hex(blob), sent_at=0.0)
        bus.announce(late)
        wait_for("the late copy to be acknowledged", lambda: bus.counters().get("repeated_after_recovery") == 1)
    counters = bus.counters()
    assert counters["reannounced_from_s3"] == 1 and counters.get("contributions_refused", 0) == 0, counters
    assert bus.pending_count() == 0
    applied = [c.contribution_id for v in range(bus.heads()[1] + 1) for c in read_manifest(store, keys, 1, v).inputs]
    assert applied.count(lost) == 1
    learner.close()
