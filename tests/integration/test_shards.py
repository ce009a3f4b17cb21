"""A run coordinated by several shards: each merges its own fragments under a lease and epoch of its own.

Against the session's real Redis and S3, coordinators in-process (their loops in threads, or stepped).
Shard k of K merges the fragments f with f % K == k and reads every announcement through a consumer
group of its own, acknowledging the other shards' at once; shard 0 keeps the round clock and ends the
run. The number of shards is one value per run: a coordinator of another number is refused while a
shard of the old one lives, and once they have all stopped, the change retires their epochs.
"""

from __future__ import annotations

import threading
import time

import pytest

from diloco.coordinator.leadership import Fenced
from diloco.infra.watch.render import coordinator_lines
from diloco.infra.watch.status import read_status
from diloco.storage.bus import Bus
from diloco.storage.errors import ConfigError
from diloco.storage.history import list_versions, read_manifest, read_run_end
from diloco.storage.keys import RunKeys, Shard
from diloco.infra.local.fleet import Proc
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import RunEnd
from harness import (announcements, assert_each_piece_merged_or_refused_stale_once, make_coordinator, merged_ids,
                     spawn_coordinator, spawn_learner, tiny_learner, train, two_shards_run, wait_all, wait_for)


def _groups(bus: Bus) -> set[str]:
    return {g["name"].decode() for g in bus.r.xinfo_groups(bus.keys.announcements)}


def test_two_shards_each_merge_their_own_fragments_exactly_once_and_the_run_ends(endpoints, run_id):
    def status_shows_the_shards(shards: list) -> None:  # `diloco status`
        assert [list(c.fragments) for c in shards] == [[0], [1]]
        assert shards[0].epoch != shards[1].epoch  # epochs stay unique across shards: version objects never collide
        status = read_status(Bus(endpoints, run_id), ObjectStore(endpoints))
        assert [(r.shard, r.fragments, r.epoch, r.holder) for r in status.coordinator.shards] == [
            (k, [k], c.epoch, c.leadership.holder) for k, c in enumerate(shards)]
        lines = coordinator_lines(status)
        assert lines[0] == "coordinator: 2 shards" and lines[2].startswith(
            f"  shard 1 (fragments 1): epoch {shards[1].epoch}, lease held by {shards[1].leadership.holder}"), lines

    shards, bus = two_shards_run(endpoints, run_id, status_shows_the_shards)
    store = ObjectStore(endpoints)
    end, heads = bus.run_end(), bus.heads()
    assert end is not None and end.versions == (heads[0], heads[1]) and end.epoch == shards[0].epoch
    for fragment, coord in enumerate(shards):
        assert heads[fragment] >= 2, heads
        epochs = {read_manifest(store, bus.keys, fragment, v).epoch for v in list_versions(store, bus.keys, fragment)}
        assert epochs == {coord.epoch}, (fragment, epochs)  # only its own shard wrote it
    assert_each_piece_merged_or_refused_stale_once(endpoints, run_id, bus)
    assert _groups(bus) == {"coordinator:0of2", "coordinator:1of2"}
    assert bus.pending_count() == 0
    assert bus.shard_count() == 2
    for k in range(2):
        assert bus.leadership(Shard(k, 2))[1] is None  # each handed its lease back on its way out


def test_a_coordinator_of_another_shard_count_is_refused_while_a_shard_lives(endpoints, run_id):
    live = make_coordinator(endpoints, run_id, shards=2, shard=0)
    with pytest.raises(ConfigError, match="--shards 2"):
        make_coordinator(endpoints, run_id, lease_s=1.0)
    with pytest.raises(ConfigError, match="would leave some without any"):
        make_coordinator(endpoints, run_id, shards=3, shard=2)  # the tiny run has 2 fragments
    live.close()


