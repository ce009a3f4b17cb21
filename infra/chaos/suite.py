"""`diloco chaos`: a whole run of real processes on real servers while a seeded schedule breaks things.

The fleet: a `LocalStack` of its own (Redis + S3 under `<out>/stack`), one coordinator holding the
run plus one `--standby`, and a few learner processes training the demo task. For `seconds`, the
faults of `infra.chaos.faults.schedule(seed, seconds)` are carried out:

- `learner_kill` / `learner_term`: SIGKILL / SIGTERM a learner (a preempted learner must exit 143, `diloco learner`'s code for "left on SIGTERM");
  either way it is restarted under the same id, with a new data seed, `restart_delay_s` later.
- `coordinator_kill:<step>`: the standby is started with `DILOCO_CRASH_AT=<step>:1`; when the fault
  is due the active coordinator is SIGKILLed, the armed standby takes over once the lease lapses
  and SIGKILLs itself at that commit step of its first merge, and the next standby takes over.
- `redis_restart`: Redis SIGKILLed and restarted (its append-only file brings the data back).
- `redis_rollback`: Redis snapshotted, then a few seconds later (while the coordinator commits
  and learners announce) SIGKILLed and restarted on that snapshot: it forgets those seconds of
  writes, commits included. The coordinator must bring it back up to the manifests in S3 and
  announce again the contributions whose announcements it lost.
- `s3_restart`: the S3 server stopped for a few seconds, then started again.
- `corrupt_object:<variant>`: a corrupt object under a learner-looking key of a real fragment,
  announced with a valid-looking announcement; the coordinator must refuse it with a reason.
- `hostile:<variant>`: a learner with valid credentials sends hostile input through the real
  servers (`infra.chaos.hostile`): lying tokens, deadline or step time, oversize or undecodable
  objects, a flood of forged announcements, an object encrypted with a key of its own, made-up
  learner ids. Each input must be refused with the reason meant for it, or (the lies the
  coordinator bounds rather than refuses) applied once within its bound; after each hostile
  fault, every fragment's head must advance within ADVANCE_S.

The processes are supervised by `infra.chaos.processes`, which also arms the coordinators with
their crash points. Heavy faults (servers, coordinator) wait for the one before to play out and
for every head to advance after it (its recovery, which must come within ADVANCE_S); light ones
do not, but corrupt objects and hostile input wait while a server is down or rolled back. Then
the learners are stopped (SIGTERM), the coordinator drains what is pending and is stopped, and
`infra.chaos.ledger` accounts for every announced contribution from S3 and Redis; each hostile
input is judged by `infra.chaos.hostile.judge_hostile`. The global model is evaluated at version 0 and at
the heads. `ChaosReport.problems()` lists everything that went wrong; an empty list is a pass
(`unbounded()` names those of its problems that are lies the coordinator must bound and did not).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis

from diloco.infra.chaos.config import ChaosConfig
from diloco.infra.chaos.faults import BOUNDED, CORRUPTIONS, FAULT_KINDS, HEAVY, KINDS, Fault, forge, labels, schedule
from diloco.infra.chaos.hostile import HostileInput, HostileLearner, Verdict, judge_hostile
from diloco.infra.chaos.ledger import Ledger, StreamWatcher, account, gather
from diloco.infra.chaos.processes import ChaosSupervisor, Tally
from diloco.infra.history.task_model import global_model
from diloco.infra.local.fleet import process_env, wait_until
from diloco.infra.local.stack import LocalStack, aws_env
from diloco.storage.bus import Bus
from diloco.storage.errors import DilocoError
from diloco.storage.history import read_layout, read_run_spec
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement, Layout, RunSpec
from diloco.workers.tasks.demo import DemoTask

log = logging.getLogger(__name__)

TASK = DemoTask(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=32, batch_size=8, eval_tokens=4096,
                warmup_steps=10)
"""A small demo task: the fleet trains it within seconds, on a CPU shared with the servers."""
FORGER = "forger"
"""The learner id corrupt objects are announced under."""
READY_TIMEOUT_S = 180.0
TICK_S = 0.2
ROLLBACK_RECOVERY_S = 30.0
"""After a redis_rollback, Redis's heads must be back where they were (re-committed from S3) within this."""
ADVANCE_S = 10.0
"""After a hostile fault, and after each heavy fault has played out, every fragment's head must
advance within this many seconds of undisturbed running (no server down or rolled back, a plain
coordinator holding the run): at the chaos run's pace, rounds merge several times a second, so a
head that stands still this long is held."""


