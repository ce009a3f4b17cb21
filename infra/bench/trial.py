"""One benchmark arm: a coordinator and learners as real `diloco` processes on a real stack, then figures.

A `Trial` says what runs: the run's settings, the coordinator's options, and one `LearnerPlan` per
learner (speed, step budget, wall-clock budget, when it is killed and restarted). `run_trial`
starts the processes on a stack the caller owns (each trial is its own run id, so arms share one
stack), supervises them, and afterwards reads everything back from S3 and Redis:

- the global model's eval loss over wall time, evaluated after the run from the manifests'
  commit times (evaluating while the learners train would steal their CPU): at a few evenly
  spaced times, or after every committed version (`curve_points=None`);
- counters, versions, and every learner's last heartbeat (steps, tokens, bytes uploaded, time
  spent in its step hook) for the communication and stall figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from diloco.infra.history.task_model import load_version
from diloco.infra.local.fleet import Supervisor, Outage, diloco_command, learner_argv, process_env, wait_until
from diloco.infra.local.stack import LocalStack, aws_env
from diloco.storage.bus import Bus
from diloco.storage.history import list_versions, read_layout, read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Layout, Manifest
from diloco.workers.tasks.base import Task

log = logging.getLogger(__name__)


SYNC_LEARNER = ("--wait-for-merge", "--merge-wait-s", "60")
"""Learner options of a synchronous arm: wait for each merge (bounded, so a learner ends near its budget)."""

OVERRUN_S = 90.0
"""Learners still running this long after the budget (stuck at a barrier) are killed."""

RUN_END_S = 30.0
"""How long after the last learner exits to wait for the coordinator to end the run (merge the final
pieces of learners that finished); a run whose learners were killed may never end."""


@dataclass(frozen=True, slots=True)
class LearnerPlan:
    name: str
    slowdown: float = 1.0
    """Step-time multiplier (with the trial's pace: each step takes step_time_s x slowdown)."""
    steps: int = 10**9
    """Inner steps; the trial's wall-clock budget usually ends the learner first."""
    data_seed: int = 0
    outages: tuple[Outage | tuple[float, float], ...] = ()
    """(at_s, down_s[, signal]), in time order: SIGKILL (or SIGTERM: a preemption notice) the learner
    at_s seconds into the trial and start it again down_s later (a replacement machine booting, a
    preempted spot instance coming back)."""
    args: tuple[str, ...] = ()
    """Options of this learner only, after the trial's `learner_args` (`--no-save-state`)."""


@dataclass(frozen=True, slots=True)
class Trial:
    name: str
    learners: tuple[LearnerPlan, ...]
    budget_s: float
    """Wall-clock budget of every learner, from the trial's start (time to join included)."""
    run_args: tuple[str, ...] = ()
    """Coordinator options that shape the run (`--fragments 2 --sync-every 30 ...`)."""
    coordinator_args: tuple[str, ...] = ()
    """Coordinator merge options (`--min-quorum 4 ...`)."""
    learner_args: tuple[str, ...] = ()
    """Options every learner gets (`--wait-for-merge`, `--threads 1`...)."""
    step_time_s: float = 0.0
    """Pace of a learner of slowdown 1 (see DemoLearnerArgs.step_time_s); 0: as fast as the CPU allows."""


@dataclass
class TrialResult:
    name: str
    run: str
    wall_s: float
    eval_loss: float
    curve: list[tuple[float, float]]
    """(seconds since the trial started, eval loss of the global model at that time)."""
    curve_versions: list[tuple[int, int]]
    """With a curve of every version: the (fragment, version) whose commit each point follows ((-1, 0)
    for the first point, every fragment's version 0); else empty."""
    counters: dict[str, int]
    heads: dict[int, int]
    learners: dict[str, dict]
    """Each learner's last heartbeat: step, tokens, bytes_uploaded, sync_s, wall_s..."""
    restarts: int
    merged_tokens: int
    """Tokens of the learner compute that reached the global model: the tokens of the contributions merged
    into versions, per fragment (every fragment's contributions cover a learner's tokens once)."""
    rounds: RoundStats | None = None
    learners_done_s: float = 0.0
    """When the last learner exited, since the trial started."""
    last_merged_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Learner -> when its last piece reached the model (`last_merged_s`), since the trial started."""

    def total(self, key: str) -> float:
        return sum(float(s.get(key, 0) or 0) for s in self.learners.values())

    def to_json(self) -> dict:
        return {"name": self.name, "run": self.run, "wall_s": round(self.wall_s, 2), "eval_loss": self.eval_loss,
                "curve": [[round(t, 2), loss] for t, loss in self.curve],
                **({"curve_versions": [list(v) for v in self.curve_versions]} if self.curve_versions else {}),
                "counters": self.counters,
                "heads": {str(k): v for k, v in self.heads.items()}, "learners": self.learners,
                "restarts": self.restarts, "merged_tokens": self.merged_tokens,
                "rounds": None if self.rounds is None else self.rounds.to_json(),
                "learners_done_s": round(self.learners_done_s, 2),
                "last_merged_s": {k: round(v, 2) for k, v in self.last_merged_s.items()}}


@dataclass(frozen=True, slots=True)
class RoundStats:
    """How the merged versions were made, over every fragment (from the manifests)."""

    versions: int
    """Versions merged (version 0 not counted)."""
    contributions: int
    learners_per_version: float
    """Mean distinct learners per merged version."""
    stale_share: float
    """Share of merged contributions computed against an older version than their parent."""
    mean_staleness: float
    weight_sum: float
    """Mean over versions of the sum of the inputs' weights: below 1 where the staleness discount shrank the step."""
    per_learner: dict[str, dict] = dataclasses.field(default_factory=dict)
    """Learner -> {"merged": pieces merged, "mean_staleness": their mean staleness}."""

    def to_json(self) -> dict:
        return {"versions": self.versions, "contributions": self.contributions,
                "learners_per_version": round(self.learners_per_version, 3), "stale_share": round(self.stale_share, 4),
                "mean_staleness": round(self.mean_staleness, 4), "weight_sum": round(self.weight_sum, 4),
                "per_learner": self.per_learner}


def last_merged_s(manifests: dict[int, list[Manifest]], started_unix: float) -> dict[str, float]:
    """Learner -> when the last version holding a piece of its committed (the latest over fragments),
    in seconds since `started_unix`: when the last of its work reached the model."""
    last: dict[str, float] = {}
    for m in (m for history in manifests.values() for m in history):
        for c in m.inputs:
            last[c.learner] = max(last.get(c.learner, -math.inf), m.committed_at - started_unix)
    return last


def round_stats(manifests: dict[int, list[Manifest]]) -> RoundStats:
    merged = [m for history in manifests.values() for m in history if m.version > 0]
    inputs = [c for m in merged for c in m.inputs]
    n = max(1, len(merged))
    return RoundStats(
        versions=len(merged), contributions=len(inputs),
        learners_per_version=sum(len({c.learner for c in m.inputs}) for m in merged) / n,
        stale_share=sum(1 for c in inputs if c.staleness > 0) / max(1, len(inputs)),
        mean_staleness=sum(c.staleness for c in inputs) / max(1, len(inputs)),
        weight_sum=sum(sum(c.weight for c in m.inputs) for m in merged) / n,
        per_learner={learner: {"merged": len(mine), "mean_staleness": sum(mine) / len(mine)}
                     for learner in sorted({c.learner for c in inputs})
                     for mine in [[c.staleness for c in inputs if c.learner == learner]]})


@dataclass(frozen=True)
class Placement:
    """Where a trial's processes run: the default is here, on the stack's endpoints; `bench wan`
    puts the coordinator in a hub network namespace and each learner behind a link of its own."""

    coordinator: tuple[str, ...] = ()
    """What goes before the coordinator's command line (e.g. `ip netns exec HUB`)."""
    learner: Callable[[int], list[str]] = lambda _k: []
    """What goes before learner k's command line (k: its index in the trial's learners)."""
    learner_env: Callable[[int], dict[str, str] | None] = lambda _k: None
    """Learner k's environment before `process_env`; None: the stack's."""


def _learner_argv(trial: Trial, plan: LearnerPlan, run: str, task_path: Path, until: float,
                  incarnation: int) -> list[str]:
    return learner_argv(run, plan.name, task_path, steps=plan.steps, until=until, slowdown=plan.slowdown,
                        step_time_s=trial.step_time_s, data_seed=plan.data_seed + 1000 * incarnation,
                        extra=(*trial.learner_args, *plan.args))


def run_trial(stack: LocalStack, trial: Trial, task: Task, out: Path, *, run: str | None = None,
              curve_points: int | None = 8, placement: Placement = Placement()) -> TrialResult:
    """Run `trial` to the end of its budget on `stack` and measure it (see the module docstring).
    `curve_points`: evaluate the global model at that many evenly spaced times, or after every
    committed version if None. `placement`: where the processes run."""
    run = run or f"{trial.name}-{int(time.time())}"
    out.mkdir(parents=True, exist_ok=True)
    task_path = out / "task.json"
    task_path.write_text(json.dumps(task.to_wire()))
    started = time.monotonic()
    started_unix = time.time()
    until = started_unix + trial.budget_s
    coordinator = f"{trial.name}-coordinator"
    plans = {f"{trial.name}-{p.name}": p for p in trial.learners}  # the fleet's names, and so its logs' names
    # A killed learner comes back unless that would be within a second of the budget's end.
    with Supervisor(process_env(stack.env()), out / "logs", restarts_until_s=trial.budget_s - 1.0) as fleet:
        try:
            fleet.add(coordinator, [*placement.coordinator, *diloco_command(
                "coordinator", "--run", run, *trial.run_args, *trial.coordinator_args)], service=True)
            for k, (name, plan) in enumerate(plans.items()):
                env = placement.learner_env(k)
                # A restarted learner's data seed counts the trial's restarts so far, not its own.
                fleet.add(name, lambda i, plan=plan, k=k: [*placement.learner(k), *_learner_argv(
                    trial, plan, run, task_path, until, fleet.restarts if i else 0)],
                          env=None if env is None else process_env(env))
                fleet.schedule(name, plan.outages)
            _supervise(trial, fleet, plans, started)
            learners_done_s = time.monotonic() - started
            bus = Bus(stack.endpoints, run)
            wait_until(lambda: bus.pending_count() == 0, 15.0)  # let the last round merge
            if not wait_until(lambda: bus.run_end() is not None, RUN_END_S):  # the learners' final pieces merged
                log.warning("%s: run %s did not end within %.0fs of its last learner: measuring the heads as they "
                            "are", trial.name, run, RUN_END_S)
            wall_s = time.monotonic() - started
            counters, heads, learners = bus.counters(), bus.heads(), bus.learner_stats()
        finally:
            fleet.stop(plans, timeout_s=10)
            fleet.stop([coordinator])
    with aws_env(stack.env()):
        store, keys = ObjectStore(stack.endpoints), RunKeys(stack.endpoints.prefix, run)
        layout = read_layout(store, keys)
        if layout is None:
            raise RuntimeError(f"{trial.name}: run {run} never committed version 0: see {out / 'logs'}")
        manifests = {f: [read_manifest(store, keys, f, v) for v in list_versions(store, keys, f)]
                     for f in range(len(layout.fragments))}
        if curve_points is None:
            curve, curve_versions = version_curve(task, store, layout, manifests, started_unix)
        else:
            curve, curve_versions = eval_curve(task, store, layout, manifests, started_unix, wall_s, curve_points), []
    # Each fragment's contributions cover the learner's tokens once: the fleet's merged tokens are the mean.
    merged = sum(c.tokens for history in manifests.values() for m in history[1:] for c in m.inputs) // len(manifests)
    return TrialResult(trial.name, run, wall_s, curve[-1][1], curve, curve_versions, counters, heads,
                       {k: dataclasses.asdict(v) for k, v in learners.items()}, fleet.restarts, merged, round_stats(manifests),
                       learners_done_s, last_merged_s(manifests, started_unix))


def _supervise(trial: Trial, fleet: Supervisor, plans: dict[str, LearnerPlan], started: float) -> None:
    """Watch the trial until its learners are done (the fleet carries out their outages). Learners
    still running OVERRUN_S after the budget are killed."""
    while fleet.busy(plans):
        time.sleep(0.2)
        fleet.check()  # the coordinator must not exit, a learner must end with 0 unless we killed it
        if time.monotonic() - started > trial.budget_s + OVERRUN_S:
            stuck = [name for name in plans if fleet.alive(name)]
            log.warning("%s: %s still running %.0fs after the budget: killed", trial.name, stuck, OVERRUN_S)
            for name in stuck:
                fleet.kill(name)
            return


def eval_curve(task: Task, store: ObjectStore, layout: Layout, manifests: dict[int, list[Manifest]],
               started_unix: float, wall_s: float, points: int) -> list[tuple[float, float]]:
    """Eval loss of the global model as it stood at `points` evenly spaced times (the last at the end),
    from the manifests' commit times."""
    model = task.make_model(0)
    loaded: dict[int, int] = {}
    curve = []
    for i in range(1, points + 1):
        t = wall_s * i / points
        for f, history in manifests.items():
            at = [m for m in history if m.committed_at <= started_unix + t] or history[:1]
            if not at or loaded.get(f) == at[-1].version:
                continue
            load_version(model, store, layout, at[-1])
            loaded[f] = at[-1].version
        curve.append((t, task.eval_loss(model)))
    return curve


def version_curve(task: Task, store: ObjectStore, layout: Layout, manifests: dict[int, list[Manifest]],
                  started_unix: float) -> tuple[list[tuple[float, float]], list[tuple[int, int]]]:
    """Eval loss of the global model after every commit, in commit order: first every fragment's
    version 0 (the genesis), then, after each committed version, the latest version of every
    fragment. Returns the curve (seconds since the trial started, loss) and the (fragment, version)
    each point follows ((-1, 0) for the genesis)."""
    model = task.make_model(0)
    for history in manifests.values():
        load_version(model, store, layout, history[0])
    curve = [(max(h[0].committed_at for h in manifests.values()) - started_unix, task.eval_loss(model))]
    labels = [(-1, 0)]
    for m in sorted((m for h in manifests.values() for m in h[1:]), key=lambda m: (m.committed_at, m.fragment,
                                                                                 m.version)):
        load_version(model, store, layout, m)
        curve.append((m.committed_at - started_unix, task.eval_loss(model)))
        labels.append((m.fragment, m.version))
    return curve, labels


def add_out_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """`--out` (the stack's data and the processes' logs, `out/bench/NAME` by default) and `--keep-stack`."""
    parser.add_argument("--out", type=Path, default=Path("out/bench") / name, help="stack data and logs")
    parser.add_argument("--keep-stack", action="store_true",
                        help="keep the local stack's server data under OUT/stack after the bench, to replay or "
                             "inspect its runs (removed by default once the figures are read: from a few hundred MB "
                             "a run to many GB for a large model)")


def add_repeats_argument(parser: argparse.ArgumentParser, once: str) -> None:
    """`--repeats N`: each arm N times, the arms in turn (`turns`); `once` says what runs once."""
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help=f"runs of each arm, the arms in turn, each repeat starting one arm further along; "
                             f"finals, times and ratios are then means, with the spread of the finals ({once}) "
                             f"(default: %(default)s)")