@pytest.mark.slow  # make test-slow; the two shards' whole run stays in make test
def test_changing_the_shard_count_fences_the_old_shards_and_loses_no_announcement(endpoints, run_id):
    """Two shards, then one coordinator for the run: a shard of the old count that wakes up late cannot
    commit, and a piece it had read but not merged is merged by the new coordinator."""
    old = [make_coordinator(endpoints, run_id, shards=2, shard=k, lease_s=1.0) for k in range(2)]
    learner, opt = tiny_learner(endpoints, run_id, "l0")

    def step_both() -> None:
        for coord in old:
            coord.step(block_ms=20)

    t = threading.Thread(target=learner.start)
    t.start()
    while t.is_alive():
        step_both()
    for coord in old:
        coord.leadership.close(release=False)  # both stall past their leases, holding open rounds
    train(learner, opt, 4)
    for coord in old:  # each shard reads its piece (pending in its group) and dies before merging it
        assert coord.bus.read_announcements(coord.config.consumer, block_ms=0)
    train(learner, opt, 4)  # announced while no coordinator runs
    pieces = [a for _, a in announcements(old[0].bus) if a.kind == "delta"]
    assert {a.fragment for a in pieces} == {0, 1} and len(pieces) >= 3
    time.sleep(1.3)

    new = make_coordinator(endpoints, run_id, lease_s=1.0)  # one shard now: the old ones' epochs are retired
    bus = new.bus
    assert bus.shard_count() == 1
    assert [bus.leadership(s)[0] for s in Shard(0, 2).layout()] == [0, 0]
    assert _groups(bus) == {RunKeys.GROUP}
    with pytest.raises(Fenced):
        for _ in range(10):
            old[0].step(block_ms=20)
    for _ in range(20):
        new.step(block_ms=20)
    merged = merged_ids(endpoints, run_id)
    assert all(merged.count(a.contribution_id) == 1 for a in pieces), (merged, pieces)
    assert bus.counters().get("contributions_refused", 0) == 0, bus.refusals()
    assert bus.pending_count() == 0
    learner.close()
    new.close()
    old[1].close(release=False)


@pytest.mark.slow  # real processes and a lease running out: about 40 s each
@pytest.mark.parametrize("replacement", ["standby", "cover"])
def test_a_killed_shard_is_replaced_and_the_others_carry_on(replacement, endpoints, run_id, tmp_path, fleet_env):
    """`diloco coordinator --shards 2 --shard k` processes, two demo learners: SIGKILL shard 1 mid-run.
    Its fragment is taken over by a `--standby` of shard 1 (`standby`), or, with no standby, by shard
    0's own process (`cover`: started with --cover-shards). Shard 0 never stops; the run ends, every
    coordinator exits 0, and every piece is merged once or refused as stale."""
    env, procs = fleet_env
    lease_s = 2.0

    def shard(k: int, name: str, *extra: str) -> Proc:
        p = spawn_coordinator(run_id, env, tmp_path / name, "--shards", "2", "--shard", str(k),
                              "--lease-s", str(lease_s), *extra)
        procs.append(p)
        return p

    # Shard 1's own coordinator first: shard 0's cover (`--cover-shards`) takes any shard whose lease
    # nobody holds, and would take shard 1 before a slower-starting process of its own did.
    one = shard(1, "shard1")
    bus = Bus(endpoints, run_id)
    wait_for("shard 1's lease", lambda: bus.leadership(Shard(1, 2))[1] is not None, [one])
    zero = shard(0, "shard0", *(["--cover-shards"] if replacement == "cover" else []))
    wait_for("both shards' leases", lambda: all(bus.leadership(s)[1] for s in Shard(0, 2).layout()), [zero, one])
    killed_holder = bus.leadership(Shard(1, 2))[1]
    standby = shard(1, "standby1", "--standby") if replacement == "standby" else zero
    learners = [spawn_learner(run_id, env, tmp_path, f"l{i}", steps=300, seed=i, slowdown=3.0) for i in range(2)]
    procs.extend(learners)
    wait_for("two versions of each fragment", lambda: len(bus.heads()) == 2 and min(bus.heads().values()) >= 2,
             [zero, one, *learners], timeout_s=120)
    zero_epoch = bus.leadership(Shard(0, 2))[0]
    one.kill()
    heads_at_kill = bus.heads()
    wait_for("the standby of shard 1 to take over",
             lambda: (h := bus.leadership(Shard(1, 2))[1]) is not None and h != killed_holder, [zero, standby],
             timeout_s=4 * lease_s + 10)
    if replacement == "cover":  # shard 0's process holds both leases now
        assert f"-{zero.pid}-" in bus.leadership(Shard(1, 2))[1]
    wait_all(learners)
    assert zero.wait(60) == 0, zero.tail()  # the learners finished: shard 0 ends the run
    assert standby.wait(30) == 0, standby.tail()  # and shard 1's new coordinator sees the end and exits
    assert bus.leadership(Shard(0, 2))[0] == zero_epoch  # shard 0 kept its lease throughout

    end, heads = bus.run_end(), bus.heads()
    assert end is not None and end.versions == (heads[0], heads[1])
    assert heads[1] > heads_at_kill[1] and heads[0] > heads_at_kill[0], (heads, heads_at_kill)
    store = ObjectStore(endpoints)
    epochs_of_1 = {read_manifest(store, bus.keys, 1, v).epoch for v in range(heads[1] + 1)}
    assert len(epochs_of_1) == 2 and zero_epoch not in epochs_of_1  # shard 1's two coordinators, not shard 0
    assert_each_piece_merged_or_refused_stale_once(endpoints, run_id, bus)


