"""Wire protocol: round trips, and refusal of everything this version did not write."""

import dataclasses
import re
import msgpack
import pytest

from diloco.storage.errors import Refused
from diloco.storage.protocol import (SCHEMA_VERSION, check_id, Announcement, Collection, Contribution, FinishRequest, Layout,
                                     LearnerFinished, LearnerStats, Manifest, ParamSpec, Refusal, RunEnd, RunSpec,
                                     ObjectMeta, VersionEvent, VersionSettings, pack)


def announcement(**over):
    fields = dict(kind="delta", run="r1", fragment=2, learner="l-0", seq=7, contribution_id="ab" * 16,
                  base_version=3, tokens=4096, steps=50, step_time_s=0.02, object_key="p/r1/fragments/0002/l-0/7",
                  size_bytes=1234, sha256="cd" * 32, sent_at=1.5)
    fields.update(over)
    return Announcement(**fields)


def manifest():
    c = Contribution(contribution_id="ab" * 16, learner="l-0", seq=7, object_key="k", sha256="cd" * 32,
                     base_version=3, staleness=1, tokens=10, steps=2, weight=1.0, stream_id="1-0")
    return Manifest(run="r1", fragment=0, version=4, parent_version=3, params_key="a", params_sha256="b",
                    outer_state_key="c", outer_state_sha256="d", inputs=(c,), settings=VersionSettings(
                        kind="delta", outer_lr=0.7, outer_momentum=0.9, outer="fractional_nesterov", progress=0.5,
                        update_norm=1.5, downstream="int4", whatif_of="p/r0", whatif_changes="outer_lr=0.7"),
                    refused=(Refusal(contribution_id="", learner="?", code="bad_message", reason="r"),),
                    committed_at=2.0, epoch=3)


@pytest.mark.parametrize("record", [
    announcement(),
    announcement(kind="genesis", base_version=-1),
    manifest(),
    VersionEvent(run="r1", fragment=0, version=1, params_key="a", params_sha256="b", manifest_key="c",
                 contributions=("x", "y"), committed_at=3.0),
    RunSpec(run="r1", num_fragments=4, sync_every=50, overlap_steps=5, merge_rule="rebase", alpha=0.5,
            codec="int4", compress=True, max_object_bytes=1 << 20, created_at=0.0),
    Layout(fragments=((ParamSpec(name="a", shape=(2, 3), dtype="float32"),),
                      (ParamSpec(name="b", shape=(), dtype="float32"),))),
    Collection(run="r1", created_at=5.0, by="gc --keep-last 2", first_replayable=(3, 0), deleted_objects=7,
               deleted_bytes=900),
    announcement(final=True),
    LearnerFinished(learner="l-0", finished_at=9.0, steps=120, final=("ab" * 16,)),
    FinishRequest(run="r1", asked_at=9.0, by="diloco finish on host (pid 1)"),
    RunEnd(run="r1", finished_at=9.5, by="operator", reason="an operator asked", versions=(12, -1), epoch=2),
    LearnerStats(learner="l-0", step=12, tokens=3072, loss=2.5, step_time_s=0.03, adopted=4, uploaded=3,
                 bytes_uploaded=9000, sync_s=0.1, wall_s=0.4, pid=42, incarnation="0a1b2c3d"),
])
def test_round_trip(record):
    assert type(record).from_wire(record.to_wire()) == record


def body(record, **over):
    d = msgpack.unpackb(record.to_wire(), raw=False)
    d.update(over)
    return d


@pytest.mark.parametrize("mutate,code", [
    (lambda d: d.update(schema=SCHEMA_VERSION + 1), "unknown_schema"),
    (lambda d: d.pop("schema"), "unknown_schema"),
    (lambda d: d.update(type="VersionEvent"), "bad_message"),
    (lambda d: d.pop("tokens"), "bad_message"),
    (lambda d: d.update(extra=1), "bad_message"),
    (lambda d: d.update(tokens="many"), "bad_message"),
    (lambda d: d.update(tokens=True), "bad_message"),
    (lambda d: d.update(tokens=-1), "bad_message"),
    (lambda d: d.update(learner="../other"), "bad_id"),
    (lambda d: d.update(sha256="zz"), "bad_message"),
    (lambda d: d.update(kind="steal"), "bad_message"),
    (lambda d: d.update(deadline=float("inf")), "bad_message"),
    (lambda d: d.update(step_time_s=float("nan")), "bad_message"),
    (lambda d: d.update(sent_at=float("-inf")), "bad_message"),
])
def test_malformed_announcements_are_refused_with_reason(mutate, code):
    d = body(announcement())
    mutate(d)
    with pytest.raises(Refused) as err:
        Announcement.from_wire(pack(d))
    assert err.value.code == code
    assert err.value.reason


@pytest.mark.parametrize("blob,code", [
    (b"\xc1garbage", "bad_message"),
    (msgpack.packb([1, 2]), "bad_message"),
    (msgpack.packb(msgpack.ExtType(5, b"x")), "bad_message"),
    (b"\x00" * (2 << 20), "too_large"),
])
def test_garbage_is_refused(blob, code):
    with pytest.raises(Refused) as err:
        Announcement.from_wire(blob)
    assert err.value.code == code


