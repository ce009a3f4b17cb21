"""A history written before schema 2 (manifest settings a map, not a record) still replays bit for
bit: tests/data/v1-export is a two-learner run exported by the last schema-1 build (b335a2d)."""

from __future__ import annotations

import shutil
from pathlib import Path

from diloco.infra.history.archive import dir_keys
from diloco.infra.history.replay import replay_run
from diloco.storage.history import read_manifest
from diloco.storage.localdir import DirStore
from diloco.storage.protocol import unpack

EXPORT = Path(__file__).resolve().parents[1] / "data" / "v1-export"


def test_a_schema_1_export_replays_bit_exact(tmp_path):
    directory = shutil.copytree(EXPORT, tmp_path / "export")  # replay may write its scratch files beside
    store, keys = DirStore(directory), dir_keys(directory, "v1-history")
    raw = store.get(keys.manifest(1, 2), max_bytes=1 << 20)
    assert unpack(raw, max_bytes=1 << 20)["schema"] == 1
    report = replay_run(store, keys)
    assert report.ok and len(report.checks) == 6, report.summary()
    settings = read_manifest(store, keys, 1, 2).settings
    assert settings.kind == "delta" and settings.outer == "fractional_nesterov" and settings.torch
