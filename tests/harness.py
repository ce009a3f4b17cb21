"""Helpers shared by the integration tests (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest
import torch
import torch.distributed as dist

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.history.task_model import global_model
from diloco.infra.local.fleet import Proc, diloco_command, learner_argv, wait_until
from diloco.infra.local.stack import LocalStack, create_bucket
from diloco.storage.bus import Bus
from diloco.storage.history import list_versions, read_layout, read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement
from diloco.storage.settings import Endpoints
from diloco.workers.tasks.demo import DemoTask
from diloco.workers.learner import Learner


@contextmanager
def serving(coord: Coordinator) -> Iterator[None]:
    """The coordinator's loop in a background thread; its exception, if any, fails the test."""
    stop, failure = threading.Event(), []

    def loop() -> None:
        try:
            coord.serve(stop)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the test's thread)
            failure.append(exc)

    thread = threading.Thread(target=loop, name="coordinator", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
    if failure:
        raise failure[0]


def leave_process_group() -> NoReturn:
    """End a spawned gloo rank whose results are written: wait for the other ranks, then exit
    without running C++ destructors. gloo's teardown aborts now and then ("terminate called without
    an active exception", SIGABRT), in destroy_process_group or at exit, on ranks that finished."""
    dist.barrier()  # nobody closes its connections while another rank still reads from them
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fresh_endpoints(stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> Endpoints:
    """`stack` with a bucket and a key prefix of the calling test's own; AWS_* set for boto3."""
    for name, value in stack.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    tag = uuid.uuid4().hex[:12]
    bucket = f"test-{tag}"  # valid S3 name: lowercase, 3-63 chars, no underscores
    create_bucket(stack.client(), bucket)
    return dataclasses.replace(stack.endpoints, bucket=bucket, prefix=f"t{tag}")


# ---- an in-process coordinator driven one step at a time, and a tiny learner ---------------------

class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))


TINY_RUN = RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, codec="fp32", compress=False)


def make_coordinator(endpoints, run_id, *, settings: RunSettings = TINY_RUN, round_cfg: RoundConfig | None = None,  # noqa: ANN001
                     **config) -> Coordinator:
    """Two fragments, H = 4 steps, fp32 (`settings`); rounds merge as soon as one contribution is in
    (unless `round_cfg` says otherwise)."""
    return Coordinator(endpoints, run_id, settings=settings,
                       config=CoordinatorConfig(round=round_cfg or RoundConfig(min_quorum=1, max_grace_s=0.0), **config))


