"""The roles of a run as processes: `diloco coordinator`, `diloco learner`, and `diloco finish`.

Each subcommand is `add_<name>_arguments(parser)` + `run_<name>(args) -> int`, listed in
`infra.cli.COMMANDS`. Options of the coordinator and learner come from their config dataclasses
(field docstring = help text).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import redis

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.leadership import Stopped
from diloco.coordinator.metrics import Metrics
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.options import add_options, build
from diloco.storage.bus import Bus
from diloco.storage.errors import DilocoError, RunFinished, StorageUnavailable
from diloco.storage.history import read_run_end, require_run_spec
from diloco.storage.lease import Lease
from diloco.storage.objects import ObjectStore
from diloco.storage.codecs import CODECS
from diloco.storage.protocol import FinishRequest, RunEnd
from diloco.storage.reach import check_servers
from diloco.storage.settings import Endpoints
from diloco.workers.tasks.train import DemoLearnerArgs, train_demo_learner
from diloco.workers.tasks.demo import DemoTask
from diloco.workers.learner import ENV_LEARNER_ID, PREEMPTED_EXIT, LearnerConfig, Preempted, stable_learner_id
from diloco.workers.tasks.kinds import load_task

log = logging.getLogger("diloco")


# -- coordinator ---------------------------------------------------------------------------------

def add_coordinator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run id (created with the settings below if it does not exist)")
    parser.add_argument("--resume", action="store_true",
                        help="run a run that exists with its stored settings, whatever run settings are given (without "
                             "it, run settings other than the stored ones are an error that shows both)")
    add_options(parser, RunSettings, flags={"num_fragments": "--fragments"}, title="run settings (fixed when the run "
                "is created)", choices={"codec": CODECS})
    add_options(parser, CoordinatorConfig, choices={"downstream_codec": ("run", *CODECS)})
    add_options(parser, RoundConfig, skip=("overlap_steps",))  # tau is a run setting


class _Interrupted(BaseException):
    """SIGTERM or SIGINT while starting: leaves whatever start-up waits on (an adapter's retries
    included) at once. A BaseException, so that no `except Exception` on the way swallows it."""


def run_coordinator(args: argparse.Namespace) -> int:
    config = build(CoordinatorConfig, args, round=build(RoundConfig, args, overlap_steps=args.overlap_steps))
    stop, starting = threading.Event(), threading.Event()
    signalled: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        signalled.append(signum)
        stop.set()
        if starting.is_set():  # nothing to finish yet: a start-up ended by a signal is retried by whoever sent it
            starting.clear()
            raise _Interrupted

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    metrics = Metrics.start(config.metrics_port, args.run)  # served while standing by too
    starting.set()
    try:
        coordinator = _start_coordinator(args, config, stop, metrics)
    except _Interrupted:
        coordinator = None
    finally:
        starting.clear()
    if coordinator is None:
        log.info("stopped before taking over run %s", args.run)
        return _stopped_code(signalled)
    covers = _cover_other_shards(args, config, stop) if config.cover_shards else []
    try:
        coordinator.serve(stop)
    finally:
        stop.set()  # the covers stand by no longer, and one that serves another shard stops too
        for cover in covers:
            cover.join(timeout=config.lease_s + 30.0)
    log.info("coordinator stopped: %s", coordinator.bus.counters())
    return 0 if coordinator.ended is not None else _stopped_code(signalled)


def _stopped_code(signalled: list[int]) -> int:
    """A coordinator stopped by a signal before its run ended exits as that signal would (143 for
    SIGTERM, 130 for SIGINT), so that a Job or a managed job counts it as stopped, not done: exit 0
    means the run is finished (a Kubernetes Job with one pod succeeded starts no new pods)."""
    return 128 + signalled[0] if signalled else 0


def _cover_other_shards(args: argparse.Namespace, config: CoordinatorConfig,
                        stop: threading.Event) -> list[threading.Thread]:
    """`--cover-shards`: a standby for each other shard of the run, in a thread of this process, that
    serves the shard once its lease lapses and no other standby took it (until the run ends or `stop`)."""

    def cover(shard: int) -> None:
        mine = replace(config, shard=shard, standby=True, cover_shards=False, metrics_port=0)
        try:
            coordinator = _start_coordinator(args, mine, stop, Metrics.start(0, args.run))
            if coordinator is not None:
                log.warning("shard %d of run %s lost its coordinator: this process coordinates it too now", shard,
                            args.run)
                coordinator.serve(stop)
        except Exception:  # noqa: BLE001 (a cover that fails leaves this process's own shard running)
            log.exception("the standby for shard %d of run %s failed", shard, args.run)

    threads = [threading.Thread(target=cover, args=(k,), name=f"cover-shard-{k}", daemon=True)
               for k in range(config.shards) if k != config.shard]
    for thread in threads:
        thread.start()
    return threads


def _start_coordinator(args: argparse.Namespace, config: CoordinatorConfig, stop: threading.Event,
                       metrics: Metrics) -> Coordinator | None:
    """The run's coordinator once it holds the lease; None if stopped first. Both servers must answer
    within `reach_timeout_s` (`check_servers`: else a ConfigError names the setting to check). S3 or
    Redis becoming unreachable after that is waited out, so that a coordinator or standby started
    during an outage is there when it ends. Attempts after a failed one wait for the lease like a
    standby: the failed one may have taken the lease, which then lapses (it is renewed only once
    start-up is done)."""
    endpoints = Endpoints.from_env()
    if not check_servers(endpoints, timeout_s=config.reach_timeout_s, stop=stop, bucket_may_be_missing=True):
        return None
    while True:
        try:
            return Coordinator(endpoints, args.run, settings=build(RunSettings, args), config=config,
                               stop=stop, metrics=metrics, resume=args.resume)
        except Stopped:
            return None
        except (StorageUnavailable, redis.RedisError) as exc:
            log.warning("could not start coordinating run %s, storage unreachable; retrying in 1s: %s", args.run, exc)
            config = replace(config, standby=True)
            if stop.wait(1.0):
                return None


# -- learner (a built-in task: the demo's by default) ----------------------------------------------

def add_learner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run id (the coordinator creates it)")
    own_id = stable_learner_id()
    parser.add_argument("--learner-id", "--id", dest="learner_id", required=own_id is None, default=own_id,
                        help=f"learner id, unique in the run and kept across restarts (default: {ENV_LEARNER_ID}, "
                             "else the Kubernetes job index or SkyPilot job id; required without them)")
    parser.add_argument("--task", type=Path, help="JSON of the task to train (its `kind`: demo, gpt2, vision; "
                        "model, data, inner optimizer and schedule), as the benchmarks and `diloco demo` write it; "
                        "default: the demo task on its synthetic language")
    parser.add_argument("--text", help="train on this text file (byte level) instead of the synthetic language")
    add_options(parser, DemoLearnerArgs, skip=("run", "learner_id"))
    add_options(parser, LearnerConfig)


def run_learner(args: argparse.Namespace) -> int:
    def preempted_early(*_: object) -> None:  # before the Learner installs its own handler
        raise Preempted(f"learner {args.learner_id} left on SIGTERM before joining run {args.run!r}")

    signal.signal(signal.SIGTERM, preempted_early)
    if args.task:
        task = load_task(args.task)
    else:
        task = DemoTask(text_path=args.text) if args.text else DemoTask()
    try:
        learner = train_demo_learner(task, build(DemoLearnerArgs, args), Endpoints.from_env(),
                                     build(LearnerConfig, args))
    except RunFinished as exc:  # started after the end (a restart, a late slot): nothing left to do
        log.info("%s", exc)
        return 0
    except Preempted as exc:
        log.warning("%s", exc)
        return PREEMPTED_EXIT
    log.info("learner %s done: %s", args.learner_id, learner.progress())
    # Left on SIGTERM: exit as a process SIGTERM killed (143), which Kubernetes Jobs and SkyPilot's
    # recovery read as "run me again", not as a learner whose training is done.
    return PREEMPTED_EXIT if learner.preempted else 0


# -- finish --------------------------------------------------------------------------------------

def add_finish_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run id to finish")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the run's coordinator to finish it (default: %(default)s)")


def run_finish(args: argparse.Namespace) -> int:
    """Ask the run's coordinator to finish the run now: it merges what is pending, then writes the
    run's end. Prints each fragment's final version; exit 1 if no coordinator did so in time."""
    endpoints = Endpoints.from_env()
    store, bus = ObjectStore(endpoints), Bus(endpoints, args.run)
    require_run_spec(store, bus.keys)
    end = read_run_end(store, bus.keys)
    if end is None:
        by = f"diloco finish on {socket.gethostname()} (pid {os.getpid()})"
        bus.ask_finish(FinishRequest(run=args.run, asked_at=bus.server_time(), by=by))
        log.info("asked the coordinator of run %s to finish it; waiting up to %.0fs", args.run, args.timeout)
        end = _wait_for_end(bus, args.timeout)
    print(f"run {end.run} finished by {end.by}: {end.reason}")
    for fragment, version in enumerate(end.versions):
        print(f"fragment {fragment}: version {version}")
    return 0


def _wait_for_end(bus: Bus, timeout_s: float) -> RunEnd:
    deadline = time.monotonic() + timeout_s
    while (end := bus.run_end()) is None:
        if time.monotonic() > deadline:
            holder = Lease(bus, "diloco-finish", 1.0).held_by_other()
            who = (f"its coordinator {holder.name} did not answer" if holder else
                   "no coordinator holds the run")
            raise DilocoError(f"run {bus.run!r} was not finished within {timeout_s:.0f}s: {who}. The request stays: "
                              f"the run's coordinator finishes the run when it runs (`diloco coordinator --run "
                              f"{bus.run}`), and `diloco finish` waits for it again")
        time.sleep(0.2)
    return end
