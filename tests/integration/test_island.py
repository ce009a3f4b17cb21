"""A torchrun-style island: two gloo ranks are one learner; only rank 0 talks to Redis and S3.

Two ways of holding the parameters, one test each:
- replicated (what DDP does): every rank holds the whole model. The ranks start from different
  random weights on purpose: the learner's start broadcast must align them, and the writes of
  merged fragments must keep them bit-identical while rank 0 alone adopts new global versions.
- sharded (FSDP2 `fully_shard` on a CPU mesh): every parameter is a DTensor, each rank holds a
  shard. Rank 0 must gather whole fragments to send them and scatter new versions back.

The run merges with `mix` and alpha = 0, so right after a merge a fragment must equal the global
version exactly: after every step in which rank 0 merged, every rank takes part in gathering the
whole model and rank 0 compares the fragment with the version's params in S3. A rank whose shard
was not written would show up as a mismatch.

The ranks are real processes (spawned, `init_process_group("gloo")` on 127.0.0.1); the
coordinator runs in this process against the session's real Redis and S3. Rank 1 is handed
endpoints that cannot work (a Redis port nobody listens on, a bucket that does not exist): if its
learner touched the network the rank would fail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.local.stack import free_ports
from diloco.storage.bus import Bus
from diloco.storage.history import read_layout, read_manifest, read_params
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import Endpoints
from diloco.workers.learner import Learner, LearnerConfig
from diloco.workers.state import LearnerState
from harness import leave_process_group, serving

WORLD = 2
MIN_STEPS = 12
WANT_ADOPTED = 2  # global versions rank 0 must have merged before the island stops
TRAIN_DEADLINE_S = 30.0
RANK_IDS = [f"island-r{r}" for r in range(WORLD)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 5 rows: shards of 3 and 2 rows on two ranks, so uneven sharding is exercised.
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.proj = torch.nn.Linear(8, 5)
        self.head = torch.nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(torch.relu(self.proj(x)))


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on every rank (a collective for sharded parameters)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def checksum(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def build(mode: str, rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)  # different weights per rank: the learner's start must align them
    model = Net()
    if mode == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def rank_main(rank: int, mode: str, endpoints_by_rank: list[Endpoints], run_id: str, init_port: int,
              out_dir: str) -> None:
    """One rank of the island: a plain data-parallel loop with the Learner hooked into its optimizer."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        model = build(mode, rank)
        before = checksum(full_state(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        learner = Learner(model, opt, run=run_id, endpoints=endpoints_by_rank[rank], learner_id=RANK_IDS[rank],
                          tokens_per_step=8 * WORLD)
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
        deadline = time.monotonic() + TRAIN_DEADLINE_S
        checked = mismatched = 0
        with learner:
            started = checksum(full_state(model))
            steps = 0
            while True:
                x = torch.randn(8, 8, generator=data)
                loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                loss.backward()
                if mode == "replicated":
                    # What DDP does to gradients (not DDP itself: its constructor would align the
                    # weights and hide whether the learner does). FSDP2 reduces in backward.
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad /= WORLD
                versions = learner.versions if rank == 0 else {}
                opt.step()
                opt.zero_grad()
                steps += 1
                merged = [f for f, v in versions.items() if learner.versions[f] != v]
                # Rank 0 decides whether to check and when to stop: every rank runs the same collectives.
                done = int(rank == 0 and steps >= MIN_STEPS
                           and (learner.adopted >= WANT_ADOPTED or time.monotonic() > deadline))
                control = torch.tensor([done, merged[0] if merged else -1])
                dist.broadcast(control, src=0)
                if control[1].item() >= 0:
                    state = full_state(model)
                    if rank == 0:
                        f = int(control[1].item())
                        manifest = read_manifest(learner.store, learner.bus.keys, f, learner.versions[f])
                        expected = read_params(learner.store, learner.layout, manifest)
                        checked += 1
                        mismatched += sum(not torch.equal(state[n], v) for n, v in expected.items())
                if control[0].item():
                    break
        result = {"before": before, "started": started, "final": checksum(full_state(model)), "steps": steps,
                  "adopted": learner.adopted, "checked": checked, "mismatched": mismatched}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group()


def unusable(endpoints: Endpoints) -> Endpoints:
    """Endpoints on a port nobody listens on and a bucket that does not exist."""
    (port,) = free_ports(1)
    return dataclasses.replace(endpoints, redis_url=f"redis://127.0.0.1:{port}/0", s3_endpoint=f"http://127.0.0.1:{port}",
                               bucket="no-such-bucket-island")


# Both modes in `make test-slow` (an island is a torchrun of learner processes: 10 s each), so that
# `make test` stays under 8 minutes.
@pytest.mark.parametrize("mode", [pytest.param("replicated", marks=pytest.mark.slow),
                                  pytest.param("sharded", marks=pytest.mark.slow)])
def test_island_ranks_stay_consistent_and_only_rank0_talks_to_the_run(mode, endpoints, run_id, tmp_path):
    coord = Coordinator(endpoints, run_id,
                        settings=RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, codec="fp32",
                                             compress=False, cadence="steps", merge_rule="mix", alpha=0.0),
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0)))
    (init_port,) = free_ports(1)
    with serving(coord):
        ctx = mp.start_processes(rank_main, args=(mode, [endpoints, unusable(endpoints)], run_id, init_port,
                                                  str(tmp_path)),
                                 nprocs=WORLD, join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + 90
            while not ctx.join(timeout=1.0):  # raises with the rank's traceback if one failed
                assert time.monotonic() < deadline, "the island did not finish in 90s"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))

    if mode == "replicated":
        assert r0["before"] != r1["before"]  # the ranks really started apart
    assert r0["started"] == r1["started"]  # aligned at the start
    assert r0["steps"] == r1["steps"]
    assert r0["adopted"] >= WANT_ADOPTED, r0  # rank 0 merged global versions beyond 0 ...
    assert r1["adopted"] == 0  # ... rank 1 never merged anything by itself ...
    assert r0["checked"] >= 1 and r0["mismatched"] == 0, r0  # ... every rank holds the merged version exactly
    assert r0["final"] == r1["final"]

    bus, store = Bus(endpoints, run_id), ObjectStore(endpoints)
    assert min(bus.heads().values()) >= 1, bus.heads()
    # The run's layout has the whole parameters' shapes, not a shard's.
    layout = read_layout(store, bus.keys)
    assert {s.name: s.shape for specs in layout.fragments for s in specs} == {
        n: tuple(p.shape) for n, p in Net().named_parameters()}
    assert set(bus.learner_stats()) == {RANK_IDS[0]}
    assert bus.learner_stats()[RANK_IDS[0]].step == r0["steps"]
    objects = list(store.list(bus.keys.root))
    assert any(f"/{RANK_IDS[0]}/" in key for key in objects)
    assert not [key for key in objects if RANK_IDS[1] in key]


