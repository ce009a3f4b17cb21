"""The spine end to end, against a real Redis and a real S3 server: learners -> coordinator -> versions.

Learners and the coordinator run as real `diloco` processes where a process matters (training,
SIGKILL); the checks on intake (duplicates, corruption) drive an in-process coordinator so they
can look at exactly one announcement at a time.
"""

from __future__ import annotations

import json
import time

import torch

from storage import codecs
from storage.bus import FIELD, Bus
from storage.history import read_layout, read_manifest, sha256_hex
from storage.objects import ObjectStore
from storage.protocol import Announcement
from harness import (announcements, global_eval, join, make_coordinator, spawn_coordinator, spawn_learner, train,
                     wait_all)

def test_three_learners_train_the_global_model(endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    coordinator = spawn_coordinator(run_id, env, tmp_path)
    procs.append(coordinator)
    # Slowed down so that the run spans several rounds of the clock (whose period is at least 1 s).
    learners = [spawn_learner(run_id, env, tmp_path, f"l{i}", steps=300, seed=i, slowdown=3.0) for i in range(3)]
    procs.extend(learners)
    wait_all(learners)
    time.sleep(1.0)
    coordinator.terminate()
    bus = Bus(endpoints, run_id)
    heads, counters = bus.heads(), bus.counters()
    assert set(heads) == {0, 1} and min(heads.values()) >= 3, heads
    assert counters["contributions_applied"] >= 2 + 3 * 2, counters  # two genesis, every learner on every fragment
    assert counters.get("contributions_refused", 0) == 0, bus.refusals()
    start, end = global_eval(endpoints, run_id, {0: 0, 1: 0}), global_eval(endpoints, run_id)
    print(f"global eval loss {start:.3f} -> {end:.3f}")
    assert end < start - 0.2, f"global eval loss {start:.3f} -> {end:.3f}"
    # Every version's manifest is in S3, contiguous, and names its inputs exactly once across versions.
    store, seen = ObjectStore(endpoints), set()
    contributors: dict[int, set[str]] = {f: set() for f in heads}
    for f, head in heads.items():
        for v in range(head + 1):
            m = read_manifest(store, bus.keys, f, v)
            assert m.parent_version == v - 1
            ids = [c.contribution_id for c in m.inputs]
            assert not (set(ids) & seen)
            seen.update(ids)
            share: dict[str, float] = {}  # a learner's pieces in one round each carry its (discounted) share
            for c in m.inputs:
                share[c.learner] = max(share.get(c.learner, 0.0), c.weight)
            assert 0 < sum(share.values()) <= 1.0 + 1e-9
            contributors[f].update(c.learner for c in m.inputs if v > 0)
    assert all(contributors[f] == {"l0", "l1", "l2"} for f in heads), contributors


def test_learner_sigkilled_midrun_others_go_on_and_it_rejoins(endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    procs.append(spawn_coordinator(run_id, env, tmp_path))
    # Survivors train long enough to be still at it well after the kill.
    survivors = [spawn_learner(run_id, env, tmp_path, f"l{i}", steps=500, seed=i) for i in range(2)]
    victim = spawn_learner(run_id, env, tmp_path, "victim", steps=80, seed=7)
    procs.extend([*survivors, victim])
    bus = Bus(endpoints, run_id)
    deadline = time.monotonic() + 120
    while bus.learner_stats().get("victim", {}).get("step", 0) < 25:
        assert time.monotonic() < deadline and victim.alive(), victim.tail()
        time.sleep(0.2)
    victim.kill()
    heads_at_kill = bus.heads()
    # The others keep training and versions keep coming without the victim.
    deadline = time.monotonic() + 60
    while min(bus.heads().values()) < min(heads_at_kill.values()) + 2:
        assert time.monotonic() < deadline, f"no progress after the kill: {bus.heads()} vs {heads_at_kill}"
        time.sleep(0.2)
    assert "victim" in bus.learner_stats()
    rejoined = spawn_learner(run_id, env, tmp_path, "victim", steps=20, seed=8)
    procs.append(rejoined)
    wait_all([*survivors, rejoined])
    log = (tmp_path / "victim.log").read_text()
    joined = [line for line in log.splitlines() if "joined run" in line]
    assert len(joined) == 2, log
    rejoin_versions = json.loads(joined[-1].split(" at versions ")[1])
    assert all(v >= heads_at_kill[f] for f, v in enumerate(rejoin_versions)), (rejoin_versions, heads_at_kill)


# ---- intake, driven one announcement at a time -------------------------------------------------

def test_duplicate_announcement_is_applied_once(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id)
    learner, opt = join(endpoints, run_id, coord, "l0")
    train(learner, opt, 4)  # fragment 0 due at step 4
    bus = coord.bus
    _, delta = [x for x in announcements(bus) if x[1].kind == "delta"][-1]
    bus.r.xadd(bus.keys.announcements, {FIELD: delta.to_wire()})  # what a retried XADD does
    for _ in range(5):
        coord.step(block_ms=50)
    manifest = read_manifest(coord.store, bus.keys, 0, 1)
    assert [c.contribution_id for c in manifest.inputs] == [delta.contribution_id]
    counters = bus.counters()
    assert counters["contributions_applied"] == 2 + 1  # two genesis versions and the delta
    assert counters["refused:duplicate"] == 1
    assert bus.pending_count() == 0
    learner.close()


def test_corrupt_fragment_is_refused_with_reason_and_run_goes_on(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id)
    learner, opt = join(endpoints, run_id, coord, "l0")
    bus, store = coord.bus, coord.store
    # A forged, corrupt contribution from "mallory": valid announcement, payload bytes flipped after upload.
    good = codecs.encode({s.name: torch.zeros(s.shape) for s in read_layout(store, bus.keys).fragments[0]}, "fp32")
    bad = bytearray(good)
    bad[-3] ^= 0xFF
    key = bus.keys.delta(0, "mallory", 1)
    store.put(key, bytes(bad))
    bus.announce(Announcement(kind="delta", run=run_id, fragment=0, learner="mallory", seq=1,
                              contribution_id="f" * 32, base_version=0, tokens=10, steps=1, step_time_s=0.1,
                              object_key=key, size_bytes=len(good), sha256=sha256_hex(good), sent_at=0.0))
    train(learner, opt, 4)
    for _ in range(5):
        coord.step(block_ms=50)
    refusals = bus.refusals()
    assert [(r.learner, r.code) for r in refusals] == [("mallory", "sha256_mismatch")]
    assert "altered or corrupted" in refusals[0].reason
    # The honest contribution was merged into version 1, whose manifest records the refusal.
    manifest = read_manifest(store, bus.keys, 0, 1)
    assert [c.learner for c in manifest.inputs] == ["l0"]
    assert [r.code for r in manifest.refused] == ["sha256_mismatch"]
    assert bus.counters()["refused:sha256_mismatch"] == 1
    assert bus.pending_count() == 0
    learner.close()


def test_malformed_and_misaddressed_entries_are_refused_and_the_run_goes_on(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id)
    learner, opt = join(endpoints, run_id, coord, "l0")
    bus = coord.bus
    _, genesis = announcements(bus)[0]
    bus.r.xadd(bus.keys.announcements, {FIELD: b"\xc1 not msgpack"})
    bus.r.xadd(bus.keys.announcements, {b"other": b"x"})
    # An announcement for a fragment the run does not have, pointing at someone else's object.
    forged = Announcement(**{**{f: getattr(genesis, f) for f in genesis.__dataclass_fields__},
                             "kind": "delta", "fragment": 7, "contribution_id": "e" * 32, "steps": 1})
    bus.announce(forged)
    train(learner, opt, 4)
    for _ in range(5):
        coord.step(block_ms=50)
    codes = sorted(r.code for r in bus.refusals())
    assert codes == ["bad_message", "bad_message", "unknown_fragment"], bus.refusals()
    assert all(r.reason for r in bus.refusals())
    assert bus.heads()[0] == 1  # the honest contribution was merged meanwhile
    assert bus.pending_count() == 0
    learner.close()
