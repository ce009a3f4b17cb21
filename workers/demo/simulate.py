"""In-process reference of synchronous DiLoCo, for tuning the demo task. Not the product.

M replicas train round-robin in one process; every H inner steps the outer gradient
`delta = global - local` is averaged over replicas (equal weights), an outer SGD-Nesterov step is
applied to the global parameters, and every replica restarts from the new global (each keeps its
own AdamW state). The baseline is one replica with AdamW for M x steps on the same batch size,
i.e. the same number of tokens.

    python -m diloco.workers.demo.simulate                       # the demo's defaults
    python -m diloco.workers.demo.simulate --H 50 --set lr=2e-3  # a variant
    python -m diloco.workers.demo.simulate --no-baseline --json  # one JSON line, for sweeps
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import time

import torch

from diloco.workers.demo.task import DemoTask, train_baseline

DEFAULT_STEPS_PER_LEARNER = 1000
DEFAULT_LEARNERS = 4
DEFAULT_H = 30


def simulate_diloco(
    task: DemoTask,
    steps_per_learner: int,
    num_learners: int = DEFAULT_LEARNERS,
    sync_every: int = DEFAULT_H,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    seed: int = 0,
    eval_every_rounds: int = 0,
) -> list[tuple[int, float]]:
    """Synchronous DiLoCo; returns [(steps per learner, eval loss of the global model)], last at the end."""
    global_model = task.make_model(seed)
    global_params = [p.detach() for p in global_model.parameters()]
    outer = torch.optim.SGD(global_params, lr=outer_lr, momentum=outer_momentum, nesterov=True)
    replicas = [copy.deepcopy(global_model) for _ in range(num_learners)]
    optimizers = [task.make_inner_optimizer(r) for r in replicas]
    replica_params = [list(r.parameters()) for r in replicas]
    streams = [task.train_batches(stream_seed=1000 + m) for m in range(num_learners)]
    curve: list[tuple[int, float]] = []
    num_rounds = math.ceil(steps_per_learner / sync_every)
    for round_index in range(num_rounds):
        first = round_index * sync_every
        last = min(first + sync_every, steps_per_learner)
        for replica, optimizer, stream in zip(replicas, optimizers, streams, strict=True):
            for step in range(first, last):
                task.inner_step(replica, optimizer, next(stream), step, steps_per_learner)
        with torch.no_grad():
            for i, g in enumerate(global_params):
                g.grad = torch.stack([g - params[i] for params in replica_params]).mean(0)
            outer.step()
            for replica in replicas:
                for p, g in zip(replica.parameters(), global_params, strict=True):
                    p.copy_(g)
        if round_index == num_rounds - 1 or (eval_every_rounds and (round_index + 1) % eval_every_rounds == 0):
            curve.append((last, task.eval_loss(global_model)))
    return curve


def _override(task: DemoTask, assignments: list[str]) -> DemoTask:
    """Apply `--set field=value` overrides; values are JSON (3e-3, [0.9, 0.95], null) or else plain strings."""
    names = {f.name for f in dataclasses.fields(task)}
    values = {}
    for assignment in assignments:
        name, _, raw = assignment.partition("=")
        if name not in names:
            raise SystemExit(f"--set {name}: not a DemoTask field ({', '.join(sorted(names))})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        values[name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(task, **values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS_PER_LEARNER, help="inner steps per learner")
    parser.add_argument("--learners", type=int, default=DEFAULT_LEARNERS, help="M")
    parser.add_argument("--H", type=int, default=DEFAULT_H, help="inner steps between outer steps")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0, help="model init seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a DemoTask field")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--no-diloco", action="store_true")
    parser.add_argument("--eval-every-rounds", type=int, default=0, help="also print the DiLoCo curve")
    parser.add_argument("--baseline-eval-every", type=int, default=0, help="also print the baseline curve")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a report")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = _override(DemoTask(), args.set)
    result: dict = {"task": dataclasses.asdict(task), "steps_per_learner": args.steps, "learners": args.learners,
                    "H": args.H, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
                    "floor": task.entropy_floor(), "threads": args.threads}
    if not args.no_diloco:
        started = time.perf_counter()
        curve = simulate_diloco(task, args.steps, args.learners, args.H, args.outer_lr, args.outer_momentum,
                                args.seed, args.eval_every_rounds)
        result.update(diloco=curve[-1][1], diloco_curve=curve, diloco_s=time.perf_counter() - started)
    if not args.no_baseline:
        started = time.perf_counter()
        curve = train_baseline(task, args.learners * args.steps, seed=args.seed, log_every=args.baseline_eval_every)
        result.update(baseline=curve[-1][1], baseline_curve=curve, baseline_s=time.perf_counter() - started)
        result["baseline_ms_per_step"] = 1000 * result["baseline_s"] / (args.learners * args.steps)
    if "diloco" in result and "baseline" in result:
        result["ratio"] = result["diloco"] / result["baseline"]
    if args.json:
        print(json.dumps(result))
        return
    floor = result["floor"]
    print(f"task: {task}")
    print(f"M={args.learners} H={args.H} steps/learner={args.steps} outer SGD lr={args.outer_lr} "
          f"momentum={args.outer_momentum} nesterov; tokens/step={task.tokens_per_step()}")
    print(f"entropy floor: {floor:.4f} nats/token" if floor is not None else "entropy floor: unknown (text)")
    for name in ("baseline", "diloco"):
        if name in result:
            extra = f" ({result[name] / floor - 1:+.1%} vs floor)" if floor else ""
            print(f"{name:9s} eval loss {result[name]:.4f}{extra}  wall {result[name + '_s']:.1f} s")
    for name in ("baseline", "diloco"):
        if len(result.get(name + "_curve", [])) > 1:
            print(f"{name} curve:", " ".join(f"{s}:{loss:.3f}" for s, loss in result[name + "_curve"]))
    if "ratio" in result:
        print(f"diloco / baseline = {result['ratio']:.4f}")


if __name__ == "__main__":
    main()