def run_dir(out: Path, repeat: int, repeats: int) -> Path:
    """Where one run of an arm keeps its logs: `out` itself for a single run, `out/run-K` (K from 1)
    for each of several, so that a repeat does not overwrite the logs of the one before."""
    return out if repeats == 1 else out / f"run-{repeat + 1}"


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def turns(arms: list[str], repeats: int) -> list[list[str]]:
    """The order the arms run in, repeat by repeat: each repeat starts one arm further along, so that
    over repeats as many as the arms each arm runs first, second... once."""
    return [arms[r % len(arms):] + arms[:r % len(arms)] if arms else [] for r in range(repeats)]



@contextmanager
def bench_stack(out: Path, *, keep: bool = False, bind: str = "127.0.0.1") -> Iterator[LocalStack]:
    """A fresh local stack under `out/stack` (an earlier one's data removed), its credentials in
    this process's environment for the figures read back from S3.

    Its servers' data (SeaweedFS's volumes: a few hundred MB a run, 16 GB for `bench device`'s 124M
    model) is removed once the bench has read its figures, unless `keep` (`--keep-stack`: to replay
    or inspect the runs afterwards) or the bench failed: then it stays for a look, and the log says
    where."""
    data = out / "stack"
    if data.exists():
        shutil.rmtree(data)
    out.mkdir(parents=True, exist_ok=True)
    with LocalStack(data, bind=bind) as stack, aws_env(stack.env()):
        try:
            yield stack
        except BaseException:
            log.warning("kept the stack's data under %s for a look at what failed", data)
            raise
    if keep:
        log.info("kept the stack's data under %s (--keep-stack)", data)
        return
    size = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    shutil.rmtree(data, ignore_errors=True)
    log.info("removed the stack's data under %s (%.0f MB; --keep-stack keeps it)", data, size / 1e6)


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """When the curve first reaches `target`: linear between the last point above and the first at or
    below it (the first point's time if it is already below); None if it never does."""
    prev: tuple[float, float] | None = None
    for t, loss in curve:
        if loss <= target:
            if prev is None:
                return t
            pt, pl = prev
            return pt + (t - pt) * (pl - target) / (pl - loss)
        prev = (t, loss)
    return None


def run_args(fragments: int, sync_every: int, overlap_steps: int, codec: str, cadence: str = "clock") -> tuple[str, ...]:
    return ("--fragments", str(fragments), "--sync-every", str(sync_every), "--overlap-steps", str(overlap_steps),
            "--codec", codec, "--cadence", cadence)


def sync_trial(name: str, learners: tuple[LearnerPlan, ...], budget_s: float, *, sync_every: int,
               overlap_steps: int = 3, codec: str = "int8", step_time_s: float = 0.0) -> Trial:
    """The synchronous DiLoCo arm of a benchmark: the whole model as one fragment on the steps
    cadence, a round waits for every learner (quorum = M, no grace window), and every learner
    waits for each merge before training on (`SYNC_LEARNER`): the barrier."""
    return Trial(name, learners, budget_s, run_args(1, sync_every, overlap_steps, codec, cadence="steps"),
                 ("--min-quorum", str(len(learners)), "--max-grace-s", "0"), SYNC_LEARNER, step_time_s=step_time_s)