class Position:
    """A rank's own place in its data: every rank of an island has its own."""

    def __init__(self, rank: int) -> None:
        self.rank, self.consumed = rank, 0

    def state_dict(self) -> dict:
        return {"rank": self.rank, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.rank, self.consumed = state["rank"], state["consumed"]


def optimizer_checksum(opt: torch.optim.Optimizer) -> str:
    """This rank's own part of the optimizer's state: its shards of the moments, the step counts."""
    h = hashlib.sha256()
    state = opt.state_dict()["state"]
    for index in sorted(state):
        for key, value in sorted(state[index].items()):
            local = value.to_local() if isinstance(value, DTensor) else value
            h.update(f"{index}.{key}{tuple(local.shape)}".encode())
            h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def state_rank_main(rank: int, phase: str, endpoints_by_rank: list[Endpoints], run_id: str, init_port: int,
                    out_dir: str) -> None:
    """One rank of a sharded island that trains and is preempted ("before"), or that rejoins under
    the same id with fresh weights and a fresh optimizer and resumes ("after")."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        model = build("sharded", rank + (10 if phase == "after" else 0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        position = Position(rank)
        learner = Learner(model, opt, run=run_id, endpoints=endpoints_by_rank[rank], learner_id=f"isle-r{rank}",
                          tokens_per_step=8 * WORLD, state={"data": position},
                          config=LearnerConfig(state_every=0))
        learner.start()
        result = {"restored": learner.restored_from, "step_at_start": learner.step,
                  "position_at_start": position.state_dict(), "optimizer_at_start": optimizer_checksum(opt)}
        data = torch.Generator().manual_seed(1000 + rank)
        for _ in range(MIN_STEPS if phase == "before" else 2):
            x = torch.randn(8, 8, generator=data)
            position.consumed += 1 + 100 * rank  # the ranks' positions differ
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
        result |= {"step": learner.step, "position": position.state_dict(), "optimizer": optimizer_checksum(opt)}
        learner.finish(preempted=phase == "before")  # the state is saved on leaving as preempted
        Path(out_dir, f"{phase}{rank}.json").write_text(json.dumps(result))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group()


def run_island(target, phase: str, endpoints: Endpoints, run_id: str, out_dir: Path) -> list[dict]:
    (init_port,) = free_ports(1)
    ctx = mp.start_processes(target, args=(phase, [endpoints, unusable(endpoints)], run_id, init_port, str(out_dir)),
                             nprocs=WORLD, join=False, start_method="spawn")
    try:
        deadline = time.monotonic() + 90
        while not ctx.join(timeout=1.0):  # raises with the rank's traceback if one failed
            assert time.monotonic() < deadline, f"the island ({phase}) did not finish in 90s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((out_dir / f"{phase}{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow  # two islands one after the other: `make test-all`
def test_a_preempted_island_resumes_each_ranks_optimizer_shard_and_own_objects(endpoints, run_id, tmp_path):
    coord = Coordinator(endpoints, run_id,
                        settings=RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, codec="fp32",
                                             compress=False, cadence="steps"),
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0)))
    with serving(coord):
        before = run_island(state_rank_main, "before", endpoints, run_id, tmp_path)
        store, keys = ObjectStore(endpoints), Bus(endpoints, run_id).keys
        (key,) = store.list(keys.learner_states_prefix("isle-r0"))  # one state, saved on leaving, by rank 0 alone
        saved = LearnerState.from_bytes(store.get(key, max_bytes=1 << 20))
        after = run_island(state_rank_main, "after", endpoints, run_id, tmp_path)

    # What was saved is whole, whatever the sharding: the moments have the parameters' full shapes,
    # and rank 1's objects travel beside rank 0's.
    shapes = dict(saved.params)
    for index, entry in saved.optimizer["state"].items():
        name = saved.params[int(index)][0]
        assert tuple(entry["exp_avg"].shape) == shapes[name] and not isinstance(entry["exp_avg"], DTensor)
    assert saved.user == {"data": before[0]["position"]} and saved.ranks == ({"data": before[1]["position"]},)
    assert saved.step == MIN_STEPS
    assert before[0]["optimizer"] != before[1]["optimizer"]  # each rank holds its own shard of the moments
    for rank in range(WORLD):
        assert before[rank]["restored"] is None and after[rank]["restored"] == key
        assert after[rank]["step_at_start"] == MIN_STEPS
        assert after[rank]["position_at_start"] == before[rank]["position"]  # its own, not rank 0's
        assert after[rank]["optimizer_at_start"] == before[rank]["optimizer"]  # its own shard, bit for bit
    assert not [k for k in store.list(keys.root) if "isle-r1" in k]  # rank 1 never talked to the run
