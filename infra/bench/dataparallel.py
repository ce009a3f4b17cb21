"""Data-parallel over the links of `diloco bench wan`: real gloo ranks in the learners' namespaces,
and the same update computed in this process over the whole token budget.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from diloco.infra.bench.netns import Rates, WanNet, netns_exec
from diloco.infra.local.fleet import Supervisor, ProcessError, process_env
from diloco.infra.local.stack import free_ports
from diloco.workers.tasks.demo import DemoTask
from diloco.workers.tasks.base import Task, train_step

log = logging.getLogger(__name__)

DP_OVERRUN_S = 60.0
"""Data-parallel workers still running this long after their budget, and after the all-reduces a
step begun just before it needs on these links, are killed (a stuck rendezvous)."""


def ring_bytes(params: float, learners: int, bytes_per_param: float) -> float:
    """Bytes one learner sends (and receives) in a ring all-reduce of `params` gradients."""
    return 2 * (learners - 1) / learners * bytes_per_param * params


def _dp_worker(argv: Sequence[str]) -> NoReturn:
    """One data-parallel rank (`python -m diloco.infra.bench.wan dp-worker ...`, inside a learner's
    namespace): the demo task on data stream `rank`, gradients summed across ranks with gloo every
    step, then clipped and applied. Stops after `--steps`, or at the first step that any rank starts
    past `--until` (the ranks agree through the all-reduce itself). Writes its step times to
    OUT/dp-rank<r>.json; rank 0 also writes its final parameters (safetensors)."""
    import torch.distributed as dist
    from datetime import timedelta

    from safetensors.torch import save_file

    p = argparse.ArgumentParser(prog="wan dp-worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of the rendezvous TCPStore")
    p.add_argument("--task", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--until", type=float, required=True)
    p.add_argument("--step-time-s", type=float, default=0.0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    launched = time.time()
    task = DemoTask.from_wire(json.loads(a.task.read_text()))
    host, port = a.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), a.world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world, timeout=timedelta(seconds=300))
    model = task.make_model(0)
    optimizer = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(optimizer, a.steps)
    batches = task.train_batches(a.rank)
    params = [q for q in model.parameters() if q.requires_grad]
    n = sum(q.numel() for q in params)
    flat = torch.zeros(n + 1)
    rec: dict = {"rank": a.rank, "launched": launched, "joined": time.time(), "elements": n + 1,
                 "step_end": [], "compute_s": [], "allreduce_s": [], "loss": []}
    for step in range(a.steps):
        t0 = time.perf_counter()
        loss = task.loss(model, next(batches))
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        torch.cat([q.grad.reshape(-1) for q in params], out=flat[:n])
        flat[n] = 1.0 if time.time() >= a.until else 0.0
        compute = time.perf_counter() - t0
        if a.step_time_s > 0:
            time.sleep(max(0.0, a.step_time_s - compute))
        t1 = time.perf_counter()
        dist.all_reduce(flat)
        reduce_s = time.perf_counter() - t1
        flat[:n] /= a.world
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        if task.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip)
        optimizer.step()
        schedule.step()
        rec["step_end"].append(time.time())
        rec["compute_s"].append(compute)
        rec["allreduce_s"].append(reduce_s)
        rec["loss"].append(loss.item())
        if flat[n] > 0:
            break
    if a.rank == 0:
        save_file({k: v.detach().contiguous() for k, v in model.named_parameters()},
                  str(a.out / "dp-final.safetensors"))
    (a.out / f"dp-rank{a.rank}.json").write_text(json.dumps(rec))
    dist.barrier()  # nobody closes its connections while another rank still reads from them
    # Leave without destroy_process_group: gloo's teardown aborts ("terminate called without an active
    # exception") now and then; everything this rank has to say is written.
    logging.shutdown()
    os._exit(0)


@dataclass
class DpRun:
    launched_unix: float
    steps: int
    step_end: list[float]
    """Rank 0's end of each step, in seconds since the launch."""
    compute_s: list[float]
    allreduce_s: list[float]
    wire: list[tuple[int, int]]
    final_eval: float

    @property
    def mean_step_s(self) -> float:
        """Mean step time, the first step (connections still warming up) left out when there are more."""
        ends = [0.0, *self.step_end] if len(self.step_end) < 2 else self.step_end
        return (ends[-1] - ends[0]) / max(1, len(ends) - 1)

    def time_at(self, step: float) -> float:
        """Seconds since the launch at which step `step` (fractional, 1-based) ended: interpolated between
        step ends within the run, the mean step time beyond it."""
        ends = self.step_end
        if step <= len(ends):
            k = max(1, math.ceil(step))
            prev = ends[k - 2] if k >= 2 else ends[0] - self.mean_step_s
            return prev + (ends[k - 1] - prev) * (step - (k - 1))
        return ends[-1] + (step - len(ends)) * self.mean_step_s

    def to_json(self) -> dict:
        return {"steps": self.steps, "mean_step_s": self.mean_step_s,
                "mean_compute_s": sum(self.compute_s) / max(1, len(self.compute_s)),
                "mean_allreduce_s": sum(self.allreduce_s) / max(1, len(self.allreduce_s)),
                "step_end": [round(t, 3) for t in self.step_end], "wire": self.wire, "final_eval": self.final_eval}


