"""One coordinator at a time: the lease, its fencing epoch, standby takeover, a deposed coordinator.

Against the session's real Redis and S3. The in-process test drives two coordinators one step at
a time to walk the exact interleaving of a coordinator that stalls past its lease; the process
test SIGKILLs a real `diloco coordinator` while a `--standby` one waits and learners train.
"""

from __future__ import annotations

import time

import pytest

from coordinator.leadership import Fenced
from harness import announcements, join, make_coordinator, spawn_coordinator, spawn_learner, train, wait_all
from storage.bus import Bus
from storage.history import read_manifest
from storage.objects import ObjectStore

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
    assert standby.terminate() == 0
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
    assert bus.counters().get("contributions_refused", 0) == 0, bus.refusals()
