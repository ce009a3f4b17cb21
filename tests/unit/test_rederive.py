"""Re-deriving a version from its manifest (coordinator/rederive.py), on hand-made manifests: pure, no servers."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.outer import NesterovState, apply_round
from diloco.coordinator.policy import Arrival, RoundConfig, merge_order, merge_weights
from diloco.coordinator.publish import state_body
from diloco.storage.updates import params_body
from diloco.coordinator.rederive import rederive
from diloco.storage.history import sha256_hex
from diloco.storage.keys import RunKeys
from diloco.storage.protocol import Contribution, Manifest, VersionSettings

KEYS = RunKeys("p", "run")
GENESIS = VersionSettings(kind="genesis", outer_lr=0.7, outer_momentum=0.9)
SHAPES = {"w": (5, 3), "b": (3,)}


def tensors(gen: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: torch.randn(s, generator=gen) * scale for k, s in SHAPES.items()}


USUAL = {"a": 9, "b": 4}
"""Usual pieces at the fleet's rate of 9 steps: b (4 steps) is raised, at most to a's weight."""


def a_version(radial: bool = False, rate: int = 0) -> tuple[Manifest, list[dict[str, torch.Tensor]], dict, NesterovState]:
    """Version 3 of fragment 0 made the way the coordinator makes one: three inputs from two
    learners (one of them stale), merged after a first outer step (so with momentum); at the
    fleet's `rate` (USUAL) if one is given."""
    gen = torch.Generator().manual_seed(7)
    cfg = RoundConfig()
    settings = dataclasses.replace(CoordinatorConfig(radial_directional=radial).settings(cfg, "delta", "fp32"),
                                   rate_steps=rate)
    parent = tensors(gen)
    merge = settings
    _, state = apply_round(parent, NesterovState(), [tensors(gen, 0.1)], [1.0], merge, staleness=[0], bounded=[False])
    arrivals = [Arrival(uuid.uuid4().hex, learner, base, tokens, steps, 0.0, 0.0)
                for learner, base, tokens, steps in (("b", 2, 40, 4), ("a", 1, 90, 9), ("b", 2, 40, 4))]
    ordered = merge_order(arrivals)
    weights = merge_weights(ordered, 2, cfg, USUAL if rate else None, rate)
    deltas = [tensors(gen, 0.01) for _ in ordered]
    # "b"'s second piece was bounded (its claims cut): it moves the params, not the momentum.
    bounded = [i == 2 for i in range(len(ordered))]
    params, new_state = apply_round(parent, state, deltas, weights, merge, staleness=[2 - a.base_version for a in ordered],
                                    bounded=bounded)
    inputs = tuple(Contribution(contribution_id=a.contribution_id, learner=a.learner, seq=i, object_key=f"k/{i}",
                                sha256="0" * 64, base_version=a.base_version, staleness=2 - a.base_version,
                                tokens=a.tokens, steps=a.steps, weight=w, stream_id="",
                                usual=USUAL[a.learner] if rate else 0, bounded="claimed more" if bounded[i] else "")
                   for i, (a, w) in enumerate(zip(ordered, weights)))
    manifest = Manifest(run="run", fragment=0, version=3, parent_version=2, params_key="x", outer_state_key="y",
                        params_sha256=sha256_hex(params_body(params, KEYS, 0, 3)),
                        outer_state_sha256=sha256_hex(state_body(new_state, KEYS, 0, 3)),
                        inputs=inputs, settings=settings, refused=(), committed_at=0.0, epoch=1)
    return manifest, deltas, parent, state


@pytest.mark.parametrize("radial", [False, True])
@pytest.mark.parametrize("rate", [0, 9])
def test_a_version_rederives_bit_exact(radial, rate):
    manifest, deltas, parent, state = a_version(radial, rate)
    assert {c.staleness for c in manifest.inputs} == {0, 1}  # a stale input: its weight is discounted
    result = rederive(manifest, KEYS, deltas, parent_params=parent, parent_state=state)
    assert result.bit_exact, result.problems


