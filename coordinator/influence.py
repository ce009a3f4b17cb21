"""How far one learner's claims may move the others: bounds derived from what the run observes.

A learner holding valid credentials chooses every number it sends: the tokens and steps its
contribution weighs by, the clock deadline it was sent for, the step time its heartbeat reports,
and its learner id. Nothing here can tell a lie from the truth; what it can do is keep each claim
within what the other learners show is plausible, so that one learner cannot take a round's whole
weight, hold a fragment's rounds open, set the round clock for everyone or make every round wait.
Each bound is relative to the others (their median), scaled by the run's `max_claim_ratio`: a
fleet whose honest learners differ by more than that (in tokens per round or batch size) raises it.

Pure functions, like `coordinator.policy`: no clock, no I/O.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from diloco.coordinator.policy import Arrival
from diloco.storage.protocol import Cadence


@dataclass(frozen=True, slots=True)
class Claim:
    """What one merged piece counted: its learner, tokens and inner steps."""

    learner: str
    tokens: int
    steps: int
    norm: float | None = None
    """The L2 norm of its delta (None: not recorded)."""


def count_claims(arrivals: Sequence[Arrival], history: Sequence[Sequence[Claim]],
                 ratio: float) -> list[tuple[Arrival, str]]:
    """Each arrival as its merge counts it, with a note saying what was cut ("" when nothing was).

    The bound is per learner, not per piece: a learner's pieces in one round add up (as its merge
    weight does, `policy.merge_weights`), and that total is measured against the *other* learners'
    totals of a round: in the fragment's recent rounds (`history`, each round's pieces as they were
    counted) and in this one. Its tokens count up to `ratio` x the others' median tokens per round,
    and its merge weight (tokens x tokens per step) up to `ratio` x the others' median weight: its
    steps are raised until it fits. The cut is shared by its pieces in proportion (tokens rounded
    down, steps up), so however many pieces one learner sends into a round, it weighs at most
    `ratio` times the median learner; an honest fleet whose learners differ by less (speed, batch
    size) is counted as it claims, and a backlog (every learner's queued pieces merged at once
    after the coordinator was down) cuts every learner alike, which leaves their weights as they were.
    When the others report no tokens (the merge then weighs by steps), its tokens count as none and
    its steps up to `ratio` x the others' median (each piece keeps at least one step). With no other
    learner to compare with, nothing is cut: a learner alone moves only its own run.

    O(n log n) in the pieces of the round and the history."""
    rounds = [_totals(r) for r in history]
    mine = _totals(arrivals)
    entries = [(g, t, s) for r in [*rounds, mine] for g, (t, s) in r.items() if s > 0]
    by_learner: dict[str, list[tuple[int, int]]] = {}
    for g, t, s in entries:
        by_learner.setdefault(g, []).append((t, s))
    all_tokens = sorted(t for _, t, _ in entries)
    all_weights = sorted(t * t / s for _, t, s in entries)
    all_steps = sorted(s for _, _, s in entries)
    pieces = Counter(a.learner for a in arrivals)
    counted: dict[str, tuple[int, int, str]] = {}
    for g, (tokens, steps) in mine.items():
        own = by_learner.get(g, [])
        others = len(entries) - len(own)
        if not others or steps < 1:
            counted[g] = (tokens, steps, "")
            continue
        median_tokens = _median_without(all_tokens, sorted(t for t, _ in own))
        bound_tokens = min(tokens, math.floor(ratio * median_tokens))
        if median_tokens > 0:
            median_weight = _median_without(all_weights, sorted(t * t / s for t, s in own))
            bound_steps = (max(steps, math.ceil(bound_tokens * bound_tokens / (ratio * median_weight)))
                           if median_weight > 0 else steps)
        else:
            median_steps = _median_without(all_steps, sorted(s for _, s in own))
            bound_steps = max(1, min(steps, math.floor(ratio * median_steps)))
        note = "" if (bound_tokens, bound_steps) == (tokens, steps) else (
            f"claimed {tokens} tokens in {steps} steps over {pieces[g]} piece(s), "
            f"counted {bound_tokens} tokens in {bound_steps} steps: at most max_claim_ratio {ratio:g} x the median "
            f"tokens and weight per round of other learners ({others} of their rounds)")
        counted[g] = (bound_tokens, bound_steps, note)
    out = []
    for a in arrivals:
        tokens, steps = mine[a.learner]
        bound_tokens, bound_steps, note = counted[a.learner]
        if not note:
            out.append((a, ""))
            continue
        # Each piece its share of the learner's counted total: tokens rounded down and raised steps
        # rounded up, so the pieces together weigh no more than the total.
        share_steps = -(-a.steps * bound_steps // steps) if bound_steps >= steps else a.steps * bound_steps // steps
        out.append((replace(a, tokens=a.tokens * bound_tokens // tokens if tokens > 0 else 0,
                            steps=max(1, share_steps)), note))
    return out


def clip_norms(arrivals: Sequence[Arrival], history: Sequence[Sequence[Claim]],
               ratio: float) -> dict[str, tuple[float, str]]:
    """Each learner of the round with the factor its pieces are scaled by in the merge (1: none)
    and a note saying why ("" when 1).

    A learner's pieces in one round add up: they are consecutive parts of its progress, and each is
    merged with its learner's whole share (`policy.merge_weights`). Their claims are bounded
    together (`count_claims`); so is how far they move the model: the sum of their norms counts up
    to `ratio` x the median of the other learners' sums per round (the fragment's recent rounds,
    `history`, and this one; this round's alone when they sent more), and a learner over it has its
    pieces scaled by bound / sum. Sixteen
    copies of one delta, or one delta sixteen times too long, then move the model at most `ratio`
    times as far as the median learner's round, at its bounded share. An honest fleet, whose
    learners' progress per round differs by less, is merged as it sent. Pieces or rounds with no
    measured norm are left out; with no other learner to compare with nothing is scaled."""
    def sums(pieces: Iterable[Arrival | Claim]) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for p in pieces:
            out.setdefault(p.learner, []).append(math.inf if p.norm is None else p.norm)
        return {g: math.fsum(n) for g, n in out.items() if math.isfinite(math.fsum(n))}

    mine = sums(arrivals)
    entries = [(g, n) for r in history for g, n in sums(r).items()] + list(mine.items())
    values = sorted(n for _, n in entries)
    this_round = sorted(mine.values())
    own: dict[str, list[float]] = {}
    for g, n in entries:
        own.setdefault(g, []).append(n)
    out = {}
    for g in {a.learner for a in arrivals}:
        if g not in mine or len(entries) == len(own[g]):
            out[g] = (1.0, "")
            continue
        # Against the others' recent rounds, or this round's others when they sent more: a backlog
        # (every learner's queued pieces at once, after the coordinator was down) is not scaled
        # (`policy.round_step` caps such a round as a whole).
        here = _median_without(this_round, [mine[g]]) if len(mine) > 1 else 0.0
        bound = ratio * max(_median_without(values, sorted(own[g])), here)
        if mine[g] <= bound or bound <= 0:  # (others that moved nothing are no measure)
            out[g] = (1.0, "")
            continue
        clip = bound / mine[g]
        out[g] = (clip, f"its pieces' norms sum to {mine[g]:.4g}, over max_norm_ratio {ratio:g} x the median "
                        f"per round of other learners ({len(entries) - len(own[g])} of their rounds): scaled by "
                        f"{clip:.4g}")
    return out


def _totals(pieces: Iterable[Arrival | Claim]) -> dict[str, tuple[int, int]]:
    """Each learner's tokens and steps summed over its pieces in one round."""
    out: dict[str, tuple[int, int]] = {}
    for p in pieces:
        t, s = out.get(p.learner, (0, 0))
        out[p.learner] = (t + p.tokens, s + p.steps)
    return out


