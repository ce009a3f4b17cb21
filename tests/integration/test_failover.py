"""One coordinator at a time: the lease, its fencing epoch, standby takeover, a deposed coordinator.

Against the session's real Redis and S3. The in-process test drives two coordinators one step at
a time to walk the exact interleaving of a coordinator that stalls past its lease; the process
test SIGKILLs a real `diloco coordinator` while a `--standby` one waits and learners train.
"""

from __future__ import annotations

import signal
import time

import pytest

from diloco.coordinator.leadership import Fenced
from diloco.infra.local.fleet import Proc, diloco_command
from diloco.storage.bus import Bus
from diloco.storage.crashpoints import ENV as CRASH_ENV, POINTS
from diloco.storage.history import read_manifest
from diloco.storage.objects import ObjectStore
from harness import (announcements, join, make_coordinator, merged_ids, spawn_coordinator, spawn_learner, tiny_learner,
                     train, wait_all)

LEASE_S = 2.0


def test_a_deposed_coordinator_cannot_commit_and_its_written_version_is_adopted(endpoints, run_id):
    a = make_coordinator(endpoints, run_id, lease_s=1.0)
    learner, opt = join(endpoints, run_id, a, "l0")
    a.leadership.close(release=False)  # A stalls: it stops renewing but believes it still coordinates
    time.sleep(1.3)  # the lease's real TTL runs out
    b = make_coordinator(endpoints, run_id, lease_s=1.0)
    assert b.epoch > a.epoch

    train(learner, opt, 4)  # fragment 0's first delta
    first = [x for x in announcements(b.bus) if x[1].kind == "delta"][-1][1]
    with pytest.raises(Fenced, match="another coordinator holds"):
        for _ in range(10):
            a.step(block_ms=50)  # A merges it, writes version 1 to S3, and its Redis commit is refused
    store, bus = ObjectStore(endpoints), Bus(endpoints, run_id)
    late = read_manifest(store, bus.keys, 0, 1)
    assert late.epoch == a.epoch and [c.contribution_id for c in late.inputs] == [first.contribution_id]
    assert bus.heads()[0] == 0  # not committed in Redis

    train(learner, opt, 4)  # fragment 0's second delta
    for _ in range(10):
        b.step(block_ms=50)
    # B found A's version 1 in S3, adopted it (S3 is the truth), and merged the second delta on top.
    assert bus.heads()[0] == 2
    v1, v2 = read_manifest(store, bus.keys, 0, 1), read_manifest(store, bus.keys, 0, 2)
    assert v1 == late
    assert v2.epoch == b.epoch and first.contribution_id not in {c.contribution_id for c in v2.inputs}
    assert len(v2.inputs) == 1 and v2.inputs[0].learner == "l0"
    counters = bus.counters()
    assert counters["versions_adopted"] == 1
    assert counters.get("contributions_refused", 0) == 0, bus.refusals()
    assert bus.pending_count() == 0
    learner.close()
    b.close()


def test_a_restart_right_after_a_crash_waits_for_the_dead_coordinators_lease(endpoints, run_id):
    crashed = make_coordinator(endpoints, run_id, lease_s=3.0)
    crashed.leadership.close(release=False)  # dies holding the lease: nobody renews it, nobody releases it
    t0 = time.monotonic()
    restarted = make_coordinator(endpoints, run_id, lease_s=3.0)  # no --standby
    waited_s = time.monotonic() - t0
    assert restarted.epoch > crashed.epoch
    assert 1.0 < waited_s < 3.0 + 2.0, waited_s  # it waited for the lease to lapse, not longer
    restarted.close()


