"""`diloco replay` (invariant 4): every committed version re-derived from S3 alone, bit for bit.

A real coordinator and two real learners (in this process, against the session's Redis and S3)
make a short history: rounds with one or two learners, a learner's two pieces in one round, and
whatever staleness the learners' timing gives. Replay then reads only S3, never Redis, and must
find every version bit-exact; tampering with one input object or one recorded weight must be
reported at exactly that fragment and version, with a reason, and make the command fail.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess

import pytest

from diloco.coordinator.policy import RoundConfig
from diloco.infra.cli import build_parser
from diloco.infra.history.replay import ReplayReport, replay_run
from diloco.infra.local.fleet import diloco_command, process_env
from diloco.storage import codecs
from diloco.storage.history import read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import ENV_REDIS_URL, Endpoints
from harness import TINY_RUN, join, make_coordinator, train, two_learners


def make_history(endpoints: Endpoints, run_id: str, rounds: int = 3) -> dict[int, int]:
    """Two learners, `rounds` rounds; l1 trains twice as many steps as l0 in each. Returns the heads."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"))
    l0, opt0 = join(endpoints, run_id, coord, "l0")
    l1, opt1 = join(endpoints, run_id, coord, "l1")
    try:
        for _ in range(rounds):
            train(l0, opt0, 4)  # H = 4: fragment 0 is due at steps 4, 8, ...; fragment 1 at 6, 10, ...
            train(l1, opt1, 8)
            for _ in range(4):
                coord.step(block_ms=50)
        heads = coord.bus.heads()
    finally:
        l0.close()
        l1.close()
        coord.close()
    assert min(heads.values()) >= 2, heads
    return heads


def dead_redis(endpoints: Endpoints) -> Endpoints:
    """`endpoints` with a Redis URL on a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dataclasses.replace(endpoints, redis_url=f"redis://127.0.0.1:{port}/0")


def replay(endpoints: Endpoints, run_id: str, **kwargs) -> ReplayReport:  # noqa: ANN003
    return replay_run(ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id), **kwargs)


def test_a_run_replays_bit_exact_from_s3_alone(endpoints, run_id):
    heads = make_history(endpoints, run_id)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    merged = [read_manifest(store, keys, f, v) for f, head in heads.items() for v in range(1, head + 1)]
    assert any(len({c.learner for c in m.inputs}) == 2 for m in merged), "no round merged both learners"

    seen = []
    report = replay(dead_redis(endpoints), run_id, progress=seen.append)
    print(report.summary())
    assert report.ok, report.summary()
    expected = [(f, v) for f in sorted(heads) for v in range(heads[f] + 1)]
    assert [(c.fragment, c.version) for c in report.checks] == expected
    assert [(c.fragment, c.version) for c in seen] == expected  # progress, one call per version
    assert all(c.bit_exact for c in report.checks)

    # A range of one fragment starts from the stored parent of its first version.
    part = replay(dead_redis(endpoints), run_id, fragment=1, start=1, end=2)
    assert part.ok and [(c.fragment, c.version) for c in part.checks] == [(1, 1), (1, 2)]


def tamper_input(store: ObjectStore, keys: RunKeys, fragment: int, version: int) -> str:
    """Replace a merged input object by a valid object of other values (a plain PUT, as a rogue
    writer with bucket-wide credentials could); returns its key."""
    key = read_manifest(store, keys, fragment, version).inputs[0].object_key
    blob = store.get(key, max_bytes=1 << 20)
    tensors, header = codecs.decode(blob, max_bytes=1 << 20)
    forged = codecs.encode({n: t + 1.0 for n, t in tensors.items()}, header.codec, meta=header.meta)
    store.put(key, forged, create_only=False)
    return key


def tamper_weight(store: ObjectStore, keys: RunKeys, fragment: int, version: int) -> None:
    """Re-upload a manifest whose first input's recorded weight is halved."""
    m = read_manifest(store, keys, fragment, version)
    first = dataclasses.replace(m.inputs[0], weight=m.inputs[0].weight / 2)
    store.put(keys.manifest(fragment, version), dataclasses.replace(m, inputs=(first, *m.inputs[1:])).to_wire(),
              create_only=False)


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_tampering_is_reported_at_exactly_that_version_and_fails_the_command(endpoints, run_id, tmp_path,
                                                                             stack, monkeypatch):
    heads = make_history(endpoints, run_id)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    forged_key = tamper_input(store, keys, 0, 2)
    tamper_weight(store, keys, 1, 1)

    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(ENV_REDIS_URL)  # S3 only
    out = tmp_path / "replay.json"
    argv = ["replay", "--run", run_id, "--json", str(out)]
    args = build_parser(argv).parse_args(argv)  # not cli.main: it would configure this process's logging
    assert args.handler(args) == 1
    result = json.loads(out.read_text())
    assert result["checked"] == sum(h + 1 for h in heads.values()) and not result["ok"]
    diverged = [v for v in result["versions"] if not v["bit_exact"]]
    assert [(v["fragment"], v["version"]) for v in diverged] == [(0, 2), (1, 1)], diverged

    corrupt, weights = diverged
    assert [p["code"] for p in corrupt["problems"]] == ["corrupt_input"]
    assert forged_key in corrupt["problems"][0]["detail"] and "sha256" in corrupt["problems"][0]["detail"]
    assert result["first_divergence"] == corrupt
    codes = [p["code"] for p in weights["problems"]]
    assert codes[0] == "weights" and "params" in codes, weights  # recorded weights are the ones replayed
    assert "merge_weights recomputed" in weights["problems"][0]["detail"]
    # The versions after a divergence are checked on their own, from the stored parent, and pass.
    assert all(v["bit_exact"] for v in result["versions"] if (v["fragment"], v["version"]) > (0, 2)
               and v["fragment"] == 0)


