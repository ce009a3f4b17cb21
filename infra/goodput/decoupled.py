"""Decoupled DiLoCo in the simulator: M learners, each a job of N/M chips, and one coordinator.

The decisions are the project's own functions, called as the live processes call them:
- a learner sends when `workers.fragments.clock_due` (clock cadence) or `due_fragments` (steps
  cadence) says so, with the chip-steps it did since its last send as tokens;
- the coordinator refuses a contribution that `coordinator.policy.staleness_verdict` refuses
  (against the head when it arrives), asks `decide_round` after every arrival and at the
  `wake_at` it names, and merges every pending contribution with `merge_order` and
  `merge_weights`, as `coordinator.service` does. Only the I/O is left out.

What the model adds around them (module `model` has the numbers):
- a learner trains without waiting for anybody (tau overlap); it takes the newest published
  version once, at least tau steps after each send (as `workers.learner` does);
- a failure in a learner makes it rescale (pause, then go on without the failed slice until it is
  repaired: nothing it computed is lost but the step in flight) or restart (down for restart_s,
  unsent progress lost, rejoin at the newest version; its heartbeat lapses after lease_s, and
  `decide_round` sees fewer live learners);
- one fragment: fragments are the same rounds at other phases, so P = 1 gives the same goodput.
Useful compute is what a merged contribution carries; a refused one's compute is `refused`.
`goodput_at_merge_weight` (in the stats) counts merged compute only at the share of its weight
that the staleness discount leaves it: a pessimistic reading in which a discounted contribution
is partly wasted.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace

from diloco.coordinator import policy
from diloco.infra.goodput.engine import EPS, Engine, ChipPool, Job, book_result, new_book, speed_multipliers
from diloco.infra.goodput.model import Model, Result
from diloco.storage.protocol import Cadence
from diloco.workers.fragments import clock_due, due_fragments


@dataclass
class LearnerState:
    """One learner as the simulator follows it: its job (chips and steps) and its protocol state."""

    name: str
    job: Job
    run: int = 0
    """Bumped whenever the learner stops: events scheduled for an earlier run are void."""
    base: int = 0
    """Version its next delta is computed against."""
    step0: int = 0
    """Its step counter (as the steps cadence counts) at the job's current origin."""
    sent: dict[int, float] = field(default_factory=dict)
    """Clock cadence: fragment -> the deadline it last sent for."""
    awaiting: bool = False
    """Sent at least tau steps ago and no newer version was published yet: takes the next one."""
    live: bool = True
    seq: int = 0


@dataclass(frozen=True, slots=True)
class Piece:
    """A contribution on its way to the coordinator."""

    learner: str
    contribution_id: str
    base: int
    tokens: int
    steps: int
    step_time_s: float
    deadline: float


