"""One replica group of the quality benchmark's torchft arm: synchronous DiLoCo in torchft 0.2.0.

    python -m diloco.infra.bench.torchft_replica --task T.json --replica 0 --replicas 4 --lighthouse ADDR \\
        --steps 1000 --sync-every 30 --out DIR

The replica trains the task exactly as a learner of our own arms does (same initial weights, data
stream `--data-seed`, inner optimizer and schedule over `--steps`, `workers.tasks.base.train_step`),
with `torchft.local_sgd.DiLoCo` hooked on the inner optimizer instead of our `Learner`: every
`--sync-every` steps the replicas average their outer gradients over gloo (a world of one rank per
replica group, `torchft.Manager` with a quorum of all `--replicas`) and take one outer step (SGD,
Nesterov, lr 0.7, momentum 0.9 as our coordinator's). Classic DiLoCo: the whole model as one
fragment, no overlap (`fragment_sync_delay` 0), the new global model adopted as it is.

Replica 0 writes the global model after every committed outer step (and the initial one) to
`DIR/versions/NNNNN.safetensors`, its metadata holding the commit's unix time and inner step, for
the benchmark to evaluate once the arm has ended (evaluating here would steal the replicas' CPU).
Steps after the last multiple of `--sync-every` are never synced: they are not in the global model.
"""

from __future__ import annotations

import argparse
import logging
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo

from diloco.workers.tasks.base import train_step
from diloco.workers.tasks.kinds import load_task

log = logging.getLogger("torchft_replica")

QUORUM_TIMEOUT = timedelta(minutes=10)
"""The first quorum waits for every replica to start (importing torch and transformers takes a while
on a shared CPU); later ones wait for the slowest replica's H steps."""


def snapshot(model: torch.nn.Module, out: Path, version: int, step: int) -> None:
    """The model's parameters (tied ones once, as `named_parameters` lists them) and when."""
    tensors = {name: p.detach().clone().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(out / f"{version:05d}.safetensors"), metadata={"t": repr(time.time()), "step": str(step)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", type=Path, required=True, help="task JSON, as the benchmark writes it")
    parser.add_argument("--replica", type=int, required=True, help="this replica group's index")
    parser.add_argument("--replicas", type=int, required=True, help="replica groups in the quorum (M)")
    parser.add_argument("--lighthouse", required=True, help="the torchft lighthouse's address")
    parser.add_argument("--steps", type=int, required=True, help="inner steps (the schedule spans them)")
    parser.add_argument("--sync-every", type=int, required=True, help="H: inner steps per outer step")
    parser.add_argument("--data-seed", type=int, required=True, help="seed of this replica's data stream")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--out", type=Path, required=True, help="replica 0 writes the global versions here")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--step-time-s", type=float, default=0.0,
                        help="pace: every step takes at least this long (the rest is slept), as our paced learners")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica-{args.replica} %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    task = load_task(args.task)
    model = task.make_model(0)  # every replica starts from the same weights: no sync at step 0 (init_sync)
    inner = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(inner, args.steps)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    batches = task.train_batches(args.data_seed)

    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), load_state_dict=None, state_dict=None,
                      min_replica_size=args.replicas, use_async_quorum=False, init_sync=False,
                      replica_id=f"replica_{args.replica}", store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname=socket.gethostname(),
                      timeout=timedelta(seconds=120), quorum_timeout=QUORUM_TIMEOUT,
                      connect_timeout=timedelta(seconds=60))
    versions = args.out / "versions"
    if args.replica == 0:
        versions.mkdir(parents=True, exist_ok=True)
        snapshot(model, versions, 0, 0)
    committed = manager.current_step()
    started = time.perf_counter()
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every, pin_memory=False):
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                loss = train_step(task, model, inner, schedule, next(batches))
                if args.step_time_s > 0:
                    time.sleep(max(0.0, args.step_time_s - (time.perf_counter() - t0)))
                if manager.current_step() != committed:  # an outer step was committed in this step's hook
                    committed = manager.current_step()
                    log.info("step %d: outer step %d committed, train loss %.4f (%.0fs)", step, committed, loss,
                             time.perf_counter() - started)
                    if args.replica == 0:
                        snapshot(model, versions, committed, step)
    finally:
        manager.shutdown(wait=False)
    log.info("done: %d steps, %d outer steps in %.0fs", args.steps, committed, time.perf_counter() - started)


if __name__ == "__main__":
    main()
