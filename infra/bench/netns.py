"""Network namespaces joined to a hub by tbf-shaped veth pairs: the links of `diloco bench wan`.

A hub namespace (`dlw-hub-<pid>`) and one namespace per learner (`dlw-<pid>-<i>`), joined by a veth
pair whose ends are both inside those namespaces (10.251.<i>.1/30 on the hub's side, .2 on the
learner's), each end shaped by `tc tbf` (the learner's end: its upload; the hub's: its download). The
hub forwards between learners. Nothing leaves these namespaces but their loopbacks. Every process in
them is stopped by its pid and every namespace deleted on the way out (Ctrl-C and SIGTERM included);
namespaces carry the pid of the process that made them, and those of a process that no longer runs
are removed at the next start.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco.infra.local.fleet import pid_alive
from diloco.infra.local.stack import LocalStack

log = logging.getLogger(__name__)

SUBNET = 251
"""Link i is 10.251.i.0/30: .1 the hub's end, .2 the learner's."""
IP_TIMEOUT_S = 30.0
STOP_WAIT_S = 5.0
_CLONE_NEWNET = 0x40000000
_OURS = re.compile(r"^dlw-(?:hub-(\d+)|(\d+)-\d+|probe-(\d+))$")


class NetError(RuntimeError):
    """An `ip` or `tc` command failed; the message carries its command line and stderr."""


def sh(*argv: str, timeout_s: float = IP_TIMEOUT_S) -> str:
    """Run `argv` (an `ip` or `tc` command), bounded in time; its stdout, or NetError."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetError(f"{' '.join(argv)}: {exc}") from None
    if done.returncode != 0:
        raise NetError(f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def netns_exec(ns: str) -> list[str]:
    """The prefix that runs a command inside namespace `ns`."""
    return ["ip", "netns", "exec", ns]


def tbf_args(rate_mbit: float, latency_ms: float) -> list[str]:
    """`tbf` parameters for a link of `rate_mbit`: a bucket of 10 ms of the rate but at least 4 KiB (two
    full frames; larger GSO packets are split by tbf), and a queue of `latency_ms` at the rate."""
    rate_bit = max(8_000, int(rate_mbit * 1e6))
    burst = max(4096, rate_bit // 8 // 100)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", f"{latency_ms:g}ms"]


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """This thread (and every thread and process it starts meanwhile) in network namespace `ns`."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def namespace_pids(ns: str) -> list[int]:
    """The processes in namespace `ns` (not this one)."""
    try:
        out = sh("ip", "netns", "pids", ns)
    except NetError:
        return []
    return [pid for pid in map(int, out.split()) if pid != os.getpid()]


def remove_namespace(ns: str) -> None:
    """Stop every process in `ns` by its pid (SIGTERM, then SIGKILL after STOP_WAIT_S), then delete it."""
    pids = namespace_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_WAIT_S
        while (pids := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pids:
            break
    if pids:
        log.warning("wan: processes %s in %s survived SIGKILL", pids, ns)
    try:
        sh("ip", "netns", "del", ns)
    except NetError as exc:
        log.warning("wan: %s", exc)


def remove_leftovers() -> list[str]:
    """Delete the namespaces an earlier run of this benchmark left behind: those named for a pid
    that no longer runs. Returns their names."""
    try:
        names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    except NetError:
        return []
    gone = []
    for name in names:
        m = _OURS.match(name)
        if m and not pid_alive(int(next(g for g in m.groups() if g))):
            log.warning("wan: removing %s, left behind by a run that no longer runs", name)
            remove_namespace(name)
            gone.append(name)
    return gone


@dataclass(frozen=True, slots=True)
class Feasibility:
    reason: str | None
    """Why the benchmark cannot run here (None: it can)."""
    netem: bool
    """Whether `tc ... netem` exists (informational: the links have no added delay either way)."""


def feasibility() -> Feasibility:
    """Can this process make namespaces, veth pairs and tbf qdiscs, and enter a namespace? Tried in a
    throw-away namespace `dlw-probe-<pid>`."""
    if not sys.platform.startswith("linux"):
        return Feasibility("needs Linux network namespaces", False)
    if os.geteuid() != 0:
        return Feasibility("needs root to make network namespaces and tc qdiscs (run it as root)", False)
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return Feasibility(f"`{tool}` not found: install iproute2", False)
    probe, netem = f"dlw-probe-{os.getpid()}", False
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "-n", probe, "link", "add", "dlwpa", "type", "veth", "peer", "name", "dlwpb")
        sh(*netns_exec(probe), "tc", "qdisc", "add", "dev", "dlwpa", "root", *tbf_args(10, 50))
        try:
            sh(*netns_exec(probe), "tc", "qdisc", "add", "dev", "dlwpb", "root", "netem", "delay", "1ms")
            netem = True
        except NetError:
            pass
        with entered(probe):
            pass
    except (NetError, OSError) as exc:
        return Feasibility(f"cannot make a namespace with a tbf-shaped veth pair: {exc}", False)
    finally:
        if Path(f"/run/netns/{probe}").exists():
            remove_namespace(probe)
    return Feasibility(None, netem)


@dataclass(frozen=True, slots=True)
class Link:
    index: int
    ns: str
    """The learner's namespace."""
    dev: str
    """Its end of the veth pair (in `ns`): its egress is the learner's upload."""
    hub_dev: str
    """The hub's end: its egress is the learner's download."""
    ip: str
    hub_ip: str


@dataclass(frozen=True, slots=True)
class Rates:
    up_mbit: float
    down_mbit: float


class WanNet:
    """The hub and `learners` learner namespaces, each joined to the hub by a veth pair; see the module
    docstring. `with WanNet(4) as net:` makes them and removes them (and every process in them)."""

    def __init__(self, learners: int, *, latency_ms: float = 100.0, congestion_control: str | None = None) -> None:
        if not 1 <= learners <= 250:
            raise ValueError("1 to 250 learners")
        pid = os.getpid()
        self.hub = f"dlw-hub-{pid}"
        self.latency_ms = latency_ms
        self.congestion_control = congestion_control
        """TCP congestion control in every namespace (`net.ipv4.tcp_congestion_control`); None: the
        host's (each new namespace takes it)."""
        self.links = [Link(i, f"dlw-{pid}-{i}", f"dwl{pid}n{i}", f"dwh{pid}n{i}", f"10.{SUBNET}.{i}.2",
                           f"10.{SUBNET}.{i}.1") for i in range(learners)]
        self.created: list[str] = []
        self.rates: dict[int, Rates] = {}

    def __enter__(self) -> WanNet:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def _add(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.created.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.congestion_control:
            sh(*netns_exec(ns), "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.congestion_control}")

    def up(self) -> None:
        self._add(self.hub)
        sh(*netns_exec(self.hub), "sysctl", "-qw", "net.ipv4.ip_forward=1")  # learners reach each other (gloo)
        for link in self.links:
            self._add(link.ns)
            sh("ip", "-n", self.hub, "link", "add", link.hub_dev, "type", "veth", "peer", "name", link.dev,
               "netns", link.ns)
            sh("ip", "-n", self.hub, "addr", "add", f"{link.hub_ip}/30", "dev", link.hub_dev)
            sh("ip", "-n", link.ns, "addr", "add", f"{link.ip}/30", "dev", link.dev)
            sh("ip", "-n", self.hub, "link", "set", link.hub_dev, "up")
            sh("ip", "-n", link.ns, "link", "set", link.dev, "up")
            sh("ip", "-n", link.ns, "route", "add", "default", "via", link.hub_ip)

    def down(self) -> None:
        """Every process in our namespaces stopped by pid, every namespace deleted (learners first)."""
        for ns in reversed(self.created):
            remove_namespace(ns)
        self.created.clear()

    def shape(self, i: int, rates: Rates) -> None:
        link = self.links[i]
        sh(*netns_exec(link.ns), "tc", "qdisc", "replace", "dev", link.dev, "root",
           *tbf_args(rates.up_mbit, self.latency_ms))
        sh(*netns_exec(self.hub), "tc", "qdisc", "replace", "dev", link.hub_dev, "root",
           *tbf_args(rates.down_mbit, self.latency_ms))
        self.rates[i] = rates

    def counters(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) so far on each learner's end of its link."""
        out = []
        for link in self.links:
            stats = json.loads(sh("ip", "-n", link.ns, "-s", "-j", "link", "show", "dev", link.dev))[0]["stats64"]
            out.append((int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])))
        return out

    def drops(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """((packets dropped, packets sent) up, the same down) so far by each learner's link's tbf: on a
        short queue a burst beyond it is dropped, and TCP sends it again."""
        def counts(ns: str, dev: str) -> tuple[int, int]:
            qdiscs = json.loads(sh(*netns_exec(ns), "tc", "-s", "-j", "qdisc", "show", "dev", dev) or "[]")
            tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), {})
            return int(tbf.get("drops", 0)), int(tbf.get("packets", 0))
        return [(counts(link.ns, link.dev), counts(self.hub, link.hub_dev)) for link in self.links]

    def endpoints_env(self, i: int, stack: LocalStack) -> dict[str, str]:
        """The stack's settings as learner i reaches them: at the hub's end of its link."""
        hub = self.links[i].hub_ip
        endpoints = dataclasses.replace(stack.endpoints, redis_url=f"redis://{hub}:{stack.redis_port}/0",
                                        s3_endpoint=f"http://{hub}:{stack.s3_ports['s3']}")
        return stack.env() | endpoints.to_env()


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, so that every `finally` below runs on it too."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


