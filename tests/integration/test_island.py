"""A torchrun-style island: two gloo ranks are one learner; only rank 0 talks to Redis and S3.

The two ranks are real processes (spawned, `init_process_group("gloo")` on 127.0.0.1) and the
coordinator runs in this process against the session's real Redis and S3. The ranks start from
different random weights on purpose: the learner's start broadcast must align them, and the
per-step broadcast of merged fragments must keep them bit-identical while rank 0 alone adopts new
global versions. Rank 1 is handed endpoints that cannot work (a Redis port nobody listens on, a
bucket that does not exist): if its learner touched the network the rank would fail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coordinator.config import CoordinatorConfig, RunSettings
from coordinator.policy import RoundConfig
from coordinator.service import Coordinator
from harness import serving
from infra.stack import free_ports
from storage.bus import Bus
from storage.objects import ObjectStore
from storage.settings import Endpoints
from workers.learner import Learner

WORLD = 2
MIN_STEPS = 12
WANT_ADOPTED = 2  # global versions rank 0 must have merged before the island stops
TRAIN_DEADLINE_S = 30.0
RANK_IDS = [f"island-r{r}" for r in range(WORLD)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def rank_main(rank: int, endpoints_by_rank: list[Endpoints], run_id: str, init_port: int, out_dir: str) -> None:
    """One rank of the island: a plain data-parallel loop with the Learner hooked into its optimizer."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(rank)  # different weights per rank: the learner's start broadcast must align them
        model = Net()
        before = checksum(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        learner = Learner(model, opt, run=run_id, endpoints=endpoints_by_rank[rank], learner_id=RANK_IDS[rank],
                          tokens_per_step=8 * WORLD)
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
        deadline = time.monotonic() + TRAIN_DEADLINE_S
        with learner:
            started = checksum(model)
            steps = 0
            while True:
                x = torch.randn(8, 8, generator=data)
                loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                loss.backward()
                # What DDP does to gradients (not DDP itself: its constructor would align the weights
                # and hide whether the learner does).
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= WORLD
                opt.step()
                opt.zero_grad()
                steps += 1
                # Rank 0 decides when to stop: every rank must run the same collectives.
                done = torch.tensor([int(rank == 0 and steps >= MIN_STEPS
                                         and (learner.adopted >= WANT_ADOPTED or time.monotonic() > deadline))])
                dist.broadcast(done, src=0)
                if done.item():
                    break
        result = {"before": before, "started": started, "final": checksum(model), "steps": steps,
                  "adopted": learner.adopted}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def unusable(endpoints: Endpoints) -> Endpoints:
    """Endpoints on a port nobody listens on and a bucket that does not exist."""
    (port,) = free_ports(1)
    return dataclasses.replace(endpoints, redis_url=f"redis://127.0.0.1:{port}/0", s3_endpoint=f"http://127.0.0.1:{port}",
                               bucket="no-such-bucket-island")


def test_island_ranks_stay_identical_and_only_rank0_talks_to_the_run(endpoints, run_id, tmp_path):
    coord = Coordinator(endpoints, run_id,
                        settings=RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, codec="fp32",
                                             compress=False, cadence="steps"),
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0)))
    (init_port,) = free_ports(1)
    with serving(coord):
        ctx = mp.start_processes(rank_main, args=([endpoints, unusable(endpoints)], run_id, init_port, str(tmp_path)),
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

    assert r0["before"] != r1["before"]  # the ranks really started apart
    assert r0["started"] == r1["started"]  # aligned by the start broadcast
    assert r0["steps"] == r1["steps"]
    assert r0["adopted"] >= WANT_ADOPTED, r0  # rank 0 merged global versions beyond 0 ...
    assert r1["adopted"] == 0  # ... rank 1 never merged anything by itself ...
    assert r0["final"] == r1["final"]  # ... and still holds exactly rank 0's parameters

    bus, store = Bus(endpoints, run_id), ObjectStore(endpoints)
    assert min(bus.heads().values()) >= 1, bus.heads()
    assert set(bus.learner_stats()) == {RANK_IDS[0]}
    assert bus.learner_stats()[RANK_IDS[0]]["step"] == r0["steps"]
    objects = list(store.list(bus.keys.root))
    assert any(f"/{RANK_IDS[0]}/" in key for key in objects)
    assert not [key for key in objects if RANK_IDS[1] in key]
