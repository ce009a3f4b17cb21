"""The quality benchmark's peer arm: synchronous DiLoCo in torchft 0.2.0 on the same task.

`run_torchft` starts a torchft lighthouse (torchft's `torchft_lighthouse`, quorum = every replica)
and M replica processes (`infra.bench.torchft_replica`, one replica group of world size 1 each, gloo), waits for
them to train their steps, and then evaluates the global model replica 0 wrote after every
committed outer step: a curve over wall time, like our arms' curves over committed versions.

torchft is an optional extra (`pip install -e '.[peer]'`); `torchft_missing()` says why the arm
cannot run.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from diloco.infra.history.task_model import load_params
from diloco.infra.local.fleet import Supervisor, Proc, process_env
from diloco.infra.local.stack import free_ports
from diloco.workers.tasks.base import Task

log = logging.getLogger(__name__)

OVERRUN_S = 300.0
"""Replicas still running this long after the expected end (a quorum that never formed) are killed."""
LIGHTHOUSE_START_S = 30.0


def torchft_missing() -> str | None:
    """Why the torchft arm cannot run here, or None if it can."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed: pip install -e '.[peer]' (torchft==0.2.0)"
    if _lighthouse_binary() is None:
        return "torchft is installed but its torchft_lighthouse command is not found"
    return None


def _lighthouse_binary() -> str | None:
    """torchft's lighthouse command: beside this interpreter (a virtualenv's bin), else on PATH."""
    beside = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    return beside or shutil.which("torchft_lighthouse")


def start_lighthouse(replicas: int, log_path: Path, env: dict[str, str]) -> tuple[Proc, str]:
    """A lighthouse whose quorum is every one of `replicas` groups, and its address. Raises RuntimeError
    if it does not listen within LIGHTHOUSE_START_S."""
    port = free_ports(1)[0]
    binary = _lighthouse_binary()
    assert binary is not None, "checked by torchft_missing"
    proc = Proc("lighthouse", [binary, "--min_replicas", str(replicas), "--bind", f"127.0.0.1:{port}"],
                log_path, env).start()
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < deadline and proc.alive():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.terminate(5)
    raise RuntimeError(f"the torchft lighthouse did not listen on port {port}:\n{proc.tail()}")


@dataclass
class PeerResult:
    name: str
    wall_s: float
    curve: list[tuple[float, float]]
    """(seconds since the arm started, eval loss of the global model after that outer step); the
    first point is the initial model."""
    steps: list[int]
    """Inner steps each replica had done at each point of the curve."""
    steps_per_replica: int

    @property
    def eval_loss(self) -> float:
        return self.curve[-1][1]

    @property
    def unsynced_steps(self) -> int:
        """Steps each replica trained after the last outer step: not in the global model."""
        return self.steps_per_replica - self.steps[-1]

    def to_json(self) -> dict:
        return {"name": self.name, "wall_s": round(self.wall_s, 2), "eval_loss": self.eval_loss,
                "curve": [[round(t, 2), loss] for t, loss in self.curve], "steps": self.steps,
                "unsynced_steps": self.unsynced_steps}


def run_torchft(task: Task, task_path: Path, out: Path, *, replicas: int, steps: int, sync_every: int,
                budget_s: float, name: str = "torchft", step_time_s: float = 0.0) -> PeerResult:
    """Run the torchft arm to its end and evaluate it (see the module docstring). `budget_s`: how
    long the replicas may take before they are counted as stuck (plus OVERRUN_S); `step_time_s`:
    each replica's pace (every step takes at least that long), 0 for none."""
    arm = out / name
    versions = arm / "versions"
    for old in versions.glob("*.safetensors"):
        old.unlink()
    env = process_env({})
    lighthouse, address = start_lighthouse(replicas, out / "logs" / f"{name}-lighthouse.log", env)
    started, started_unix = time.monotonic(), time.time()
    with Supervisor(env, out / "logs") as fleet:
        try:
            for i in range(replicas):
                fleet.add(f"replica-{i}", [sys.executable, "-m", "diloco.infra.bench.torchft_replica", "--task",
                                           str(task_path), "--replica", str(i), "--replicas", str(replicas),
                                           "--lighthouse", address, "--steps", str(steps),
                                           "--sync-every", str(sync_every), "--data-seed", str(i), "--out", str(arm),
                                           "--step-time-s", str(step_time_s)],
                          log=f"{name}-replica-{i}.log")
            while fleet.busy():
                time.sleep(0.5)
                fleet.check()  # a replica must end with 0
                if time.monotonic() - started > budget_s + OVERRUN_S:
                    raise RuntimeError(f"torchft: replicas still running after {budget_s + OVERRUN_S:.0f}s: see "
                                       f"{out / 'logs'}")
            wall_s = time.monotonic() - started
        finally:
            fleet.stop(timeout_s=10)
            lighthouse.terminate(10)
    return PeerResult(name, wall_s, *evaluate_versions(task, versions, started_unix), steps)


def evaluate_versions(task: Task, versions: Path, started_unix: float) -> tuple[list[tuple[float, float]], list[int]]:
    """Eval loss of every global model in `versions` (in outer-step order) and the inner step each was taken at."""
    model = task.make_model(0)
    curve, steps = [], []
    for path in sorted(versions.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            load_params(model, {name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (not a dict)
            meta = f.metadata()
        curve.append((float(meta["t"]) - started_unix, task.eval_loss(model)))
        steps.append(int(meta["step"]))
    if not curve:
        raise RuntimeError(f"torchft: no global version in {versions}")
    return curve, steps
