"""`diloco export` / `diloco import` and `--dir`: a run's history as a local directory, for offline debugging.

A real coordinator and learners make a short history in the session's S3 server. It is exported
(S3 only, no Redis) to a directory, replayed bit-exact from the directory alone, brought up to
date incrementally, imported into another bucket and replayed from there. Damage to the exported
copy is reported at the version it touches.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import uuid

import pytest

from diloco.infra.history.archive import INDEX, dir_keys, export_run, import_keys, import_run
from diloco.infra.history.replay import replay_run
from diloco.infra.local.fleet import diloco_command, process_env
from diloco.storage.errors import ConfigError, Conflict
from diloco.storage.history import read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import ENV_REDIS_URL
from harness import create_bucket, fresh_endpoints
from test_replay import make_history

pytestmark = pytest.mark.slow  # trained runs exported, replayed and imported: `make test-all`


def cli(stack, endpoints, *argv: str) -> subprocess.CompletedProcess:
    """A `diloco` process with the test bucket's S3 settings and no Redis."""
    env = process_env({k: v for k, v in stack.env().items() if k.startswith("AWS_")} | endpoints.to_env())
    env.pop(ENV_REDIS_URL)
    return subprocess.run(diloco_command(*argv), env=env, capture_output=True, text=True, timeout=120)


def test_an_exported_run_replays_bit_exact_from_the_directory_and_imports_elsewhere(endpoints, run_id, stack,
                                                                                    tmp_path, monkeypatch):
    heads = make_history(endpoints, run_id, rounds=2)
    total = sum(h + 1 for h in heads.values())
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    in_bucket = dict(store.list_sizes(keys.root))
    out = tmp_path / "export"

    proc = cli(stack, endpoints, "export", "--run", run_id, "--dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"exported run {run_id}: {len(in_bucket)} objects" in proc.stdout, proc.stdout
    assert dict(DirStore(out).list_sizes(keys.root)) == in_bucket  # every object, same sizes
    index = json.loads((out / INDEX).read_text())
    assert index["runs"][run_id]["prefix"] == endpoints.prefix and index["runs"][run_id]["objects"] == len(in_bucket)

    # Replay from the directory alone: no bucket settings at all in the environment.
    env = process_env({})
    for name in list(env):
        if name.startswith(("DILOCO_", "AWS_")):
            env.pop(name)
    replayed = subprocess.run(diloco_command("replay", "--dir", str(out), "--json", str(tmp_path / "r.json")),
                              env=env, capture_output=True, text=True, timeout=120)
    assert replayed.returncode == 0, replayed.stderr
    assert f"{total} version(s) checked over 2 fragment(s), {total} bit-exact, 0 diverged" in replayed.stdout

    # A second export copies nothing (objects are immutable: same key and size, already there).
    again = export_run(store, keys, out)
    assert (again.objects, again.copied) == (len(in_bucket), 0)

    # Import into another bucket (same prefix: the manifests name it) and replay there.
    other = fresh_endpoints(stack, monkeypatch)
    other = dataclasses.replace(other, prefix=endpoints.prefix)
    imported = import_run(out, ObjectStore(other), dir_keys(out, None))
    assert (imported.objects, imported.copied) == (len(in_bucket), len(in_bucket))
    report = replay_run(ObjectStore(other), keys)
    assert report.ok and len(report.checks) == total, report.summary()


def test_damage_to_an_export_is_reported_at_its_version(endpoints, run_id, tmp_path):
    make_history(endpoints, run_id, rounds=2)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    out = tmp_path / "export"
    export_run(store, keys, out)
    victim = read_manifest(store, keys, 1, 2).inputs[0].object_key
    path = out / victim
    path.write_bytes(path.read_bytes()[:-7])  # truncated on disk
    report = replay_run(DirStore(out), dir_keys(out, run_id))
    assert [(c.fragment, c.version) for c in report.diverged] == [(1, 2)], report.summary()
    assert report.diverged[0].problems[0].code == "corrupt_input" and victim in report.diverged[0].problems[0].detail

    # A truncated copy is not mistaken for the history: the next export replaces nothing silently,
    # it refuses the different object (the directory is create-only like the bucket).
    with pytest.raises(Conflict, match="already exists with other contents"):
        export_run(store, keys, out)


def test_import_and_dir_errors_say_what_to_do(endpoints, run_id, tmp_path, stack):
    with pytest.raises(ConfigError, match="not a diloco export"):
        dir_keys(tmp_path, None)
    make_history(endpoints, run_id, rounds=2)
    out = tmp_path / "export"
    export_run(ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id), out)
    with pytest.raises(ConfigError, match=f"set DILOCO_S3_PREFIX={endpoints.prefix}"):
        import_keys(out, None, "another-prefix")
    with pytest.raises(ConfigError, match="not 'nope'"):
        dir_keys(out, "nope")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    create_bucket(stack.client(), bucket)
    proc = cli(stack, dataclasses.replace(endpoints, bucket=bucket), "import", "--dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"imported run {run_id}" in proc.stdout
    missing = cli(stack, endpoints, "replay", "--run", "no-such-run")
    assert missing.returncode == 1 and "no run spec" in missing.stderr