def tiny_learner(endpoints: Endpoints, run_id: str, name: str) -> tuple[Learner, torch.optim.Optimizer]:
    """A learner around Tiny and SGD, not started."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Learner(model, opt, run=run_id, endpoints=endpoints, learner_id=name, tokens_per_step=10), opt


def join(endpoints, run_id, coord, name) -> tuple[Learner, torch.optim.Optimizer]:  # noqa: ANN001
    """A learner joined through genesis, with the coordinator stepped in between."""
    learner, opt = tiny_learner(endpoints, run_id, name)
    start_beside(coord, learner)
    return learner, opt


def start_beside(coord, learner: Learner) -> None:  # noqa: ANN001
    """`learner.start()` in a thread while the in-process coordinator steps (joining waits for the
    run's version 0, which the coordinator commits); re-raises what the start raised."""
    raised: list[BaseException] = []

    def start() -> None:
        try:
            learner.start()
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    t = threading.Thread(target=start)
    t.start()
    while t.is_alive():
        coord.step(block_ms=50)
    if raised:
        raise raised[0]


@contextmanager
def two_learners(endpoints, run_id) -> Iterator[tuple[Coordinator, tuple[Learner, torch.optim.Optimizer],  # noqa: ANN001
                                                  tuple[Learner, torch.optim.Optimizer]]]:
    """A coordinator at steps cadence and learners l0 and l1 joined through it; all closed after."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"))
    l0 = join(endpoints, run_id, coord, "l0")
    l1 = join(endpoints, run_id, coord, "l1")
    try:
        yield coord, l0, l1
    finally:
        l0[0].close()
        l1[0].close()
        coord.close()


def train(learner: Learner, opt: torch.optim.Optimizer, steps: int) -> None:
    """`steps` optimizer steps on random gradients, then wait until every contribution is announced."""
    for _ in range(steps):
        for p in learner.model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    assert learner.uploader.flush(30)


def announcements(bus: Bus) -> list[tuple[str, Announcement]]:
    """Every entry of the announcements stream, in order; a malformed one fails the test."""
    entries = bus.announcement_entries()
    assert all(isinstance(a, Announcement) for _, a in entries), entries
    return entries  # type: ignore[return-value]


def merged_ids(endpoints: Endpoints, run_id: str) -> list[str]:
    """The contribution ids every committed version of the run merged, from the manifests in S3 (the
    truth: Redis's `applied` set keeps only the last versions' ids); an id merged twice is there twice."""
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    layout = read_layout(store, keys)
    return [c.contribution_id for f in range(len(layout.fragments) if layout else 0)
            for v in list_versions(store, keys, f) for c in read_manifest(store, keys, f, v).inputs]


def two_shards_run(endpoints: Endpoints, run_id: str,
                   while_training: Callable[[list[Coordinator]], None] = lambda shards: None
                   ) -> tuple[list[Coordinator], Bus]:
    """A whole run of two coordinator shards (in-process, serving) and two tiny learners that train 3 x 4
    steps each and finish; `while_training` looks at it once the learners have joined. Returns once
    the run has ended."""
    shards = [make_coordinator(endpoints, run_id, shards=2, shard=k) for k in range(2)]
    learners = []
    with serving(shards[0]), serving(shards[1]):
        for name in ("l0", "l1"):
            learner, opt = tiny_learner(endpoints, run_id, name)
            learner.start()  # joins once each shard has published its fragment's version 0
            learners.append((learner, opt))
        while_training(shards)
        for _ in range(3):
            for learner, opt in learners:
                train(learner, opt, 4)
        for learner, _ in learners:
            learner.finish()
        bus = Bus(endpoints, run_id)
        assert wait_until(lambda: bus.run_end() is not None, 60), (bus.heads(), bus.pending_count())
    for learner, _ in learners:
        learner.close()
    return shards, bus


def assert_each_piece_merged_or_refused_stale_once(endpoints: Endpoints, run_id: str, bus: Bus) -> None:
    """Every delta announced is an input of exactly one manifest, or refused once as stale (learners that
    train in turns, or through a takeover, may send a piece too late): nothing lost, nothing twice."""
    deltas = [a.contribution_id for _, a in announcements(bus) if a.kind == "delta"]
    merged = [cid for cid in merged_ids(endpoints, run_id) if cid in set(deltas)]
    refused = bus.refusals()
    assert {r.code for r in refused} <= {"stale"}, refused
    assert Counter(merged + [r.contribution_id for r in refused]) == Counter(deltas)


# ---- real `diloco` processes on the demo task ------------------------------------------------------

TASK = DemoTask(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=32, batch_size=8, eval_tokens=4096,
                warmup_steps=10)


def spawn_coordinator(run_id: str, env: dict[str, str], log_dir: Path, *extra: str) -> Proc:
    argv = diloco_command("coordinator", "--run", run_id, "--fragments", "2", "--sync-every", "10",
                          "--overlap-steps", "5", "--codec", "int8", *extra)
    return Proc("coordinator", argv, log_dir / "coordinator.log", env).start()


def spawn_learner(run_id: str, env: dict[str, str], tmp_path: Path, name: str, steps: int, seed: int = 0,
                  slowdown: float = 1.0, step_time_s: float | None = None) -> Proc:
    """A demo learner on TASK (the `fleet_env` fixture writes tmp_path/task.json); `step_time_s` paces
    each step to at least that long, so a test's timeline holds on a fast machine too."""
    argv = learner_argv(run_id, name, tmp_path / "task.json", steps=steps, data_seed=seed, slowdown=slowdown,
                        step_time_s=step_time_s)
    return Proc(name, argv, tmp_path / f"{name}.log", env).start()


def global_eval(endpoints: Endpoints, run_id: str, versions: dict[int, int] | None = None) -> float:
    """TASK's eval loss of the global model at `versions` (default: the heads)."""
    store, bus = ObjectStore(endpoints), Bus(endpoints, run_id)
    heads = versions if versions is not None else bus.heads()
    return TASK.eval_loss(global_model(TASK, store, bus.keys, heads))


def wait_all(procs: list[Proc], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        rc = p.wait(max(1.0, deadline - time.monotonic()))
        assert rc == 0, f"{p.name} exited {rc}:\n{p.tail(40)}"


def wait_for(what: str, condition, procs: list[Proc] | tuple = (), timeout_s: float = 90.0) -> None:  # noqa: ANN001
    """Poll `condition` until it holds; fail if it does not in time or if one of `procs` exits."""
    def all_alive() -> None:
        for p in procs:
            assert p.alive(), f"{p.name} exited {p.returncode()} while waiting for {what}:\n{p.tail(30)}"

    assert wait_until(condition, timeout_s, between=all_alive), f"timed out waiting for {what}"
