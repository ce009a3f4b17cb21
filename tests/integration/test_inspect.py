"""`diloco inspect`: a version's inputs and refusals, or a run per learner, as the manifests and objects say.

A real coordinator and two real learners (in this process, against the session's Redis and S3)
make a short history: a version merged from one learner alone, versions merged from both (one of
them sent two pieces), and a forged contribution that is refused. Inspect reads S3 only; its
numbers must be the manifests' (tokens, steps, weights, staleness, base versions) and the decoded
deltas' (norms); a single input is its version's merged update (cosine 1); the refusal is listed
with its reason; and an export read with `--dir` gives the very same JSON.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import uuid

import pytest
import torch

from diloco.coordinator.outer import round_delta
from diloco.infra.cli import build_parser
from diloco.infra.history.archive import export_run
from diloco.infra.history.gc import collect
from diloco.infra.local.fleet import diloco_command, process_env
from diloco.storage import codecs
from diloco.storage.errors import Refused
from diloco.storage.history import list_versions, read_manifest, sha256_hex
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement
from diloco.storage.settings import ENV_REDIS_URL, Endpoints
from harness import train, two_learners

FORGER = "mallory"


def drive(coord, until, steps: int = 40) -> None:  # noqa: ANN001
    for _ in range(steps):
        if until():
            return
        coord.step(block_ms=50)
    assert until(), "the coordinator did not get there"


def forge(coord) -> Announcement:  # noqa: ANN001
    """Announce an object that is not a tensor object at all, under the forger's own key."""
    blob = b"not a tensor object" * 4
    key = coord.keys.delta(0, FORGER, 1)
    coord.store.put(key, blob)
    a = Announcement(kind="delta", run=coord.spec.run, fragment=0, learner=FORGER, seq=1,
                     contribution_id=uuid.uuid4().hex, base_version=coord.bus.heads()[0], tokens=40, steps=4,
                     step_time_s=0.01, object_key=key, size_bytes=len(blob), sha256=sha256_hex(blob), sent_at=0.0)
    coord.bus.announce(a)
    return a


def make_inspect_history(endpoints: Endpoints, run_id: str) -> None:
    """Fragment 0 version 1 from l0 alone; a forged contribution refused; then rounds of both learners."""
    with two_learners(endpoints, run_id) as (coord, (l0, opt0), (l1, opt1)):
        train(l0, opt0, 4)  # H = 4: fragment 0 is due at steps 4, 8, ...; fragment 1 at 6, 10, ...
        drive(coord, lambda: coord.bus.heads()[0] == 1)
        forge(coord)
        drive(coord, lambda: coord.bus.counters().get("contributions_refused", 0) == 1)
        for _ in range(2):
            train(l0, opt0, 4)
            train(l1, opt1, 8)
            for _ in range(4):
                coord.step(block_ms=50)


@pytest.fixture
def history(endpoints: Endpoints, run_id: str, monkeypatch: pytest.MonkeyPatch) -> tuple[ObjectStore, RunKeys]:
    make_inspect_history(endpoints, run_id)
    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(ENV_REDIS_URL)  # the history tools read S3 only
    return ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)