def test_the_fleets_rate_is_replayed_from_the_recorded_usual_pieces():
    manifest, deltas, parent, state = a_version(rate=9)
    plain, _, _, _ = a_version()
    # b's 8 steps in two pieces weigh 80*80/8 = 800 against a's 900: raised by 9/4, capped at a's
    # (each against a's: the round's weights are then scaled together, `staleness_relative`).
    def against_a(m: Manifest) -> list[float]:
        return [c.weight / m.inputs[0].weight for c in m.inputs]

    assert [round(r / p, 6) for r, p in zip(against_a(manifest), against_a(plain))] == [1.0, 1.125, 1.125]

    def problems(m: Manifest) -> list[str]:
        return [p.code for p in rederive(m, KEYS, deltas, parent_params=parent, parent_state=state).problems]

    other = tuple(dataclasses.replace(c, usual=8 if c.learner == "b" else c.usual) for c in manifest.inputs)
    assert problems(dataclasses.replace(manifest, inputs=other)) == []  # 9/8 of 800 is still a's 900
    other = tuple(dataclasses.replace(c, usual=9) for c in manifest.inputs)
    # b's two, not raised, and with them a's: a round's weights are scaled together (`staleness_relative`)
    assert problems(dataclasses.replace(manifest, inputs=other)) == ["weights"] * 3
    slower = dataclasses.replace(manifest, settings=dataclasses.replace(manifest.settings, rate_steps=4))
    assert problems(slower) == ["weights"] * 3  # b is at a rate of 4: not raised


def test_each_kind_of_difference_is_named():
    manifest, deltas, parent, state = a_version()

    def problems(m: Manifest, d=deltas) -> list[str]:  # noqa: ANN001
        return [p.code for p in rederive(m, KEYS, d, parent_params=parent, parent_state=state).problems]

    i = next(i for i, c in enumerate(manifest.inputs) if c.staleness == 0)  # a fresh input's delta...
    other = [{k: v + 1e-3 for k, v in d.items()} if j == i else d for j, d in enumerate(deltas)]
    assert problems(manifest, other) == ["params", "outer_state"]
    s = next(i for i, c in enumerate(manifest.inputs) if c.staleness > 0)  # ...a stale one's moves the params only
    other = [{k: v + 1e-3 for k, v in d.items()} if j == s else d for j, d in enumerate(deltas)]
    assert problems(manifest, other) == ["params"]
    heavier = dataclasses.replace(manifest, inputs=tuple(dataclasses.replace(c, weight=c.weight * 2) if j == i else c
                                                         for j, c in enumerate(manifest.inputs)))
    assert problems(heavier) == ["weights", "params", "outer_state"]
    swapped = dataclasses.replace(manifest, inputs=manifest.inputs[::-1])
    assert problems(swapped, deltas[::-1])[0] == "order"
    fresh = dataclasses.replace(manifest, inputs=tuple(dataclasses.replace(c, staleness=0) for c in manifest.inputs))
    assert problems(fresh) == ["staleness", "params", "outer_state"]  # staleness decides what the momentum takes
    # The recorded settings are the ones replayed: another lr gives other params (the momentum does not use it).
    assert problems(dataclasses.replace(manifest, settings=dataclasses.replace(manifest.settings, outer_lr=0.5))) == [
        "params"]
    assert problems(dataclasses.replace(manifest, settings=dataclasses.replace(manifest.settings, weights="tokens"))) == [
        "settings"]


def test_genesis_is_its_proposal_unchanged():
    gen = torch.Generator().manual_seed(1)
    proposal = tensors(gen)
    inputs = (Contribution(contribution_id=uuid.uuid4().hex, learner="a", seq=0, object_key="g", sha256="0" * 64,
                           base_version=-1, staleness=0, tokens=0, steps=0, weight=1.0, stream_id=""),)
    manifest = Manifest(run="run", fragment=0, version=0, parent_version=-1, params_key="x", outer_state_key="y",
                        params_sha256=sha256_hex(params_body(proposal, KEYS, 0, 0)),
                        outer_state_sha256=sha256_hex(state_body(NesterovState(), KEYS, 0, 0)),
                        inputs=inputs, settings=GENESIS, refused=(), committed_at=0.0, epoch=1)
    assert rederive(manifest, KEYS, [proposal]).bit_exact
    changed = {k: v.clone() for k, v in proposal.items()}
    changed["b"][0] += 1
    assert [p.code for p in rederive(manifest, KEYS, [changed]).problems] == ["params"]
