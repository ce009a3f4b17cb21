"""A run that lasts weeks: what Redis holds stays bounded however many contributions go through.

The Redis side of 100,000 contributions is driven through the real `Bus` on the real server, the
way the coordinator drives it (announce, deliver to the group, commit a version that acknowledges
them, refuse some, trim), without the S3 round trips that would make it take an hour; then the
run's keys are measured. A round's size, and so its manifest's, is bounded by the coordinator's
`max_round_bytes` (checked here on a real coordinator), and the refusals a manifest lists by
`max_refusals_listed` (test_bad_input).
"""

from __future__ import annotations

import time
import uuid

import pytest

from diloco.storage import bus as bus_module
from diloco.storage.bus import FIELD, Bus
from diloco.storage.errors import Refused
from diloco.storage.history import read_manifest
from diloco.storage.protocol import Announcement, LearnerStats, Refusal, VersionEvent
from rig import Rig

CONTRIBUTIONS = 100_000
PER_VERSION = 100
KEEP_APPLIED = 5
KEPT = 1000


def run_keys_bytes(bus: Bus) -> dict[str, int]:
    prefix = bus.keys.announcements.removesuffix("announcements")
    return {k.decode(): int(bus.r.memory_usage(k, samples=0) or 0) for k in bus.r.scan_iter(match=prefix + "*")}


