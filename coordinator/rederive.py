"""Re-deriving a committed version from its manifest: the check behind `diloco replay` (invariant 4).

Pure: no I/O, no clock. Given a manifest, the parent version's params and outer state and the
decoded inputs (in the manifest's order), `rederive` recomputes the version with the functions
the live coordinator merges with (`merge_order`, `merge_weights`, `outer.apply_round`, and
`updates.params_body` / `publish.state_body` for the bytes), using the weights and settings the
manifest records, and compares the sha256 of the encoded bytes with the manifest's.

It also re-checks what the manifest claims about its own inputs: that they are in merge order,
that each recorded staleness is parent - base, and that `merge_weights`, recomputed from the
recorded tokens, steps and base versions, gives exactly the recorded weights. Each thing that
differs is a `Problem` with a code and a sentence that says what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from diloco.coordinator.outer import NesterovState, apply_recorded
from diloco.coordinator.policy import Arrival, RoundConfig, merge_order, merge_weights
from diloco.coordinator.publish import state_body
from diloco.storage.updates import params_body
from diloco.storage.history import sha256_hex
from diloco.storage.keys import RunKeys
from diloco.storage.protocol import Contribution, Manifest, VersionSettings

WEIGHTS_RULE = "tokens*tokens/steps"
"""The only weighting rule `merge_weights` implements (recorded as the manifest's `weights` setting)."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One way a version does not replay as recorded."""

    code: str
    """settings, order, staleness, weights, params, outer_state (here); the reader adds the I/O ones
    (manifest, missing_input, corrupt_input, parent, stored_params, stored_outer_state, stored_update)."""
    detail: str
    """What was expected and what was found, for a person."""


@dataclass(frozen=True, slots=True)
class Rederived:
    """A version computed again from its inputs."""

    params: dict[str, Tensor] | None
    """The re-derived parameters (None if the inputs did not even allow computing them)."""
    state: NesterovState | None
    problems: tuple[Problem, ...]
    """Empty when the version is bit-exact: same weights, same params and outer-state bytes."""

    @property
    def bit_exact(self) -> bool:
        return not self.problems


def _short(sha: str) -> str:
    return sha[:16]


def _arrival(c: Contribution) -> Arrival:
    return Arrival(contribution_id=c.contribution_id, learner=c.learner, base_version=c.base_version,
                   tokens=c.tokens, steps=c.steps, arrived_at=0.0, step_time_s=0.0)


def _input_name(i: int, c: Contribution) -> str:
    return f"input {i} ({c.learner}, contribution {c.contribution_id[:12]}, {'/'.join(c.object_key.split('/')[-3:])})"


def recomputed_weights(inputs: Sequence[Contribution], parent_version: int, settings: VersionSettings) -> list[float]:
    """The weights `merge_weights` gives `inputs` from their recorded tokens, steps, base versions and
    usual pieces, against `parent_version`, under `settings` (the staleness discount, the fleet's
    rate): a manifest's own inputs (to check its weights, or to re-weight them in a what-if), or some
    of them (what the coordinator would have merged without a learner).
    Raises ValueError as merge_weights does."""
    cfg = dataclasses.replace(RoundConfig(), staleness_discount=settings.staleness_discount,
                              staleness_relative=settings.staleness_relative)
    usual = {c.learner: c.usual for c in inputs if c.usual > 0}
    weights = merge_weights([_arrival(c) for c in inputs], parent_version, cfg, usual, settings.rate_steps)
    # Each times the factor its learner's pieces were scaled by (`influence.clip_norms`, recorded):
    # the very product the coordinator made.
    return [w * c.clip for w, c in zip(weights, inputs, strict=True)]


def recorded_problems(manifest: Manifest) -> list[Problem]:
    """What the manifest's own records contradict: unknown settings, inputs out of merge order,
    a staleness other than parent - base, a weight other than what `merge_weights` recomputes."""
    s = manifest.settings
    if manifest.version == 0:
        if len(manifest.inputs) != 1 or manifest.inputs[0].weight != 1.0:
            return [Problem("weights", f"version 0 must be one genesis proposal of weight 1, the manifest records "
                            f"{[(c.learner, c.weight) for c in manifest.inputs]}")]
        return []
    if s.weights != WEIGHTS_RULE:
        return [Problem("settings", f"weights rule {s.weights!r}: this build replays only {WEIGHTS_RULE!r}")]
    if not manifest.inputs:
        return [Problem("weights", "the manifest of a merged version records no inputs")]
    problems = []
    arrivals = [_arrival(c) for c in manifest.inputs]
    recorded = [c.contribution_id for c in manifest.inputs]
    ordered = [a.contribution_id for a in merge_order(arrivals)]
    if ordered != recorded:
        problems.append(Problem("order", f"inputs are recorded in the order {[x[:8] for x in recorded]}, "
                                f"merge_order gives {[x[:8] for x in ordered]}"))
    for i, c in enumerate(manifest.inputs):
        if c.staleness != manifest.parent_version - c.base_version:
            problems.append(Problem("staleness", f"{_input_name(i, c)} records staleness {c.staleness}, but its "
                                    f"base v{c.base_version} is {manifest.parent_version - c.base_version} "
                                    f"behind the parent v{manifest.parent_version}"))
    try:
        weights = recomputed_weights(manifest.inputs, manifest.parent_version, s)
    except ValueError as exc:
        return [*problems, Problem("weights", f"merge_weights refuses the recorded inputs: {exc}")]
    for i, (c, w) in enumerate(zip(manifest.inputs, weights, strict=True)):
        if c.weight != w:
            problems.append(Problem("weights", f"{_input_name(i, c)} records weight {c.weight!r}, merge_weights "
                                    f"recomputed from the recorded tokens, steps and bases gives {w!r}"))
    return problems


def rederive(manifest: Manifest, keys: RunKeys, inputs: Sequence[Mapping[str, Tensor]], *,
             parent_params: Mapping[str, Tensor] | None = None,
             parent_state: NesterovState | None = None) -> Rederived:
    """Compute `manifest`'s version again and compare its encoded bytes with the recorded sha256s.

    `inputs` are the decoded input objects, one per `manifest.inputs` entry in the same order.
    Version 0 is its genesis proposal published unchanged (no parent); any other version needs
    the parent's params and outer state. The merge uses the recorded weights; the weights
    `merge_weights` recomputes are checked against them (`recorded_problems`).
    """
    if len(inputs) != len(manifest.inputs):
        raise ValueError(f"{len(inputs)} inputs given for the {len(manifest.inputs)} the manifest records")
    problems = recorded_problems(manifest)
    if not manifest.inputs or any(p.code == "settings" for p in problems):
        return Rederived(None, None, tuple(problems))
    if manifest.version == 0:
        params, state = {name: t for name, t in inputs[0].items()}, NesterovState()
    else:
        if parent_params is None or parent_state is None:
            raise ValueError(f"version {manifest.version} needs its parent's params and outer state")
        try:
            params, state = apply_recorded(parent_params, parent_state, list(inputs),
                                           [c.weight for c in manifest.inputs], manifest.settings, manifest.inputs)
        except ValueError as exc:
            return Rederived(None, None, (*problems, Problem("settings", str(exc))))
    f, v = manifest.fragment, manifest.version
    got = sha256_hex(params_body(params, keys, f, v))  # hashed from the tensors: no copy of them
    if got != manifest.params_sha256:
        problems.append(Problem("params", f"params sha256 expected {_short(manifest.params_sha256)}..., "
                                f"re-derived {_short(got)}..."))
    got = sha256_hex(state_body(state, keys, f, v))
    if got != manifest.outer_state_sha256:
        problems.append(Problem("outer_state", f"outer state sha256 expected "
                                f"{_short(manifest.outer_state_sha256)}..., re-derived {_short(got)}..."))
    return Rederived(params, state, tuple(problems))