def test_a_shard_that_merges_after_the_run_ended_commits_nothing_and_the_end_is_exact(endpoints, run_id):
    """Shard 0 ends the run at the heads while shard 1 still holds a piece: shard 1's version is
    written to S3 but its commit is refused (the end fences it), its objects are withdrawn, and a
    later roll-forward never passes the end. Ending at heads that moved meanwhile writes nothing."""
    shards = [make_coordinator(endpoints, run_id, shards=2, shard=k) for k in range(2)]
    learner, opt = tiny_learner(endpoints, run_id, "l0")
    t = threading.Thread(target=learner.start)
    t.start()
    while t.is_alive():
        for coord in shards:
            coord.step(block_ms=20)
    train(learner, opt, 8)  # a piece of each fragment, announced
    bus, store = shards[0].bus, ObjectStore(endpoints)
    stale = RunEnd(run=run_id, finished_at=0.0, by="operator", reason="test", epoch=shards[0].epoch,
                   versions=(bus.heads()[0], bus.heads()[1] - 1))
    assert bus.end_at_heads(stale, shards[0].epoch) is None and bus.run_end() is None  # heads moved: nothing
    shards[0]._end("operator", "ended while shard 1 holds a piece")
    end = bus.run_end()
    assert end is not None and end.versions == (bus.heads()[0], 0) and read_run_end(store, bus.keys) == end
    deadline = time.monotonic() + 20
    while shards[1].ended is None and time.monotonic() < deadline:
        shards[1].step(block_ms=20)  # reads its piece, merges it, and its commit is refused
    assert shards[1].ended == end
    assert bus.heads()[1] == 0 and list_versions(store, bus.keys, 1) == [0]  # version 1 withdrawn from S3
    assert bus.refusals()[-1].code == "run_finished" and bus.pending_count() == 0  # its piece dealt with
    assert bus.end_at_heads(end, shards[0].epoch + 1) is False  # fenced: not shard 0's epoch
    learner.close()
    for coord in shards:
        coord.close()
    restarted = make_coordinator(endpoints, run_id, shards=2, shard=1)  # its roll-forward stops at the end
    assert restarted.ended == end and restarted.fragments[1].head == 0
    restarted.close()


def test_an_end_in_redis_only_is_recorded_in_s3_by_the_next_coordinator(endpoints, run_id):
    """The coordinator that ends a run writes Redis first, then S3: stopped in between, the next
    coordinator records the end in S3 from Redis."""
    coord = make_coordinator(endpoints, run_id)
    learner, opt = tiny_learner(endpoints, run_id, "l0")
    t = threading.Thread(target=learner.start)
    t.start()
    while t.is_alive():
        coord.step(block_ms=20)
    bus, store = coord.bus, ObjectStore(endpoints)
    heads = bus.heads()
    end = RunEnd(run=run_id, finished_at=1.0, by="operator", reason="test", epoch=coord.epoch,
                 versions=(heads[0], heads[1]))
    assert bus.end_at_heads(end, coord.epoch)  # ... and the coordinator stops here
    learner.close()
    coord.close()
    assert read_run_end(store, bus.keys) is None
    again = make_coordinator(endpoints, run_id)
    assert again.ended == end and read_run_end(store, bus.keys) == end
    again.close()
