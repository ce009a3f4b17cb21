"""The processes of a chaos run: coordinators armed with crash points, learners restarted after faults.

`ChaosFleet.supervise()` is called every tick by the runner (infra/chaos/suite.py). It
- judges every process that exited by what it was sent: a SIGTERMed learner must exit 0, a
  coordinator armed with a crash point must die there, anything unasked for is a failure;
- restarts learners (same id, next data seed) `restart_delay_s` after they exited;
- keeps one coordinator holding the run and standbys waiting (every coordinator is started with
  `--standby`, so the first one simply takes the free lease). A coordinator fault that is near gets
  a standby started with `DILOCO_CRASH_AT=<step>:1`; when it is due and a plain coordinator holds
  the run, the holder is SIGKILLed, the armed standby takes over once the lease lapses and dies at
  that commit step of its first merge. Several faults near together get several armed standbys,
  which take over and die one after the other; a plain standby would race them for the lease, so
  there is none until the last armed one holds the run.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis

from diloco.infra.chaos.config import ChaosConfig
from diloco.infra.chaos.faults import Fault
from diloco.infra.local.fleet import Proc, diloco_command, learner_argv
from diloco.storage.crashpoints import ENV as CRASH_ENV

log = logging.getLogger(__name__)

TERM_TIMEOUT_S = 60.0
"""A SIGTERMed learner that has not exited by then is a failure (it is SIGKILLed)."""
MIN_TRAINING_S = 8.0
"""A learner fault hits only a learner that has trained this long since it (re)joined."""
ARM_LEAD_S = 8.0
"""A standby is armed with a crash point this long before its fault is due: its start-up time."""


@dataclass
class Tally:
    """What happened, written by the runner, the fleet and the server-restart thread."""

    fired: Counter[str] = field(default_factory=Counter)
    """Fault label -> how many times it really happened."""
    failures: list[str] = field(default_factory=list)
    """Processes that exited when they should not have, faults that could not be carried out."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, label: str) -> None:
        with self._lock:
            self.fired[label] += 1

    def fail(self, what: str) -> None:
        log.error("chaos: %s", what)
        with self._lock:
            self.failures.append(what)


@dataclass
class CoordinatorProc:
    proc: Proc
    fault: Fault | None
    """The coordinator fault it is armed for: it SIGKILLs itself at that commit step (DILOCO_CRASH_AT)."""
    stopping: bool = False
    """We sent it SIGKILL or SIGTERM."""
    ready: bool = False

    @property
    def point(self) -> str | None:
        return None if self.fault is None else self.fault.target

    def standing_by(self) -> bool:
        """Started and waiting for the lease (its imports done, so it takes over without delay)."""
        self.ready = self.ready or "standing by" in self.proc.tail(50)
        return self.ready


@dataclass
class LearnerSlot:
    name: str
    index: int
    proc: Proc | None = None
    incarnation: int = 0
    restart_at: float | None = 0.0
    expect: str = ""
    """'kill' or 'term' once we signalled it, so that its exit is judged by what it was sent."""
    signalled_at: float = 0.0
    joined_at: float | None = None
    """When it was first seen to have joined the run (its log says so)."""

    def joined(self) -> bool:
        if self.joined_at is None and self.proc is not None and "joined run" in self.proc.tail(200):
            self.joined_at = time.monotonic()
        return self.joined_at is not None

    def training_for_s(self) -> float:
        """Seconds since it joined and started training; 0 if it is not training."""
        if self.proc is None or self.expect or not self.proc.alive() or not self.joined():
            return 0.0
        return time.monotonic() - (self.joined_at or 0.0)


