"""`diloco blame`: a poisoned learner among honest ones is ranked first; honest learners are not suspects.

Four learners (in this process, the real `Learner`) train the demo TASK, a small GPT on a synthetic
language, so that progress is real and a harmful update is measurably harmful. A real coordinator
(in a thread, against the session's Redis and S3) merges their rounds with min_quorum 4, so every
round holds every learner. A poisoned learner's contributions are finite and well-formed; only
their direction or size is wrong:

- `uphill`: its inner optimizer maximizes the loss (AdamW with maximize=True), so its deltas point
  against the others';
- `noise`: after every step it adds Gaussian noise to its weights, so its deltas are mostly a
  random direction many times the others' norm.

Blame reads S3 (or an export) only, with the task for loss evidence.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import torch

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.cli import build_parser
from diloco.infra.history.archive import export_run
from diloco.storage.history import list_versions
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import ENV_REDIS_URL, Endpoints
from diloco.workers.learner import Learner
from diloco.workers.tasks.base import train_step
from harness import TASK, global_eval, serving

pytestmark = pytest.mark.slow  # three trained runs: `make test-all`

STEPS = 120
"""Inner steps per learner: 12 rounds of each fragment at H = 10."""
RUN = RunSettings(num_fragments=2, sync_every=10, overlap_steps=2, codec="int8", compress=True, cadence="steps")
MIN_VERSIONS = 10
"""Versions of evidence a blame needs here: as many as its loss impact re-derives per fragment
(`blame_run`'s `loss_versions`)."""
NOISE_STD = 0.02
"""Per-step weight noise of the `noise` poison: its deltas come out ~10x the honest ones."""


def train_fleet(endpoints: Endpoints, run_id: str, poison: dict[str, str]) -> None:
    """Learners l0..l3 (`poison` maps some of them to 'uphill' or 'noise') train STEPS steps in
    lockstep while a coordinator merges rounds of all four."""
    torch.set_num_threads(1)
    coord = Coordinator(endpoints, run_id, settings=RUN,
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=4, max_grace_s=5.0)))
    fleet = []
    with serving(coord):
        for i in range(4):
            name = f"l{i}"
            model = TASK.make_model(i)
            opt = TASK.make_inner_optimizer(model)
            if poison.get(name) == "uphill":
                for group in opt.param_groups:
                    group["maximize"] = True
            learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id=name,
                              tokens_per_step=TASK.tokens_per_step())
            learner.start()
            schedule = TASK.make_lr_schedule(opt, STEPS)
            fleet.append((name, learner, model, opt, schedule, TASK.train_batches(i)))
        try:
            for _step in range(STEPS):
                for name, _, model, opt, schedule, batches in fleet:
                    train_step(TASK, model, opt, schedule, next(batches))
                    if poison.get(name) == "noise":
                        with torch.no_grad():
                            for p in model.parameters():
                                p.add_(torch.randn_like(p) * NOISE_STD)
                time.sleep(0.005)  # lets the coordinator's thread and the fetchers in
            merged_everything(coord, [learner for _, learner, *_ in fleet])
        finally:
            for _, learner, *_ in fleet:
                learner.close()
        left_merged(coord)


