"""Every task kind a learner can train, and reading one from its wire form (a JSON file's contents)."""

from __future__ import annotations

import json
from pathlib import Path

from diloco.storage.errors import ConfigError
from diloco.workers.tasks.demo import DemoTask
from diloco.workers.tasks.base import Task
from diloco.workers.tasks.gpt2 import GPT2Task
from diloco.workers.tasks.vision import VisionTask

KINDS: dict[str, type] = {cls.kind: cls for cls in (DemoTask, GPT2Task, VisionTask)}
"""Task classes by their wire `kind`."""


def task_from_wire(wire: dict) -> Task:
    """The task `wire` describes. A wire form without a kind is a demo task (files written before
    there were other kinds). Raises ValueError for an unknown kind or a bad field."""
    if not isinstance(wire, dict):
        raise ValueError(f"a task is a JSON object, not {type(wire).__name__}")
    kind = wire.get("kind", DemoTask.kind)
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}: one of {', '.join(sorted(KINDS))}")
    return KINDS[kind].from_wire(wire)


def load_task(path: Path) -> Task:
    """The task in a JSON file (as `diloco demo` writes OUT/task.json, of any kind in KINDS).
    Raises ConfigError if the file cannot be read or does not hold a task, so a bad `--task` is a
    one-line error before a tool reads or writes anything."""
    try:
        return task_from_wire(json.loads(path.read_text()))
    except OSError as exc:
        raise ConfigError(f"cannot read the task {path}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not a task JSON (as `diloco demo` writes to OUT/task.json): {exc}") from None