@pytest.mark.slow  # 100k announcements: 16 s
def test_100k_contributions_leave_redis_bounded(endpoints, run_id, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(bus_module, "VERSIONS_MAXLEN", 500)  # the streams' cap, reached within the test
    monkeypatch.setattr(bus_module, "COMMITS_KEPT", 200)
    monkeypatch.setattr(bus_module, "LEARNERS_FORGOTTEN_S", 0.0)  # lapsed heartbeats are forgotten at once
    bus = Bus(endpoints, run_id)
    bus.ensure_group()
    bus.r.set(bus.keys.epoch, 1)
    template = Announcement(kind="delta", run=run_id, fragment=0, learner="l", seq=0, contribution_id="0" * 32,
                            base_version=0, tokens=40, steps=4, step_time_s=0.1, object_key="k", size_bytes=1,
                            sha256="0" * 64, sent_at=0.0)
    sizes: list[dict[str, int]] = []
    versions = CONTRIBUTIONS // PER_VERSION
    for v in range(1, versions + 1):
        fragment = v % 2
        ids = [uuid.uuid4().hex for _ in range(PER_VERSION)]
        pipe = bus.r.pipeline(transaction=False)
        for i, cid in enumerate(ids):
            a = Announcement(**{**{f: getattr(template, f) for f in template.__slots__}, "contribution_id": cid,
                                "fragment": fragment, "learner": f"learner-{i % 10}"})
            pipe.xadd(bus.keys.announcements, {FIELD: a.to_wire()})
        pipe.execute()
        delivered = bus.r.xreadgroup(bus.keys.GROUP, "coordinator", {bus.keys.announcements: ">"}, count=PER_VERSION)
        entry_ids = [eid.decode() for eid, _ in delivered[0][1]]
        event = VersionEvent(run=run_id, fragment=fragment, version=(v + 1) // 2, params_key="p",
                             params_sha256="0" * 64, manifest_key="m", contributions=tuple(ids), committed_at=0.0)
        expected = None if v <= 2 else (v + 1) // 2 - 1
        result = bus.commit_version(event, expected_head=expected, epoch=1, ack_ids=entry_ids,
                                    keep_applied=KEEP_APPLIED)
        assert result.name == "COMMITTED", (v, result)
        if v % 10 == 0:  # a refusal now and then, and learners that come and go (made-up ids included)
            bus.refuse(None, Refusal(contribution_id=ids[0], learner="mallory", code="misaddressed", reason="x" * 500))
            bus.heartbeat(f"made-up-{v}", 0.001, LearnerStats(learner=f"made-up-{v}"), joined=True)
        if v % 100 == 0:
            bus.trim_announcements(keep=KEPT)
            sizes.append(run_keys_bytes(bus))
    # Nothing is left pending, and what recovery needs is still there: the ids of the last versions.
    assert bus.pending_count() == 0
    assert bus.applied_among(ids) == set(ids)
    # Each structure is within its documented bound...
    assert bus.r.xlen(bus.keys.announcements) <= KEPT + PER_VERSION
    assert bus.r.scard(bus.keys.applied) == 2 * KEEP_APPLIED * PER_VERSION  # two fragments
    assert bus.r.llen(bus.keys.applied_log(0)) == KEEP_APPLIED
    assert bus.r.hlen(bus.keys.commits) <= 2 * 200
    assert bus.r.xlen(bus.keys.versions) < 2 * 500 and bus.r.xlen(bus.keys.refusals) <= 100
    assert bus.r.zcard(bus.keys.learners) <= 16 and bus.r.hlen(bus.keys.learner_stats) <= 16
    assert bus.r.scard(bus.keys.joined) <= 16  # forgotten ids leave the joined set too
    # ... and the run's whole footprint stopped growing: the second 50,000 contributions added nothing.
    half, end = sum(sizes[len(sizes) // 2 - 1].values()), sum(sizes[-1].values())
    assert end < 1.15 * half, (half, end, sizes[-1])
    assert end < 8 << 20, sizes[-1]


def test_a_round_flooded_with_pieces_merges_at_most_its_cap(make_rig):
    rig: Rig = make_rig(min_quorum=10, max_round_bytes=1)  # cap: 1 byte / the fragment's size -> 1 piece
    rig.coord.step()
    head = rig.head()
    firsts = [rig.send_good(f"learner-{i}")[1] for i in range(3)]
    for k in range(3):  # the round is full at one piece: each step merges one, the earliest first
        rig.coord.step()
        assert rig.head() == head + 1 + k
    for k, a in enumerate(firsts):
        inputs = read_manifest(rig.store, rig.keys, 0, head + 1 + k).inputs
        assert [c.contribution_id for c in inputs] == [a.contribution_id]


def test_a_heartbeat_is_bounded_in_size_ttl_and_live_ids(endpoints, run_id, monkeypatch: pytest.MonkeyPatch):
    """What one learner's heartbeats may make the coordinator hold and read each loop: stats over
    MAX_STATS_BYTES are refused unwritten; a ttl of 1e9 s keeps an id live for MAX_LEASE_S at most
    (200k made-up ids heartbeated once stayed live for good, and the loop read them all twice a
    step: 2.3 ms -> 3.8 s); past MAX_LIVE_LEARNERS live ids a new one is refused, a live one goes on."""
    monkeypatch.setattr(bus_module, "MAX_LIVE_LEARNERS", 3)
    bus = Bus(endpoints, run_id)
    try:
        # The script itself refuses oversize stats (a typed LearnerStats is a few hundred bytes; a
        # learner calling the script with its own bytes gets nothing written).
        assert bus.heartbeat_script("big", 30.0, b"x" * (8 << 20)) == [0]
        assert bus.r.hget(bus.keys.learner_stats, "big") is None and "big" not in bus.fleet().live
        assert bus.heartbeat_script("big", 30.0, b"x" * 100)[0] == 1
        bus.leave("big")
        bus.heartbeat("forever", 1e9)
        lapses = bus.r.zscore(bus.keys.learners, "forever") - bus.server_time()
        assert 0 < lapses <= bus_module.MAX_LEASE_S
        with pytest.raises(ValueError, match="finite"):
            bus.heartbeat("nan", float("nan"))
        bus.heartbeat("a", 30.0)
        bus.heartbeat("b", 30.0)
        with pytest.raises(Refused, match="has 3 live learners") as full:
            bus.heartbeat("c", 30.0)
        assert full.value.code == "fleet_full" and bus.fleet().live == {"forever", "a", "b"}
        bus.heartbeat("a", 30.0, LearnerStats(learner="a", step=1))  # one already live goes on
        bus.leave("b")
        bus.heartbeat("c", 30.0)  # room again
        assert bus.fleet().live == {"forever", "a", "c"}
    finally:
        bus.close()


def test_ids_long_gone_leave_the_joined_set(endpoints, run_id, monkeypatch: pytest.MonkeyPatch):
    """Ids that joined and lapsed long ago are forgotten by later heartbeats, their membership of the
    joined set too: every fleet read returns it, and made-up ids joining in waves grew it for good."""
    monkeypatch.setattr(bus_module, "LEARNERS_FORGOTTEN_S", 0.0)  # lapsed heartbeats are forgotten at once
    bus = Bus(endpoints, run_id)
    try:
        for i in range(40):
            bus.heartbeat(f"made-up-{i}", 0.001, joined=True)
        time.sleep(0.01)
        for _ in range(3):  # each heartbeat forgets up to 16 lapsed ids
            bus.heartbeat("honest", 30.0, joined=True)
        fleet = bus.fleet()
        assert fleet.joined == {"honest"} and fleet.live == {"honest"}
    finally:
        bus.close()