@dataclass(slots=True)
class Watch:
    """A fault whose aftermath is watched: every head must move past `heads`. A hostile fault's is
    watched from when it was carried out; a heavy fault's (`recovery`) from when it has played out,
    and the next heavy fault waits until it ends."""

    label: str
    heads: dict[int, int]
    """Redis's heads when the fault was carried out."""
    at: float
    """time.monotonic() then."""
    quiet_s: float = 0.0
    """Undisturbed seconds since (see ADVANCE_S)."""
    recovery: bool = False


class ChaosError(DilocoError):
    """The fleet could not be brought up; the message says what was missing."""


@dataclass
class ChaosReport:
    seed: int
    seconds: float
    faults: dict[str, int]
    ledger: Ledger
    loss_start: float
    loss_end: float
    forged: dict[str, str]
    """Contribution id -> corruption variant, for every corrupt object announced."""
    hostile: list[Verdict]
    """Every hostile input and what became of it."""
    failures: list[str]
    """Processes that exited when they should not have, faults that could not be carried out."""
    restarts: int = 0
    deposed: int = 0
    skipped: int = 0
    """Scheduled faults that could not be carried out in time (every label fired all the same, or
    `problems()` says which did not)."""
    wall_s: float = 0.0
    kinds: tuple[str, ...] = KINDS
    """The kinds of fault the run injected (`--kinds`): each of their labels must have fired."""
    recovered: dict[str, int] = field(default_factory=dict)
    """Heavy fault kind -> recoveries seen: the heads advanced after one had played out."""

    def figures(self) -> dict:
        """The figures written by `--json`."""
        return {"faults": {label: self.faults.get(label, 0) for label in labels(self.kinds)},
                "recovered": {k: self.recovered.get(k, 0) for k in self.kinds if k in HEAVY}, **self.ledger.figures(),
                "hostile": dict(sorted(Counter(v.kind for v in self.hostile).items()))}

    def to_wire(self) -> dict:
        """Everything, for `<out>/report.json`."""
        codes = Counter(self.ledger.refusal_codes.values())
        return {"seed": self.seed, "seconds": self.seconds, **self.figures(),
                "refused_by_code": dict(sorted(codes.items())), "forged": self.forged,
                "hostile_inputs": [{"variant": v.input.variant, "input": v.input.what,
                                    "contribution_id": v.input.contribution_id, "outcome": v.outcome,
                                    "problem": v.problem} for v in self.hostile],
                "loss_start": self.loss_start, "loss_end": self.loss_end, "learner_restarts": self.restarts,
                "coordinators_deposed": self.deposed, "faults_skipped": self.skipped, "wall_s": self.wall_s,
                "problems": self.problems()}

    def problems(self) -> list[str]:
        led = self.ledger
        out = list(self.failures)
        out += [f"fault {label} never fired" for label in labels(self.kinds) if not self.faults.get(label)]
        out += led.problems
        if led.lost:
            out.append(f"{len(led.lost)} announced contribution(s) lost: {sorted(led.lost)[:5]}")
        if led.duplicated:
            out.append(f"{len(led.duplicated)} contribution(s) applied twice: {sorted(led.duplicated)[:5]}")
        if led.unannounced:
            out.append(f"{len(led.unannounced)} applied contribution(s) never announced: {sorted(led.unannounced)[:5]}")
        parts = len(led.applied) + len(led.refused) + len(led.dropped) + len(led.pending) + len(led.lost)
        if parts != len(led.announced):
            out.append(f"outcomes add up to {parts}, not to the {len(led.announced)} announced")
        for cid, variant in sorted(self.forged.items()):
            code = led.refusal_codes.get(cid)
            # Dropped as stale counts too: its base fell max_staleness behind while it waited (an outage,
            # a takeover), and a stale piece is refused before its object is read.
            if cid not in led.dropped and (cid not in led.refused or code not in CORRUPTIONS[variant]):
                out.append(f"corrupt object ({variant}) {cid}: {code or 'not refused'}, expected one of "
                           f"{sorted(CORRUPTIONS[variant])}")
        out += _hostile_problems(v for v in self.hostile if v.problem)
        hostile = {v.input.contribution_id for v in self.hostile}
        honest = sorted((cid, led.refusal_codes[cid]) for cid in led.refused if cid not in set(self.forged) | hostile)
        out += [f"contribution {cid} of a learner refused: {code}" for cid, code in honest]
        if not (math.isfinite(self.loss_end) and self.loss_end < self.loss_start):
            out.append(f"global eval loss {self.loss_start:.4f} -> {self.loss_end:.4f}: must be finite and below the "
                       "start")
        return out

    def unbounded(self) -> list[str]:
        """The problems of `problems()` that are lies the coordinator must bound (faults.BOUNDED) and
        did not: a lying piece that weighed more than MAX_WEIGHT_RATIO x the median of the other learners' pieces."""
        return _hostile_problems(v for v in self.hostile if v.problem and v.unbounded and v.input.variant in BOUNDED)

    def line(self) -> str:
        f = self.figures()
        faults = " ".join(f"{k}={v}" for k, v in f["faults"].items())
        problems = self.problems()
        recovered = " ".join(f"{k}={v}" for k, v in f["recovered"].items()) or "none"
        return (f"chaos seed {self.seed}, {self.seconds:g}s: faults {faults}; recoveries seen {recovered}; "
                f"{f['versions_committed']} versions "
                f"committed; {f['announced']} contributions announced: {f['applied']} applied, {f['refused']} refused, "
                f"{f['dropped']} dropped as stale, {f['pending']} pending; lost {f['lost']}, duplicated "
                f"{f['duplicated']}; {len(self.hostile)} hostile inputs: "
                + (", ".join(f"{n} {kind}" for kind, n in f["hostile"].items()) or "none") +
                f"; eval loss {self.loss_start:.3f} -> {self.loss_end:.3f}; {self.restarts} learner "
                f"restarts, {self.deposed} coordinators deposed; {self.wall_s:.0f}s; "
                + ("OK" if not problems else f"FAILED ({len(problems)} problems)"))