class Decoupled:
    """One simulation: the learners, the coordinator's state and the event engine that drives them."""

    def __init__(self, model: Model) -> None:
        self.model = model
        # The coordinator takes tau from the run, whatever its own round settings say.
        self.cfg = replace(model.round, overlap_steps=model.overlap_steps)
        self.cfg_undiscounted = replace(self.cfg, staleness_discount=False)
        self.engine = Engine(model.horizon_s)
        self.book = new_book()
        self.fleet = ChipPool(self.engine, model, model.learners, self._failure)
        speeds = speed_multipliers(model)
        offsets = random.Random(f"offsets:{model.seed}")
        self.learners = [
            LearnerState(f"learner-{m:02d}", Job(self.fleet.job_chips(m), model.step_time_s * speeds[m], self.book),
                    step0=offsets.randrange(model.sync_every) if model.cadence == "steps" else 0)
            for m in range(model.learners)]
        # Deadlines half a step of the fastest learner off its step boundaries: its period is exactly
        # H of its steps, and a step ending on a deadline would be a float coin toss. (The live
        # coordinator's origin is arbitrary, and live step times jitter.)
        self.cadence = Cadence(origin=model.step_time_s / 2, period_s=model.period_s)
        self.head = 0
        self.merged_deadline = 0.0
        self.published = 0
        self.round: list[tuple[policy.Arrival, float]] = []
        self.in_flight: dict[str, float] = {}
        self.wake_at: float | None = None
        self.stats = {"rescales": 0, "restarts": 0, "rounds": 0, "merged": 0, "refused": 0, "stale_merged": 0}
        self.useful_at_weight = 0.0
        """Merged compute scaled by the staleness discount its merge weight carries."""

    @property
    def now(self) -> float:
        return self.engine.now

    @property
    def live(self) -> int:
        """Learners the coordinator counts live: all but those whose heartbeat lease lapsed."""
        return sum(learner.live for learner in self.learners)

    def run(self) -> Result:
        started = time.perf_counter()
        for learner in self.learners:
            self._schedule_send(learner)
        self.fleet.start()
        self.engine.run()
        for learner in self.learners:
            learner.job.finish(self.model.horizon_s)
            self.book["pending"] += learner.job.take()[0]
        self.book["pending"] += sum(self.in_flight.values()) + sum(chip_s for _, chip_s in self.round)
        s = self.stats
        stats = s | {"failures": self.fleet.failures,
                     "learners_per_round": s["merged"] / s["rounds"] if s["rounds"] else 0.0,
                     "goodput_at_merge_weight": self.useful_at_weight / (self.model.chips * self.model.horizon_s)}
        return book_result("decoupled", self.model, self.book, stats, started)

    # ---- learners ----------------------------------------------------------------------------

    def _schedule_send(self, learner: LearnerState) -> None:
        """The step boundary after which the learner's schedule says to send, as the live learner's
        step hook would find it checking after every step."""
        job, step_s = learner.job, learner.job.step_s
        if self.model.cadence == "clock":
            first = job.boundary(job.done + 1)
            deadline = self.cadence.next_deadline(0, 1, after=first)
            k = max(job.done + 1, math.ceil((deadline - step_s - job.origin) / step_s - EPS) - 1)
            while not (due := clock_due(job.boundary(k), step_s, self.cadence, 1, learner.sent)):
                k += 1
            self.engine.at(job.boundary(k), self._send, learner, learner.run, due[0][1])
        else:
            h = self.model.sync_every
            count = max(h, math.ceil((learner.step0 + job.done + 1) / h) * h)
            while not due_fragments(count, 1, h):
                count += 1
            self.engine.at(job.boundary(count - learner.step0), self._send, learner, learner.run, 0.0)

    def _send(self, learner: LearnerState, run: int, deadline: float) -> None:
        if run != learner.run:
            return  # it stopped since; it schedules again when it resumes
        job = learner.job
        job.advance(self.now)
        chip_s, steps = job.take()
        if deadline:
            learner.sent[0] = deadline
        if steps:
            learner.seq += 1
            piece = Piece(learner.name, f"{learner.name}-{learner.seq}", learner.base,
                          tokens=round(chip_s / job.step_s), steps=steps, step_time_s=job.step_s,
                          deadline=deadline)
            self.in_flight[piece.contribution_id] = chip_s
            self.engine.at(self.now + self.model.upload_s, self._arrive, piece)
            self.engine.at(self.now + self.model.overlap_steps * job.step_s, self._adopt, learner, run)
        self._schedule_send(learner)

    def _adopt(self, learner: LearnerState, run: int) -> None:
        """tau steps after a send: take the newest version if it is newer, else the next one published."""
        if run != learner.run and self.model.learner_failure == "restart":
            return  # a new process, which joined at the newest version
        if self.published > learner.base:
            learner.base = self.published
        else:
            learner.awaiting = True

    def _failure(self, index: int, slice_: int) -> None:
        learner = self.learners[index]
        job = learner.job
        if self.model.learner_failure == "rescale":
            self.fleet.in_repair.add(slice_)
            self.engine.at(self.now + self.model.repair_s, self._repaired, learner, slice_)
            if job.running:  # a failure during a rescale is handled by that rescale
                job.advance(self.now)
                learner.step0 += job.done
                job.stop(self.now, lose_settled=False)
                learner.run += 1
                self.stats["rescales"] += 1
                self.engine.at(self.now + self.model.rescale_s, self._resume, learner)
            job.resize(self.now, -self.fleet.chips_per_slice)
        elif job.running:  # restart; a failure during a restart is repaired by it
            job.stop(self.now, lose_settled=True)
            learner.run += 1
            self.stats["restarts"] += 1
            self.engine.at(self.now + self.model.lease_s, self._lapse, learner, learner.run)
            self.engine.at(self.now + self.model.restart_s, self._rejoin, learner)

    def _repaired(self, learner: LearnerState, slice_: int) -> None:
        self.fleet.in_repair.discard(slice_)
        learner.job.resize(self.now, self.fleet.chips_per_slice)

    def _resume(self, learner: LearnerState) -> None:
        learner.job.resume(self.now)
        self._schedule_send(learner)

    def _lapse(self, learner: LearnerState, run: int) -> None:
        if run == learner.run and not learner.job.running and learner.live:
            learner.live = False
            self._decide()

    def _rejoin(self, learner: LearnerState) -> None:
        """A new learner process under the same name: fresh step counter, newest version."""
        learner.job.resume(self.now)
        learner.step0, learner.sent, learner.awaiting = 0, {}, False
        learner.base = self.published
        learner.live = True
        self._schedule_send(learner)

    # ---- the coordinator ---------------------------------------------------------------------

    def _arrive(self, piece: Piece) -> None:
        chip_s = self.in_flight.pop(piece.contribution_id)
        accept, _staleness, _reason = policy.staleness_verdict(piece.base, self.head, self.cfg)
        if not accept:
            self.book["refused"] += chip_s
            self.stats["refused"] += 1
            return
        arrival = policy.Arrival(contribution_id=piece.contribution_id, learner=piece.learner,
                                 base_version=piece.base, tokens=piece.tokens, steps=piece.steps,
                                 arrived_at=self.now, step_time_s=piece.step_time_s, deadline=piece.deadline)
        self.round.append((arrival, chip_s))
        self._decide()

    def _decide(self) -> None:
        if not self.round:
            return
        state = policy.RoundState(fragment=0, head_version=self.head, arrivals=tuple(a for a, _ in self.round),
                                  live_learners=self.live, sync_time_s=self.model.merge_s,
                                  period_s=self.model.period_s if self.model.cadence == "clock" else 0.0,
                                  merged_deadline=self.merged_deadline)
        decision = policy.decide_round(self.now, state, self.cfg)
        if decision.merge:
            self._merge()
        elif decision.wake_at is not None and decision.wake_at != self.wake_at:
            self.wake_at = decision.wake_at
            self.engine.at(decision.wake_at, self._decide)

    def _merge(self) -> None:
        chip_s = {a.contribution_id: c for a, c in self.round}
        ordered = policy.merge_order([a for a, _ in self.round])
        weights = policy.merge_weights(ordered, self.head, self.cfg)
        # The same weights without the staleness discount: their ratio is the share a stale
        # contribution keeps (1 for a fresh one).
        full = policy.merge_weights(ordered, self.head, self.cfg_undiscounted)
        for a, w, f in zip(ordered, weights, full, strict=True):
            self.book["useful"] += chip_s[a.contribution_id]
            self.useful_at_weight += chip_s[a.contribution_id] * (w / f if f > 0 else 0.0)
        self.stats["rounds"] += 1
        self.stats["merged"] += len(ordered)
        self.stats["stale_merged"] += sum(a.base_version < self.head for a in ordered)
        self.merged_deadline = policy.served_deadline(self.merged_deadline, ordered)
        self.round, self.wake_at = [], None
        self.head += 1
        self.engine.at(self.now + self.model.merge_s, self._publish, self.head)

    def _publish(self, version: int) -> None:
        self.published = max(self.published, version)
        for learner in self.learners:
            if learner.awaiting:
                learner.base, learner.awaiting = self.published, False


def decoupled(model: Model) -> Result:
    return Decoupled(model).run()
