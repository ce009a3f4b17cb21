"""The global model of a run, read from S3 alone: every fragment's params at a chosen version.

A version number is per fragment. Which versions make "the model" (`Which`):
- "latest": each fragment's highest committed version (its manifest exists), the model the
  learners are converging on; for a finished run that is its final model.
- "final": the versions the run's end record names (`diloco finish`, or every learner finished);
  refused while the run is not finished.
- an int V: every fragment at version V (a one-fragment run's version V).
- a sequence of ints: fragment f at the f-th.

Every params object is checked against the sha256 its manifest records and its shapes against the
layout (`history.read_params`). A version whose params were deleted by `diloco gc` is refused
naming it: gc keeps the latest versions' params, and any version can be re-derived (`diloco replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.storage.errors import ConfigError, Refused
from diloco.storage.history import latest_version, read_layout, read_manifest, read_params, read_run_end
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, ObjectStore, Store
from diloco.storage.names import run_parameters
from diloco.storage.protocol import Layout
from diloco.storage.settings import Endpoints

Which = str | int | Sequence[int]

@dataclass(frozen=True, slots=True)
class GlobalModel:
    run: str
    versions: tuple[int, ...]
    """Per fragment (index = fragment): the version its params come from."""
    state: dict[str, torch.Tensor]
    """Every trainable parameter, by name (the names the learners' models give them), fp32, CPU."""
    params_sha256: tuple[str, ...]
    """Per fragment: the sha256 of the params object, as its manifest records it (and as checked)."""
    finished: bool
    """The run has ended and these are its final versions."""

    def describe(self) -> str:
        versions = ", ".join(f"{f}:{v}" for f, v in enumerate(self.versions))
        numel = sum(t.numel() for t in self.state.values())
        return (f"run {self.run!r}, {len(self.state)} tensors ({numel:,} parameters), "
                f"version per fragment {versions}{' (final)' if self.finished else ''}")

    def metadata(self) -> dict[str, str]:
        """Flat string metadata for a checkpoint's header (safetensors takes str -> str only)."""
        return {"diloco.run": self.run, "diloco.versions": ",".join(map(str, self.versions)),
                "diloco.params_sha256": ",".join(self.params_sha256), "diloco.finished": str(self.finished).lower()}


def parse_which(text: str) -> Which:
    """A --version option: 'latest', 'final', 'V' or 'V0,V1,...' (one per fragment)."""
    text = text.strip()
    if text in ("latest", "final"):
        return text
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--version must be latest, final, a version number or one per fragment "
                         f"(e.g. 12,11,12), got {text!r}") from None
    if any(n < 0 for n in numbers):
        raise ValueError(f"versions are >= 0, got {text!r}")
    return numbers[0] if len(numbers) == 1 else numbers


def choose_versions(store: Store, keys: RunKeys, layout: Layout, which: Which) -> tuple[tuple[int, ...], bool]:
    """The version of each fragment `which` names, and whether they are the run's final versions.
    Raises Refused naming what is missing, ConfigError for a choice that cannot be met."""
    count = len(layout.fragments)
    end = read_run_end(store, keys)
    if which == "final" or which == "latest":
        if end is not None and all(v >= 0 for v in end.versions):
            return tuple(end.versions), True
        if which == "final":
            raise ConfigError(f"run {keys.run!r} is not finished: take its latest versions, or finish it "
                              "(`diloco finish`)")
        latest = [latest_version(store, keys, f) for f in range(count)]
        missing = [f for f, v in enumerate(latest) if v is None]
        if missing:
            raise Refused("missing_object", f"run {keys.run!r}: fragment(s) {missing} have no committed version yet")
        return tuple(int(v) for v in latest), False  # type: ignore[arg-type]
    if isinstance(which, int):
        versions = (which,) * count
    elif isinstance(which, Sequence) and not isinstance(which, str):
        versions = tuple(int(v) for v in which)
        if len(versions) != count:
            raise ConfigError(f"run {keys.run!r} has {count} fragments, {len(versions)} versions given")
    else:
        raise ValueError(f"not a version choice: {which!r}")
    finished = end is not None and tuple(end.versions) == versions
    return versions, finished


def read_global(store: Store, keys: RunKeys, which: Which = "latest") -> GlobalModel:
    """The run's global model at `which` (see the module docstring), verified. Raises Refused if the
    run, a version or its params are missing or do not check out."""
    layout = read_layout(store, keys)
    if layout is None:
        raise Refused("missing_object", f"run {keys.run!r} has no layout at {store.url(keys.layout())}: wrong run, "
                      "bucket or prefix, or no version 0 yet?")
    versions, finished = choose_versions(store, keys, layout, which)
    state: dict[str, torch.Tensor] = {}
    hashes = []
    for fragment, version in enumerate(versions):
        try:
            manifest = read_manifest(store, keys, fragment, version)
        except ObjectMissing:
            raise Refused("missing_object", f"run {keys.run!r}: fragment {fragment} has no version {version}") from None
        try:
            tensors = read_params(store, layout, manifest)
        except ObjectMissing:
            raise Refused("missing_object", f"run {keys.run!r}: the params of fragment {fragment} version {version} "
                          "were deleted (`diloco gc` keeps the latest ones; `diloco replay` re-derives any "
                          "version)") from None
        state.update({spec.name: tensors[spec.name] for spec in layout.fragments[fragment]})
        hashes.append(manifest.params_sha256)
    return GlobalModel(keys.run, versions, state, tuple(hashes), finished)


def load_global(run: str, model: torch.nn.Module, *, endpoints: Endpoints | None = None,
                version: Which = "latest") -> GlobalModel:
    """Load run `run`'s global model (see `read_global` for `version`) into `model`'s trainable
    parameters, in place, and return it (its versions say what was loaded). Reads S3 only: the
    endpoints default to the environment's (DILOCO_S3_*; no Redis needed)."""
    endpoints = endpoints or Endpoints.from_env(redis=False)
    loaded = read_global(ObjectStore(endpoints), RunKeys(endpoints.prefix, run), version)
    load_into(model, loaded.state)
    return loaded


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the model's trainable parameters in place (names compared without the
    prefixes of DDP, torch.compile and other wrappers). Raises ValueError naming the first
    parameters that do not match."""
    params = run_parameters(model)
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise ValueError(f"the model does not match the run's parameters: model has but run lacks {missing[:3]}, "
                         f"run has but model lacks {extra[:3]}")
    for name, param in params.items():
        if tuple(param.shape) != tuple(state[name].shape):
            raise ValueError(f"parameter {name}: run has shape {list(state[name].shape)}, model has "
                             f"{list(param.shape)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
