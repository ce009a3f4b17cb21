"""What each input of a version did to it: pure numbers over tensors, for `diloco inspect` and `diloco blame`.

Everything is measured against the merged update the version applied, computed by the very
function the coordinator merges with (`outer.round_delta`, configured by the manifest's settings),
so "the merged update" here is the outer gradient that was stepped with, not an approximation.

- Per input: the L2 norm of its delta and its cosine to the merged update (`input_figures`).
- Per learner (its pieces in one round summed, as the merge adds them): its share of the round's
  weight, its norm next to the other learners', and the cosine of its progress to the merged
  update of the *other* learners (`learner_rounds`). That leave-one-out consensus is what a
  learner can be said to agree or disagree with; the merged update itself contains the learner,
  so a dominant input always looks aligned with it. Next to it, how much the other learners agree
  with theirs, since how aligned honest learners are depends on the model, the data and H.
- The round without one learner (`round_without`): the weights `merge_weights` would have given
  the remaining inputs and the outer step they would have made from the same parent.

Norms and dot products are float64 over all of the fragment's tensors, in name order.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco.coordinator.outer import NesterovState, apply_recorded, round_delta
from diloco.coordinator.rederive import recomputed_weights
from diloco.storage.protocol import Contribution, VersionSettings

Tensors = Mapping[str, Tensor]


def flat(tensors: Tensors) -> Tensor:
    """A fragment's tensors as one float64 vector, in name order."""
    return torch.cat([tensors[name].detach().reshape(-1).to(torch.float64) for name in sorted(tensors)])


def cosine(a: Tensor, b: Tensor) -> float | None:
    """cos(a, b) of two flat vectors; None when either is zero (no direction to compare)."""
    norms = float(torch.linalg.vector_norm(a)) * float(torch.linalg.vector_norm(b))
    if norms == 0.0:
        return None
    return max(-1.0, min(1.0, float(a @ b) / norms))


@dataclass(frozen=True, slots=True)
class InputFigures:
    """One input of a version, next to the merged update."""

    norm: float
    """L2 norm of the input's delta (for version 0: of the proposed parameters)."""
    cos_merged: float | None
    """Cosine of the delta to the version's merged update; None if either is zero."""


def input_figures(deltas: Sequence[Tensors], weights: Sequence[float],
                  settings: VersionSettings) -> tuple[list[InputFigures], float]:
    """Per input (in merge order): norm and cosine to the merged update; and the merged update's norm."""
    merged = flat(round_delta(deltas, weights, settings))
    figures = []
    for d in deltas:
        v = flat(d)
        figures.append(InputFigures(norm=float(torch.linalg.vector_norm(v)), cos_merged=cosine(v, merged)))
    return figures, float(torch.linalg.vector_norm(merged))


@dataclass(frozen=True, slots=True)
class LearnerRound:
    """What one learner contributed to one version, next to the other learners in it."""

    learner: str
    pieces: int
    """Inputs it had in the round (a learner that sent twice before the round closed has two)."""
    share: float
    """Its weight over the sum of the learners' weights in the round (each piece carries its learner's
    weight, so a learner's weight is the mean over its pieces)."""
    norm: float
    """L2 norm of its progress in the round: its pieces summed, as the merge adds them."""
    others: int
    """Other learners in the round."""
    loo_cos: float | None
    """Cosine of its progress to the merged update of the other learners (leave-one-out); None without
    others, or when either is zero."""
    norm_ratio: float | None
    """Its norm over the median of the other learners' norms; None without others or if that median is 0."""
    peers_cos: float | None = None
    """The median of the other learners' own leave-one-out cosines in the same round: how much the
    others agree with their consensus, to compare `loo_cos` with. None without them."""


def learner_rounds(learners: Sequence[str], deltas: Sequence[Tensors], weights: Sequence[float],
                   settings: VersionSettings) -> list[LearnerRound]:
    """One `LearnerRound` per distinct learner of a version, in order of first appearance.

    `learners`, `deltas` and `weights` are the version's inputs in merge order (the manifest's).
    The others' merged update is `round_delta` over their inputs with their recorded weights: its
    direction does not depend on how those weights are normalized, for either merge rule.
    """
    if not len(learners) == len(deltas) == len(weights):
        raise ValueError(f"{len(learners)} learners, {len(deltas)} deltas and {len(weights)} weights")
    names = list(dict.fromkeys(learners))
    flats = [flat(d) for d in deltas]
    progress = {g: torch.stack([f for f, who in zip(flats, learners, strict=True) if who == g]).sum(0) for g in names}
    norms = {g: float(torch.linalg.vector_norm(progress[g])) for g in names}
    weight = {g: statistics.fmean(w for w, who in zip(weights, learners, strict=True) if who == g) for g in names}
    total = math.fsum(weight.values())
    rounds = []
    for g in names:
        rest = [i for i, who in enumerate(learners) if who != g]
        loo_cos = ratio = None
        if rest:
            consensus = flat(round_delta([deltas[i] for i in rest], [weights[i] for i in rest], settings))
            loo_cos = cosine(progress[g], consensus)
            median = statistics.median(norms[h] for h in names if h != g)
            ratio = norms[g] / median if median > 0 else None
        rounds.append(LearnerRound(learner=g, pieces=learners.count(g), share=weight[g] / total if total else 0.0,
                                   norm=norms[g], others=len(names) - 1, loo_cos=loo_cos, norm_ratio=ratio))
    cosines = {r.learner: r.loo_cos for r in rounds if r.loo_cos is not None}
    return [dataclasses.replace(r, peers_cos=statistics.median(c for h, c in cosines.items() if h != r.learner))
            if any(h != r.learner for h in cosines) else r for r in rounds]


def weights_without(inputs: Sequence[Contribution], learner: str, parent_version: int,
                    settings: VersionSettings) -> tuple[list[int], list[float]]:
    """The inputs left when `learner`'s are taken out (indices into `inputs`), and the weights
    `merge_weights` gives them: what the coordinator would have merged had the learner not sent.
    Raises ValueError if nothing is left."""
    kept = [i for i, c in enumerate(inputs) if c.learner != learner]
    if not kept:
        raise ValueError(f"version has no inputs other than {learner}'s")
    return kept, recomputed_weights([inputs[i] for i in kept], parent_version, settings)


def round_without(parent_params: Tensors, parent_state: NesterovState, inputs: Sequence[Contribution],
                  deltas: Sequence[Tensors], learner: str, parent_version: int,
                  settings: VersionSettings) -> dict[str, Tensor]:
    """The parameters a version would have had without `learner`'s inputs: the same parent, the
    others' deltas with the weights `weights_without` gives them, the same outer step."""
    kept, weights = weights_without(inputs, learner, parent_version, settings)
    params, _ = apply_recorded(parent_params, parent_state, [deltas[i] for i in kept], weights, settings,
                               [inputs[i] for i in kept])
    return params