def _hostile_problems(verdicts: Iterable[Verdict], most: int = 10) -> list[str]:
    """One line per hostile input with a problem, at most `most` per variant (a flood has hundreds)."""
    out, shown = [], Counter[str]()
    for v in verdicts:
        shown[v.input.variant] += 1
        if shown[v.input.variant] <= most:
            out.append(f"hostile {v.input.variant}: {v.input.what}: {v.problem}")
    out += [f"hostile {variant}: {n - most} more inputs with problems" for variant, n in shown.items() if n > most]
    return out


# ---- the run ------------------------------------------------------------------------------------

class Chaos:
    """Brings the fleet up, carries out a fault schedule, drains and stops it. One use."""

    def __init__(self, cfg: ChaosConfig, stack: LocalStack) -> None:
        self.cfg, self.stack = cfg, stack
        self.bus = Bus(stack.endpoints, cfg.run)
        self.store = ObjectStore(stack.endpoints)
        # For decisions taken every tick: answers fast or fails fast while Redis is down.
        self.quick = Bus(stack.endpoints, cfg.run, quick=True)
        self.tally = Tally()
        # Processes restarted during a server's outage wait it out (its restart included), however slow the machine.
        env = process_env(stack.env() | {"DILOCO_REACH_TIMEOUT_S": "120"})
        self.fleet = ChaosSupervisor(cfg, env, self.quick, cfg.out / "task.json", self.tally)
        self.forged: dict[str, str] = {}
        self.hostile = HostileLearner(self.bus, self.store, stack.endpoints, tokens_per_step=TASK.tokens_per_step())
        self.hostile_inputs: list[HostileInput] = []
        self.watches: list[Watch] = []
        """Faults whose aftermath is still watched: every head must advance past its value then."""
        self.disturbed = ""
        """The heavy fault playing out (a server's restart, a coordinator's kills), "" when none is."""
        self.recovered = Counter[str]()
        """Heavy fault kind -> how many times the heads advanced after one had played out."""
        self.skipped = 0
        self.server_fault: threading.Thread | None = None
        self.spec: RunSpec | None = None
        self.layout: Layout | None = None

    def run(self) -> Ledger:
        unknown = set(FAULT_KINDS) - set(self._handlers()) - {"coordinator_kill"}
        if unknown:
            raise ChaosError(f"fault kinds {sorted(unknown)} are scheduled but not carried out: add their handlers")
        faults = schedule(self.cfg.seed, self.cfg.seconds, self.cfg.fault_kinds(),
                          learners=tuple(s.name for s in self.fleet.slots))
        self.fleet.coordinator_faults = [f for f in faults if f.kind == "coordinator_kill"]
        log.info("chaos: %d faults scheduled over %gs (seed %d)", len(faults), self.cfg.seconds, self.cfg.seed)
        watcher = StreamWatcher(Bus(self.stack.endpoints, self.cfg.run, quick=True))
        try:
            self._bring_up()
            watcher.start()
            self._inject([f for f in faults if f.kind != "coordinator_kill"])
            self._drain()
        finally:
            self.hostile.stop()
            self.fleet.kill_all()
            seen = watcher.stop()
        assert self.spec is not None
        return account(gather(self.store, self.bus, self.spec.num_fragments, seen))

    def _bring_up(self) -> None:
        self.fleet.task_path.write_text(json.dumps(TASK.to_wire()))
        self.fleet.start_learners()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self.fleet.supervise(0.0, arming=False, restart=True, may_kill=False)
            heads = self._heads()
            self.spec = self.spec or read_run_spec(self.store, self.bus.keys)
            if self.spec and len(heads) == self.spec.num_fragments and min(heads.values()) >= 1 \
                    and self.fleet.all_joined():
                break
            if time.monotonic() > deadline:
                raise ChaosError(f"the fleet was not up after {READY_TIMEOUT_S:.0f}s: heads {heads}, learners "
                                 f"joined: {[s.name for s in self.fleet.slots if s.joined()]}; logs in "
                                 f"{self.cfg.out / 'logs'}")
            time.sleep(TICK_S)
        self.layout = read_layout(self.store, self.bus.keys)
        log.info("chaos: fleet up, heads %s", heads)

    def _inject(self, faults: list[Fault]) -> None:
        """Carry out the faults. A fault waits while it cannot be carried out (a heavy one while the
        previous one plays out, a learner fault while no learner qualifies); past `seconds`, the run
        goes on only while a fault of a label that has not fired yet is still waiting, a heavy one is
        playing out, or the heads have yet to advance after a hostile or a heavy fault."""
        todo = sorted(faults, key=lambda f: f.at_s)
        t0 = time.monotonic()
        overtime = self.cfg.seconds * 0.5 + 30.0
        elapsed = 0.0
        while True:
            now = time.monotonic() - t0
            tick_s, elapsed = now - elapsed, now
            self._watch_recovery()  # before any fault is due: one that has just played out holds the next
            self.fleet.supervise(elapsed, arming=True, restart=True,
                                 may_kill=not (self._server_busy() or self._recovering()))
            for fault in [f for f in todo if f.at_s <= elapsed]:
                if self._execute(fault):
                    todo.remove(fault)
                    log.info("chaos: t=%.1fs %s %s", elapsed, fault.label, fault.target if fault.kind not in
                             ("coordinator_kill", "corrupt_object", "hostile") else "")
            self._watch_heads(tick_s)
            waiting = todo + self.fleet.coordinator_faults
            unfired = [f for f in waiting if not self.tally.fired[f.label]]
            if elapsed >= self.cfg.seconds and (not (unfired or self.watches or self.disturbed)
                                                or elapsed > self.cfg.seconds + overtime):
                break
            time.sleep(TICK_S)
        self._watch_heads(0.0, final=True)
        self.skipped = len(waiting)
        if self.skipped:
            log.info("chaos: %d scheduled fault(s) did not run in time", self.skipped)

    def _drain(self) -> None:
        """Stop the learners (SIGTERM, exit 143 or 0 expected), let the coordinator merge or refuse what is
        pending, then stop it (SIGTERM)."""
        if self.server_fault is not None:
            self.server_fault.join()
        self.hostile.stop()
        self.fleet.stop_learners()
        # Each learner exits, or is SIGKILLed TERM_TIMEOUT_S after its SIGTERM.
        wait_until(self.fleet.learners_gone, math.inf, tick_s=TICK_S, between=self._supervise_draining)
        if not wait_until(lambda: self._backlog() == 0, self.cfg.drain_s, tick_s=TICK_S,
                          between=self._supervise_draining):
            self.tally.fail(f"{self._backlog()} announcement(s) still pending {self.cfg.drain_s:.0f}s after the "
                            "learners stopped")
        self.fleet.stop_coordinators()

    def _supervise_draining(self) -> None:
        self.fleet.supervise(math.inf, arming=False, restart=False, may_kill=False)

    # ---- faults --------------------------------------------------------------------------------
    def _handlers(self) -> dict[str, Callable[[Fault], bool]]:
        """How each kind of fault (`faults.FAULT_KINDS`) is carried out: True once done, False to try
        again on the next tick. The coordinator's kills are the supervisor's (`coordinator_faults`);
        a server's restart plays out in a thread of its own, the fleet supervised meanwhile."""
        return {
            "learner_kill": self.fleet.learner_fault,
            "learner_term": self.fleet.learner_fault,
            "corrupt_object": lambda f: not self._server_busy() and self._corrupt(f),
            "hostile": lambda f: not self._server_busy() and self._hostile(f),
            "redis_restart": self._in_thread(self._restart_redis),
            "redis_rollback": self._in_thread(lambda f: self._roll_redis_back(f.down_s)),
            "s3_restart": self._in_thread(self._restart_s3),
        }

    def _execute(self, fault: Fault) -> bool:
        """Carry out a due fault; False to try again on the next tick."""
        done = self._handlers()[fault.kind](fault)
        if done and fault.kind not in HEAVY:  # a server's restart counts once it has played out
            self.tally.count(fault.label)
        return done

    def _server_busy(self) -> bool:
        return self.server_fault is not None and self.server_fault.is_alive()

    def _in_thread(self, restart: Callable[[Fault], None]) -> Callable[[Fault], bool]:
        def start(fault: Fault) -> bool:
            if self._server_busy() or self._recovering() or not self.fleet.coordinator_settled():
                return False
            self.server_fault = threading.Thread(target=self._restart_server, args=(restart, fault), daemon=True,
                                                 name=fault.kind)
            self.disturbed = fault.kind  # now: a short restart may be over before the next tick looks
            self.server_fault.start()
            return True
        return start

    def _restart_server(self, restart: Callable[[Fault], None], fault: Fault) -> None:
        try:
            restart(fault)
            self.tally.count(fault.label)
        except Exception as exc:  # noqa: BLE001 (recorded: the run reports it and fails)
            self.tally.fail(f"{fault.label}: {exc!r}")

    def _restart_redis(self, fault: Fault) -> None:
        self.stack.kill_redis()
        time.sleep(fault.down_s)
        self.stack.start_redis()

    def _restart_s3(self, fault: Fault) -> None:
        self.stack.stop_s3()
        time.sleep(fault.down_s)
        self.stack.start_s3()

    def _roll_redis_back(self, forget_s: float) -> None:
        """Snapshot Redis, let the fleet work for `forget_s`, restore the snapshot; the fault has
        played out once Redis's heads are back where they were (the coordinator re-commits from S3
        what Redis forgot), or fails after ROLLBACK_RECOVERY_S."""
        snapshot = self.stack.data_dir / "redis-snapshot"
        shutil.rmtree(snapshot, ignore_errors=True)
        self.stack.snapshot_redis(snapshot)
        time.sleep(forget_s)  # the coordinator commits and learners announce: all of it forgotten
        before = self._heads()
        self.stack.restore_redis(snapshot)
        shutil.rmtree(snapshot)
        log.info("chaos: Redis restored to its snapshot of %.1fs ago; heads were %s, now %s", forget_s, before,
                 self._heads())

        def recovered() -> bool:
            heads = self._heads()
            return bool(heads) and all(heads.get(f, -1) >= v for f, v in before.items())

        if not wait_until(recovered, ROLLBACK_RECOVERY_S, tick_s=TICK_S):
            self.tally.fail(f"redis_rollback: Redis heads {self._heads()} not back to {before} "
                            f"{ROLLBACK_RECOVERY_S:.0f}s after the restore")

    def _corrupt(self, fault: Fault) -> bool:
        """Upload a corrupt object as a learner would and announce it; False if a server did not answer."""
        assert self.spec is not None and self.layout is not None
        fragment = len(self.forged) % self.spec.num_fragments
        try:
            base = self.bus.heads()[fragment]
            cid, seq = uuid.uuid4().hex, int(time.time() * 1000) * 1000
            meta = {"run": self.cfg.run, "fragment": fragment, "learner": FORGER, "kind": "delta",
                    "contribution_id": cid, "base_version": base}
            blob, size, sha = forge(fault.target, self.layout.shapes(fragment), codec=self.spec.codec,
                                    compress=self.spec.compress, meta=meta, seed=seq)
            key = self.bus.keys.delta(fragment, FORGER, seq)
            self.store.put(key, blob)
            self.bus.announce(Announcement(kind="delta", run=self.cfg.run, fragment=fragment, learner=FORGER, seq=seq,
                                           contribution_id=cid, base_version=base, tokens=1, steps=1, step_time_s=0.05,
                                           object_key=key, size_bytes=size, sha256=sha, sent_at=time.time()))
        except (DilocoError, redis.RedisError) as exc:
            log.warning("chaos: could not plant a corrupt object yet: %s", exc)
            return False
        self.forged[cid] = fault.target
        return True

    def _hostile(self, fault: Fault) -> bool:
        """Send one hostile variant's input, then watch the heads; False if a server did not answer."""
        assert self.spec is not None and self.layout is not None
        heads = self._heads()
        if len(heads) < self.spec.num_fragments:
            return False
        try:
            self.hostile.act(fault.target, self.spec, self.layout, heads, self.hostile_inputs)
        except (DilocoError, redis.RedisError) as exc:
            log.warning("chaos: the hostile learner could not act yet: %s", exc)
            return False
        self.watches.append(Watch(fault.label, heads, time.monotonic()))
        return True

    def _recovering(self) -> bool:
        """A heavy fault is playing out, or the heads have yet to advance after it."""
        return bool(self.disturbed) or any(w.recovery for w in self.watches)

    def _watch_recovery(self) -> None:
        """Once a heavy fault has played out (its server back, or a plain coordinator holding every
        shard again), watch the heads: the next heavy fault waits until they have all advanced, so
        that each fault's recovery is seen, and one that does not come is a failure (`_watch_heads`).
        Without the wait, a server restarted on a slow machine was often only just back when the
        next heavy fault came, and what followed one fault was never seen apart from the next."""
        fault = self.server_fault.name if self._server_busy() else ""  # set as it starts, too (`_in_thread`)
        if not fault and not self.fleet.coordinator_settled():
            fault = "coordinator_kill"
        if self.disturbed and not fault and (heads := self._heads()):
            self.watches.append(Watch(self.disturbed, heads, time.monotonic(), recovery=True))
            self.disturbed = ""
        elif fault:
            self.disturbed = self.disturbed or fault  # a coordinator deposed by a Redis restart is the restart's

    def _watch_heads(self, tick_s: float, *, final: bool = False) -> None:
        """A watch ends once every head has moved past its value when it began; it fails after
        ADVANCE_S undisturbed seconds (or at the end of the run: `final`)."""
        heads = self._heads()
        if not heads and not final:
            return  # Redis does not answer right now
        quiet = not self._server_busy() and self.fleet.coordinator_settled()
        for w in list(self.watches):
            w.quiet_s += tick_s if quiet else 0.0
            if all(heads.get(f, -1) > v for f, v in w.heads.items()):
                self.watches.remove(w)
                self.recovered[w.label] += w.recovery
                log.info("chaos: heads advanced %.1fs after %s%s: %s -> %s", time.monotonic() - w.at, w.label,
                         " had played out" if w.recovery else "", w.heads, heads)
            elif final or w.quiet_s > ADVANCE_S:
                self.watches.remove(w)
                self.tally.fail(f"{'recovery from ' * w.recovery}{w.label}: heads {w.heads} had not all advanced {time.monotonic() - w.at:.0f}s "
                                f"later ({w.quiet_s:.0f}s of them undisturbed): {heads}")

    def _backlog(self) -> int:
        """Announcements the coordinator has not dealt with yet; -1 while Redis does not answer."""
        try:
            return self.quick.backlog().waiting
        except redis.RedisError:
            return -1

    def _heads(self) -> dict[int, int]:
        try:
            return self.quick.heads()
        except redis.RedisError:
            return {}


