"""Split a model into P fragments and decide when each one syncs. Pure functions only.

Planning: parameters are grouped into units. A *block* is every parameter under the same
`<container>.<index>.` prefix (`blocks.3.attn.qkv.weight` and `blocks.3.mlp.fc.bias` share the
unit `blocks.3`; a Hugging Face `model.layers.7.` works the same). Every other parameter is a unit
of its own. Units go greedily, largest first, to the lightest fragment (ties: lowest index), which
is balanced by size and, for equal-sized blocks, strided: block i lands in fragment i mod P as in
Streaming DiLoCo. Order inside a fragment is the model's parameter order.

Scheduling, two cadences (the run spec says which):
- steps (`due_fragments`): fragment p sends every H steps at offset p*H/P (staggered, so peak
  bandwidth is 1/P of a full sync). Simple, but learners of different speeds drift apart and
  their contributions arrive one by one.
- clock (`clock_due`): the coordinator publishes a round clock (`Cadence`); a learner sends
  fragment p at its last step boundary before p's next deadline, with however many steps it
  managed, and earlier by the time its pieces take to go out (`send_lead`), so that a piece on a
  thin link arrives by the deadline too. Every learner, fast or slow, lands in the same round;
  nothing drifts.
Until the coordinator has published a clock (it needs measured step times), clock runs fall back
on the step cadence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from diloco.storage.names import run_parameters
from diloco.storage.protocol import Cadence, Layout, ParamSpec

if TYPE_CHECKING:  # only for a type hint: the schedules are imported where torch is not (the goodput simulator)
    import torch

_BLOCK_RE = re.compile(r"^(.*?\.\d+)\.")


def unit_of(name: str) -> str:
    """The planning unit of a parameter: its first `<container>.<index>` prefix, else itself."""
    m = _BLOCK_RE.match(name)
    return m.group(1) if m else name


def plan_layout(params: Iterable[tuple[str, tuple[int, ...], str]], num_fragments: int) -> Layout:
    """Assign (name, shape, dtype) parameters to `num_fragments` fragments; see module docstring."""
    specs = [ParamSpec(name=n, shape=tuple(int(d) for d in s), dtype=str(dt)) for n, s, dt in params]
    if not specs:
        raise ValueError("the model has no trainable parameters")
    units: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        units.setdefault(unit_of(spec.name), []).append(i)
    if len(units) < num_fragments:
        raise ValueError(f"cannot split {len(units)} parameter groups into {num_fragments} fragments: "
                         f"use --fragments {len(units)} or fewer")
    order = sorted(units.items(), key=lambda kv: -sum(specs[i].numel for i in kv[1]))  # stable: model order on ties
    loads = [0] * num_fragments
    owner: dict[int, int] = {}
    for _unit, members in order:
        target = min(range(num_fragments), key=lambda f: (loads[f], f))
        loads[target] += sum(specs[i].numel for i in members)
        for i in members:
            owner[i] = target
    fragments = tuple(tuple(s for i, s in enumerate(specs) if owner[i] == f) for f in range(num_fragments))
    return Layout(fragments=fragments)


def model_params(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every trainable parameter, in model order (shared tensors once), named as
    in a run (`names.run_parameters`: without the prefixes of DDP, torch.compile and other wrappers)."""
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in run_parameters(model).items()]


def layout_mismatch(expected: Layout, actual: Layout) -> str | None:
    """A sentence naming the first difference between two layouts, or None if they are equal."""
    if len(expected.fragments) != len(actual.fragments):
        return f"run has {len(expected.fragments)} fragments, this model was split into {len(actual.fragments)}"
    for f, (a, b) in enumerate(zip(expected.fragments, actual.fragments, strict=True)):
        names_a, names_b = [p.name for p in a], [p.name for p in b]
        if names_a != names_b:
            missing = sorted(set(names_a) - set(names_b))[:3]
            extra = sorted(set(names_b) - set(names_a))[:3]
            return f"fragment {f}: parameters differ (run has but model lacks {missing}, model has extra {extra})"
        for pa, pb in zip(a, b, strict=True):
            if pa.shape != pb.shape:
                return f"parameter {pa.name}: run has shape {list(pa.shape)}, model has {list(pb.shape)}"
    return None


def sync_offset(fragment: int, num_fragments: int, sync_every: int) -> int:
    return (fragment * sync_every) // num_fragments


def due_fragments(step: int, num_fragments: int, sync_every: int) -> list[int]:
    """Fragments whose contribution is due after inner step `step` (1-based, step 0 never syncs)."""
    if step <= 0:
        return []
    return [f for f in range(num_fragments)
            if step >= sync_every and (step - sync_offset(f, num_fragments, sync_every)) % sync_every == 0]


SEND_LEAD_SHARE = 0.5
"""The most of a round period a learner sends ahead of a deadline (`send_lead`): a piece keeps at
least the other half of its round's steps, and a lead stays shorter than the period, so it never
reaches past the deadline before."""


def send_lead(send_lag_s: float, period_s: float) -> float:
    """How long before a deadline a learner whose pieces take `send_lag_s` to go out (encode, PUT
    and announce: `TransferStats.send_lag_s`) sends, so that its piece arrives by the deadline:
    the lag, at most `SEND_LEAD_SHARE` of the round period. On a thin link a piece sent at the
    deadline arrives seconds late and holds the round's grace window open, or misses the round and
    is merged a version stale; sent this much earlier it makes its round on time, with the steps
    trained by then, and the steps after go out with the next piece: nothing is lost."""
    if not (send_lag_s > 0 and period_s > 0):
        return 0.0
    return min(send_lag_s, SEND_LEAD_SHARE * period_s)


def clock_due(now: float, step_time_s: float, cadence: Cadence, num_fragments: int,
              sent: dict[int, float], previous: float | None = None, lead_s: float = 0.0
              ) -> list[tuple[int, float]]:
    """(fragment, deadline) pairs to send now: the next step would end past the fragment's deadline
    less `lead_s` (`send_lead`), or the step that just ended (from `previous`, the step boundary
    before `now`) crossed a deadline that was not served: a step that took longer than the learner's
    mean step time. That send is late, but within the round's grace window it still makes the round;
    skipping it would leave the learner out of the round and put two rounds of its progress, stale,
    into the next one.

    `now` and `previous` are on the cadence's clock; `sent` maps fragment -> the deadline it was last
    sent for, so a deadline is served once. `previous` is None at the first step (nothing was crossed).
    """
    due = []
    for f in range(num_fragments):
        deadline = cadence.next_deadline(f, num_fragments, after=now)
        if now + step_time_s + lead_s >= deadline and sent.get(f) != deadline:
            due.append((f, deadline))
            continue
        if previous is not None:
            crossed = cadence.next_deadline(f, num_fragments, after=previous)  # the first one after it
            while crossed + cadence.period_s <= now:  # a step that stalled across several: the latest
                crossed += cadence.period_s
            if crossed <= now and crossed > sent.get(f, float("-inf")):
                due.append((f, crossed))
    return due