@pytest.mark.slow  # make test-slow (CI runs it after make test)
def test_replay_command_prints_progress_and_summary_without_redis(endpoints, run_id, tmp_path, stack):
    heads = make_history(endpoints, run_id, rounds=2)
    env = process_env({k: v for k, v in stack.env().items() if k.startswith("AWS_")} | endpoints.to_env())
    env.pop(ENV_REDIS_URL)
    out = tmp_path / "replay.json"
    proc = subprocess.run(diloco_command("replay", "--run", run_id, "--json", str(out)), env=env,
                          capture_output=True, text=True, timeout=120)
    total = sum(h + 1 for h in heads.values())
    assert proc.returncode == 0, proc.stderr
    assert f"{total} version(s) checked over 2 fragment(s), {total} bit-exact, 0 diverged" in proc.stdout, proc.stdout
    assert proc.stderr.count(": bit-exact (") == total, proc.stderr
    assert json.loads(out.read_text())["bit_exact"] == total

    missing = subprocess.run(diloco_command("replay", "--run", "no-such-run"), env=env, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 1 and "has no run spec" in missing.stderr, missing.stderr


def test_a_round_with_a_stale_piece_keeps_it_out_of_the_momentum_and_replays_bit_exact(endpoints, run_id):
    """By default (`RoundConfig.stale_momentum` False) a stale piece moves the params but not the
    outer momentum; the manifest records it, and replay re-derives the version bit for bit."""
    with two_learners(endpoints, run_id) as (coord, (l0, opt0), (l1, opt1)):
        train(l0, opt0, 4)  # fragment 0 from l0, based on version 0...
        for _ in range(4):
            coord.step(block_ms=50)  # ...merged alone: version 1
        train(l1, opt1, 4)  # l1's piece, still based on version 0: one version stale
        train(l0, opt0, 4)  # l0's next, based on version 1
        for _ in range(4):
            coord.step(block_ms=50)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    history = [read_manifest(store, keys, 0, v) for v in range(1, coord.bus.heads()[0] + 1)]
    mixed = [m for m in history if {c.staleness for c in m.inputs} == {0, 1}]
    assert mixed, [[(c.learner, c.staleness) for c in m.inputs] for m in history]
    assert all(not m.settings.stale_momentum for m in history)
    report = replay(dead_redis(endpoints), run_id)
    assert report.ok and all(c.bit_exact for c in report.checks), report.summary()


def test_a_bounded_learners_pieces_stay_out_of_the_momentum_and_replay_bit_exact(endpoints, run_id):
    """By default (`RoundConfig.bounded_momentum` False) the pieces of a learner whose claims the
    merge cut (here: max_claim_ratio 1, and l1 sends twice l0's tokens into one round) move the
    params but not the outer momentum; the manifest records the bound, and replay re-derives the
    version bit for bit from it."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"),
                             round_cfg=RoundConfig(min_quorum=1, max_grace_s=0.0, max_claim_ratio=1.0))
    l0, opt0 = join(endpoints, run_id, coord, "l0")
    l1, opt1 = join(endpoints, run_id, coord, "l1")
    try:
        train(l0, opt0, 4)  # one piece of fragment 0...
        train(l1, opt1, 8)  # ...and two of l1's, all based on version 0: one round
        for _ in range(4):
            coord.step(block_ms=50)
        head = coord.bus.heads()[0]
    finally:
        l0.close()
        l1.close()
        coord.close()
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    history = [read_manifest(store, keys, 0, v) for v in range(1, head + 1)]
    cut = [c for m in history for c in m.inputs if c.bounded]
    assert cut and {c.learner for c in cut} == {"l1"}, [[(c.learner, c.bounded) for c in m.inputs] for m in history]
    assert all(not m.settings.bounded_momentum for m in history)
    report = replay(dead_redis(endpoints), run_id)
    assert report.ok and all(c.bit_exact for c in report.checks), report.summary()