def run_dp(net: WanNet, task: DemoTask, out: Path, *, steps: int, budget_s: float, step_time_s: float,
           rate: Rates) -> DpRun:
    """The real data-parallel run: one gloo rank per learner namespace, the rendezvous store in this
    process (in the hub), for at most `steps` steps or `budget_s` seconds."""
    import torch.distributed as dist
    from datetime import timedelta

    from safetensors.torch import load_file

    world = len(net.links)
    for i in range(world):
        net.shape(i, rate)
    out.mkdir(parents=True, exist_ok=True)
    for old in (*out.glob("dp-rank*.json"), out / "dp-final.safetensors"):
        old.unlink(missing_ok=True)
    task_path = out / "task.json"
    task_path.write_text(json.dumps(task.to_wire()))
    port = free_ports(1)[0]
    store = dist.TCPStore("0.0.0.0", port, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    model = task.make_model(0)  # its parameters' count now, the data-parallel run's final values at the end
    params = sum(p.numel() for p in model.parameters())
    allreduce_s = ring_bytes(params, world, 4) * 8 / (min(rate.up_mbit, rate.down_mbit) * 1e6)
    overrun_s = DP_OVERRUN_S + 3 * allreduce_s  # the last step's all-reduce, and the one the ranks stop by
    before = net.counters()
    launched = time.time()
    started = time.monotonic()
    until = launched + budget_s
    names = [f"dp-{i}" for i in range(world)]
    with Supervisor(process_env({}), out / "logs") as fleet:
        try:
            for i, name in enumerate(names):
                link = net.links[i]
                argv = [sys.executable, "-m", "diloco.infra.bench.wan", "dp-worker", "--rank", str(i), "--world",
                        str(world), "--store", f"{link.hub_ip}:{port}", "--task", str(task_path), "--steps", str(steps),
                        "--until", f"{until:.2f}", "--step-time-s", str(step_time_s), "--out", str(out)]
                fleet.add(name, [*netns_exec(link.ns), *argv],
                          env=process_env({"GLOO_SOCKET_IFNAME": link.dev}))
            while fleet.busy(names):
                time.sleep(0.2)
                fleet.check()
                if time.monotonic() - started > budget_s + overrun_s:
                    raise ProcessError(f"data-parallel workers still running {overrun_s:.0f}s after their budget "
                                       f"({allreduce_s:.1f} s per all-reduce): see {out / 'logs'}")
        finally:
            fleet.stop(names, timeout_s=5)
            del store
    after = net.counters()
    rec = json.loads((out / "dp-rank0.json").read_text())
    final = load_file(str(out / "dp-final.safetensors"))
    with torch.no_grad():
        for name, q in model.named_parameters():
            q.copy_(final[name])
    return DpRun(launched, len(rec["step_end"]), [t - launched for t in rec["step_end"]], rec["compute_s"],
                 rec["allreduce_s"], [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)], task.eval_loss(model))


def dp_equivalent_curve(task: Task, world: int, steps: int, *, eval_every: int, also: Sequence[int] = ()) \
        -> list[tuple[int, float]]:
    """Eval loss per step of data-parallel over `world` learners, computed in this process: each step
    takes one batch from each of the learners' streams (0..world-1) and steps on their mean loss,
    whose gradient is the mean of their gradients (equal batch sizes): the update a gloo all-reduce
    of the gradients gives, up to the order of the float additions. Evaluated at step 0, every
    `eval_every` steps, at the steps in `also` and at the last."""
    model = task.make_model(0)
    optimizer = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(optimizer, steps)
    streams = [task.train_batches(i) for i in range(world)]
    curve = [(0, task.eval_loss(model))]
    for step in range(1, steps + 1):
        parts = [next(s) for s in streams]
        batch = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        train_step(task, model, optimizer, schedule, batch)
        if step % eval_every == 0 or step in also or step == steps:
            curve.append((step, task.eval_loss(model)))
    return curve


