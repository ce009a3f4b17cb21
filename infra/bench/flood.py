"""`diloco bench flood`: what one learner's heartbeats cost the coordinator that reads them.

A learner with valid credentials may heartbeat as many learner ids as it likes, ask each to stay
live for 1e9 s, and write what it likes as its stats. The coordinator reads the fleet and the
learners' stats in its loop, so such a learner could slow every round and swell the coordinator's
memory (issue 28: 200k made-up ids took a loop step from 2.3 ms to 3.8 s; 60 stats records of
8 MB took it from 351 to 870 MB). On one local stack (a real redis-server and a real S3 server):

1. A coordinator (in this process, the run's defaults: clock cadence) and `learners` real
   `workers.learner.Learner`s, joined and heartbeating, nothing trained.
2. **base**: the loop stepped without blocking for `window_s`: mean step time, RSS.
3. **stats**: a hostile process heartbeats as learner `mallory`, then asks the heartbeat script
   `junk_stats` times to store `junk_mb` MB of stats (refused unwritten), and writes that many junk
   records of that size into the stats hash itself, each different, spread over the window.
4. **ids (flood)**: the hostile process heartbeats `made_up_ids` made-up ids, each joined with a ttl of
   1e9 s (the script keeps at most MAX_LIVE_LEARNERS live, for at most MAX_LEASE_S); the loop
   steps meanwhile (Redis is busy with the flood too).
5. **ids (after)**: the flood over, its ids still live: another window.

The figures are each window's mean step time and the process's RSS against the base window's.
The target (issue 28): within 10% after the flood and the junk. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.service import Coordinator
from diloco.infra.bench.backlog import ThroughputConfig, fresh_run
from diloco.infra.bench.throughput import join
from diloco.infra.local.stack import LocalStack, aws_env
from diloco.infra.options import add_options, build, require_at_least
from diloco.infra.output import figures_table
from diloco.storage.bus import Bus
from diloco.storage.errors import ConfigError, Refused
from diloco.storage.settings import Endpoints

log = logging.getLogger(__name__)

NAME = "flood"
HELP = ("the coordinator's loop step time and memory while one learner floods it with made-up learner ids "
        "and junk stats, against the same loop without")
MB = 1 << 20
HOSTILE = "mallory"


@dataclass(frozen=True, slots=True)
class FloodConfig:
    """What the hostile learner sends, and how long each window steps the loop (one option per field)."""

    made_up_ids: int = 200_000
    """Made-up learner ids heartbeated once each (joined, ttl 1e9 s)."""
    junk_stats: int = 60
    """Junk stats records written, and as many oversize heartbeats refused."""
    junk_mb: float = 8.0
    """Size of each junk stats record, in MB."""
    learners: int = 3
    """Honest learners joined and heartbeating."""
    window_s: float = 10.0
    """Seconds of loop steps per window."""

    def __post_init__(self) -> None:
        require_at_least(self, made_up_ids=0, junk_stats=0, learners=1)
        if not (self.junk_mb > 0 and self.window_s > 0):
            raise ConfigError(f"--junk-mb and --window-s must be > 0, got {self.junk_mb} and {self.window_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, FloodConfig)


def run(args: argparse.Namespace) -> FloodResult:
    config = build(FloodConfig, args)
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        return measure(config, Path(tmp))


@dataclass
class Window:
    name: str
    steps: int
    seconds: float
    rss_mb: float
    """The process's resident memory at the window's end."""
    rss_max_mb: float
    """The most it held during the window (sampled twice a second)."""
    live: int
    joined: int

    @property
    def step_ms(self) -> float:
        return 1e3 * self.seconds / max(self.steps, 1)


@dataclass
class FloodResult:
    config: FloodConfig
    windows: list[Window] = field(default_factory=list)
    hostile: dict[str, int] = field(default_factory=dict)
    """What the hostile process's writes came to: written, and refused by code."""

    def ratios(self) -> dict[str, tuple[float, float]]:
        """(step time, RSS) of each window over the base window's."""
        base = self.windows[0]
        return {w.name: (w.step_ms / base.step_ms, w.rss_mb / base.rss_mb) for w in self.windows}

    def table(self) -> str:
        c = self.config
        head = (f"coordinator loop under a flood: {c.learners} honest learners; hostile: {c.junk_stats} stats records of "
                f"{c.junk_mb:g} MB, then {c.made_up_ids:,} made-up ids (ttl 1e9 s, joined); {c.window_s:g} s windows")
        ratios = self.ratios()
        rows = [[w.name, w.steps, w.step_ms, ratios[w.name][0], w.rss_mb, w.rss_max_mb, ratios[w.name][1], w.live,
                 w.joined] for w in self.windows]
        body = figures_table(["window", "steps", "step ms", "x base", "RSS MB", "RSS max MB", "RSS x base", "live ids",
                              "joined ids"], rows)
        said = ", ".join(f"{k} {v:,}" for k, v in sorted(self.hostile.items()))
        return "\n".join([head, body, f"hostile writes: {said}"])

    def to_json(self) -> dict:
        return {"bench": NAME, "config": asdict(self.config), "hostile": self.hostile,
                "windows": [asdict(w) | {"step_ms": w.step_ms} for w in self.windows],
                "ratios": {k: {"step": s, "rss": r} for k, (s, r) in self.ratios().items()}}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def step_for(coord: Coordinator, name: str, seconds: float, *, until: multiprocessing.Process | None = None) -> Window:
    """Step the loop without blocking for `seconds` (or, given `until`, until that process ends)."""
    steps, peak, sampled = 0, rss_mb(), time.monotonic()
    t0 = time.perf_counter()
    while (until.is_alive() if until is not None else time.perf_counter() - t0 < seconds):
        coord.step(block_ms=0)
        steps += 1
        if time.monotonic() - sampled > 0.5:
            peak, sampled = max(peak, rss_mb()), time.monotonic()
    elapsed = time.perf_counter() - t0
    fleet = coord.bus.fleet()
    return Window(name, steps, elapsed, rss_mb(), max(peak, rss_mb()), len(fleet.live), len(fleet.joined))


