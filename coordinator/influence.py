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

import math
import statistics
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, replace

from diloco.coordinator.policy import Arrival
from diloco.storage.protocol import Cadence


@dataclass(frozen=True, slots=True)
class Claim:
    """What one merged piece counted: its learner, tokens and inner steps."""

    learner: str
    tokens: int
    steps: int


def count_claims(arrivals: Sequence[Arrival], history: Sequence[Claim], ratio: float) -> list[tuple[Arrival, str]]:
    """Each arrival as its merge counts it, with a note saying what was cut ("" when nothing was).

    A learner's piece is measured against the pieces of the *other* learners: those of the
    fragment's recent rounds (`history`, as they were counted) and those in this round. Its tokens
    count up to `ratio` x the others' median tokens, and its merge weight (tokens x tokens per step,
    `policy.merge_weights`) up to `ratio` x the others' median weight: its steps are raised until
    it fits. One learner then weighs at most `ratio` times the median learner, whatever it claims;
    an honest fleet whose learners differ by less (speed, batch size) is counted as it claims.
    When the others report no tokens (the merge then weighs by steps), its tokens count as none and
    its steps up to `ratio` x the others' median. With no other learner to compare with, nothing is
    cut: a learner alone moves only its own run.
    """
    out = []
    for a in arrivals:
        others = [c for c in history if c.learner != a.learner]
        others += [Claim(b.learner, b.tokens, b.steps) for b in arrivals if b.learner != a.learner]
        others = [c for c in others if c.steps > 0]
        if not others or a.steps < 1:
            out.append((a, ""))
            continue
        median_tokens = statistics.median(c.tokens for c in others)
        tokens = min(a.tokens, math.floor(ratio * median_tokens))
        if median_tokens > 0:
            median_weight = statistics.median(c.tokens * c.tokens / c.steps for c in others)
            steps = max(a.steps, math.ceil(tokens * tokens / (ratio * median_weight))) if median_weight > 0 else a.steps
        else:
            steps = max(1, min(a.steps, math.floor(ratio * statistics.median(c.steps for c in others))))
        if (tokens, steps) == (a.tokens, a.steps):
            out.append((a, ""))
            continue
        note = (f"claimed {a.tokens} tokens in {a.steps} steps, counted {tokens} tokens in {steps} steps: at most "
                f"max_claim_ratio {ratio:g} x the median tokens and weight of {len(others)} pieces of other learners")
        out.append((replace(a, tokens=tokens, steps=steps), note))
    return out


def plausible_deadline(deadline: float, *, now: float, cadence: Cadence | None, fragment: int,
                       num_fragments: int, final: bool = False) -> float:
    """The clock deadline an arrival counts as sent for. A learner sends a fragment just before its
    deadline, on the clock the coordinator published: a deadline more than one period ahead of
    `now` names no round that exists yet and would hold the fragment's rounds open until then, so
    it counts as the fragment's next deadline. So does a piece sent on step counts (deadline 0) once
    there is a clock, unless it is a learner's last (`final`): its learner had not read the clock
    yet (a run's first pieces, sent H steps in, while the clock published a moment before reaches
    the learners on their next heartbeat), and merged on its own it would split the round the other
    learners send for the clock's deadline. Without a clock deadlines pass unchanged."""
    if cadence is None or final or (0 < deadline <= now + cadence.period_s):
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
