"""Parameter names as a run knows them, whatever wraps the model.

Learners of one run may hold the same model in different wrappers: a torchrun island wraps it in
DistributedDataParallel (every name gains `module.`), another learner compiles it (`_orig_mod.`),
a third runs it bare, FSDP1 and activation checkpointing insert `_fsdp_wrapped_module.` and
`_checkpoint_wrapped_module.` into the names of what they wrap. The run names each parameter as
the bare model does: the wrappers are taken off the module (by type, so that a model of one's own
whose child happens to be called `module` keeps its names) and the wrapper segments off the names.
"""

from __future__ import annotations

import torch

COMPILED_PREFIX = "_orig_mod."
"""What `torch.compile` puts before every parameter name of the module it wraps."""

WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""What FSDP1 (`FullyShardedDataParallel`) and `checkpoint_wrapper` insert before the names of the
module they wrap, wherever it sits in the model."""


def plain_name(name: str) -> str:
    """A parameter's name in a run: without torch.compile's `_orig_mod.` prefix and the wrapper
    segments FSDP1 and activation checkpointing insert."""
    name = name.removeprefix(COMPILED_PREFIX)
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its whole-model wrappers (DistributedDataParallel, DataParallel,
    torch.compile's module, in any nesting): the same parameters under the bare model's names."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel | DataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None),
                                                                       torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def run_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's trainable parameters by their names in a run, in model order (a shared tensor
    once). Raises ValueError if two of them would take the same name."""
    params: dict[str, torch.nn.Parameter] = {}
    for name, param in unwrapped(model).named_parameters():
        if not param.requires_grad:
            continue
        plain = plain_name(name)
        if plain in params:
            raise ValueError(f"parameters {name!r} and another one are both {plain!r} without their wrappers' "
                             "prefixes: rename one")
        params[plain] = param
    return params


def model_names(model: torch.nn.Module) -> dict[str, str]:
    """Each trainable parameter's name in a run -> its name in `model.state_dict()` (wrappers and all)."""
    by_param = {id(p): n for n, p in model.named_parameters()}
    return {plain: by_param[id(p)] for plain, p in run_parameters(model).items()}
