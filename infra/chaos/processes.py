"""The processes of a chaos run: coordinators armed with crash points, learners restarted after faults.

`ChaosSupervisor.supervise()` is called every tick by the runner (infra/chaos/suite.py). On a `Supervisor`
(infra.local.fleet), it
- judges every process that exited by what it was sent: a SIGTERMed learner must exit 143 (or 0 if it had finished), a
  coordinator armed with a crash point must die there, anything unasked for is a failure;
- restarts learners (same id, next data seed) `restart_delay_s` after they exited;
- keeps, for each coordinator shard (`--shards`), one coordinator holding it and standbys waiting (every
  coordinator is started with `--standby`, so the first one simply takes the free lease). Coordinator
  faults go to the shards in turn. A coordinator fault that is near gets
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
from diloco.infra.local.fleet import Exit, Supervisor, Member, Proc, diloco_command, learner_argv
from diloco.storage.bus import Bus
from diloco.storage.crashpoints import ENV as CRASH_ENV
from diloco.storage.keys import Shard

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
    member: Member
    proc: Proc
    fault: Fault | None
    """The coordinator fault it is armed for: it SIGKILLs itself at that commit step (DILOCO_CRASH_AT)."""
    shard: int = 0
    ready: bool = False

    @property
    def name(self) -> str:
        return self.member.name

    @property
    def point(self) -> str | None:
        return None if self.fault is None else self.fault.target

    @property
    def stopping(self) -> bool:
        """We sent it SIGKILL or SIGTERM."""
        return self.member.sent is not None

    def standing_by(self) -> bool:
        """Started and waiting for the lease (its imports done, so it takes over without delay)."""
        self.ready = self.ready or "standing by" in self.proc.tail(50)
        return self.ready


@dataclass
class LearnerSlot:
    member: Member
    joined_at: float | None = None
    """When its current process was first seen to have joined the run (its log says so)."""

    @property
    def name(self) -> str:
        return self.member.name

    def joined(self) -> bool:
        proc = self.member.proc
        if self.joined_at is None and proc is not None and "joined run" in proc.tail(200):
            self.joined_at = time.monotonic()
        return self.joined_at is not None

    def training_for_s(self) -> float:
        """Seconds since it joined and started training; 0 if it is not training (or we signalled it)."""
        proc = self.member.proc
        if proc is None or self.member.sent is not None or not proc.alive() or not self.joined():
            return 0.0
        return time.monotonic() - (self.joined_at or 0.0)


class ChaosSupervisor:
    def __init__(self, cfg: ChaosConfig, env: dict[str, str], quick: Bus, task_path: Path, tally: Tally) -> None:
        self.cfg, self.quick, self.task_path = cfg, quick, task_path
        """`quick`: a Bus that answers within seconds or raises (`Bus(..., quick=True)`)."""
        self.shards = Shard(0, cfg.shards).layout()
        self.tally = tally
        self.fleet = Supervisor(env, cfg.out / "logs", term_timeout_s=TERM_TIMEOUT_S)
        self.coordinators: list[CoordinatorProc] = []
        # Learners train until stopped (any exit of their own is a failure) and come back, same id, next
        # data seed, restart_delay_s after any exit; each incarnation logs to a file of its own.
        self.slots = [LearnerSlot(self.fleet.add(
            f"l{i}", lambda incarnation, i=i: self._learner_argv(i, incarnation), log=lambda n, i=i: f"l{i}.{n}.log",
            service=True, restart_after_s=cfg.restart_delay_s, start=False)) for i in range(cfg.learners)]
        self.coordinator_faults: list[Fault] = []
        """Coordinator faults that have not fired yet, by time."""
        self.fault_shard: dict[int, int] = {}
        """The shard each coordinator fault kills (by the fault's id): the shards in turn."""
        self.spawned = self.deposed = 0

    @property
    def restarts(self) -> int:
        return self.fleet.restarts

    def supervise(self, elapsed: float, *, arming: bool, restart: bool, may_kill: bool) -> None:
        """`arming`: carry out coordinator faults; `restart`: restart learners that exited;
        `may_kill`: a due coordinator fault may SIGKILL the holder now (no server is restarting)."""
        self._judge(self.fleet.watch(restart=restart))
        self._keep_coordinators(elapsed, arming, may_kill)

    def _judge(self, exits: list[Exit]) -> None:
        learners = {s.name: s for s in self.slots}
        for done in exits:
            if done.name in learners:
                learners[done.name].joined_at = None
                if done.problem:  # judged by the fleet: by what it was sent, and a learner trains until stopped
                    self.tally.fail(done.problem)
            else:
                self._coordinator_exited(done)

    # ---- learners ------------------------------------------------------------------------------
    def _learner_argv(self, index: int, incarnation: int) -> list[str]:
        return learner_argv(self.cfg.run, f"l{index}", self.task_path, steps=1_000_000, slowdown=self.cfg.slowdown,
                            data_seed=1000 * index + incarnation)

    def start_learners(self) -> None:
        for slot in self.slots:
            self.fleet.start(slot.name)

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
            if fault.kind == "learner_term":
                self.fleet.term(slot.name)
            else:
                self.fleet.kill(slot.name)
            return True
        return False

    def stop_learners(self) -> None:
        """SIGTERM every learner that trains (it must exit 143, or 0); SIGKILL any still starting, whose
        SIGTERM handler may not be set yet."""
        for slot in self.slots:
            if self.fleet.alive(slot.name) and slot.member.sent is None:
                if slot.joined():
                    self.fleet.term(slot.name)
                else:
                    self.fleet.kill(slot.name)

    def learners_gone(self) -> bool:
        return all(s.member.proc is None for s in self.slots)

    # ---- coordinators --------------------------------------------------------------------------
    def _coordinator_exited(self, done: Exit) -> None:
        c = next(c for c in self.coordinators if c.name == done.name)
        self.coordinators.remove(c)
        rc, tail = done.returncode, c.proc.tail(30)
        if c.point is not None and rc == -signal.SIGKILL and f"crash point {c.point} reached" in tail:
            self.tally.count(f"coordinator_kill:{c.point}")
            if c.fault in self.coordinator_faults:
                self.coordinator_faults.remove(c.fault)
            log.info("chaos: %s died at crash point %s", c.name, c.point)
        elif done.sent is not None and rc in (0, 128 + signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM):
            pass
        elif rc == 1 and ("another coordinator" in tail or "FENCED" in tail):
            self.deposed += 1  # it lost the lease (e.g. across a Redis restart) and stopped: by design
            log.info("chaos: %s was deposed and stopped", c.name)
        else:
            self.tally.fail(f"{c.name} exited {rc}:\n{done.tail}")

    def shard_of(self, fault: Fault) -> int:
        return self.fault_shard.setdefault(id(fault), len(self.fault_shard) % len(self.shards))

    def _keep_coordinators(self, elapsed: float, arming: bool, may_kill: bool) -> None:
        try:
            holders = [self.holder(k) for k in range(len(self.shards))]
        except redis.RedisError:
            return  # Redis is restarting: decide on the next tick
        for k, holder in enumerate(holders):
            self._keep_shard(k, holder, elapsed, arming, may_kill)

    def _keep_shard(self, shard: int, holder: CoordinatorProc | None, elapsed: float, arming: bool,
                    may_kill: bool) -> None:
        live = [c for c in self.coordinators if c.proc.alive() and not c.stopping and c.shard == shard]
        faults = [f for f in self.coordinator_faults if self.shard_of(f) == shard] if arming else []
        assigned = [c.fault for c in live if c.fault is not None]
        for fault in faults:
            if fault.at_s <= elapsed + ARM_LEAD_S and not any(f is fault for f in assigned):
                live.append(self._spawn_coordinator(fault, shard))
        standbys = [c for c in live if c is not holder]
        plain = [c for c in standbys if c.fault is None]
        if len(plain) < len(standbys):
            for c in plain:  # it would race the armed ones for the lease
                self.fleet.term(c.name)
        elif not standbys:
            self._spawn_coordinator(None, shard)
        due = faults[0] if faults and faults[0].at_s <= elapsed else None
        if due is None or holder is None or holder.fault is not None or not may_kill:
            return  # nothing due, or the previous coordinator fault is still playing out
        ready = [c for c in standbys if c.fault is not None and c.standing_by()]
        if ready:
            log.info("chaos: t=%.1fs SIGKILL %s; standing by, armed: %s", elapsed, holder.name,
                     ", ".join(c.name for c in ready))
            self.fleet.kill(holder.name)

    def _spawn_coordinator(self, fault: Fault | None, shard: int) -> CoordinatorProc:
        point = None if fault is None else fault.target
        name = (f"coordinator-{self.spawned}" + (f"-shard{shard}" if len(self.shards) > 1 else "")
                + (f"-dies-at-{point}" if point else ""))
        self.spawned += 1
        argv = diloco_command("coordinator", "--run", self.cfg.run, "--fragments", "2", "--sync-every", "10",
                              "--overlap-steps", "5", "--codec", "int8", "--lease-s", str(self.cfg.lease_s),
                              "--standby", "--shards", str(len(self.shards)), "--shard", str(shard))
        env = self.fleet.env | ({CRASH_ENV: f"{point}:1"} if point else {})
        member = self.fleet.add(name, argv, env=env, service=True)
        log.info("chaos: started %s", name)
        assert member.proc is not None
        self.coordinators.append(CoordinatorProc(member, member.proc, fault, shard))
        return self.coordinators[-1]

    def holder(self, shard: int) -> CoordinatorProc | None:
        """Our live coordinator process that holds `shard`'s lease, if any. Raises redis errors. The
        holder's name (coordinator.leadership.holder_name) is host-pid-suffix."""
        _epoch, name, _expires_in_s = self.quick.leadership(self.shards[shard])
        if name is None:
            return None
        parts = name.rsplit("-", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
        return next((c for c in self.coordinators if c.proc.pid == pid and c.proc.alive()), None)

    def coordinator_settled(self) -> bool:
        """A plain coordinator holds every shard: no coordinator fault is playing out."""
        try:
            holders = [self.holder(k) for k in range(len(self.shards))]
        except redis.RedisError:
            return False
        return all(h is not None and h.fault is None for h in holders)

    def stop_coordinators(self) -> None:
        """SIGTERM the standbys, then the active ones, which must exit 143 (stopped while the run goes on) or 0
        (the run had ended)."""
        holders = [h for k in range(len(self.shards)) if (h := self.holder(k)) is not None]
        codes = self.fleet.stop([c.name for c in sorted(self.coordinators, key=lambda c: c in holders)],
                                timeout_s=30.0)
        for holder in holders:
            if codes[holder.name] not in (0, 128 + signal.SIGTERM):
                self.tally.fail(f"{holder.name} (active) exited {codes[holder.name]} on SIGTERM:\n"
                                f"{holder.proc.tail(15)}")
        self._judge(self.fleet.watch(restart=False))

    def kill_all(self) -> None:
        """Whatever happened: nothing of ours keeps running."""
        self.fleet.kill_all()