def _median_without(values: list[float], remove: list[float]) -> float:
    """The median of the sorted `values` once the sorted `remove` (a sub-multiset of them, a few)
    are taken out, without copying `values`: O(len(remove) x log len(values))."""
    positions: list[int] = []
    for i, v in enumerate(remove):  # equal values are taken from consecutive places
        positions.append(positions[-1] + 1 if i and remove[i - 1] == v else bisect.bisect_left(values, v))

    def kept(m: int) -> float:
        i = m
        for p in positions:
            if p > i:
                break
            i += 1
        return values[i]

    n = len(values) - len(remove)
    return kept(n // 2) if n % 2 else (kept(n // 2 - 1) + kept(n // 2)) / 2


def plausible_deadline(deadline: float, *, now: float, cadence: Cadence | None, fragment: int,
                       num_fragments: int, final: bool = False) -> float:
    """The clock deadline an arrival counts as sent for. A learner sends a fragment just before its
    deadline, on the clock the coordinator published: a deadline more than one period ahead of
    `now` names no round that exists yet and would hold the fragment's rounds open until then (and
    once merged, make every later round look late), so it counts as the fragment's next deadline,
    a learner's last piece (`final`) too. So does a piece sent on step counts (deadline 0) once
    there is a clock, unless it is a learner's last: its learner had not read the clock yet (a
    run's first pieces, sent H steps in, while the clock published a moment before reaches the
    learners on their next heartbeat), and merged on its own it would split the round the other
    learners send for the clock's deadline. Before there is a clock (or on the step cadence) no
    round has a deadline: one in the future counts as none (0)."""
    if cadence is None:
        return deadline if deadline <= now else 0.0
    if 0 < deadline <= now + cadence.period_s or (final and deadline == 0):
        return deadline
    return cadence.next_deadline(fragment, num_fragments, after=now)


def fastest_plausible(step_times: Sequence[float], ratio: float) -> float | None:
    """The step time the round clock follows: the fastest learner's, but no faster than 1/`ratio` of
    the median learner's (the higher median, so that with two learners one cannot pull the other's
    share down): one heartbeat reporting 1e-9 s cannot set a clock of H nanoseconds for everyone.
    None without any step time."""
    times = [t for t in step_times if t > 0 and math.isfinite(t)]
    if not times:
        return None
    return max(min(times), statistics.median_high(times) / ratio)


def usual_fleet(live: frozenset[str], *, arrived: frozenset[str], sent: Container[str], merged: frozenset[str],
                finished: frozenset[str]) -> frozenset[str]:
    """The learners a round's usual round counts (`policy.round_step`'s `fleet`): the `live`
    ones that have `sent` pieces (ids that only heartbeat are not counted: a flood of made-up ids
    would make every round a sliver of a step), the round's own (`arrived`), and those that
    `finished` with pieces `merged` into the fragment. A run winding down keeps the usual round of
    the fleet that trained, to its end: the last learners' lone pieces stay their share of it (a
    learner restarted mid-run and training on alone after the others finished moves the model as
    far per step as it did beside them), where counted against the live learners alone the last
    one's would be whole outer steps of one learner's delta. A learner that leaves without
    finishing (preempted, crashed) stops counting once it stops sending: the fleet follows it."""
    return frozenset({n for n in live if n in sent} | arrived | (merged & finished))


FLEET_EVERY_STEP = 256
"""A fleet of at most this many names (live, joined, finished and gone together) is read every loop step."""
FLEET_READ_S_PER_NAME = 250e-6
"""Past FLEET_EVERY_STEP names, the loop reads the fleet at most once per this many seconds per name."""


def fleet_read_due(names: int, since_s: float) -> bool:
    """Whether the coordinator's loop reads the fleet again, `since_s` after a read that held
    `names` names. Every step while the fleet is small; past FLEET_EVERY_STEP names, at most once
    per FLEET_READ_S_PER_NAME x names seconds, so that reading it takes the loop the same share of
    its time however many ids heartbeat (made-up ids that never send, up to the run's live cap,
    each cost the loop O(1) amortised, where reading them twice a step made it 25x slower). What
    the fleet decides, who the rounds wait for and whether the run is over, then lags by at most
    about a second, against leases of many seconds."""
    return names <= FLEET_EVERY_STEP or since_s >= names * FLEET_READ_S_PER_NAME


def waited_learners(live: frozenset[str], *, first_seen: Mapping[str, float], last_piece: Mapping[str, float],
                    known: frozenset[str], now: float, patience_s: float) -> frozenset[str]:
    """The live learners a round waits for.

    A live learner is waited for while it sends: it is *established* if it sent a piece within
    `patience_s`, a *newcomer* if it was first seen live (`first_seen`) within `patience_s` and has
    sent nothing since (time for its first piece). A live learner silent for longer (a learner id
    that heartbeats but never contributes) is not waited for until it sends again. Newcomers are
    waited for up to as many as the larger of the established learners and the `known` ones (those
    of the fragments' recent rounds, so that a restarted coordinator waits for the fleet it had),
    known ones first, then the earliest seen; at a run's start, when nobody has sent yet, all of
    them. A flood of made-up learner ids costs each round at most its grace window while they are
    new, and nothing once they are not.
    `patience_s` <= 0 (unknown) waits for every live learner.
    """
    if patience_s <= 0:
        return live
    established = {n for n in live if now - last_piece.get(n, -math.inf) <= patience_s}
    newcomers = sorted((n not in known, first_seen.get(n, now), n) for n in live - established
                       if now - first_seen.get(n, now) <= patience_s
                       and last_piece.get(n, -math.inf) < first_seen.get(n, now))
    room = max(len(established), len(known)) or len(newcomers)  # at a run's start, everyone is new
    return frozenset(established | {n for *_, n in newcomers[:room]})
