"""`diloco bench coordinator` at a tiny size, on a stack of its own: the result is complete and
consistent (every contribution merged exactly once, none refused, figures positive, JSON written).
Nothing here looks at how fast it was."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from diloco.infra.local.fleet import diloco_command, process_env

pytestmark = pytest.mark.slow  # a benchmark's harness: `make test-all`


def test_bench_coordinator_merges_every_contribution_once_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "coordinator.json"
    argv = diloco_command("bench", "coordinator", "--fragment-mb", "0.25", "--tensors", "3", "--fragments", "2",
                          "--learners", "2", "--contributions", "6", "--repeats", "2", "--stack-dir",
                          str(tmp_path / "stack"), "--json", str(out))
    done = subprocess.run(argv, env=process_env({}), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ratio coordinator / raw GET" in done.stdout and "fetch_wait" in done.stdout

    result = json.loads(out.read_text())
    assert result["bench"] == "coordinator" and len(result["repeats"]) == 2
    for r in result["repeats"]:
        assert r["contributions"] == 6 and r["consistent"]
        assert r["merged"] == r["merged_distinct"] == 6 and r["refused"] == 0
        assert r["versions"] >= 2  # at least one per fragment
        assert r["contribution_bytes"] > 0
        for figure in ("raw_get_mb_s", "coordinator_mb_s", "contributions_per_s", "versions_per_s", "ratio"):
            assert r[figure] > 0, figure
        for phase in ("get", "verify", "merge", "tensors", "outer", "encode", "put", "manifest", "commit"):
            assert r["phases_s"][phase][0] > 0, phase
    assert result["median"]["ratio"] > 0
    # The same workload drained by 1 and by 2 coordinator processes (`--shards 1,2`, the default).
    assert [r["shards"] for r in result["sharded"]] == [1, 2, 1, 2] and "x K=1" in done.stdout
    for r in result["sharded"]:
        assert r["consistent"] and r["merged"] == r["merged_distinct"] == 6 and r["foreign_writes"] == 0
        assert r["contributions_per_s"] > 0 and r["ratio"] > 0
    assert set(result["by_shards"]) == {"1", "2"} and result["by_shards"]["1"]["x_one"] == 1
    assert set(result["phases_median"]) >= {"get", "verify", "merge", "tensors", "commit"}
