"""`diloco whatif`: a range re-derived with other settings into a scratch run, next to the real one.

Real history from a real coordinator and learners (the session's Redis and S3 servers). A
what-if with the recorded settings must reproduce every version bit for bit; one with another
outer lr drifts, says by how much (and what it does to the eval loss), and writes a run that
replays bit-exact. The run's own prefix is never written, and settings a what-if cannot change
are refused with the list of those it can.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from diloco.infra.history.archive import export_run
from diloco.infra.history.replay import replay_run
from diloco.infra.history.whatif import what_if
from diloco.storage.errors import ConfigError
from diloco.storage.history import list_versions, read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.objects import ObjectStore
from harness import TASK, TINY_RUN, global_eval, make_coordinator, train
from test_archive import cli
from test_replay import make_history
from diloco.workers.learner import Learner

pytestmark = pytest.mark.slow  # trained runs re-derived under other settings: `make test-all`


def test_a_what_if_with_the_recorded_settings_reproduces_every_version_exactly(endpoints, run_id, tmp_path):
    heads = make_history(endpoints, run_id, rounds=3)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    before = dict(store.list_sizes(keys.root))

    report, _ = what_if(store, keys, f"{endpoints.prefix}-same", {})
    print(report.summary())
    assert [(s.fragment, s.version) for s in report.steps] == [(f, v) for f in sorted(heads)
                                                               for v in range(1, heads[f] + 1)]
    assert all(s.identical and s.drift == 0.0 for s in report.steps) and report.model_drift == 0.0
    assert dict(store.list_sizes(keys.root)) == before  # the run's own prefix: only read

    scratch = RunKeys(f"{endpoints.prefix}-same", run_id)
    for f, head in heads.items():
        mine, theirs = read_manifest(store, scratch, f, head), read_manifest(store, keys, f, head)
        assert (mine.params_sha256, mine.outer_state_sha256) == (theirs.params_sha256, theirs.outer_state_sha256)
        assert mine.inputs == theirs.inputs  # the original contributions, with the weights they had
        assert mine.settings.whatif_changes == "no change"
    replayed = replay_run(store, scratch)
    assert replayed.ok and len(replayed.checks) == len(report.steps), replayed.summary()

    # The same from an export directory, into a prefix of that directory.
    out = tmp_path / "export"
    export_run(store, keys, out)
    report, _ = what_if(DirStore(out), keys, "whatif-dir", {}, fragment=1, start=2)
    assert [(s.fragment, s.version, s.identical) for s in report.steps] == [(1, v, True) for v in
                                                                          range(2, heads[1] + 1)]
    assert replay_run(DirStore(out), RunKeys("whatif-dir", run_id)).ok


def task_history(endpoints, run_id: str, rounds: int = 3) -> dict[int, int]:  # noqa: ANN001
    """The demo task's model (TASK), two learners on random gradients, `rounds` rounds; returns the heads."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"))
    learners = []
    for name in ("l0", "l1"):
        model = TASK.make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id=name, tokens_per_step=10)
        joining = threading.Thread(target=learner.start)
        joining.start()
        while joining.is_alive():
            coord.step(block_ms=50)
        learners.append((learner, opt))
    try:
        for _ in range(rounds):
            for learner, opt in learners:
                train(learner, opt, 4)
            for _ in range(4):
                coord.step(block_ms=50)
        return coord.bus.heads()
    finally:
        for learner, _ in learners:
            learner.close()
        coord.close()


def test_a_what_if_with_another_outer_lr_drifts_and_writes_a_run_that_replays(endpoints, run_id, stack, tmp_path):
    heads = task_history(endpoints, run_id)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    before = dict(store.list_sizes(keys.root))
    (tmp_path / "task.json").write_text(json.dumps(TASK.to_wire()))
    into = f"{endpoints.prefix}-lr"

    proc = cli(stack, endpoints, "whatif", "--run", run_id, "--into", into, "--set", "outer_lr=0.2",
               "--task", str(tmp_path / "task.json"), "--json", str(tmp_path / "whatif.json"))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "whatif.json").read_text())
    assert result["changes"] == {"outer_lr": 0.2} and result["model_drift"] > 0
    assert [(v["fragment"], v["version"]) for v in result["versions"]] == [
        (f, v) for f in sorted(heads) for v in range(1, heads[f] + 1)]
    assert all(v["drift"] > 0 and not v["identical"] for v in result["versions"])
    assert proc.stderr.count("drift ") == len(result["versions"])  # one progress line per version
    losses = result["eval_loss"]
    assert losses["recorded"] == global_eval(endpoints, run_id, heads) and losses["whatif"] != losses["recorded"]
    assert f"eval loss at the end of the range: recorded {losses['recorded']:.4f}" in proc.stdout
    assert f"diloco replay --run {run_id} --prefix {into}" in proc.stdout
    assert dict(store.list_sizes(keys.root)) == before

    scratch = RunKeys(into, run_id)
    m = read_manifest(store, scratch, 0, heads[0])
    assert m.settings.outer_lr == 0.2 and m.settings.whatif_changes == "outer_lr=0.2"
    assert [c.object_key for c in m.inputs] == [c.object_key for c in read_manifest(store, keys, 0, heads[0]).inputs]
    assert list_versions(store, scratch, 0) == list(range(0, heads[0] + 1))  # the parent (v0) copied, then 1..head

    replayed = cli(stack, endpoints, "replay", "--run", run_id, "--prefix", into)
    assert replayed.returncode == 0, replayed.stderr
    total = len(result["versions"])
    assert f"{total} version(s) checked over 2 fragment(s), {total} bit-exact, 0 diverged" in replayed.stdout


def test_a_what_if_refuses_unknown_settings_the_runs_own_prefix_and_a_used_scratch_prefix(endpoints, run_id, stack):
    make_history(endpoints, run_id, rounds=2)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    before = dict(store.list_sizes(keys.root))

    unknown = cli(stack, endpoints, "whatif", "--run", run_id, "--into", "x", "--set", "max_staleness=1")
    assert unknown.returncode == 1
    assert "cannot change 'max_staleness'; it can change outer_lr" in unknown.stderr, unknown.stderr
    assert "staleness_discount" in unknown.stderr

    for prefix in (endpoints.prefix, f"{endpoints.prefix}/{run_id}/whatif"):
        with pytest.raises(ConfigError, match="under the run's own objects"):
            what_if(store, keys, prefix, {"outer_lr": 0.1})
    assert dict(store.list_sizes(keys.root)) == before

    what_if(store, keys, "used", {"merge": "radial_directional"}, fragment=0)
    with pytest.raises(ConfigError, match="already holds objects"):
        what_if(store, keys, "used", {})
