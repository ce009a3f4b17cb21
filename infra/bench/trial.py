"""One benchmark arm: a coordinator and learners as real `diloco` processes on a real stack, then figures.

A `Trial` says what runs: the run's settings, the coordinator's options, and one `LearnerPlan` per
learner (speed, step budget, wall-clock budget, when it is killed and restarted). `run_trial`
starts the processes on a stack the caller owns (each trial is its own run id, so arms share one
stack), supervises them, and afterwards reads everything back from S3 and Redis:

- the global model's eval loss over wall time, evaluated after the run from the manifests'
  commit times (evaluating while the learners train would steal their CPU);
- counters, versions, and every learner's last heartbeat (steps, tokens, bytes uploaded, time
  spent in its step hook) for the communication and stall figures.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infra.fleet import Proc, diloco_command, process_env
from infra.stack import LocalStack, aws_env
from storage.bus import Bus
from storage.history import list_versions, read_layout, read_manifest, read_params
from storage.keys import RunKeys
from storage.objects import ObjectStore
from storage.protocol import Manifest
from workers.demo.task import DemoTask

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LearnerPlan:
    name: str
    slowdown: float = 1.0
    """Step-time multiplier (with the trial's pace: each step takes step_time_s x slowdown)."""
    steps: int = 10**9
    """Inner steps; the trial's wall-clock budget usually ends the learner first."""
    data_seed: int = 0
    kill_at_s: float | None = None
    """SIGKILL the learner this many seconds into the trial; it restarts after `down_s`."""
    down_s: float = 5.0
    """How long a killed learner stays down (a replacement machine booting, a preempted spot instance)."""


@dataclass(frozen=True, slots=True)
class Trial:
    name: str
    learners: tuple[LearnerPlan, ...]
    budget_s: float
    """Wall-clock budget of every learner, from the trial's start (time to join included)."""
    run_args: tuple[str, ...] = ()
    """Coordinator options that shape the run (`--fragments 2 --sync-every 30 ...`)."""
    coordinator_args: tuple[str, ...] = ()
    """Coordinator merge options (`--min-quorum 4 ...`)."""
    learner_args: tuple[str, ...] = ()
    """Options every learner gets (`--wait-for-merge`, `--threads 1`...)."""
    step_time_s: float = 0.0
    """Pace of a learner of slowdown 1 (see DemoLearnerArgs.step_time_s); 0: as fast as the CPU allows."""


@dataclass
class TrialResult:
    name: str
    run: str
    wall_s: float
    eval_loss: float
    curve: list[tuple[float, float]]
    """(seconds since the trial started, eval loss of the global model at that time)."""
    counters: dict[str, int]
    heads: dict[int, int]
    learners: dict[str, dict]
    """Each learner's last heartbeat: step, tokens, bytes_uploaded, sync_s, wall_s..."""
    restarts: int
    started_at: float = field(default=0.0, repr=False)

    def total(self, key: str) -> float:
        return sum(float(s.get(key, 0) or 0) for s in self.learners.values())

    def to_json(self) -> dict:
        return {"name": self.name, "run": self.run, "wall_s": round(self.wall_s, 2), "eval_loss": self.eval_loss,
                "curve": [[round(t, 2), loss] for t, loss in self.curve], "counters": self.counters,
                "heads": {str(k): v for k, v in self.heads.items()}, "learners": self.learners,
                "restarts": self.restarts}


def _learner_proc(trial: Trial, plan: LearnerPlan, run: str, env: dict[str, str], task_path: Path, logs: Path,
                  seconds: float, incarnation: int) -> Proc:
    argv = diloco_command("learner", "--run", run, "--id", plan.name, "--steps", str(plan.steps),
                          "--seconds", f"{max(seconds, 0.1):.2f}", "--slowdown", str(plan.slowdown),
                          "--step-time-s", str(trial.step_time_s), "--data-seed",
                          str(plan.data_seed + 1000 * incarnation), "--task", str(task_path), *trial.learner_args)
    return Proc(plan.name, argv, logs / f"{trial.name}-{plan.name}.log", env)


def run_trial(stack: LocalStack, trial: Trial, task: DemoTask, out: Path, *, run: str | None = None,
              curve_points: int = 8) -> TrialResult:
    """Run `trial` to the end of its budget on `stack` and measure it (see the module docstring)."""
    run = run or f"{trial.name}-{int(time.time())}"
    out.mkdir(parents=True, exist_ok=True)
    task_path = out / "task.json"
    task_path.write_text(json.dumps(task.to_wire()))
    env = process_env(stack.env())
    logs = out / "logs"
    started = time.monotonic()
    started_unix = time.time()
    coordinator = Proc("coordinator", diloco_command("coordinator", "--run", run, *trial.run_args,
                                                     *trial.coordinator_args),
                       logs / f"{trial.name}-coordinator.log", env).start()
    procs = {p.name: _learner_proc(trial, p, run, env, task_path, logs, trial.budget_s, 0).start()
             for p in trial.learners}
    plans = {p.name: p for p in trial.learners}
    down: dict[str, float] = {}  # killed learners -> when they come back
    restarts = 0
    try:
        while any(p.alive() for p in procs.values()) or down:
            time.sleep(0.2)
            elapsed = time.monotonic() - started
            if not coordinator.alive():
                raise RuntimeError(f"{trial.name}: the coordinator exited ({coordinator.returncode()}):\n"
                                   f"{coordinator.tail()}")
            for name, proc in procs.items():
                plan = plans[name]
                if proc.returncode() not in (None, 0) and name not in down:
                    raise RuntimeError(f"{trial.name}: {name} failed ({proc.returncode()}):\n{proc.tail()}")
                if plan.kill_at_s is not None and not proc.restarts and name not in down and elapsed >= plan.kill_at_s:
                    proc.kill()
                    down[name] = elapsed + plan.down_s
                    log.info("%s: SIGKILL %s at %.0fs; back in %.0fs", trial.name, name, elapsed, plan.down_s)
            for name, back_at in list(down.items()):
                if elapsed >= back_at:
                    del down[name]
                    if elapsed < trial.budget_s:
                        procs[name] = _learner_proc(trial, plans[name], run, env, task_path, logs,
                                                    trial.budget_s - elapsed, 1).start()
                        procs[name].restarts = 1
                        restarts += 1
        bus = Bus(stack.endpoints, run)
        deadline = time.monotonic() + 15.0
        while bus.pending_count() and time.monotonic() < deadline:  # let the last round merge
            time.sleep(0.2)
        wall_s = time.monotonic() - started
        counters, heads, learners = bus.counters(), bus.heads(), bus.learner_stats()
    finally:
        for proc in procs.values():
            proc.terminate(10)
        coordinator.terminate()
    store, keys = ObjectStore(stack.endpoints), RunKeys(stack.endpoints.prefix, run)
    curve = eval_curve(task, store, keys, started_unix, wall_s, curve_points)
    return TrialResult(trial.name, run, wall_s, curve[-1][1] if curve else float("nan"), curve, counters, heads,
                       {k: dict(v) for k, v in learners.items()}, restarts)


def eval_curve(task: DemoTask, store: ObjectStore, keys: RunKeys, started_unix: float, wall_s: float,
               points: int) -> list[tuple[float, float]]:
    """Eval loss of the global model as it stood at `points` evenly spaced times (the last at the end),
    from the manifests' commit times."""
    layout = read_layout(store, keys)
    if layout is None:
        return []
    manifests: dict[int, list[Manifest]] = {
        f: [read_manifest(store, keys, f, v) for v in list_versions(store, keys, f)]
        for f in range(len(layout.fragments))}
    model = task.make_model(0)
    state = dict(model.named_parameters())
    loaded: dict[int, int] = {}
    curve = []
    for i in range(1, points + 1):
        t = wall_s * i / points
        with torch.no_grad():
            for f, history in manifests.items():
                at = [m for m in history if m.committed_at <= started_unix + t] or history[:1]
                if not at or loaded.get(f) == at[-1].version:
                    continue
                for name, value in read_params(store, layout, at[-1]).items():
                    state[name].copy_(value)
                loaded[f] = at[-1].version
        curve.append((t, task.eval_loss(model)))
    return curve


@contextmanager
def bench_stack(out: Path) -> Iterator[LocalStack]:
    """A fresh local stack under `out/stack` (an earlier one's data removed), its credentials in
    this process's environment for the figures read back from S3."""
    if (out / "stack").exists():
        shutil.rmtree(out / "stack")
    out.mkdir(parents=True, exist_ok=True)
    with LocalStack(out / "stack") as stack, aws_env(stack.env()):
        stack.start()
        yield stack


def run_args(fragments: int, sync_every: int, overlap_steps: int, codec: str, cadence: str = "clock") -> tuple[str, ...]:
    return ("--fragments", str(fragments), "--sync-every", str(sync_every), "--overlap-steps", str(overlap_steps),
            "--codec", codec, "--cadence", cadence)
