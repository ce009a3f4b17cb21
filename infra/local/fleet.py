"""Starting and stopping `diloco` processes: the coordinator and learners as real OS processes.

Used by the demo, the benchmarks, the chaos run and the tests, so that all of them exercise the
same command lines a user runs; `learner_argv` is the one command line of a learner they start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def diloco_command(*args: str) -> list[str]:
    """`diloco ARGS` with this interpreter (`python -m diloco.infra.cli`): no PATH lookup."""
    return [sys.executable, "-m", "diloco.infra.cli", *args]


def learner_argv(run: str, name: str, task: Path, *, steps: int, data_seed: int, slowdown: float = 1.0,
                 until: float | None = None, step_time_s: float | None = None,
                 extra: Sequence[str] = ()) -> list[str]:
    """`diloco learner`: learner `name` of `run` trains the task in the JSON file `task` for `steps`
    inner steps on data seed `data_seed`, each step `slowdown` times slower. `until` (a Unix time)
    ends it earlier and `step_time_s` paces it (see DemoLearnerArgs); `extra`: more learner options."""
    argv = ["learner", "--run", run, "--id", name, "--steps", str(steps), "--slowdown", str(slowdown),
            "--data-seed", str(data_seed), "--task", str(task)]
    if until is not None:
        argv += ["--until", f"{until:.2f}"]
    if step_time_s is not None:
        argv += ["--step-time-s", str(step_time_s)]
    return diloco_command(*argv, *extra)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self.env, start_new_session=True)
        log.close()
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, like a machine that vanished."""
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait()

    def send(self, sig: signal.Signals) -> bool:
        """Send `sig` to the process group without waiting; False if it had exited already."""
        if not self.alive():
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after the deadline. Returns the exit code."""
        if not self.alive():
            return self.returncode()
        os.killpg(self.pid, signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.returncode()

    def wait(self, timeout_s: float | None = None) -> int | None:
        assert self.popen is not None
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def process_env(base: dict[str, str]) -> dict[str, str]:
    """The environment for child processes: ours plus the stack settings, one torch thread each."""
    env = dict(os.environ)
    env.update(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env
