"""`diloco gc --keep-last N`: old objects go, every manifest and what replay of the kept range needs stays.

Real history from a real coordinator and learners (the session's Redis and S3 servers), then gc
through the command line (S3 settings only), checked by listing the bucket: the right objects are
gone, the kept range replays bit-exact, and older versions are reported as collected. A dry run
deletes nothing and lists exactly what the real pass then deletes. On a live run, a contribution
announced but not merged yet survives gc and is merged afterwards. An export directory is
collected the same way.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from diloco.infra.history.archive import export_run
from diloco.infra.history.gc import collect
from diloco.infra.history.replay import replay_run
from diloco.storage import codecs
from diloco.storage.errors import ConfigError
from diloco.storage.history import list_versions, read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.objects import ObjectStore
from harness import TINY_RUN, join, make_coordinator, train
from test_archive import cli
from test_replay import make_history

pytestmark = pytest.mark.slow  # trained runs collected and replayed: `make test-all`


def plant(store: ObjectStore, keys: RunKeys, heads: dict[int, int]) -> dict[str, str]:
    """Objects a real run leaves behind besides its versions, by what gc must do with them."""
    head = read_manifest(store, keys, 0, heads[0])
    blob = store.get(head.inputs[0].object_key, max_bytes=1 << 20)
    tensors, header = codecs.decode(blob, max_bytes=1 << 20)
    planted = {
        # Uploaded against the head and not merged yet (pending, or waiting to be announced again).
        "may_merge": (keys.delta(0, "l9", 1), codecs.encode(tensors, header.codec, meta=header.meta | {
            "learner": "l9", "contribution_id": "9" * 32, "base_version": heads[0]})),
        "unreadable_contributions": (keys.delta(0, "l9", 2), b"not a tensor object"),
        # A deposed coordinator's copy of a committed version, and a version being written right now.
        "other_epoch_objects": (keys.params(0, heads[0], head.epoch + 7), store.get(head.params_key, max_bytes=1 << 20)),
        "uncommitted_version": (keys.params(1, heads[1] + 1, 99), store.get(head.params_key, max_bytes=1 << 20)),
        "unchosen_genesis": (keys.genesis_params("l9", 0),
                             store.get(read_manifest(store, keys, 0, 0).inputs[0].object_key, max_bytes=1 << 20)),
    }
    for key, data in planted.values():
        store.put(key, data)
    return {what: key for what, (key, _) in planted.items()}


def deleted_keys(path) -> set[str]:  # noqa: ANN001
    report = json.loads(path.read_text())
    return {key for kind in report["deleted"]["by_kind"].values() for key in kind["keys"]}


def test_gc_deletes_what_replay_of_the_kept_range_does_not_need_and_replay_says_collected(endpoints, run_id, stack,
                                                                                       tmp_path):
    heads = make_history(endpoints, run_id, rounds=3)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    planted = plant(store, keys, heads)
    before = dict(store.list_sizes(keys.root))
    manifests = {(f, v): read_manifest(store, keys, f, v) for f, h in heads.items() for v in range(h + 1)}

    dry = cli(stack, endpoints, "gc", "--run", run_id, "--keep-last", "2", "--min-age-s", "0", "--dry-run", "-v",
              "--json", str(tmp_path / "dry.json"))
    assert dry.returncode == 0, dry.stderr
    print(dry.stdout)
    assert "(dry run: nothing deleted)" in dry.stdout and "would delete" in dry.stdout
    assert dict(store.list_sizes(keys.root)) == before
    would = deleted_keys(tmp_path / "dry.json")
    assert all(key in dry.stdout for key in would)  # -v lists every key

    real = cli(stack, endpoints, "gc", "--run", run_id, "--keep-last", "2", "--min-age-s", "0",
               "--json", str(tmp_path / "real.json"))
    assert real.returncode == 0, real.stderr
    print(real.stdout)
    gone = deleted_keys(tmp_path / "real.json")
    assert gone == would and f"deleted {len(gone)} object(s)" in real.stdout
    record = json.loads((tmp_path / "real.json").read_text())["record"]
    after = dict(store.list_sizes(keys.root))
    assert set(after) == (set(before) - gone) | {record}

    for (f, v), m in manifests.items():
        assert keys.manifest(f, v) in after  # every manifest: the run's record
        first = heads[f] - 1  # keep-last 2: versions head-1 and head replay, from the parent head-2
        assert (m.params_key in after) == (v >= first - 1) and (m.outer_state_key in after) == (v >= first - 1)
        assert all((c.object_key in after) == (v >= first) for c in m.inputs), (f, v)
    assert {what: key in after for what, key in planted.items()} == {
        "may_merge": True, "unreadable_contributions": False, "other_epoch_objects": False,
        "uncommitted_version": True, "unchosen_genesis": False}

    report = replay_run(store, keys)  # by default from the first replayable version
    assert report.ok, report.summary()
    assert [(c.fragment, c.version) for c in report.checks] == [
        (f, v) for f in sorted(heads) for v in (heads[f] - 1, heads[f])]
    starts = [n for n in report.notes if n.startswith("fragment ")]
    assert len(starts) == 2 and all("their inputs were deleted by gc --keep-last 2 --min-age-s 0" in n
                                    for n in starts), report.notes

    older = cli(stack, endpoints, "replay", "--run", run_id, "--fragment", "0", "--from", "0")
    print(older.stdout)
    assert older.returncode == 1
    assert f"{heads[0] - 1} collected (not replayable here)" in older.stdout, older.stdout
    assert ("first collected: fragment 0 version 0: not replayable: their inputs were deleted by gc --keep-last 2"
            in older.stdout)
    assert "COLLECTED" in older.stderr and "missing" not in older.stdout + older.stderr

    again = collect(store, keys, keep_last=2, min_age_s=0, dry_run=True)
    assert again.plan.deletions == [], again.summary()  # a second pass finds nothing more to do


def test_gc_of_a_live_run_keeps_an_announced_contribution_and_the_coordinator_then_merges_it(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"))
    learner, opt = join(endpoints, run_id, coord, "l0")
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    try:
        for _ in range(4):
            train(learner, opt, 4)
            for _ in range(4):
                coord.step(block_ms=50)
        heads = coord.bus.heads()
        assert min(heads.values()) >= 3, heads
        train(learner, opt, 4)  # announced, and the coordinator has not read it yet
        pending = set(store.list(keys.deltas_prefix())) - {
            c.object_key for f, h in heads.items() for v in range(h + 1) for c in read_manifest(store, keys, f, v).inputs}
        assert pending, "the learner announced nothing"

        result = collect(store, keys, keep_last=1, min_age_s=0)
        print(result.summary())
        assert set(result.plan.kept["may_merge"]) == pending
        assert all(store.exists(key) for key in pending)
        for f, head in heads.items():  # learners and a restarted coordinator load the head's params
            assert store.exists(read_manifest(store, keys, f, head).params_key)

        for _ in range(4):
            coord.step(block_ms=50)
    finally:
        learner.close()
        coord.close()
    merged = {c.object_key for f in heads for v in list_versions(store, keys, f) if v > heads[f]
              for c in read_manifest(store, keys, f, v).inputs}
    assert pending <= merged
    report = replay_run(store, keys)
    assert report.ok and {c.version for c in report.checks if c.fragment == 0} == set(
        range(heads[0], list_versions(store, keys, 0)[-1] + 1)), report.summary()


def test_gc_of_an_export_directory(endpoints, run_id, stack, tmp_path):
    heads = make_history(endpoints, run_id, rounds=2)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    out = tmp_path / "export"
    export_run(store, keys, out)
    in_bucket = dict(store.list_sizes(keys.root))

    proc = cli(stack, endpoints, "gc", "--dir", str(out), "--keep-last", "1", "--min-age-s", "0")
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    assert "deleted" in proc.stdout and "after writing" in proc.stdout
    report = replay_run(DirStore(out), keys)
    assert report.ok and [(c.fragment, c.version) for c in report.checks] == sorted(heads.items()), report.summary()
    assert len(list(DirStore(out).list(keys.root))) < len(in_bucket)
    assert dict(store.list_sizes(keys.root)) == in_bucket  # the bucket is another copy: untouched


def test_keep_last_below_one_is_refused(endpoints, run_id, stack):
    for n in (0, -2):
        with pytest.raises(ConfigError, match="--keep-last must be at least 1"):
            collect(ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id), keep_last=n)
    proc = cli(stack, endpoints, "gc", "--run", run_id, "--keep-last", "0")
    assert proc.returncode == 1 and "--keep-last must be at least 1" in proc.stderr, proc.stderr