def merged_everything(coord: Coordinator, learners: list[Learner], timeout_s: float = 60.0) -> None:
    """Wait until every piece the learners uploaded has been merged, or can only merge once they
    leave: leaving one by one would lower the quorum for the last round, and a piece still uploading
    would then merge in a round of its own.

    A learner whose piece reached a busy coordinator a round late has it merged beside its next one
    (one version holds two of its pieces), so its last piece of a fragment can find the others'
    already merged: with min_quorum 4 it waits until the fleet leaves. That is the end of this fleet's
    training, not a lost piece: every learner has sent as many pieces as the others (a fleet in
    lockstep), and nothing moves."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        sent = [learner.progress().uploaded for learner in learners]
        now = (sum(sent), coord.bus.counters().get("contributions_applied"), coord.bus.backlog().waiting)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 2.0 and (now[2] == 0 or len(set(sent)) == 1):
            return
        time.sleep(0.2)
    raise AssertionError(f"the learners' pieces were not all merged after {timeout_s:.0f}s: {last}")


def left_merged(coord: Coordinator, timeout_s: float = 30.0) -> None:
    """Wait until the pieces that waited for the fleet to leave have merged."""
    deadline = time.monotonic() + timeout_s
    while coord.bus.backlog().waiting and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not coord.bus.backlog().waiting, "pieces still wait after every learner left"
    time.sleep(1.0)  # the last round's version is published


def blame(tmp_path, *argv: str) -> dict:  # noqa: ANN001
    """`diloco blame ARGV --json` in this process (not cli.main: it would configure logging)."""
    path = tmp_path / f"blame-{uuid.uuid4().hex[:6]}.json"
    argv = ("blame", *argv, "--json", str(path))
    args = build_parser(list(argv)).parse_args(list(argv))
    assert args.handler(args) == 0
    return json.loads(path.read_text())


@pytest.fixture
def s3_only(endpoints: Endpoints, monkeypatch: pytest.MonkeyPatch, tmp_path) -> Endpoints:  # noqa: ANN001
    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(ENV_REDIS_URL)
    (tmp_path / "task.json").write_text(json.dumps(TASK.to_wire()))
    return endpoints


@pytest.mark.parametrize("poison, why", [
    ("uphill", "anti-aligned with the others in"),
    ("noise", "x the others' norm and less aligned with the consensus than the others in"),
])
def test_a_poisoned_learner_is_ranked_first(s3_only, run_id, tmp_path, capsys, poison, why):
    train_fleet(s3_only, run_id, {"l2": poison})
    result = blame(tmp_path, "--run", run_id, "--task", str(tmp_path / "task.json"))
    print(capsys.readouterr().out)
    first, *honest = result["learners"]
    assert first["learner"] == "l2", result["learners"]
    # min_quorum 4: every round holds every learner. 24 rounds are trained; a coordinator slow at the
    # start (a busy machine) merges a few rounds' pieces as one version: 14 in one fresh clone.
    assert result["with_evidence"] == result["versions"] >= MIN_VERSIONS
    # A clear margin, geometric and measured: it is a suspect for two reasons, none of the others is.
    assert first["suspect"] and why in first["verdict"], first["verdict"]
    assert "leaving it out lowered the eval loss in" in first["verdict"], first["verdict"]
    assert not any(b["suspect"] for b in honest), honest
    assert all(b["verdict"].startswith("consistent: aligned with the others") for b in honest), honest
    assert first["score"] > max(b["score"] for b in honest) + 0.05
    # Leaving the poisoned learner out helps in most re-derived versions (17 to 20 of 20 seen; a
    # version near the end, where the honest learners' deltas are small, can go either way).
    assert first["loss_worse"] >= 0.8 * first["loss_samples"] and first["loss_impact"] > 0
    assert all(b["loss_worse"] <= 0.1 * b["loss_samples"] and b["loss_impact"] < 0 for b in honest), honest
    if poison == "uphill":
        assert first["anti_aligned"] >= 0.9 * first["evidence"] and first["score"] > 0.2
    else:
        assert first["norm_ratio"] > 4 and all(b["norm_ratio"] < 2 for b in honest)


def test_honest_learners_are_not_suspects_and_an_export_says_the_same(s3_only, run_id, tmp_path, capsys):
    train_fleet(s3_only, run_id, {})
    start, end = global_eval(s3_only, run_id, {0: 0, 1: 0}), global_eval_heads(s3_only, run_id)
    assert end < start - 0.3, f"the honest learners should learn: eval loss {start:.3f} -> {end:.3f}"
    result = blame(tmp_path, "--run", run_id, "--task", str(tmp_path / "task.json"))
    print(capsys.readouterr().out)
    assert len(result["learners"]) == 4 and result["with_evidence"] >= MIN_VERSIONS
    assert not any(b["suspect"] for b in result["learners"]), result["learners"]
    assert "no learner is a suspect" in " ".join(result["notes"])
    assert all(b["anti_aligned"] <= 0.2 * b["evidence"] for b in result["learners"]), result["learners"]

    # The same history from an export, without any bucket: the same geometric evidence and verdicts.
    export_run(ObjectStore(s3_only), RunKeys(s3_only.prefix, run_id), tmp_path / "export")
    from_dir = blame(tmp_path, "--dir", str(tmp_path / "export"))
    from_bucket = blame(tmp_path, "--run", run_id)
    assert from_dir == from_bucket and from_dir["loss"] is None


def global_eval_heads(endpoints: Endpoints, run_id: str) -> float:
    """TASK's eval loss of the latest version of every fragment, read from S3 (Redis is not in the env)."""
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    return global_eval(endpoints, run_id, {f: list_versions(store, keys, f)[-1] for f in (0, 1)})
