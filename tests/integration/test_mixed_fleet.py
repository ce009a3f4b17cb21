"""A mixed fleet: a DDP island (two gloo ranks, the model wrapped in DistributedDataParallel, every
parameter named `module.<name>`) and a plain single-process learner train one run.

The island starts first and proposes version 0, so the run's layout comes from the wrapped model:
it must hold the bare names, the plain learner must fit it, and both learners' pieces must be
merged into the same fragments. The run ends when both have finished.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.local.stack import free_ports
from diloco.storage.bus import Bus
from diloco.storage.history import read_layout, read_manifest, read_run_end
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import Endpoints
from diloco.workers.learner import Learner
from harness import leave_process_group, serving

WORLD = 2
STEPS = 24


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def train(learner: Learner, model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    with learner:  # joins unless started already
        for _ in range(STEPS):
            x = torch.randn(8, 8, generator=data)
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()


def _catching(failed: list[BaseException], fn, *args) -> None:  # noqa: ANN001
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 (reported by the test)
        failed.append(exc)
        raise


def island_rank(rank: int, endpoints: Endpoints, run_id: str, init_port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        model = DistributedDataParallel(Net())
        assert all(n.startswith("module.") for n, _ in model.named_parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id="ddp-island",
                          tokens_per_step=8 * WORLD)
        learner.start()
        while not Path(out_dir, "go").exists():  # the plain learner has joined: train together
            time.sleep(0.05)
        train(learner, model, opt, seed=100 + rank)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(state, Path(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group()


@pytest.mark.slow
def test_a_ddp_island_and_a_plain_learner_train_one_run(endpoints, run_id, tmp_path):
    coord = Coordinator(endpoints, run_id,
                        settings=RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, codec="fp32",
                                             compress=False, cadence="steps"),
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0)))
    store, bus = ObjectStore(endpoints), Bus(endpoints, run_id)
    (init_port,) = free_ports(1)
    with serving(coord):
        ctx = mp.start_processes(island_rank, args=(endpoints, run_id, init_port, str(tmp_path)), nprocs=WORLD,
                                 join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + 60
            while read_layout(store, bus.keys) is None:  # the island proposes version 0
                assert ctx.processes[0].is_alive() or ctx.join(timeout=0), "the island died before joining"
                assert time.monotonic() < deadline, "the island proposed no layout in 60s"
                time.sleep(0.2)
            plain = Net()
            opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
            learner = Learner(plain, opt, run=run_id, endpoints=endpoints, learner_id="plain", tokens_per_step=8)
            learner.start()
            (tmp_path / "go").touch()
            failed: list[BaseException] = []
            thread = threading.Thread(target=lambda: _catching(failed, train, learner, plain, opt, 7))
            thread.start()
            while not ctx.join(timeout=1.0):  # raises with the rank's traceback if one failed
                assert time.monotonic() < deadline + 60, "the island did not finish in 120s"
            thread.join(timeout=60)
            assert not thread.is_alive() and not failed, failed
            deadline = time.monotonic() + 30
            while read_run_end(store, bus.keys) is None:
                assert time.monotonic() < deadline, "the run did not end after both learners finished"
                time.sleep(0.2)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()

    layout = read_layout(store, bus.keys)
    assert sorted(s.name for specs in layout.fragments for s in specs) == sorted(n for n, _ in Net().named_parameters())
    # Both learners' pieces were merged, into each fragment.
    for fragment, head in bus.heads().items():
        merged = {c.learner for v in range(1, head + 1)
                  for c in read_manifest(store, bus.keys, fragment, v).inputs}
        refused = [(r.learner, r.code) for v in range(1, head + 1) for r in read_manifest(store, bus.keys, fragment, v).refused]
        assert merged == {"ddp-island", "plain"}, (fragment, merged, refused, head)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    assert all(torch.equal(r0[n], r1[n]) for n in r0)  # the island's ranks stayed one replica
    # The global model comes back under each learner's own names.
    assert sorted(learner.global_state_dict()) == sorted(n for n, _ in plain.named_parameters())
