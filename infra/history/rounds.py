"""A run's committed versions read back for the history tools (inspect, blame, replay, whatif), verified.

Reads S3 (or an export directory) only, through `storage.history`: every manifest is checked
against its key, every input object against the sha256 its manifest records and the layout. A
version whose inputs cannot all be read is returned with the reason instead of its deltas, so a
tool can say what is missing and go on with the rest. Versions below a fragment's floor (`diloco
gc` deleted their inputs, see `storage.history.read_floors`) come back as collected, with the gc
pass that did it: their manifests still say who contributed what, their deltas are gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from diloco.coordinator.outer import NesterovState
from diloco.coordinator.publish import decode_state
from diloco.storage.errors import Refused
from diloco.storage.history import (Floor, list_versions, params_limit, read_floors, read_input, read_layout,
                                    read_manifest, read_params, read_run_spec, read_verified)
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, Store
from diloco.storage.protocol import Layout, Manifest, RunSpec


@dataclass(frozen=True, slots=True)
class Run:
    """A run's history as the tools read it."""

    store: Store
    keys: RunKeys
    spec: RunSpec
    layout: Layout
    floors: dict[int, Floor]
    """Per fragment whose old inputs `diloco gc` deleted: the first version that still has them."""

    @property
    def fragments(self) -> list[int]:
        return list(range(self.spec.num_fragments))

    def floor(self, fragment: int) -> int:
        """The first version of `fragment` whose inputs are all still there."""
        return self.floors[fragment].version if fragment in self.floors else 0


@dataclass(frozen=True, slots=True)
class Round:
    """One committed version and its inputs' decoded deltas (in the manifest's merge order)."""

    manifest: Manifest
    deltas: list[dict[str, torch.Tensor]] | None
    """None when an input could not be read; `problem` says which and why."""
    problem: str = ""
    collected: bool = False
    """Below the fragment's floor: gc deleted the inputs (`problem` names the pass)."""


def open_run(store: Store, keys: RunKeys) -> Run:
    """The run's spec and layout. Raises Refused('missing_object') with what to check if either is absent."""
    spec, layout = read_run_spec(store, keys), read_layout(store, keys)
    if spec is None or layout is None:
        raise Refused("missing_object", f"run {keys.run!r} has no {'run spec' if spec is None else 'layout'} under "
                      f"{store.url(keys.root)}: wrong run, bucket, DILOCO_S3_PREFIX or --dir?")
    return Run(store, keys, spec, layout, read_floors(store, keys))


def check_fragment(run: Run, fragment: int | None) -> list[int]:
    """The fragments to look at: all of them, or the one asked for if the run has it."""
    if fragment is None:
        return run.fragments
    if not 0 <= fragment < run.spec.num_fragments:
        raise Refused("unknown_fragment", f"run {run.keys.run!r} has fragments 0..{run.spec.num_fragments - 1}, "
                      f"not {fragment}")
    return [fragment]


def versions(run: Run, fragment: int, start: int = 0, end: int | None = None) -> list[int]:
    """Committed versions of a fragment (those whose manifest exists) in start..end, ascending."""
    return [v for v in list_versions(run.store, run.keys, fragment) if v >= start and (end is None or v <= end)]


def read_round(run: Run, fragment: int, version: int) -> Round:
    """A version's manifest and its inputs, each checked against the recorded sha256 and the layout.
    Raises ObjectMissing / Refused only for the manifest itself."""
    manifest = read_manifest(run.store, run.keys, fragment, version)
    if version < run.floor(fragment):
        return Round(manifest, None, f"not measurable: {run.floors[fragment].reason()}", collected=True)
    deltas = []
    for i, c in enumerate(manifest.inputs):
        try:
            deltas.append(read_input(run.store, run.layout, fragment, c, max_bytes=run.spec.max_object_bytes))
        except ObjectMissing:
            return Round(manifest, None, f"input {i} ({c.learner}) {c.object_key} is missing from the bucket")
        except Refused as exc:
            return Round(manifest, None, f"input {i} ({c.learner}) cannot be used: {exc}")
    return Round(manifest, deltas)


def rounds(run: Run, fragment: int, start: int = 0, end: int | None = None) -> Iterator[Round]:
    """`read_round` for each committed version of `fragment` in start..end, in order. A manifest that
    cannot be read stops the walk with a Refused that names the version."""
    for version in versions(run, fragment, start, end):
        try:
            yield read_round(run, fragment, version)
        except (ObjectMissing, Refused) as exc:
            raise Refused(getattr(exc, "code", "missing_object"), f"fragment {fragment} version {version}: the "
                          f"manifest cannot be read ({exc}); `diloco replay` lists every damaged version") from None


def read_state(run: Run, manifest: Manifest) -> tuple[dict[str, torch.Tensor], NesterovState]:
    """A version's stored params and outer state, checked against its manifest."""
    limit = params_limit(run.layout, manifest.fragment)
    params = read_params(run.store, run.layout, manifest)
    state = decode_state(read_verified(run.store, manifest.outer_state_key, manifest.outer_state_sha256,
                                       max_bytes=limit), limit, hashed=True)
    return params, state