def inspect(capsys: pytest.CaptureFixture, *argv: str) -> tuple[str, dict | None]:
    """`diloco inspect ARGV --json` in this process (not cli.main: it would configure logging): stdout, JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/inspect.json"
        argv = ("inspect", *argv, "--json", path)
        args = build_parser(list(argv)).parse_args(list(argv))
        assert args.handler(args) == 0
        with open(path) as f:
            return capsys.readouterr().out, json.load(f)


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors.values()])


def delta(store: ObjectStore, key: str) -> dict[str, torch.Tensor]:
    return codecs.decode(store.get(key, max_bytes=1 << 20), max_bytes=1 << 20)[0]


def test_a_versions_rows_are_its_manifests_and_its_deltas(history, capsys):
    store, keys = history
    seen_single = seen_pair = False
    for f in (0, 1):
        for v in list_versions(store, keys, f)[1:]:
            out, data = inspect(capsys, "--run", keys.run, "--fragment", str(f), "--version", str(v))
            [view] = data["versions"]
            m = read_manifest(store, keys, f, v)
            assert (view["fragment"], view["version"], view["parent_version"]) == (f, v, v - 1)
            recorded = [(c.learner, c.seq, c.tokens, c.steps, c.weight, c.staleness, c.base_version, c.waited_s)
                        for c in m.inputs]
            shown = [(r["learner"], r["seq"], r["tokens"], r["steps"], r["weight"], r["staleness"], r["base_version"],
                      r["waited_s"]) for r in view["inputs"]]
            assert shown == recorded
            deltas = [delta(store, c.object_key) for c in m.inputs]
            merged = flat(round_delta(deltas, [c.weight for c in m.inputs], m.settings))
            for row, d in zip(view["inputs"], deltas, strict=True):
                d = flat(d)
                assert row["norm"] == pytest.approx(float(d.norm()), rel=1e-9)
                assert row["cos_merged"] == pytest.approx(float(d @ merged / (d.norm() * merged.norm())), abs=1e-6)
            if len(m.inputs) == 1:
                seen_single = True
                assert view["inputs"][0]["cos_merged"] == pytest.approx(1.0, abs=1e-6)
                assert view["merged_norm"] == pytest.approx(m.settings.round_scale * m.inputs[0].weight
                                                            * view["inputs"][0]["norm"], rel=1e-5)
            if len({c.learner for c in m.inputs}) == 2:
                seen_pair = True
            assert f"fragment {f} version {v} (parent {v - 1}): {len(m.inputs)} input(s)" in out
            for c in m.inputs:
                assert str(c.seq) in out
    assert seen_single and seen_pair, "the history should hold a one-input and a two-learner version"


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_refusals_are_listed_with_their_reasons_and_counted_per_learner(history, capsys):
    store, keys = history
    refusing = [(f, v) for f in (0, 1) for v in list_versions(store, keys, f)
                if read_manifest(store, keys, f, v).refused]
    assert len(refusing) == 1, refusing
    f, v = refusing[0]
    out, data = inspect(capsys, "--run", keys.run, "--version", str(v))  # every fragment that has version v
    [view] = [x for x in data["versions"] if x["fragment"] == f]
    [refusal] = view["refused"]
    assert refusal["learner"] == FORGER and refusal["code"] == "bad_framing"
    assert refusal["object_key"] == keys.delta(0, FORGER, 1) and refusal["reason"]
    assert f"refused since version {v - 1}: 1" in out and refusal["reason"][:40] in out

    out, data = inspect(capsys, "--run", keys.run)
    learners = {x["learner"]: x for x in data["learners"]}
    assert learners[FORGER]["merged"] == 0 and learners[FORGER]["refused"] == {"bad_framing": 1}
    for name in ("l0", "l1"):
        inputs = [c for g in (0, 1) for w in list_versions(store, keys, g)[1:]
                  for c in read_manifest(store, keys, g, w).inputs if c.learner == name]
        assert learners[name]["merged"] == len(inputs) and learners[name]["tokens"] == sum(c.tokens for c in inputs)
        assert learners[name]["mean_weight"] == pytest.approx(sum(c.weight for c in inputs) / len(inputs))
        assert learners[name]["mean_staleness"] == pytest.approx(sum(c.staleness for c in inputs) / len(inputs))
        assert learners[name]["refused"] == {}
    assert data["versions"] == {str(g): list_versions(store, keys, g) for g in (0, 1)}
    assert "bad_framing x1" in out and f"run {keys.run}: 2 fragment(s), H=4" in out


@pytest.mark.slow  # make test-slow (CI runs it after make test)
def test_an_export_inspects_the_same_as_the_bucket_and_errors_say_what_to_do(history, capsys, tmp_path, stack,
                                                                            endpoints):
    store, keys = history
    export_run(store, keys, tmp_path / "export")
    last = list_versions(store, keys, 0)[-1]
    for argv in ((), ("--version", str(last)), ("--fragment", "1", "--from", "2")):
        _, from_bucket = inspect(capsys, "--run", keys.run, *argv)
        _, from_dir = inspect(capsys, "--dir", str(tmp_path / "export"), *argv)
        assert from_dir == from_bucket, argv

    # A damaged manifest in the copy stops the walk with the version named, and the bucket's stays intact.
    manifest = tmp_path / "export" / keys.manifest(0, last)
    manifest.write_bytes(manifest.read_bytes()[:-5])
    with pytest.raises(Refused, match=f"fragment 0 version {last}: the manifest cannot be read"):
        inspect(capsys, "--dir", str(tmp_path / "export"))
    inspect(capsys, "--run", keys.run)

    # The command itself, as a process: the table on stdout; a wrong run or version says what to check.
    env = process_env({k: v for k, v in stack.env().items() if k.startswith("AWS_")} | endpoints.to_env())
    env.pop(ENV_REDIS_URL)
    proc = subprocess.run(diloco_command("inspect", "--run", keys.run), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    assert proc.stdout.splitlines()[3].split()[:4] == ["learner", "merged", "versions", "tokens"], proc.stdout
    missing = subprocess.run(diloco_command("inspect", "--run", "no-such-run"), env=env, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 1 and "has no run spec" in missing.stderr, missing.stderr
    beyond = subprocess.run(diloco_command("inspect", "--dir", str(tmp_path / "export"), "--version", "999"),
                            env=env, capture_output=True, text=True, timeout=120)
    assert beyond.returncode == 1 and "has no committed version 999 (fragment 0: v0..v" in beyond.stderr, beyond.stderr


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_after_gc_the_manifests_still_say_who_contributed_what(history, capsys):
    """`diloco gc --keep-last 1` deletes the older versions' inputs: inspect still counts them from
    their manifests and says why it has no norms for them; blame leaves them out and says so."""
    store, keys = history
    _, before = inspect(capsys, "--run", keys.run)
    collect(store, keys, keep_last=1, min_age_s=0)
    out, after = inspect(capsys, "--run", keys.run)
    fields = ("learner", "merged", "versions", "tokens", "steps", "mean_weight", "mean_staleness", "refused")
    assert [{k: s[k] for k in fields} for s in after["learners"]] == [{k: s[k] for k in fields}
                                                                      for s in before["learners"]]
    assert any("count in merged, tokens, weights and staleness only: their inputs were deleted by gc" in p
               for p in after["problems"]), after["problems"]
    assert "note: fragment 0: versions 1.." in out

    out, data = inspect(capsys, "--run", keys.run, "--fragment", "0", "--version", "1")
    [view] = data["versions"]
    assert view["collected"] and all(r["norm"] is None for r in view["inputs"]) and view["inputs"]
    assert "cannot measure the deltas: not measurable: their inputs were deleted by gc" in out

    argv = ["blame", "--run", keys.run]
    args = build_parser(argv).parse_args(argv)
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "note: left out: fragment 0 before version" in out and "deleted by gc" in out, out


def test_a_version_says_how_long_each_piece_waited_for_its_round_to_close(make_rig, capsys, monkeypatch):
    """A piece that waited in its round for another learner's records how long
    (`Contribution.waited_s`); the piece that closed the round waited for nothing. On mixed links
    this says whose pieces hold the rounds open, and `inspect` shows it."""
    rig = make_rig(min_quorum=2)
    for learner in ("early", "late"):
        rig.bus.heartbeat(learner, 600.0)  # two live learners: the round waits for both
    head = rig.head(0)
    _, early = rig.send_good("early")
    rig.coord.step()
    assert rig.head(0) == head  # held open for the other learner
    time.sleep(0.6)
    _, late = rig.send_good("late")
    rig.coord.step()
    assert rig.head(0) == head + 1
    manifest = read_manifest(rig.store, rig.keys, 0, head + 1)
    waited = {c.contribution_id: c.waited_s for c in manifest.inputs}
    assert waited[early.contribution_id] >= 0.6 and waited[late.contribution_id] < 0.3, waited
    for name, value in rig.endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    out, data = inspect(capsys, "--run", rig.keys.run, "--fragment", "0", "--version", str(head + 1))
    assert {r["contribution_id"]: r["waited_s"] for r in data["versions"][0]["inputs"]} == waited
    assert "waited s" in out and f"{waited[early.contribution_id]:.2f}" in out
