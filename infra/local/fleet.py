"""The one process supervisor: `diloco` processes and the local servers as real OS processes.

`Proc` is one process in its own process group (session), its output appended to a log file.
It is signalled, stopped (SIGTERM, a deadline, then SIGKILL) and killed (SIGKILL) as a group, so
nothing it started outlives it. The local stack's servers are Procs (`infra.local.stack`), and so
are the coordinators, learners and replicas below.

`Supervisor` is the named processes of one run, as the demo, the benchmarks and the chaos run start
them. A member is started, then watched every tick: `watch()` reaps the processes that exited and
judges each exit by what we sent it (SIGKILL: expected; SIGTERM: must exit 0, or 143 for a learner that left on it; nothing: a service
such as the coordinator must not fail (it exits 0 once its run is finished), a learner with a number of steps must exit 0), and
starts the incarnations that are due. `kill(name, back_in_s=...)` is an outage: SIGKILL now, the
next incarnation that much later (`term(name, back_in_s=...)`: a preemption, SIGTERM instead);
`schedule(name, outages)` plans outages ahead (`Outage`: SIGKILL unless it says SIGTERM), carried out by
`watch()` at their time (as torchft's EventInjector plans failures for a step). `stop()` ends them all; `wait_until` polls a condition of the run
(nothing pending, the run's end) with a deadline.

`learner_argv` is the one command line of a learner that the demo, the benchmarks, the chaos run
and the tests start, so all of them exercise the command a user runs.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

KILL_WAIT_S = 10.0
"""How long a SIGKILLed group may take to be gone before that is an error."""


class Outage(NamedTuple):
    """A planned outage of a fleet member (`Supervisor.schedule`); a plain (at_s, down_s) is one with SIGKILL."""

    at_s: float
    """Seconds after the fleet started."""
    down_s: float | None
    """The next incarnation starts this long after the signal (None: never)."""
    sig: signal.Signals = signal.SIGKILL
    """SIGKILL (a machine that vanished) or SIGTERM (a preemption notice: a learner sends its progress,
    saves its state and exits 143)."""


class ProcessError(RuntimeError):
    """A process did not do what the supervisor needs: it survived SIGKILL, or exited when it should not
    have (the message carries the tail of its log)."""


def diloco_command(*args: str) -> list[str]:
    """`diloco ARGS` with this interpreter (`python -m diloco.infra.cli`): no PATH lookup."""
    return [sys.executable, "-m", "diloco.infra.cli", *args]


def learner_argv(run: str, name: str, task: Path, *, steps: int, data_seed: int, slowdown: float = 1.0,
                 until: float | None = None, step_time_s: float | None = None,
                 extra: Sequence[str] = ()) -> list[str]:
    """`diloco learner`: learner `name` of `run` trains the task in the JSON file `task` for `steps`
    inner steps on data seed `data_seed`, each step `slowdown` times slower. `until` (a Unix time)
    ends it earlier and `step_time_s` paces it (DemoLearnerArgs); `extra`: more learner options."""
    argv = ["learner", "--run", run, "--id", name, "--steps", str(steps), "--slowdown", str(slowdown),
            "--data-seed", str(data_seed), "--task", str(task)]
    if until is not None:
        argv += ["--until", f"{until:.2f}"]
    if step_time_s is not None:
        argv += ["--step-time-s", str(step_time_s)]
    return diloco_command(*argv, *extra)


def process_env(base: dict[str, str]) -> dict[str, str]:
    """The environment for child processes: ours plus the stack settings, one torch thread each."""
    env = dict(os.environ)
    env.update(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_until(condition: Callable[[], bool], timeout_s: float, *, tick_s: float = 0.2,
               between: Callable[[], object] | None = None) -> bool:
    """Poll `condition` every `tick_s` until it holds (True) or `timeout_s` passed (False); `between`
    runs before each new poll (a fleet's `watch`, so that exits are seen meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(tick_s)
        if between is not None:
            between()
    return True


# ---------------------------------------------------------------------------------------------
# One process.


def pid_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie, or a pid we cannot see, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we know
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pid_runs(pid: int, exe: str) -> bool:
    """True if `pid` is alive and still runs `exe` (guards an adopted pid against recycling)."""
    if not pid_alive(pid):
        return False
    if not Path("/proc/self/exe").exists():
        return True  # no /proc (macOS): trust the pid
    try:
        return os.path.realpath(f"/proc/{pid}/exe", strict=True) == os.path.realpath(exe)
    except OSError:
        return False  # it exited while we looked


@dataclass
class Proc:
    """A process in its own process group, its output appended to `log_path`. `popen` is None before
    `start()`, and for a process adopted by pid from a state file (`from_wire`: a detached stack's
    servers), which is then watched through /proc."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    """Its whole environment (None: ours)."""
    cwd: Path | None = None
    stop_timeout_s: float = 30.0
    """How long `terminate()` waits after SIGTERM before it sends SIGKILL."""
    pid: int = 0
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                          stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid
        log.debug("started %s pid %d: %s", self.name, self.pid, " ".join(self.argv))
        return self

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.pid > 0 and _pid_runs(self.pid, self.argv[0])

    def returncode(self) -> int | None:
        """The exit code (negative: the signal that ended it); None while it runs or if never started."""
        return None if self.popen is None else self.popen.poll()

    def send(self, sig: signal.Signals) -> bool:
        """Send `sig` to the process group without waiting; False if it had exited already."""
        if not self.alive():
            return False
        try:
            os.killpg(self.pid, sig)  # pgid == pid: started with start_new_session
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL to the whole group: no chance to clean up, like a machine that vanished."""
        if self.send(signal.SIGKILL) and not self._wait(KILL_WAIT_S):
            raise ProcessError(f"{self.name} (pid {self.pid}) survived SIGKILL")

    def terminate(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM to the group, then SIGKILL if it still runs after `timeout_s` (default
        `stop_timeout_s`). Returns the exit code (None for an adopted process)."""
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        if self.send(signal.SIGTERM) and not self._wait(timeout_s):
            log.debug("%s did not exit %.0fs after SIGTERM; sending SIGKILL", self.name, timeout_s)
            self.kill()
        return self.returncode()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for the exit; its code, or None if it still runs after `timeout_s`."""
        assert self.popen is not None
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _wait(self, timeout_s: float) -> bool:
        if self.popen is not None:
            return self.wait(timeout_s) is not None
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def tail(self, lines: int = 20, *, notable: re.Pattern[str] | None = None) -> str:
        """The last lines of the log; with `notable`, the last five earlier lines that match it
        first (a Go panic buries its cause under a stack trace)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        earlier = [line for line in text[:-lines] if notable.search(line)][-5:] if notable else []
        return "\n".join([*earlier, *(["..."] if earlier else []), *text[-lines:]])

    def to_wire(self) -> dict:
        return {"name": self.name, "pid": self.pid, "argv": self.argv, "log": str(self.log_path),
                "stop_timeout_s": self.stop_timeout_s}

    @classmethod
    def from_wire(cls, d: dict) -> Proc:
        return cls(name=d["name"], argv=d["argv"], log_path=Path(d["log"]), pid=d["pid"],
                   stop_timeout_s=d["stop_timeout_s"])


# ---------------------------------------------------------------------------------------------
# The processes of a run.


@dataclass(frozen=True, slots=True)
class Exit:
    """A member's process that exited, as `Supervisor.watch` saw it."""

    name: str
    returncode: int
    sent: signal.Signals | None
    """What we had sent it (SIGKILL or SIGTERM), if anything."""
    problem: str | None
    """Why this exit is a failure (with the tail of its log), None if it is not one."""
    tail: str


@dataclass
class Member:
    """A named process of a fleet, across its incarnations (every start after the first is a restart)."""

    name: str
    argv: Callable[[int], list[str]]
    """The command line of incarnation i (0 for the first start)."""
    log: Callable[[int], str]
    """The log file name of incarnation i, under the fleet's log directory."""
    env: dict[str, str]
    service: bool
    """It runs until it is stopped (a coordinator, a learner without a step budget): exiting on its own,
    even with 0, is a failure. Otherwise exiting 0 is finishing."""
    restart_after_s: float | None
    """Started again this long after any exit; None: only after an outage (`Supervisor.kill(back_in_s=)`)."""
    proc: Proc | None = None
    starts: int = 0
    sent: signal.Signals | None = None
    sent_at: float = 0.0
    back_at: float | None = None
    """When its next incarnation is due (None: not coming back)."""
    outages: list[Outage] = field(default_factory=list)
    """Planned outages not carried out yet, in time order (`at_s` since the fleet started)."""
    next_argv: list[str] | None = None
    """The next incarnation's command line, when it is not `argv`'s."""


class Supervisor:
    """The named processes of a run; see the module docstring. Leaving `with Supervisor(...)` SIGKILLs
    whatever still runs, so that an error leaves nothing behind."""

    def __init__(self, env: dict[str, str], logs: Path, *, term_timeout_s: float | None = None,
                 restarts_until_s: float | None = None) -> None:
        """`env`: the members' environment (`process_env`); `logs`: their log directory;
        `term_timeout_s`: a member still running this long after SIGTERM is SIGKILLed, a failure;
        `restarts_until_s`: no incarnation is started this long after the fleet started (a member
        due back later stays down)."""
        self.env, self.logs, self.term_timeout_s = env, logs, term_timeout_s
        self.restarts_until_s = restarts_until_s
        self.started = time.monotonic()
        self.members: dict[str, Member] = {}
        self.restarts = 0
        """Incarnations started after the first, over every member."""

    def add(self, name: str, argv: list[str] | Callable[[int], list[str]], *,
            log: str | Callable[[int], str] | None = None, env: dict[str, str] | None = None,
            service: bool = False, restart_after_s: float | None = None, start: bool = True) -> Member:
        """A member; started now unless `start` is False. `argv` and `log` may depend on the incarnation."""
        member = Member(name, argv if callable(argv) else (lambda _i, argv=argv: argv),
                        log if callable(log) else (lambda _i, log=log: log or f"{name}.log"),
                        self.env if env is None else env, service, restart_after_s)
        self.members[name] = member
        if start:
            self.start(name)
        return member

    def start(self, name: str) -> Proc:
        """Start the member's next incarnation now."""
        m = self.members[name]
        if m.starts:
            self.restarts += 1  # before `argv` runs: a benchmark's restarted learner is seeded by the count
        argv, m.next_argv = m.next_argv or m.argv(m.starts), None
        m.proc = Proc(name, argv, self.logs / m.log(m.starts), m.env).start()
        m.starts, m.sent, m.back_at = m.starts + 1, None, None
        return m.proc

    def proc(self, name: str) -> Proc | None:
        """The member's current process (None while it is down)."""
        return self.members[name].proc

    def alive(self, name: str) -> bool:
        proc = self.members[name].proc
        return proc is not None and proc.alive()

    def busy(self, names: Iterable[str] | None = None) -> bool:
        """True while any of `names` (default: every member) runs or is due back."""
        names = self.members if names is None else names
        return any(self.alive(n) or self.members[n].back_at is not None for n in names)

    def kill(self, name: str, *, back_in_s: float | None = None, argv: list[str] | None = None) -> None:
        """SIGKILL the member now (its exit is no failure) and, with `back_in_s`, start its next
        incarnation that much later (`argv`: with this command line instead of its usual one)."""
        m = self.members[name]
        if m.proc is not None:
            m.sent, m.sent_at = signal.SIGKILL, time.monotonic()
            m.proc.kill()
        if back_in_s is not None:
            m.back_at, m.next_argv = time.monotonic() + back_in_s, argv

    def schedule(self, name: str, outages: Iterable[Outage | tuple[float, float | None]]) -> None:
        """Plan outages of the member: its signal (SIGKILL unless the `Outage` says SIGTERM) at each
        `at_s` seconds after the fleet started, and start it again `down_s` after the signal (None:
        never; after SIGTERM, not before it has exited). An outage falls due only once the member is
        back from the one before; one due while the member has exited on its own is dropped."""
        self.members[name].outages.extend(sorted((Outage(*o) for o in outages), key=lambda o: o.at_s))

    def term(self, name: str, *, back_in_s: float | None = None) -> None:
        """SIGTERM the member without waiting (a preemption): it must exit 0 (143 for a learner that
        left on it). With `back_in_s`, its next incarnation starts that much later, once it has exited."""
        m = self.members[name]
        if m.proc is not None and m.proc.send(signal.SIGTERM):
            m.sent, m.sent_at = signal.SIGTERM, time.monotonic()
        if back_in_s is not None:
            m.back_at = time.monotonic() + back_in_s

    def watch(self, *, restart: bool = True) -> list[Exit]:
        """One tick: carry out the outages due, reap and judge every member's process that exited,
        SIGKILL one still running `term_timeout_s` after SIGTERM (a failure) and, with `restart`,
        start the incarnations due."""
        exits, now = [], time.monotonic()
        for m in self.members.values():
            if m.outages and m.back_at is None and now - self.started >= m.outages[0][0]:
                _, down_s, sig = m.outages.pop(0)
                if m.proc is not None and m.proc.alive():
                    log.info("outage: %s %s at %.1fs%s", sig.name, m.name, now - self.started,
                             "" if down_s is None else f", back in {down_s:.1f}s")
                    (self.kill if sig == signal.SIGKILL else self.term)(m.name, back_in_s=down_s)
            if m.proc is not None and m.proc.returncode() is None and self._overdue(m, now):
                m.proc.kill()
                exits.append(self._reap(m, now, f"{m.name} still running {self.term_timeout_s:.0f}s after SIGTERM"))
            elif m.proc is not None and (rc := m.proc.returncode()) is not None:
                exits.append(self._reap(m, now, _judge(m, rc)))
            if m.proc is None and m.back_at is not None and now >= m.back_at and restart:
                if self.restarts_until_s is not None and now - self.started > self.restarts_until_s:
                    m.back_at = None  # too late to come back
                else:
                    self.start(m.name)
        return exits

    def _overdue(self, m: Member, now: float) -> bool:
        return (m.sent == signal.SIGTERM and self.term_timeout_s is not None
                and now - m.sent_at > self.term_timeout_s)

    def _reap(self, m: Member, now: float, why: str | None) -> Exit:
        """The exit of `m`'s process (a failure if `why` says why), which is then forgotten; with
        `restart_after_s`, its next incarnation is due that much later."""
        assert m.proc is not None
        rc, tail = m.proc.returncode(), m.proc.tail(15)
        assert rc is not None
        done = Exit(m.name, rc, m.sent, None if why is None else f"{why}:\n{tail}", tail)
        m.proc, m.sent = None, None
        if m.restart_after_s is not None:
            m.back_at = now + m.restart_after_s
        return done

    def check(self) -> None:
        """`watch()`, raising ProcessError on the first exit that is a failure."""
        for done in self.watch():
            if done.problem:
                raise ProcessError(done.problem)

    def stop(self, names: Iterable[str] | None = None, timeout_s: float | None = None) -> dict[str, int | None]:
        """SIGTERM each of `names` (default: every member) in turn and wait for it, SIGKILL after
        `timeout_s` (default 30 s); no restarts. Returns the exit codes."""
        codes = {}
        for name in list(self.members if names is None else names):
            m = self.members[name]
            m.back_at = None
            if m.proc is not None:
                m.sent, m.sent_at = signal.SIGTERM, time.monotonic()
                codes[name] = m.proc.terminate(timeout_s)
        return codes

    def kill_all(self) -> None:
        """Whatever happened: nothing of ours keeps running."""
        for m in self.members.values():
            m.back_at = None
            if m.proc is not None:
                m.proc.kill()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_all()


def _judge(m: Member, rc: int) -> str | None:
    """Why `m`'s exit with `rc` is a failure, or None: judged by what we sent it."""
    if m.sent == signal.SIGKILL:
        return None
    if m.sent == signal.SIGTERM:  # a learner that left on it, or a service stopped before its run ended,
        # exits 143 (restart me), as does one the signal killed before Python could handle it (-15 here; 143 in a
        # container); a service whose run had ended exits 0
        return None if rc in (0, 143, -signal.SIGTERM) else f"{m.name} exited {rc} after SIGTERM, not 0 or 143"
    if m.service:  # exit 0 on its own: done (a coordinator whose run is finished)
        return None if rc == 0 else f"{m.name} exited {rc} on its own"
    return None if rc == 0 else f"{m.name} failed ({rc})"