def measure(config: FloodConfig, stack_dir: Path) -> FloodResult:
    stack = LocalStack(stack_dir)
    result = FloodResult(config)
    with stack, aws_env(stack.env()):
        endpoints, run_id = fresh_run(stack)
        # The run's defaults but for a model of a few KB: what is measured is the loop, not a merge.
        coord = Coordinator(endpoints, run_id, settings=RunSettings(num_fragments=2, sync_every=8),
                            config=CoordinatorConfig())
        learners = []
        try:
            shapes = ThroughputConfig(fragments=2, fragment_mb=0.02, tensors=2)
            learners = [join(coord, endpoints, run_id, f"learner-{i}", shapes) for i in range(config.learners)]
            Bus(endpoints, run_id).heartbeat(HOSTILE, 600.0, joined=True)  # live, among the first seen
            step_for(coord, "warm-up", 2.0)
            result.windows.append(step_for(coord, "base", config.window_s))
            log.info("base: %.3f ms per step", result.windows[-1].step_ms)
            result.windows.append(hostile_window(coord, "stats", endpoints, run_id, config, stats=True,
                                                 sink=result.hostile))
            result.windows.append(hostile_window(coord, "ids (flood)", endpoints, run_id, config, stats=False,
                                                 sink=result.hostile))
            result.windows.append(step_for(coord, "ids (after)", config.window_s))
        finally:
            for learner in learners:
                learner.close()
            coord.close()
    for w in result.windows:
        log.info("%s: %d steps, %.3f ms per step, RSS %.0f MB (max %.0f), %d live ids", w.name, w.steps, w.step_ms,
                 w.rss_mb, w.rss_max_mb, w.live)
    return result


def hostile_window(coord: Coordinator, name: str, endpoints: Endpoints, run_id: str, config: FloodConfig, *,
                   stats: bool, sink: dict[str, int]) -> Window:
    """Step the loop while a hostile process writes (spawned: no threads of this one are copied)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    target = write_stats if stats else heartbeat_ids
    proc = ctx.Process(target=target, args=(endpoints, run_id, config, queue), name=f"hostile-{name}")
    proc.start()
    window = step_for(coord, name, config.window_s, until=None if stats else proc)
    proc.join(60)
    said = queue.get(timeout=10) if proc.exitcode == 0 else {"hostile process failed": 1}
    sink.update(said)
    log.info("%s: %s", name, said)
    return window


def write_stats(endpoints: Endpoints, run_id: str, config: FloodConfig, queue: multiprocessing.Queue) -> None:
    """As learner HOSTILE: oversize stats through the heartbeat script, then junk written to the
    stats hash directly, each record different, spread over the window."""
    bus = Bus(endpoints, run_id)
    size = int(config.junk_mb * MB)
    counts = {"stats refused": 0, "stats written raw": 0}
    rng = random.Random(0)
    t0 = time.monotonic()
    for i in range(config.junk_stats):
        junk = rng.randbytes(size)
        # What the heartbeat script writes (nothing: the stats are over MAX_STATS_BYTES), then the hash itself.
        counts["stats refused"] += bus.heartbeat_script(HOSTILE, 600.0, junk, joined=True)[0] == 0
        bus.r.hset(bus.keys.learner_stats, HOSTILE, junk)
        counts["stats written raw"] += 1
        time.sleep(max(0.0, t0 + (i + 1) * 0.8 * config.window_s / config.junk_stats - time.monotonic()))
    bus.close()
    queue.put(counts)


def heartbeat_ids(endpoints: Endpoints, run_id: str, config: FloodConfig, queue: multiprocessing.Queue) -> None:
    """`config.made_up_ids` made-up ids, each heartbeated once, joined, with a ttl of 1e9 s."""
    bus = Bus(endpoints, run_id)
    counts: dict[str, int] = {"ids live": 0}
    for i in range(config.made_up_ids):
        try:
            bus.heartbeat(f"made-up-{i}", 1e9, joined=True)
            counts["ids live"] += 1
        except Refused as exc:
            counts[f"ids refused ({exc.code})"] = counts.get(f"ids refused ({exc.code})", 0) + 1
    bus.close()
    queue.put(counts)