class ChaosFleet:
    def __init__(self, cfg: ChaosConfig, env: dict[str, str], quick: redis.Redis, lease_key: str,
                 task_path: Path, tally: Tally) -> None:
        self.cfg, self.env, self.quick, self.lease_key, self.task_path = cfg, env, quick, lease_key, task_path
        self.tally = tally
        self.coordinators: list[CoordinatorProc] = []
        self.slots = [LearnerSlot(f"l{i}", i) for i in range(cfg.learners)]
        self.coordinator_faults: list[Fault] = []
        """Coordinator faults that have not fired yet, by time."""
        self.spawned = self.restarts = self.deposed = 0

    def supervise(self, elapsed: float, *, arming: bool, restart: bool, may_kill: bool) -> None:
        """`arming`: carry out coordinator faults; `restart`: restart learners that exited;
        `may_kill`: a due coordinator fault may SIGKILL the holder now (no server is restarting)."""
        self._learners(restart)
        self._reap_coordinators()
        self._keep_coordinators(elapsed, arming, may_kill)

    # ---- learners ------------------------------------------------------------------------------
    def _learners(self, restart: bool) -> None:
        now = time.monotonic()
        for slot in self.slots:
            p = slot.proc
            if p is not None and p.returncode() is not None:
                rc = p.returncode()
                if slot.expect == "term" and rc != 0:
                    self.tally.fail(f"{p.name} exited {rc} after SIGTERM, not 0:\n{p.tail(15)}")
                elif not slot.expect:
                    self.tally.fail(f"{p.name} exited {rc} on its own:\n{p.tail(15)}")
                slot.proc, slot.expect, slot.joined_at = None, "", None
                slot.restart_at = now + self.cfg.restart_delay_s
            elif p is not None and slot.expect == "term" and now - slot.signalled_at > TERM_TIMEOUT_S:
                self.tally.fail(f"{p.name} still running {TERM_TIMEOUT_S:.0f}s after SIGTERM:\n{p.tail(15)}")
                p.kill()
            if slot.proc is None and restart and slot.restart_at is not None and now >= slot.restart_at:
                self._start_learner(slot)

    def _start_learner(self, slot: LearnerSlot) -> None:
        if slot.incarnation:
            self.restarts += 1
        argv = learner_argv(self.cfg.run, slot.name, self.task_path, steps=1_000_000, slowdown=self.cfg.slowdown,
                            data_seed=1000 * slot.index + slot.incarnation)
        log_path = self.cfg.out / "logs" / f"{slot.name}.{slot.incarnation}.log"
        slot.proc, slot.restart_at = Proc(slot.name, argv, log_path, self.env).start(), None
        slot.incarnation += 1

    def all_joined(self) -> bool:
        return all(s.joined() for s in self.slots)

    def learner_fault(self, fault: Fault) -> bool:
        """SIGKILL or SIGTERM the target learner, or another one; False if none qualifies now. Only
        a learner that has trained for a while (so that each incarnation contributes) is hit, and
        never the last one training."""
        training = [s for s in self.slots if s.training_for_s() > 0]
        for slot in sorted(training, key=lambda s: s.name != fault.target):
            if len(training) < 2 or slot.training_for_s() < MIN_TRAINING_S:
                continue
            self._signal(slot, "term" if fault.kind == "learner_term" else "kill")
            return True
        return False

    def _signal(self, slot: LearnerSlot, how: str) -> None:
        assert slot.proc is not None
        slot.expect, slot.signalled_at = how, time.monotonic()
        if how == "kill":
            slot.proc.kill()
        else:
            slot.proc.send(signal.SIGTERM)

    def stop_learners(self) -> None:
        """SIGTERM every learner that trains (it must exit 0); SIGKILL any still starting, whose
        SIGTERM handler may not be set yet."""
        for slot in self.slots:
            if slot.proc is not None and slot.proc.alive() and not slot.expect:
                self._signal(slot, "term" if slot.joined() else "kill")

    def learners_gone(self) -> bool:
        return all(s.proc is None for s in self.slots)

    # ---- coordinators --------------------------------------------------------------------------
    def _reap_coordinators(self) -> None:
        for c in list(self.coordinators):
            rc = c.proc.returncode()
            if rc is None:
                continue
            self.coordinators.remove(c)
            tail = c.proc.tail(30)
            if c.point is not None and rc == -signal.SIGKILL and f"crash point {c.point} reached" in tail:
                self.tally.count(f"coordinator_kill:{c.point}")
                if c.fault in self.coordinator_faults:
                    self.coordinator_faults.remove(c.fault)
                log.info("chaos: %s died at crash point %s", c.proc.name, c.point)
            elif c.stopping and rc in (0, -signal.SIGKILL, -signal.SIGTERM):
                pass
            elif rc == 1 and ("another coordinator" in tail or "FENCED" in tail):
                self.deposed += 1  # it lost the lease (e.g. across a Redis restart) and stopped: by design
                log.info("chaos: %s was deposed and stopped", c.proc.name)
            else:
                self.tally.fail(f"{c.proc.name} exited {rc}:\n{c.proc.tail(15)}")

    def _keep_coordinators(self, elapsed: float, arming: bool, may_kill: bool) -> None:
        try:
            holder = self.holder()
        except redis.RedisError:
            return  # Redis is restarting: decide on the next tick
        live = [c for c in self.coordinators if c.proc.alive() and not c.stopping]
        faults = self.coordinator_faults if arming else []
        assigned = [c.fault for c in live if c.fault is not None]
        for fault in faults:
            if fault.at_s <= elapsed + ARM_LEAD_S and not any(f is fault for f in assigned):
                live.append(self._spawn_coordinator(fault))
        standbys = [c for c in live if c is not holder]
        plain = [c for c in standbys if c.fault is None]
        if len(plain) < len(standbys):
            for c in plain:  # it would race the armed ones for the lease
                c.stopping = True
                c.proc.send(signal.SIGTERM)
        elif not standbys:
            self._spawn_coordinator(None)
        due = faults[0] if faults and faults[0].at_s <= elapsed else None
        if due is None or holder is None or holder.fault is not None or not may_kill:
            return  # nothing due, or the previous coordinator fault is still playing out
        ready = [c for c in standbys if c.fault is not None and c.standing_by()]
        if ready:
            log.info("chaos: t=%.1fs SIGKILL %s; standing by, armed: %s", elapsed, holder.proc.name,
                     ", ".join(c.proc.name for c in ready))
            holder.stopping = True
            holder.proc.kill()

    def _spawn_coordinator(self, fault: Fault | None) -> CoordinatorProc:
        point = None if fault is None else fault.target
        name = f"coordinator-{self.spawned}" + (f"-dies-at-{point}" if point else "")
        self.spawned += 1
        argv = diloco_command("coordinator", "--run", self.cfg.run, "--fragments", "2", "--sync-every", "10",
                              "--overlap-steps", "5", "--codec", "int8", "--lease-s", str(self.cfg.lease_s),
                              "--standby")
        env = self.env | ({CRASH_ENV: f"{point}:1"} if point else {})
        proc = Proc(name, argv, self.cfg.out / "logs" / f"{name}.log", env).start()
        log.info("chaos: started %s", name)
        self.coordinators.append(CoordinatorProc(proc, fault))
        return self.coordinators[-1]

    def holder(self) -> CoordinatorProc | None:
        """Our live coordinator process that holds the lease, if any. Raises redis errors. The
        holder's name (coordinator.leadership.holder_name) is host-pid-suffix."""
        raw = self.quick.get(self.lease_key)
        if raw is None:
            return None
        parts = raw.decode().rsplit("-", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
        return next((c for c in self.coordinators if c.proc.pid == pid and c.proc.alive()), None)

    def coordinator_settled(self) -> bool:
        """A plain coordinator holds the run: no coordinator fault is playing out."""
        try:
            holder = self.holder()
        except redis.RedisError:
            return False
        return holder is not None and holder.fault is None

    def stop_coordinators(self) -> None:
        """SIGTERM the standbys, then the active one, which must exit 0."""
        holder = self.holder()
        for c in sorted(self.coordinators, key=lambda c: c is holder):
            c.stopping = True
            rc = c.proc.terminate(timeout_s=30.0)
            if c is holder and rc != 0:
                self.tally.fail(f"{c.proc.name} (active) exited {rc} on SIGTERM:\n{c.proc.tail(15)}")
        self._reap_coordinators()

    def kill_all(self) -> None:
        """Whatever happened: nothing of ours keeps running."""
        for c in self.coordinators:
            c.stopping = True
            c.proc.kill()
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.kill()
