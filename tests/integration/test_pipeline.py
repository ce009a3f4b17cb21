"""The spine end to end, against a real Redis and a real S3 server: learners -> coordinator -> versions.

Learners and the coordinator run as real `diloco` processes (training, SIGKILL). The checks on
intake (duplicates, corruption, every other kind of bad input) are in tests/adversarial/test_bad_input.py.
"""

from __future__ import annotations

import pytest

import json
import time

from diloco.storage.bus import Bus
from diloco.storage.history import read_manifest
from diloco.storage.objects import ObjectStore
from harness import global_eval, make_coordinator, spawn_coordinator, spawn_learner, wait_all

def test_three_learners_train_the_global_model(endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    coordinator = spawn_coordinator(run_id, env, tmp_path)
    procs.append(coordinator)
    # Slowed down so that the run spans several rounds of the clock (whose period is at least 1 s).
    learners = [spawn_learner(run_id, env, tmp_path, f"l{i}", steps=300, seed=i, slowdown=3.0) for i in range(3)]
    procs.extend(learners)
    wait_all(learners)
    assert coordinator.wait(30) == 0, coordinator.tail()  # every learner finished: the run ends, and its coordinator
    bus = Bus(endpoints, run_id)
    heads, counters = bus.heads(), bus.counters()
    assert set(heads) == {0, 1} and min(heads.values()) >= 3, heads
    assert counters["contributions_applied"] >= 2 + 3 * 2, counters  # two genesis, every learner on every fragment
    # A learner the machine stalls for max_staleness rounds (4 s here) sends a delta the coordinator
    # must refuse as stale: that is the policy, not a fault. Any other refusal is a fault.
    refusals = bus.refusals()
    assert all(r.code == "stale" for r in refusals), refusals
    assert len(refusals) <= counters["contributions_applied"] // 10, refusals
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
            if m.settings.rate_steps == 0:
                assert 0 < sum(share.values()) <= 1.0 + 1e-9
            else:  # a slower learner's share raised to the fleet's rate (replay checks the figures)
                assert all(w > 0 for w in share.values())
                assert all(0 < c.usual <= m.settings.rate_steps for c in m.inputs)
            contributors[f].update(c.learner for c in m.inputs if v > 0)
    assert all(contributors[f] == {"l0", "l1", "l2"} for f in heads), contributors


@pytest.mark.slow  # `make test-slow`, beside the chaos run's learner kills
def test_learner_sigkilled_midrun_others_go_on_and_it_rejoins(endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    procs.append(spawn_coordinator(run_id, env, tmp_path))
    # Paced (at least 50 ms a step), so that on a fast machine too the victim is still training when
    # it is killed (80 steps: 4 s) and the survivors well after (500 steps: 25 s).
    survivors = [spawn_learner(run_id, env, tmp_path, f"l{i}", steps=500, seed=i, step_time_s=0.05) for i in range(2)]
    victim = spawn_learner(run_id, env, tmp_path, "victim", steps=80, seed=7, step_time_s=0.05)
    procs.extend([*survivors, victim])
    bus = Bus(endpoints, run_id)
    deadline = time.monotonic() + 120
    while (s.step if (s := bus.learner_stats().get("victim")) else 0) < 25:
        assert time.monotonic() < deadline and victim.alive(), victim.tail()
        time.sleep(0.2)
    assert victim.alive(), victim.tail()  # killed mid-run, not after its last step
    victim.kill()
    heads_at_kill = bus.heads()
    # The others keep training and versions keep coming without the victim.
    deadline = time.monotonic() + 60
    while min(bus.heads().values()) < min(heads_at_kill.values()) + 2:
        assert time.monotonic() < deadline, f"no progress after the kill: {bus.heads()} vs {heads_at_kill}"
        time.sleep(0.2)
    assert "victim" in bus.learner_stats()
    rejoined = spawn_learner(run_id, env, tmp_path, "victim", steps=20, seed=8, step_time_s=0.05)
    procs.append(rejoined)
    wait_all([*survivors, rejoined])
    log = (tmp_path / "victim.log").read_text()
    joined = [line for line in log.splitlines() if "joined run" in line]
    assert len(joined) == 2, log
    rejoin_versions = json.loads(joined[-1].split(" at versions ")[1])
    assert all(v >= heads_at_kill[f] for f, v in enumerate(rejoin_versions)), (rejoin_versions, heads_at_kill)


# ---- the loop --------------------------------------------------------------------------------

def test_a_step_that_may_not_wait_returns_at_once(endpoints, run_id):
    """Once a round's merge time has come the loop reads with block_ms=0: that must not block
    (Redis takes BLOCK 0 as "wait for the next entry"), or the merge waits for the socket timeout."""
    coord = make_coordinator(endpoints, run_id)
    coord.step()  # the first step after a start reads this consumer's pending entries (none)
    t0 = time.monotonic()
    coord.step(block_ms=0)
    assert time.monotonic() - t0 < 2.0
    coord.close()