def run_chaos(cfg: ChaosConfig) -> ChaosReport:
    """A whole chaos run on a fresh local stack under `cfg.out`; see the module docstring."""
    started = time.monotonic()
    for old in ("stack", "logs"):  # from scratch: no earlier run's data in the ledger, nor its logs
        if (cfg.out / old).exists():
            shutil.rmtree(cfg.out / old)
    cfg.out.mkdir(parents=True, exist_ok=True)
    with LocalStack(cfg.out / "stack") as stack, aws_env(stack.env()):
        chaos = Chaos(cfg, stack)
        ledger = chaos.run()
        store, keys = chaos.store, chaos.bus.keys
        heads = chaos.bus.heads()
        start = TASK.eval_loss(global_model(TASK, store, keys, {f: 0 for f in heads}))
        end = TASK.eval_loss(global_model(TASK, store, keys, heads))
    report = ChaosReport(seed=cfg.seed, seconds=cfg.seconds, faults=dict(chaos.tally.fired), ledger=ledger,
                         loss_start=start, loss_end=end, forged=dict(chaos.forged),
                         hostile=judge_hostile(chaos.hostile_inputs, ledger), failures=list(chaos.tally.failures),
                         restarts=chaos.fleet.restarts, deposed=chaos.fleet.deposed, skipped=chaos.skipped,
                         recovered=dict(chaos.recovered),
                         wall_s=time.monotonic() - started, kinds=cfg.fault_kinds())
    (cfg.out / "report.json").write_text(json.dumps(report.to_wire(), indent=2) + "\n")
    return report
