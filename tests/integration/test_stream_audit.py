"""What the tools that audit a run read of the announcements stream, through `Bus` (no raw Redis
outside storage/): the entries not dealt with yet, and the stream read outside any group."""

from __future__ import annotations

from diloco.storage.bus import Bus
from diloco.storage.errors import Refused
from diloco.storage.keys import Shard
from diloco.storage.protocol import Announcement


def _announce(bus: Bus, seq: int) -> str:
    a = Announcement(kind="delta", run=bus.run, fragment=0, learner="l0", seq=seq, contribution_id=f"{seq:032x}",
                     base_version=0, tokens=10, steps=1, step_time_s=0.01,
                     object_key=bus.keys.delta(0, "l0", seq), size_bytes=1, sha256="00" * 32, sent_at=1.0)
    return bus.announce(a)


def test_the_entries_not_dealt_with_are_those_pending_or_unread_by_some_group(endpoints, run_id):
    bus = Bus(endpoints, run_id, quick=True)
    ids = [_announce(bus, seq) for seq in range(4)]
    bus.r.xadd(bus.keys.announcements, {b"junk": b"1"})  # an entry that does not decode
    assert bus.unfinished_entries(ids) == set(ids)  # no group yet: nothing was read
    shards = [Bus(endpoints, run_id, Shard(k, 2)) for k in range(2)]
    shards[0].ensure_group()
    read = shards[0].read_announcements("c", count=3, block_ms=0)
    shards[0].ack([read[0][0]])
    shards[1].read_announcements("c", count=10, block_ms=0)
    shards[1].ack(ids)
    # Shard 0 acknowledged the first, holds the next two pending and has not read the last;
    # shard 1 has read and acknowledged them all.
    assert bus.unfinished_entries(ids) == set(ids[1:])
    shards[0].ack(ids[1:3])
    assert bus.unfinished_entries(ids) == {ids[3]}

    entries = bus.announcements_after("0")
    assert [eid for eid, _ in entries[:4]] == ids
    assert [a.contribution_id for _, a in entries[:4]] == [f"{seq:032x}" for seq in range(4)]
    assert isinstance(entries[4][1], Refused)  # parsed as the coordinator parses it
    assert bus.announcements_after(entries[-1][0]) == []
