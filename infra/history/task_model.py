"""A task's model holding a run's global parameters: for the tools that evaluate a run.

`diloco demo`, `diloco whatif --task`, `diloco blame --task`, the benchmarks' loss curves, the
chaos report and the tests all evaluate the global model the same way: build the task's model,
copy each fragment's parameters at some version into it, and ask the task for its eval loss.
A task a person passes (read by `workers.tasks.kinds.load_task`) is checked against the run here
first (`check_task_fits`), so a task of another model is a one-line error before a tool reads or
writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.storage.errors import ConfigError
from diloco.storage.history import read_layout, read_manifest, read_params
from diloco.storage.keys import RunKeys
from diloco.storage.objects import Store
from diloco.storage.protocol import Layout, Manifest
from diloco.workers.tasks.base import Task


def check_task_fits(task: Task, layout: Layout, run: str) -> None:
    """Refuse a task whose model's parameters (names and shapes) are not the run's `layout`: its
    eval losses would be of another model, or loading the run's parameters into it would fail."""
    wanted = {p.name: tuple(p.shape) for specs in layout.fragments for p in specs}
    have = {n: tuple(p.shape) for n, p in task.make_model(0).named_parameters()}
    if wanted != have:
        differ = sorted(set(wanted) ^ set(have)) or sorted(n for n in wanted if wanted[n] != have[n])
        raise ConfigError(f"the task's model does not fit run {run!r} (parameters {differ[:5]} differ): "
                          "pass the task the run trained, e.g. OUT/task.json of `diloco demo`")


@torch.no_grad()
def load_params(model: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Copy `values` (parameter name -> tensor, e.g. one fragment's) into the model's parameters."""
    params = dict(model.named_parameters())
    for name, value in values.items():
        params[name].copy_(value)


def load_version(model: torch.nn.Module, store: Store, layout: Layout, manifest: Manifest) -> None:
    """Copy the global parameters of the fragment version `manifest` commits into the model (verified)."""
    load_params(model, read_params(store, layout, manifest))


def global_model(task: Task, store: Store, keys: RunKeys, heads: Mapping[int, int]) -> torch.nn.Module:
    """The task's model holding the global parameters at `heads` (fragment -> version), read from S3."""
    model = task.make_model(0)
    layout = read_layout(store, keys)
    assert layout is not None, "no layout: the run never committed version 0"
    for fragment, version in heads.items():
        load_version(model, store, layout, read_manifest(store, keys, fragment, version))
    return model