@pytest.mark.slow  # 40 s of leases running out; the chaos run kills coordinators in `make test` too
def test_standby_takes_over_within_the_lease_when_the_coordinator_is_killed(endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    lease = ["--lease-s", str(LEASE_S)]
    active = spawn_coordinator(run_id, env, tmp_path / "active", *lease)
    procs.append(active)
    bus = Bus(endpoints, run_id)
    deadline = time.monotonic() + 60
    while bus.r.get(bus.keys.lease) is None:
        assert time.monotonic() < deadline and active.alive(), active.tail()
        time.sleep(0.1)
    active_name = bus.r.get(bus.keys.lease).decode()
    standby = spawn_coordinator(run_id, env, tmp_path / "standby", *lease, "--standby")
    procs.append(standby)
    learners = [spawn_learner(run_id, env, tmp_path, f"l{i}", steps=400, seed=i, slowdown=3.0) for i in range(2)]
    procs.extend(learners)

    # A second coordinator without --standby refuses to run beside a live one.
    intruder = spawn_coordinator(run_id, env, tmp_path / "intruder", *lease)
    assert intruder.wait(30) == 1, intruder.tail()
    assert "--standby" in intruder.tail(), intruder.tail()

    deadline = time.monotonic() + 120
    while not bus.heads() or min(bus.heads().values()) < 2:
        assert time.monotonic() < deadline, bus.heads()
        time.sleep(0.2)
    active.kill()
    killed_at, heads_at_kill = time.monotonic(), bus.heads()
    while (holder := bus.r.get(bus.keys.lease)) is None or holder.decode() == active_name:
        assert time.monotonic() - killed_at < 4 * LEASE_S, "the standby did not take over"
        time.sleep(0.05)
    takeover_s = time.monotonic() - killed_at
    print(f"standby took over {takeover_s:.2f}s after the SIGKILL (lease {LEASE_S}s)")
    assert takeover_s <= LEASE_S + LEASE_S / 3 + 1.0  # the TTL, one standby poll, and slack for a busy machine

    wait_all(learners)
    deadline = time.monotonic() + 30
    while bus.pending_count():  # the standby drains what the learners announced last
        assert time.monotonic() < deadline, bus.pending_count()
        time.sleep(0.2)
    assert standby.wait(30) == 0, standby.tail()  # the learners finished: the run ends, its coordinator exits
    assert bus.run_end() is not None
    assert bus.r.get(bus.keys.lease) is None  # handed over at once on a clean stop

    heads = bus.heads()
    assert all(heads[f] > heads_at_kill[f] for f in heads), (heads, heads_at_kill)
    store, seen, epochs = ObjectStore(endpoints), set(), set()
    for f, head in heads.items():
        for v in range(head + 1):
            m = read_manifest(store, bus.keys, f, v)
            ids = {c.contribution_id for c in m.inputs}
            assert not ids & seen, f"fragment {f} version {v} re-applies a contribution"
            seen |= ids
            epochs.add(m.epoch)
    assert len(epochs) == 2  # both coordinators committed versions
    # Nothing lost: every delta announced is applied, or (a learner that kept training on the old
    # version through the takeover, more than max_staleness versions behind by the time its backlog
    # merged, which depends on the machine's load) dropped as stale, with its reason.
    refused = {r.contribution_id: r.code for r in bus.refusals()}
    assert set(refused.values()) <= {"stale"}, bus.refusals()
    announced = {a.contribution_id for _, a in announcements(bus) if a.kind == "delta"}
    assert announced == (seen & announced) | set(refused), announced - seen - set(refused)
    assert not seen & set(refused)


# Every step in `make test-slow` (13 s each), where the chaos run kills the coordinator at every step
# too; `make test` keeps the in-process failover tests above, so that it stays under 8 minutes.
@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.slow) for p in POINTS])
def test_coordinator_killed_at_each_commit_step_resumes_and_applies_everything_once(point, endpoints, run_id,
                                                                                    tmp_path, fleet_env):
    env, procs = fleet_env
    argv = diloco_command("coordinator", "--run", run_id, "--fragments", "2", "--sync-every", "4",
                          "--overlap-steps", "1", "--codec", "fp32", "--cadence", "steps", "--min-quorum", "1",
                          "--max-grace-s", "0", "--lease-s", "1")
    # Versions 0 of both fragments pass the publish points first: die at the first delta's version.
    hit = 1 if point == "fetched" else 3
    doomed = Proc("doomed", argv, tmp_path / "doomed.log", env | {CRASH_ENV: f"{point}:{hit}"}).start()
    procs.append(doomed)
    learner, opt = tiny_learner(endpoints, run_id, "l0")
    learner.start()  # genesis, committed by the doomed coordinator
    train(learner, opt, 4)  # fragment 0's first delta: the coordinator dies on its way to version 1
    assert doomed.wait(30) == -signal.SIGKILL, doomed.tail()
    assert f"crash point {point} reached" in doomed.tail()
    bus, store = Bus(endpoints, run_id), ObjectStore(endpoints)
    manifest_written = store.exists(bus.keys.manifest(0, 1))
    assert manifest_written == (point in ("manifest_written", "committed")), point

    procs.append(Proc("successor", argv, tmp_path / "successor.log", env).start())
    train(learner, opt, 12)  # more deltas for both fragments while the successor takes over
    learner.close()
    announced = {a.contribution_id for _, a in announcements(bus) if a.kind == "delta"}
    assert len(announced) >= 3  # the first one, then at least one per fragment (fast sends coalesce)
    deadline = time.monotonic() + 60
    while bus.pending_count() or not announced <= set(merged_ids(endpoints, run_id)):
        assert time.monotonic() < deadline, (bus.heads(), bus.pending_count(), procs[-1].tail())
        time.sleep(0.1)

    # Every delta the learner announced is in exactly one manifest; versions are contiguous.
    applied: list[str] = []
    for f, head in bus.heads().items():
        for v in range(head + 1):
            m = read_manifest(store, bus.keys, f, v)
            assert m.parent_version == v - 1
            applied += [c.contribution_id for c in m.inputs if v > 0]
    assert len(applied) == len(set(applied)), "a contribution was applied twice"
    assert set(applied) == announced
    assert bus.counters().get("contributions_refused", 0) == 0, bus.refusals()
