"""Decoupled DiLoCo over S3 and Redis.

The public API is what a training loop needs:

    from diloco import Learner, LearnerConfig, Endpoints
    from diloco import load_global          # a run's global model into a model of the same shape
    from diloco import Preempted            # raised out of optimizer.step() after SIGTERM (handle_sigterm=True)
    from diloco import RunFinished          # raised on joining a run that is finished

Everything else lives in the layers, each a subpackage: `diloco.storage` (records, keys, codecs,
S3 and Redis adapters), `diloco.workers` (the learner), `diloco.coordinator` (the merge loop) and
`diloco.infra` (the `diloco` command line, the local stack, the demo, the benchmarks). In a
source checkout they are the top-level folders storage/, workers/, coordinator/ and infra/;
pyproject.toml maps them under this package.

The names are imported on first use, so `import diloco` (and `diloco stack`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diloco.storage.global_model import load_global
    from diloco.storage.errors import RunFinished
    from diloco.storage.settings import Endpoints
    from diloco.workers.learner import Learner, LearnerConfig, Preempted

__version__ = "0.1.0"

_PUBLIC = {
    "Learner": "diloco.workers.learner",
    "LearnerConfig": "diloco.workers.learner",
    "Preempted": "diloco.workers.learner",
    "Endpoints": "diloco.storage.settings",
    "RunFinished": "diloco.storage.errors",
    "load_global": "diloco.storage.global_model",
}

__all__ = ["Endpoints", "Learner", "LearnerConfig", "Preempted", "RunFinished", "__version__", "load_global"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'diloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
