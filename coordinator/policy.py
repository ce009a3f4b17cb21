"""When to merge a fragment's round, which contributions to accept, and how to weigh them.

Every function here is pure: it reads no clock, does no I/O and never sleeps. The time is an
argument (`now`, seconds on the coordinator's clock (Redis server time)), like torchft's `quorum_compute(now, state, opt)`,
so a test can walk a round through time without waiting, and the coordinator can log the
returned reason verbatim.

A round of fragment p, as `decide_round` sees it:

    t_open            t_quorum                   t_quorum + grace
      |--- arrivals ---|------ grace window -------|
      first            K-th distinct learner        merge (or earlier, once every live
      arrival          (quorum)                     learner has arrived)

The grace window keeps the round open only while waiting still costs nothing: the first
contributor keeps training `tau` (overlap_steps) inner steps after it sends, so the round can stay
open for a fraction gamma of whatever is left of that slack once quorum is in and the sync time is
paid: grace = clamp(gamma * (tau * t_step - (t_quorum - t_open + t_sync)), 0, max_grace_s).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from diloco.storage.errors import ConfigError
from diloco.storage.protocol import Cadence


@dataclass(frozen=True, slots=True)
class Arrival:
    """One announced contribution to one fragment, already verified by the coordinator."""

    contribution_id: str
    """Unique id of the contribution (also deduplicates announcements that landed twice)."""
    learner: str
    """Learner that sent it."""
    base_version: int
    """Global version of this fragment the delta was computed against."""
    tokens: int
    """Tokens trained since the learner's last contribution to this fragment."""
    steps: int
    """Inner steps in that interval."""
    arrived_at: float
    """Coordinator clock (Redis server time, seconds) when the announcement was read."""
    step_time_s: float
    """The learner's measured mean inner-step time, as reported in the announcement."""
    deadline: float = 0.0
    """The clock round (Cadence deadline, same clock as `arrived_at`) it was sent for; 0 if sent on a step count."""
    final: bool = False
    """The learner's last piece before it left the run (it finished, or was preempted)."""
    norm: float | None = None
    """L2 norm of its decoded delta, once the coordinator has read it (None: not measured)."""


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """How a fragment's round is closed and merged."""

    min_quorum: int = 1
    """K: distinct learners that must have contributed before a round may merge (lowered to the
    number of live learners when the fleet is smaller)."""
    grace_gamma: float = 0.5
    """gamma (0 < gamma < 1): share of the learners' remaining overlap slack the round may stay
    open after quorum, to gather near-simultaneous arrivals into one outer step."""
    overlap_steps: int = 2
    """tau: inner steps a learner keeps training after sending a delta before it wants the new
    version of that fragment."""
    max_grace_s: float = 30.0
    """Hard cap on the grace window, in seconds."""
    max_staleness: int = 4
    """Contributions whose base version is more than this many versions behind the head are refused."""
    staleness_discount: bool = True
    """Scale the weight of an accepted stale contribution by 1/(1+staleness)."""
    staleness_relative: bool = True
    """With the discount: the round's weights sum to what they would at the round's own median
    staleness (`merge_weights`), so that stale pieces among fresh ones take less of a round that
    moves as far as a fresh one. False: every stale piece shrinks the round (manifests before it)."""
    stale_momentum: bool = False
    """Stale pieces enter the outer momentum buffer too. False (the default): the buffer takes only
    the round's fresh pieces, the params all of them (`outer.buffered_part`). Whole steps (no
    `scale_rounds`) always take all."""
    bounded_momentum: bool = False
    """Pieces the merge bounded (a learner's claims or norms cut against the others',
    `coordinator.influence`) enter the outer momentum buffer too. False (the default): they move
    the params once, at their bounded share, and the buffer takes the round's other pieces
    (`outer.buffered_inputs`), so that what a learner may push once does not come back every round.
    Whole steps (no `scale_rounds`) always take all."""
    max_claim_ratio: float = 4.0
    """How far one learner's claims may stray from the other learners' median (`coordinator.influence`):
    a learner's pieces in a round count at most this many times their median tokens and merge
    weight per round, and the step time a grace window or the round clock follows is at most this
    far from theirs. Raise it for a fleet whose honest learners differ by more (e.g. one island with
    8x the batch of the others)."""
    max_norm_ratio: float = 4.0
    """How far one learner's pieces in a round may move the model against the other learners': the
    sum of their norms counts up to this many times the others' median per round, and a learner
    over it has its pieces scaled down (`influence.clip_norms`, recorded per input as `clip`). Raise
    it for a fleet whose honest learners' progress per round differs by more."""
    max_silent_rounds: int = 4
    """Clock cadence: a live learner that has sent nothing for this many round periods (since it was
    first seen, for a new one) is not waited for until it sends again: learner ids that heartbeat
    and never contribute do not hold every round open."""

    def __post_init__(self) -> None:
        for name in ("grace_gamma", "max_grace_s", "max_claim_ratio", "max_norm_ratio"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.min_quorum < 1:
            raise ConfigError(f"min_quorum must be at least 1, got {self.min_quorum}")
        if not 0.0 < self.grace_gamma < 1.0:
            raise ConfigError(f"grace_gamma must be strictly between 0 and 1, got {self.grace_gamma}")
        if self.overlap_steps < 0:
            raise ConfigError(f"overlap_steps must be >= 0, got {self.overlap_steps}")
        if not self.max_grace_s >= 0.0:
            raise ConfigError(f"max_grace_s must be >= 0 seconds, got {self.max_grace_s}")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not self.max_claim_ratio >= 1.0:
            raise ConfigError(f"max_claim_ratio must be at least 1, got {self.max_claim_ratio}")
        if not self.max_norm_ratio >= 1.0:
            raise ConfigError(f"max_norm_ratio must be at least 1, got {self.max_norm_ratio}")
        if self.max_silent_rounds < 1:
            raise ConfigError(f"max_silent_rounds must be at least 1, got {self.max_silent_rounds}")


@dataclass(frozen=True, slots=True)
class RoundState:
    """What the coordinator knows about one fragment's open round."""

    fragment: int
    head_version: int
    arrivals: tuple[Arrival, ...]
    """Distinct learners' latest pending contributions to this fragment, in arrival order."""
    live_learners: int
    """Learners with a live heartbeat that have not finished."""
    sync_time_s: float = 0.0
    """Recent time the coordinator took from merge start to commit (EMA); 0 if unknown."""
    period_s: float = 0.0
    """The round clock's period (clock cadence); 0 for step cadence."""
    merged_deadline: float = 0.0
    """The latest clock deadline a merged round of this fragment served; 0 if none (or unknown)."""
    finished: frozenset[str] = frozenset()
    """Learners that have finished the run, all their final pieces read: no longer part of the fleet."""
    finish_asked: bool = False
    """An operator asked to finish the run (`diloco finish`): every open round merges now."""


@dataclass(frozen=True, slots=True)
class Decision:
    merge: bool
    reason: str
    """A sentence for the log, e.g. 'wait: 1/2 learners in, quorum not reached'."""
    wake_at: float | None = None
    """When to ask again if not merging; None means on the next arrival."""


def quorum_target(cfg: RoundConfig, live_learners: int) -> int:
    """Distinct learners needed to close a round: K, or fewer when fewer learners are live."""
    return max(1, min(cfg.min_quorum, live_learners))


def grace_window_s(cfg: RoundConfig, t_open: float, t_quorum: float, t_step_s: float,
                   sync_time_s: float) -> tuple[float, float]:
    """(grace, slack): slack = tau * t_step - (t_quorum - t_open + t_sync), grace = gamma * slack clamped."""
    slack_s = cfg.overlap_steps * t_step_s - (t_quorum - t_open + sync_time_s)
    grace_s = min(max(cfg.grace_gamma * slack_s, 0.0), cfg.max_grace_s)
    return grace_s, slack_s


@dataclass(frozen=True, slots=True)
class Quorum:
    """Who is in a round and what closes it, as `decide_round` counts them."""

    first_seen: dict[str, float]
    """Learner -> its first arrival in the round."""
    gone: set[str]
    """Learners in the round that have left (a final piece, or finished): waited for no more."""
    fleet: int
    """Learners the round is for: the live ones (at least those in it), those leaving counted."""
    target: int
    """Distinct learners that close it: K, lowered to the fleet."""

    @property
    def reached_at(self) -> float | None:
        """When the target-th learner arrived; None while the round has fewer."""
        times = sorted(self.first_seen.values())
        return times[self.target - 1] if len(times) >= self.target else None


def quorum(state: RoundState, cfg: RoundConfig) -> Quorum:
    """The round's quorum. A learner whose contribution is pending counts as part of the fleet even
    if its heartbeat has lapsed since; one that has left counts among the learners in."""
    first_seen: dict[str, float] = {}
    for a in sorted(state.arrivals, key=lambda a: a.arrived_at):
        first_seen.setdefault(a.learner, a.arrived_at)
    gone = {a.learner for a in state.arrivals if a.final} | (first_seen.keys() & state.finished)
    fleet = max(state.live_learners, len(first_seen) - len(gone)) + len(gone)
    return Quorum(first_seen, gone, fleet, quorum_target(cfg, fleet))


def decide_round(now: float, state: RoundState, cfg: RoundConfig) -> Decision:
    """Merge now, or wait (until `wake_at`, or the next arrival); the reason says why.

    A learner whose contribution is pending counts as part of the fleet even if its heartbeat has
    lapsed since, so a fleet of 0 live learners with pending work still merges it. A learner that
    has left (its piece in the round is final, or it has finished) counts among the learners in,
    but the round waits for nothing more from it. Once no live learner is left unfinished, every
    learner of the fleet has finished: the round merges at once, so the final pieces of a fleet that
    ends together merge as one round, not one per learner. Every open round also merges at once
    when an operator has asked to finish the run.
    """
    if not state.arrivals:
        return Decision(False, f"wait: no contributions pending (head v{state.head_version})")
    q = quorum(state, cfg)
    first_seen, gone, fleet, target = q.first_seen, q.gone, q.fleet, q.target
    arrived = len(first_seen)
    learners_in = _n(arrived, "learner")
    if state.finish_asked:
        return Decision(True, f"merge: an operator asked to finish the run, so every open round merges now "
                              f"({learners_in} in)")
    if state.live_learners == 0 and state.finished:
        return Decision(True, f"merge: every learner of the fleet has finished, so their final pieces merge "
                              f"as one round ({learners_in} in)")
    shrunk = (f" (lowered from min_quorum {cfg.min_quorum}: only {_n(fleet, 'learner')} live)"
              if target < cfg.min_quorum else "")
    if arrived < target:
        return Decision(False, f"wait: {arrived}/{target} learners in, quorum not reached "
                               f"({state.live_learners} live){shrunk}")
    if arrived >= fleet:
        leaving = f" ({len(gone)} of them leaving)" if gone else ""
        return Decision(True, f"merge: quorum {target} reached and all {_n(fleet, 'live learner')} "
                              f"arrived{leaving}{shrunk}")
    deadline = max(a.deadline for a in state.arrivals)
    if deadline > 0 and state.period_s > 0:
        late = deadline <= state.merged_deadline
        if late:  # sent for a round that merged without them: they join the next one, not a round of their own
            deadline = state.merged_deadline + state.period_s
        return _clock_round(now, deadline, state.period_s, cfg, f"{arrived}/{fleet} learners in"
                            + (" (late for the round that merged, held for the next)" if late else ""))

    times = sorted(first_seen.values())
    t_open, t_quorum = times[0], times[target - 1]
    t_step_s = slowest_plausible([a.step_time_s for a in state.arrivals], cfg.max_claim_ratio)
    grace_s, slack_s = grace_window_s(cfg, t_open, t_quorum, t_step_s, state.sync_time_s)
    why = _grace_why(cfg, slack_s)
    deadline = t_quorum + grace_s
    learners_in = f"{arrived}/{fleet} learners in"
    if now >= deadline:
        return Decision(True, f"merge: quorum {target} reached{shrunk}, grace window of {grace_s:.2f}s "
                              f"closed ({why}), {learners_in}")
    return Decision(False, f"wait: grace window open for {deadline - now:.2f}s more, until quorum "
                           f"+{grace_s:.2f}s ({why}), {learners_in}", wake_at=deadline)


def slowest_plausible(step_times: Sequence[float], ratio: float) -> float:
    """The step time a grace window is sized by: the slowest arrival's, but no slower than `ratio` x
    the lower median (one arrival reporting 1e9 s cannot keep a round open for the grace cap)."""
    times = [t for t in step_times if t >= 0 and math.isfinite(t)]
    if not times:
        return 0.0
    return min(max(times), ratio * statistics.median_low(times))


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _grace_why(cfg: RoundConfig, slack_s: float) -> str:
    if cfg.grace_gamma * slack_s > cfg.max_grace_s:
        return f"capped at max_grace_s {cfg.max_grace_s:g}s; gamma {cfg.grace_gamma:g} x slack {slack_s:.2f}s"
    if slack_s <= 0:
        return f"no slack left: {slack_s:.2f}s"
    return f"gamma {cfg.grace_gamma:g} x slack {slack_s:.2f}s"


def served_deadline(merged_deadline: float, merged: Sequence[Arrival], period_s: float = 0.0) -> float:
    """A fragment's `RoundState.merged_deadline` after a round of `merged` arrivals merged: the
    latest deadline among them; for a round of pieces all late for a round that had merged (held
    for the next one, `decide_round`), the deadline they were held for (clock period `period_s`).
    Otherwise a piece sent for that deadline that comes after its grace would merge alone: a
    version of one piece, for every learner to download."""
    latest = max((a.deadline for a in merged), default=0.0)
    if 0.0 < latest <= merged_deadline and period_s > 0.0:
        return merged_deadline + period_s
    return max(merged_deadline, latest)


def last_in(arrivals: Sequence[Arrival]) -> str:
    """For the log of a clock round that merges: when its last piece came, against the deadline it
    was sent for (e.g. "last piece 1.21s after its deadline, from learner-3"); "" without a clock.
    A fleet whose rounds close long after their deadlines is waiting for someone's link."""
    timed = [a for a in arrivals if a.deadline > 0]
    if not timed:
        return ""
    last = max(timed, key=lambda a: a.arrived_at)
    offset = last.arrived_at - last.deadline
    return f"last piece {abs(offset):.2f}s {'after' if offset >= 0 else 'before'} its deadline, from {last.learner}"


def _clock_round(now: float, deadline: float, period_s: float, cfg: RoundConfig, learners_in: str) -> Decision:
    """A round of the clock cadence: learners send just before `deadline`; missing ones get a grace
    of gamma x period (capped) after it, then the round merges without them."""
    grace_s = min(cfg.grace_gamma * period_s, cfg.max_grace_s)
    close = deadline + grace_s
    if now >= close:
        return Decision(True, f"merge: round deadline +{grace_s:.2f}s grace passed "
                              f"(gamma {cfg.grace_gamma:g} x period {period_s:.2f}s), {learners_in}")
    return Decision(False, f"wait: round deadline grace open for {close - now:.2f}s more, {learners_in}",
                    wake_at=close)


def lookahead(staying: int, leaving: int, *, finishing: bool = False) -> float:
    """The share of the momentum's look-ahead a round's outer step takes (`outer.nesterov_step`):
    the share of the learners live as it merges (`staying`, plus the `leaving` ones whose piece in
    it is final, or that have finished) that train on from the version it makes.

    Nesterov publishes the point one momentum step ahead of the merged progress; the learners that
    train from it correct what overshoots. The run's last rounds have nobody after them: their
    look-ahead is an extrapolation the final model keeps. In `bench wan`'s mixed-links arm the
    last two rounds' push left the final model 14% worse than the same rounds without it (1.76
    against 1.55, `diloco whatif`), where with equal links it was a tie either way. A round that
    one learner of four leaves takes 3/4 of it; a round of final pieces alone, none; nor a round
    merged because an operator asked to finish the run (`finishing`): nobody trains from it."""
    fleet = staying + leaving
    if finishing:
        return 0.0
    return 1.0 if fleet <= 0 else staying / fleet


def run_end(*, joined: frozenset[str], live: frozenset[str], finished: frozenset[str], asked_by: str | None,
            pending: int, gone: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """(by, reason) once the run is over, None while it is not (`by`: 'operator' or 'learners').

    Nothing may be pending: no open round, no announcement unread or not yet fetched. Then the run
    is over if an operator asked to finish it (`asked_by` says who), or once every learner that
    joined has finished or is `gone` (no heartbeat for longer than the coordinator's
    `gone_after_s`), at least one has finished, and no live learner is left unfinished. A learner
    that joined and died without finishing holds the run open until it is gone, as it may be
    restarted under its id; `diloco finish` ends such a run at once.
    """
    if pending:
        return None
    if asked_by is not None:
        return "operator", f"an operator asked to finish it ({asked_by})"
    if not finished or not joined - gone <= finished or not live <= finished:
        return None
    reason = f"every learner that joined has finished ({_some(finished)})"
    if left := gone - finished:
        reason += f"; gone without finishing: {_some(left)}"
    return "learners", reason


def _some(names: frozenset[str]) -> str:
    ordered = sorted(names)
    return ", ".join(ordered[:5]) + (f" and {len(ordered) - 5} more" if len(ordered) > 5 else "")


def budget_spent(merged_tokens: Mapping[int, int], budget: int) -> str | None:
    """Why the run is over once every fragment has merged `budget` tokens (`merged_tokens`: per
    fragment, since version 0), None while one has not. Every fragment covers each learner's tokens
    once, so the least of them is what the fleet's training has put into the whole model."""
    if budget <= 0 or not merged_tokens:
        return None
    least = min(merged_tokens.values())
    if least < budget:
        return None
    return f"the token budget is spent: every fragment merged at least {least:,} tokens (budget {budget:,})"


def staleness_verdict(base_version: int, head_version: int, cfg: RoundConfig) -> tuple[bool, int, str]:
    """(accept, staleness, reason) for a contribution computed against `base_version`.

    staleness = head - base. A base ahead of the head ("from the future") is refused: no such
    version was ever published, so the contribution is forged, corrupt or from another run.
    """
    staleness = head_version - base_version
    if staleness < 0:
        return False, staleness, (f"refused: base version {base_version} is ahead of head "
                                  f"{head_version} (from the future)")
    if staleness > cfg.max_staleness:
        return False, staleness, (f"refused: base version {base_version} is {_n(staleness, 'version')} behind "
                                  f"head {head_version}, more than max_staleness {cfg.max_staleness}")
    if staleness == 0:
        return True, 0, f"accepted: computed against the head version {head_version}"
    weight = f"weight x 1/{1 + staleness}" if cfg.staleness_discount else "full weight"
    return True, staleness, (f"accepted: {_n(staleness, 'version')} behind head {head_version} "
                             f"(max_staleness {cfg.max_staleness}), {weight}")


def merge_weights(arrivals: Sequence[Arrival], head_version: int, cfg: RoundConfig,
                  usual: Mapping[str, int] | None = None, rate_steps: int = 0) -> list[float]:
    """Merge weights, one per arrival, in the order given.

    Contributions are grouped by learner: one learner's contributions in the same round are
    consecutive pieces of its progress (it sent again before the round closed), so they add up
    rather than average. Learner g weighs w_g = T_g * (T_g / S_g) with T_g, S_g its tokens and
    steps summed over its pieces (token weighting: more tokens, and more tokens per step, weigh
    more); the w_g are normalized to sum 1 over learners, and each piece gets its learner's share.

    **At the fleet's rate** (`rate_steps` > 0: the usual piece of the fleet's fastest learner, and
    `usual`: each learner's own, `usual_pieces`): a learner whose usual piece is k times smaller,
    because it is k times slower, weighs k times its share, but never more than the heaviest other
    learner of the round (nor less than its share). Its delta then counts as an estimate of the
    progress per step, like the others', and the merged update is the progress `rate_steps` steps
    of the fleet make: a slow learner's short pieces add their steps to the round instead of making
    its update that much shorter (one learner 5x slower beside three made every round 5% shorter).
    The weights then sum to more than 1; a round of its usual pieces moves as far as the fleet's
    fastest learners do, and `round_step` sizes a smaller one by the steps it holds. The cap keeps
    a learner that claims fewer steps than it trained from weighing more than an honest one.

    With `cfg.staleness_discount`, a piece computed against a version `s` behind the head is also
    scaled by 1/(1+s): a stale update is shrunk, not renormalized away. **Relative to the round**
    (`cfg.staleness_relative`): the weights are then scaled, all by one factor, to sum to what they
    would if every piece were as stale as the round's median piece (the lower median). A round
    whose pieces are all s stale shrinks by 1/(1+s) as before; one where two learners of four on
    thin links send pieces a version stale (their versions come late) moves as far as a fresh
    round, those pieces taking half a fresh one's share of it, where the absolute discount made
    every such round 3/4 of a step: a fleet with slow links fell behind one without them. The
    caller refuses contributions with `staleness_verdict` first; this function does not drop any.

    Deterministic, and independent of input order: group totals are exactly rounded sums
    (math.fsum), so a permutation yields the same bits per arrival.
    If no contribution in the round reports tokens, learners are weighed by their inner steps.
    Raises ValueError for a contribution with no steps or from the future.
    """
    tokens: dict[str, list[int]] = {}
    steps: dict[str, list[int]] = {}
    for a in arrivals:
        if a.steps < 1 or a.tokens < 0 or a.base_version > head_version:
            raise ValueError(f"contribution {a.contribution_id} from {a.learner} cannot be weighted: "
                             f"{a.tokens} tokens, {a.steps} steps, base v{a.base_version}, head v{head_version}")
        tokens.setdefault(a.learner, []).append(a.tokens)
        steps.setdefault(a.learner, []).append(a.steps)
    if any(math.fsum(t) > 0 for t in tokens.values()):
        group = {g: math.fsum(tokens[g]) ** 2 / math.fsum(steps[g]) for g in tokens}
    else:  # nobody reports tokens (tokens_per_step left at 0): weigh by inner steps instead
        group = {g: math.fsum(steps[g]) for g in steps}
    total = math.fsum(group.values())
    raised = at_rate(group, usual or {}, rate_steps)
    plain = [raised[a.learner] / total for a in arrivals]
    if not cfg.staleness_discount:
        return plain
    weights = [w / (1 + head_version - a.base_version) for w, a in zip(plain, arrivals, strict=True)]
    if cfg.staleness_relative:
        typical = statistics.median_low(head_version - a.base_version for a in arrivals)
        factor = math.fsum(plain) / (1 + typical) / math.fsum(weights)
        weights = [w * factor for w in weights]
    return weights


def at_rate(group: Mapping[str, float], usual: Mapping[str, int], rate_steps: int) -> dict[str, float]:
    """Each learner's group weight raised to the fleet's rate (`merge_weights`): times `rate_steps`
    over its usual piece, at most the heaviest other learner's weight and never below its own. A
    learner the map does not name, and every learner when `rate_steps` is 0, keeps its own."""
    if rate_steps <= 0:
        return dict(group)
    # The heaviest other learner of each: the heaviest of all, or the runner-up for the heaviest itself.
    top = sorted(group.items(), key=lambda gw: gw[1], reverse=True)[:2]
    raised = {}
    for g, w in group.items():
        piece = min(rate_steps, max(1, usual.get(g, rate_steps)))
        heaviest = next((v for h, v in top if h != g), math.inf)
        raised[g] = max(w, min(w * (rate_steps / piece), heaviest))
    return raised


def merge_order(arrivals: Sequence[Arrival]) -> list[Arrival]:
    """The fixed order the merge sums contributions in: by (learner, contribution_id).

    Independent of arrival order, so a replay from the manifest adds in the same order.
    """
    return sorted(arrivals, key=lambda a: (a.learner, a.contribution_id))


FIRST_DEADLINE_LEAD_S = 2.0
"""How far ahead of its publication a new round clock puts its first deadline, at least: learners
read the clock on their heartbeat (every second by default), and a deadline some of them learn of
too late splits that round into two, the second a whole outer step on top of the first."""


def next_cadence(current: Cadence | None, period_s: float, now: float, num_fragments: int = 1, *,
                 slower: float = 0.15, faster: float = 0.1) -> Cadence | None:
    """The round clock to publish for a measured `period_s` (H steps of the fastest live learner), or
    None to keep `current`.

    A first clock starts at its origin (no deadline before it), FIRST_DEADLINE_LEAD_S or a
    fragment's share of the period from `now`, whichever is later, so that every learner has read
    it before any fragment's first deadline (fragment p's is then p/P of a period after the origin).

    The clock is re-set only when the period moves by more than 15% slower (`slower`) or 10% faster
    (`faster`): a clock running slow makes every round carry more than H steps of the fastest
    learner, hence fewer outer steps in the run, so it follows a faster fleet closely; one running
    fast makes every round a fraction of a step and sends more bytes (a first clock set from the
    first steps' times, 20-25% short, stayed so for a whole `bench wan` run at 30%, and the thin
    links' pieces came a version stale); a noisy step time that moves it back and forth would
    only shift the rounds' phase. When it is re-set, the new
    clock starts from the current one's last fragment-0 deadline: each upcoming deadline moves by a
    fraction of the change of period, so learners that have not read the new clock yet send for
    nearly the same instant and land in the same round. (A clock started afresh at `now` would put
    its deadlines anywhere against the old ones and split the next round of every fragment.)
    """
    if current is None:
        return Cadence(origin=now + max(FIRST_DEADLINE_LEAD_S, period_s / num_fragments), period_s=period_s)
    if -faster <= period_s / current.period_s - 1.0 <= slower:
        return None
    return Cadence(origin=current.next_deadline(0, 1, after=now) - current.period_s, period_s=period_s)


MAX_LINK_STRETCH = 4.0
"""The most the round clock stretches for the learners' links (`link_bound_period`): H steps of the
fastest learner times this."""


def link_bound_period(step_period_s: float, link_round_s: Sequence[float], max_share: float
                      ) -> tuple[float, float]:
    """(period, busy_s): the round clock's period for the learners' links, and the seconds of link
    use per round it follows.

    `link_round_s` are the training learners' `LearnerStats.link_round_s`: the seconds of each
    round period their links are in use (a round's pieces up, its versions down), about the same
    under any period. The clock follows their lower median: a minority of thin links are slow
    learners, whose pieces come late, not the whole fleet's clock; a majority stretch it, and one
    learner claiming a full link among honest ones cannot. The period is the one that makes that
    `max_share` of a round, never shorter than `step_period_s` (H steps of the fastest learner)
    nor longer than MAX_LINK_STRETCH times it. Each round then carries more inner steps (still one
    outer step: `round_step` counts H of the fastest learner's steps as a whole piece) and its
    bytes each way are spread over more time. Figures of 0 (none measured) are left out; none
    left, or `max_share` 1: `step_period_s`.
    """
    loads = [b for b in link_round_s if 0.0 < b and math.isfinite(b)]
    if not loads or max_share >= 1.0 or step_period_s <= 0.0:
        return step_period_s, 0.0
    busy = statistics.median_low(loads)
    return min(max(step_period_s, busy / max_share), MAX_LINK_STRETCH * step_period_s), busy


RECENT_ROUNDS = 8
"""How many of a fragment's last rounds `round_step` takes the usual round's size from."""
MAX_REACH = 2.0
"""The most progress per learner a round may carry, in usual rounds (see `round_step`)."""
STILL_SHARE = 0.5
"""A round whose merged update moves the fragment less than this share of the usual round's
counts its movement, not its tokens, as its progress (see `round_step`)."""
STILL_PROGRESS = 1e-6
"""The progress of a round whose learners did not move at all (an update of norm 0): a step must
be positive, and this one changes nothing measurable."""


@dataclass(frozen=True, slots=True)
class RoundSize:
    """What a merged round held: its tokens and its distinct learners, and how far they moved the
    fragment (`norm`: the L2 norm of the round's merged update before its scale and momentum,
    recorded as the manifest's `update_norm`; None if unknown: versions made before it was)."""

    tokens: int
    learners: int
    norm: float | None = None
    steps: int = 0
    """The inner steps of its pieces, summed (0 if not known)."""
    names: frozenset[str] = frozenset()
    """Its learners (empty if not known: then only their count is)."""

    @property
    def reach(self) -> float:
        """Tokens per learner: how far the round's average learner trained since its last send."""
        return self.tokens / self.learners if self.learners > 0 else 0.0


class _Piece(Protocol):
    @property
    def tokens(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def learner(self) -> str: ...


def round_size(pieces: Iterable[_Piece], norm: float | None = None) -> RoundSize:
    """The size of a round of `pieces` (its arrivals, or a manifest's inputs) whose merged update
    has L2 norm `norm` (None: not measured)."""
    pieces = list(pieces)
    names = frozenset(p.learner for p in pieces)
    return RoundSize(tokens=sum(p.tokens for p in pieces), learners=len(names), norm=norm,
                     steps=sum(p.steps for p in pieces), names=names)


def usual_pieces(fleet: Iterable[str], history: Iterable[Iterable[_Piece]], interval: int,
                 finished: Mapping[str, int] | None = None) -> dict[str, int]:
    """Each learner of `fleet` with its usual piece (`round_step`), in inner steps: the median of the
    steps it carried into the recent rounds it was in (`history`: each round's pieces; a learner's
    pieces in one round add up), at most `interval` (H); H for a learner in none of them, so a
    newcomer counts whole until its pieces show otherwise. A learner that `finished` counts with
    the usual piece it had before (the caller's record): the recent rounds hold less and less of it
    as they move on, at last only its final piece, a sliver of the steps it trained since its last
    send, which would make the fleet's usual round that much smaller. On the clock, a learner k
    times slower than the fastest carries H / k steps into each round: that is its usual piece, and
    a round of every learner's usual piece is a usual round. With no fixed interval (0) every
    learner counts 1: the usual round is counted in learners."""
    if interval <= 0:
        return dict.fromkeys(fleet, 1)
    finished = finished or {}
    carried: dict[str, list[int]] = {}
    for pieces in history:
        in_round: dict[str, int] = {}
        for p in pieces:
            in_round[p.learner] = in_round.get(p.learner, 0) + p.steps
        for name, steps in in_round.items():
            carried.setdefault(name, []).append(steps)
    return {name: min(interval, finished[name]) if name in finished
            else min(interval, max(1, round(statistics.median(carried[name])))) if carried.get(name) else interval
            for name in fleet}


@dataclass(frozen=True, slots=True)
class RoundStep:
    """How far a round's outer step goes (recorded in its manifest: `round_scale`, `progress`)."""

    scale: float
    """In (0, 1]: the merged update's multiplier (`round_scale`). A round of fewer learners than
    usual counts for their share of the fleet's mean, by their usual pieces (its merged update is
    theirs alone); a round
    carrying more than MAX_REACH usual rounds of progress per learner is capped there."""
    progress: float
    """In (0, 1]: how much of a usual round's progress (its tokens, or its movement when that is
    far less) the round carries: the outer step is that fraction of a whole one, momentum included
    (`outer.nesterov_step`)."""


def round_step(size: RoundSize, recent: Sequence[RoundSize], fleet: Mapping[str, int] | None = None,
               interval: int = 0) -> RoundStep:
    """The outer step of a round of `size` (the coordinator's `scale_rounds`): the share of the
    usual round it carries, the usual round being every learner of the fleet with its usual piece.

    **The fleet's learners** are the median of the recent rounds' (the last RECENT_ROUNDS of
    `recent`), so one odd round does not move them and a fleet that has really changed is followed
    after a few rounds, but never fewer than `fleet`: the learners the round was for that contribute
    (live, and known to have sent pieces: the caller names them, each with its usual piece,
    `usual_pieces`; None if not known). When most rounds
    hold one learner each (the step cadence with quorum 1: each piece merges as it comes), their
    median says 1, and each round would be a whole outer step of one learner's delta: counted
    against the fleet, each is its share. Learners that only heartbeat must not be in `fleet`: a
    flood of made-up ids would make every round a sliver of a step.

    **A usual piece** is a learner's own (`fleet`): the steps it carries into a round, at most
    `interval` inner steps (H: the step cadence's, and the round clock's when it follows H steps of
    the fastest learner); `interval` for a learner the fleet does not name. When the interval is not
    fixed (0: a clock of a fixed period) it is the median tokens per learner of the recent rounds
    (`RoundSize.reach`). H does not drift with the clock: a clock that runs slower or faster for a
    while makes every round carry more or fewer steps, and a median of recent rounds would then
    count the next rounds of the fleet as fractions, or the larger ones as no more than whole. On
    the clock a learner slower than the fastest sends fewer than H steps each round: that is its
    usual piece, so a round of the whole fleet is a whole step, and a slow learner added to a fleet
    adds its own progress to each round instead of making every round of the others a fraction.
    A round without it counts for the others' share of the usual round's steps, by the same
    measure its update's scale does.

    - **A small round** (one learner of four merged alone, a learner late for the round that
      merged, a last piece at the end of a run) moves the model only as far as the progress it
      carries: its update counts for its learners' share of the fleet, and its step, momentum
      included, for its share of a usual round's steps. Cutting the same deltas into more rounds
      then gives nearly the model one round gives (invariant 8), where a whole Nesterov step per
      extra round would push the momentum again each time.
    - **An oversized round** is capped at MAX_REACH usual rounds of progress per learner (its
      tokens per learner against the recent rounds'): a learner back from an S3 outage (its queued
      pieces coalesced into one delta of hundreds of steps), or a backlog merged at once after the
      coordinator was down, would otherwise take one outer step many times the usual size, which
      momentum then carries on for rounds. A straggler's two intervals in one round stay within it.
    - **A round that barely moves** carries the progress of its movement: when its merged update's
      norm is under STILL_SHARE of the usual round's, its progress is its norm over that share of
      the usual norm, if that is below its share of steps. Steps trained at an inner learning rate
      decayed to almost nothing (the end of a cosine schedule) are not a usual round's progress,
      and a whole step would be mostly momentum: it would carry the model on, past where the
      learners stopped, for as many rounds as the run has left. Mid-run, rounds move about as
      far as the usual one and this never binds.

    A round larger than usual (more learners, more steps) takes a whole step, not more. Without
    history (a run's first round) or without token counts the step is whole.
    """
    if size.tokens <= 0 or not recent:
        return RoundStep(1.0, 1.0)
    recent = recent[-RECENT_ROUNDS:]
    fleet = fleet or {}
    usual_learners = max(statistics.median(r.learners for r in recent), len(fleet))
    usual_reach = statistics.median(r.reach for r in recent)
    unit = interval if interval > 0 else 1  # a learner the fleet does not name: a whole one
    usual = math.fsum(fleet.values()) + unit * (usual_learners - len(fleet))
    here = math.fsum(fleet.get(n, unit) for n in size.names) if size.names else unit * size.learners
    if interval > 0 and size.steps > 0:
        progress = min(1.0, size.steps / usual)
    else:
        usual_tokens = usual_learners * usual_reach
        progress = min(1.0, size.tokens / usual_tokens) if usual_tokens > 0 else 1.0
    norms = [r.norm for r in recent if r.norm]
    if size.norm is not None and norms:
        progress = max(min(progress, size.norm / (STILL_SHARE * statistics.median(norms))), STILL_PROGRESS)
    scale = min(1.0, here / usual) if usual > 0 else 1.0
    if usual_reach > 0 and size.reach > MAX_REACH * usual_reach:
        scale *= MAX_REACH * usual_reach / size.reach
    return RoundStep(scale=scale, progress=progress)
