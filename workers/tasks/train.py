"""`diloco learner`: a built-in task (the demo's, or any kind in `workers.tasks.kinds`) trained as
one learner of a run.

This is also the reference for wrapping your own loop: build the model, the inner optimizer and
its schedule, wrap the model and optimizer in a `Learner`, train as usual.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from diloco.storage.settings import Endpoints
from diloco.workers.learner import Learner, LearnerConfig, Preempted
from diloco.workers.tasks.base import Task, train_step

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DemoLearnerArgs:
    run: str
    learner_id: str
    steps: int
    """Inner steps to train before leaving (the inner learning-rate schedule spans them)."""
    slowdown: float = 1.0
    """Step-time multiplier: 2.0 makes this learner take twice as long per step (a slower chip)."""
    step_time_s: float = 0.0
    """Pace: every step takes at least step_time_s x slowdown seconds (the rest is slept), so speed ratios
    hold however many processes share the cores. 0: no pacing; slowdown then sleeps (slowdown - 1) x the step."""
    until: float = 0.0
    """Leave at this unix time (a wall-clock budget that counts start-up and joining), even if steps remain;
    0: no time limit."""
    data_seed: int = 0
    """Seed of this learner's data stream: give each learner its own, the same across its restarts (a
    restarted learner resumes its stream where its saved state says; without one it starts it again)."""
    model_seed: int = 0
    """Seed of the initial weights (only matters for whoever proposes version 0)."""
    threads: int = 1
    """torch intra-op threads."""


class DataPosition:
    """Where a learner is in its data stream, saved and restored with the learner's state: a
    restarted learner goes on with the batches after the last one it trained on (regenerated from
    the stream's seed, the ones before it skipped), not with the stream's first ones again."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task, self.seed, self.consumed = task, seed, 0
        self._batches = task.train_batches(seed)

    def next(self) -> object:
        self.consumed += 1
        return next(self._batches)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.consumed = int(state["seed"]), int(state["consumed"])
        self._batches = self.task.train_batches(self.seed)
        for _ in range(self.consumed):
            next(self._batches)


def train_demo_learner(task: Task, args: DemoLearnerArgs, endpoints: Endpoints | None = None,
                       config: LearnerConfig | None = None) -> Learner:
    torch.set_num_threads(args.threads)
    model = task.make_model(args.model_seed)
    optimizer = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(optimizer, args.steps)
    data = DataPosition(task, args.data_seed)
    # handle_sigterm: SIGTERM (a spot preemption notice, a pod deleted) ends the step in progress,
    # sends the progress since the last sends (it joins the others' next round) and leaves, but not as
    # finished: the learner may come back, and the run does not end without it. optimizer.step()
    # then raises Preempted, which this loop takes as a normal exit.
    # state=: the schedule and the data position are saved with the optimizer's state and restored
    # when this learner's id rejoins (LearnerConfig.save_state): a restart resumes at its saved step.
    learner = Learner(model, optimizer, run=args.run, endpoints=endpoints, learner_id=args.learner_id,
                      tokens_per_step=task.tokens_per_step(), config=config, handle_sigterm=True,
                      state={"schedule": schedule, "data": data})
    try:
        with learner:
            log.info("learner %s: %d steps, slowdown x%.2f", args.learner_id, args.steps, args.slowdown)
            until = args.until if args.until > 0 else float("inf")
            for step in range(learner.step, args.steps):  # learner.step: 0, or where a saved state left off
                if learner.run_finished:
                    log.info("learner %s: the run is finished, leaving after step %d", args.learner_id, step)
                    learner.finish(preempted=True)
                    break
                if time.time() >= until:
                    log.info("learner %s: time budget spent, leaving after step %d", args.learner_id, step)
                    break
                t0 = time.perf_counter()
                loss = train_step(task, model, optimizer, schedule, data.next())
                learner.report(loss=loss)
                elapsed = time.perf_counter() - t0
                if args.step_time_s > 0:
                    time.sleep(max(0.0, args.step_time_s * args.slowdown - elapsed))
                elif args.slowdown > 1.0:
                    time.sleep((args.slowdown - 1.0) * elapsed)
    except Preempted as exc:
        log.info("%s", exc)
    return learner