def test_an_announcement_written_before_final_existed_decodes_as_not_final():
    d = body(announcement())
    d.pop("final")
    assert Announcement.from_wire(pack(d)) == announcement(final=False)


def test_invalid_run_spec_is_refused():
    d = body(RunSpec(run="r1", num_fragments=4, sync_every=50, overlap_steps=5, merge_rule="rebase", alpha=0.5,
                     codec="int4", compress=True, max_object_bytes=1, created_at=0.0), overlap_steps=50)
    with pytest.raises(Refused, match="overlap_steps"):
        RunSpec.from_wire(pack(d))


@pytest.mark.parametrize("over,says", [
    (dict(step_time_s="fast"), "step_time_s: expected a number, got str"),
    (dict(step_time_s=float("inf")), "step_time_s must be a finite number >= 0"),
    (dict(step_time_s=-0.5), "step_time_s must be a finite number >= 0"),
    (dict(step=-1), "step must be >= 0"),
    (dict(tokens=1.5), "tokens: expected an integer"),
    (dict(learner="../other"), "learner id"),
    (dict(mood="sunny"), "unknown fields ['mood']"),
    (dict(link_round_s=-1.0), "link_round_s must be a finite number >= 0"),
    (dict(link_round_s=float("nan")), "link_round_s must be a finite number >= 0"),
])
def test_learner_stats_that_are_not_what_a_learner_writes_are_refused(over, says):
    """A heartbeat's stats are read by the coordinator (the round clock) and by people: a learner
    that sends anything else is refused with a reason, not believed and not crashed on."""
    blob = pack(body(LearnerStats(learner="l-0", step=3, step_time_s=0.02), **over))
    with pytest.raises(Refused) as err:
        LearnerStats.from_wire(blob)
    assert says in err.value.reason


def test_learner_stats_without_a_loss_carry_nan():
    stats = LearnerStats.from_wire(LearnerStats(learner="l-0").to_wire())
    assert stats.loss != stats.loss and stats.step == 0


@pytest.mark.parametrize("bad", ["l-0\n", "l-0\r", "\nl-0", "l 0", "", "a" * 65, "-l0"])
def test_ids_are_refused_unless_the_whole_string_is_an_id(bad):
    with pytest.raises(Refused) as err:
        check_id("learner", bad)
    assert err.value.code == "bad_id" and repr(bad) in err.value.reason


def v1_manifest(settings: object, version: int = 4) -> bytes:
    """A manifest as builds before schema 2 wrote it: settings a map of scalars."""
    body = {k: v for k, v in msgpack.unpackb(manifest().to_wire()).items() if k != "settings"}
    return msgpack.packb(body | {"schema": 1, "version": version, "parent_version": version - 1, "settings": settings})


def test_a_schema_1_manifest_reads_as_this_build_writes_it():
    m = Manifest.from_wire(v1_manifest({"kind": "delta", "outer_lr": 0.35, "outer_momentum": 0.9,
                                        "merge": "radial_directional", "max_staleness": 2, "progress": 0.4}))
    assert m.settings == VersionSettings(kind="delta", outer_lr=0.35, outer_momentum=0.9, merge="radial_directional",
                                         max_staleness=2)  # a whole step's recorded progress was not used
    assert Manifest.from_wire(m.to_wire()) == m and msgpack.unpackb(m.to_wire())["schema"] == SCHEMA_VERSION == 3
    genesis = Manifest.from_wire(v1_manifest({"outer_lr": 0.7, "outer_momentum": 0.0}, version=0))
    assert genesis.settings.kind == "genesis" and genesis.settings.torch == ""
    for settings, why in (({"kind": "delta", "outer_lr": 0.7, "outer_momentum": 0.9, "speed": "x"}, "unknown fields"),
                          ({"kind": "delta", "outer_momentum": 0.9}, "missing fields"),
                          ([1, 2], "expected a map"), ({"kind": "delta", "outer_lr": 0.7, "outer_momentum": 1.0}, "in [0, 1)")):
        with pytest.raises(Refused, match=re.escape(why)) as exc:
            Manifest.from_wire(v1_manifest(settings))
        assert exc.value.code == "bad_message"


def test_an_object_meta_round_trips_through_a_header_map_and_a_partial_one_is_refused():
    meta = ObjectMeta(run="r1", fragment=2, learner="l-0", kind="delta", contribution_id="ab" * 16, base_version=5,
                      tokens=4096, steps=2, step_time_s=0.25, deadline=12.5, final=True)
    header = meta.to_meta()
    assert header["final"] == 1 and all(type(v) in (str, int, float) for v in header.values())
    assert ObjectMeta.from_meta(header, "k") == meta
    assert "final" not in dataclasses.replace(meta, final=False).to_meta()
    a = meta.announcement("p/r1/fragments/0002/l-0/0000000000000007", 7, 100, "cd" * 32, 1.0)
    assert (a.recovered, a.final, a.tokens, a.deadline, a.base_version) == (True, True, 4096, 12.5, 5)
    for bad in ({k: v for k, v in header.items() if k != "tokens"}, header | {"final": 2},
                header | {"steps": "2"}, header | {"extra": 1}, [1]):
        with pytest.raises(Refused) as exc:
            ObjectMeta.from_meta(bad, "k")
        assert exc.value.code == "bad_header" and "k: its header does not describe a contribution" in exc.value.reason
