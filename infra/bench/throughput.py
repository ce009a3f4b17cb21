"""`diloco bench coordinator`: contributions merged per second by the coordinator, against the limit.

The limit is the raw S3 GET throughput of the very same contribution objects from the same server,
measured in the same run with as many threads as the coordinator fetches with: a coordinator
cannot merge contributions faster than it can read them. Each repeat, on one local stack (a real
redis-server and a real S3 server):

1. A coordinator (in this process) creates a fresh run: P fragments of `fragment_mb` MB of fp32
   each, `tensors` tensors per fragment, the run's codec. M real `workers.learner.Learner`s join
   it (the first one proposes version 0).
2. With the coordinator paused, the learners train on random gradients and send N contributions
   in total through their own uploader (encode with the run's codec, create-only PUT, XADD the
   announcement), then leave.
3. (a) GET every announced object with `fetch_threads` threads through the coordinator's own S3
   adapter, once before and once after (b): MB/s, the limit (both passes together, so that load
   from other work that comes and goes weighs on both sides alike).
4. (b) Step the coordinator until it has committed every contribution: contributions/s, MB/s of
   contribution objects, versions/s, and the loop's time split by phase (`coordinator/timing.py`).
5. Check that every announced contribution is an input of exactly one committed manifest and that
   none was refused.

The ratio (b)/(a) is the figure. Both also report the CPU they used per MB, in this process and
in the two servers (Linux /proc), which says what bounds them on a small machine. Nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.infra.bench.backlog import (MB, SyntheticModel, ThroughputConfig, deltas_announced, fresh_run, raw_get,
                                        send, tensor_shapes)
from diloco.infra.bench.sharded import ShardedRepeat, sharded_repeat
from diloco.infra.local.stack import LocalStack, aws_env
from diloco.infra.options import add_options, build
from diloco.infra.output import figures_table
from diloco.storage.codecs import CODECS
from diloco.storage.errors import DilocoError
from diloco.storage.history import read_manifest
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import Endpoints
from diloco.workers.learner import Learner

log = logging.getLogger(__name__)

NAME = "coordinator"
HELP = ("coordinator throughput: contributions merged per second and MB/s, against the raw S3 GET "
        "throughput of the same objects from the same server (the limit)")

LOOP_PHASES = ("read", "check", "fetch_wait", "load", "merge", "outer", "encode", "put", "manifest", "commit")
"""Phases of the coordinator's loop (wall time, in this order in the table)."""
THREAD_PHASES = ("get", "verify", "tensors")
"""Phases on the fetch threads (thread-seconds: they overlap each other, `fetch_wait` and `merge`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stack-dir", type=Path, metavar="D",
                        help="data directory of the local stack (default: a temporary directory, removed after)")
    add_options(parser, ThroughputConfig, choices={"codec": CODECS})


def run(args: argparse.Namespace) -> ThroughputResult:
    config = build(ThroughputConfig, args)
    if args.stack_dir is not None:
        return measure(config, args.stack_dir)
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        return measure(config, Path(tmp))


# ---- one repeat ---------------------------------------------------------------------------------

@dataclass
class Repeat:
    """The figures of one repeat."""

    contributions: int
    contribution_bytes: int
    raw_get_s: float
    """Mean of the two raw GET passes."""
    coordinator_s: float
    versions: int
    merged: int
    """Contribution ids found among the inputs of the committed manifests (with repeats)."""
    merged_distinct: int
    refused: int
    phases_s: dict[str, tuple[float, float]]
    """(seconds, CPU seconds of the threads that ran it) per phase of the coordinator."""
    raw_cpu_s: tuple[float, float]
    """CPU seconds per raw GET pass (mean of the two): (this process, the Redis and S3 servers)."""
    coordinator_cpu_s: tuple[float, float]
    """CPU seconds while the coordinator drained the backlog: (this process, the servers)."""

    @property
    def raw_mb_s(self) -> float:
        return self.contribution_bytes / MB / self.raw_get_s

    @property
    def coordinator_mb_s(self) -> float:
        return self.contribution_bytes / MB / self.coordinator_s

    @property
    def contributions_per_s(self) -> float:
        return self.contributions / self.coordinator_s

    @property
    def versions_per_s(self) -> float:
        return self.versions / self.coordinator_s

    @property
    def ratio(self) -> float:
        return self.coordinator_mb_s / self.raw_mb_s

    @property
    def consistent(self) -> bool:
        """Every contribution merged exactly once, none refused."""
        return self.merged == self.merged_distinct == self.contributions and self.refused == 0

    def figures(self) -> dict[str, float]:
        mb = self.contribution_bytes / MB
        return {"raw_get_mb_s": self.raw_mb_s, "coordinator_mb_s": self.coordinator_mb_s,
                "contributions_per_s": self.contributions_per_s, "versions_per_s": self.versions_per_s,
                "ratio": self.ratio,
                "raw_cpu_ms_per_mb": 1000 * sum(self.raw_cpu_s) / mb,
                "coordinator_cpu_ms_per_mb": 1000 * sum(self.coordinator_cpu_s) / mb}


def measure(config: ThroughputConfig, stack_dir: Path) -> ThroughputResult:
    """Start a local stack under `stack_dir`, run `config.repeats` repeats on it, stop it."""
    stack = LocalStack(stack_dir)
    with stack, aws_env(stack.env()):  # the stack's credentials for boto3's chain
        repeats, sharded = [], []
        for i in range(config.repeats):
            repeats.append(one_repeat(config, stack))
            r = repeats[-1]
            log.info("repeat %d/%d: raw GET %.1f MB/s, coordinator %.1f MB/s (%.1f contributions/s, %d versions), "
                     "ratio %.2f", i + 1, config.repeats, r.raw_mb_s, r.coordinator_mb_s, r.contributions_per_s,
                     r.versions, r.ratio)
            for k in config.shard_counts:
                (stack_dir / "shards").mkdir(exist_ok=True)
                sharded.append(sharded_repeat(config, stack, k, stack_dir / "shards"))
                f = sharded[-1].figures()
                log.info("repeat %d/%d, %d coordinator process(es): %.1f MB/s (%.1f contributions/s), ratio %.2f",
                         i + 1, config.repeats, k, f["coordinator_mb_s"], f["contributions_per_s"], f["ratio"])
    bad = [asdict(r) for r in [*repeats, *sharded] if not r.consistent]
    if bad:
        raise DilocoError(f"repeat(s) did not merge every contribution exactly once: {bad}")
    return ThroughputResult(config=config, server=stack.s3_kind, shapes=tensor_shapes(config.fragment_mb,
                                                                                       config.tensors),
                            repeats=repeats, sharded=sharded)


def one_repeat(config: ThroughputConfig, stack: LocalStack) -> Repeat:
    endpoints, run_id = fresh_run(stack)
    settings = RunSettings(num_fragments=config.fragments, sync_every=config.fragments, overlap_steps=0,
                           codec=config.codec, compress=config.compress, cadence="steps")
    # Every delta is based on version 0 and merges in whatever round the backlog lands in: never stale.
    rounds = RoundConfig(min_quorum=1, max_grace_s=0.0, max_staleness=config.contributions)
    coord = Coordinator(endpoints, run_id, settings=settings,
                        config=CoordinatorConfig(round=rounds, fetch_threads=config.fetch_threads,
                                                 consumer=f"bench-{uuid.uuid4().hex[:6]}"))
    try:
        learners = [join(coord, endpoints, run_id, f"learner-{i}", config) for i in range(config.learners)]
        for i, learner in enumerate(learners):
            send(learner, config.contributions // config.learners + (i < config.contributions % config.learners),
                 config.fragments)
        announced = deltas_announced(coord.bus)
        keys = [a.object_key for a in announced]
        nbytes = sum(a.size_bytes for a in announced)
        store = ObjectStore(endpoints)
        servers = [s.pid for s in stack.servers()]
        with CpuClock(servers) as raw_cpu:
            raw_s = raw_get(store, keys, coord.spec.max_object_bytes, config.fetch_threads, nbytes)
        with CpuClock(servers) as coordinator_cpu:
            coordinator_s, versions, phases = drain(coord, len(announced), config.timeout_s)
        with CpuClock(servers) as raw_cpu_after:
            raw_s = (raw_s + raw_get(store, keys, coord.spec.max_object_bytes, config.fetch_threads, nbytes)) / 2
        merged = merged_ids(coord)
        return Repeat(contributions=len(announced), contribution_bytes=nbytes, raw_get_s=raw_s,
                      coordinator_s=coordinator_s, versions=versions,
                      merged=sum(merged[a.contribution_id] for a in announced),
                      merged_distinct=sum(a.contribution_id in merged for a in announced),
                      refused=coord.bus.counters().get("contributions_refused", 0), phases_s=phases,
                      raw_cpu_s=((raw_cpu.own_s + raw_cpu_after.own_s) / 2,
                                 (raw_cpu.servers_s + raw_cpu_after.servers_s) / 2),
                      coordinator_cpu_s=(coordinator_cpu.own_s, coordinator_cpu.servers_s))
    finally:
        coord.close()


def join(coord: Coordinator, endpoints: Endpoints, run_id: str, name: str, config: ThroughputConfig) -> Learner:
    """A learner joined to the run (proposing version 0 if it is the first), the coordinator stepped meanwhile."""
    model = SyntheticModel(config.fragments, tensor_shapes(config.fragment_mb, config.tensors))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    learner = Learner(model, optimizer, run=run_id, endpoints=endpoints, learner_id=name, tokens_per_step=1024)
    failure: list[BaseException] = []

    def start() -> None:
        try:
            learner.start()
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            failure.append(exc)

    thread = threading.Thread(target=start, name=f"join-{name}", daemon=True)
    thread.start()
    while thread.is_alive():
        coord.step(block_ms=50)
    if failure:
        raise failure[0]
    return learner


class CpuClock:
    """CPU seconds used inside a `with` block by this process (all threads) and by the `pids` (the
    servers; NaN where /proc cannot be read)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.own_s = self.servers_s = 0.0

    def __enter__(self) -> CpuClock:
        self._own, self._servers = time.process_time(), self._server_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.own_s = time.process_time() - self._own
        self.servers_s = self._server_cpu() - self._servers

    def _server_cpu(self) -> float:
        total = 0.0
        for pid in self.pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return math.nan
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        return total


def drain(coord: Coordinator, contributions: int,
          timeout_s: float) -> tuple[float, int, dict[str, tuple[float, float]]]:
    """Step the coordinator until `contributions` more are applied: (seconds, versions committed, phase split)."""
    before = coord.bus.counters()
    phases = coord.timing.snapshot()
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    while True:
        coord.step(block_ms=0)
        now = coord.bus.counters()
        done = now.get("contributions_applied", 0) - before.get("contributions_applied", 0)
        refused = now.get("contributions_refused", 0) - before.get("contributions_refused", 0)
        if done + refused >= contributions:
            break
        if time.perf_counter() > deadline:
            raise DilocoError(f"the coordinator applied {done} of {contributions} contributions in {timeout_s:.0f}s")
    elapsed = time.perf_counter() - t0
    versions = now.get("versions_committed", 0) - before.get("versions_committed", 0)
    return elapsed, versions, coord.timing.since(phases)


def merged_ids(coord: Coordinator) -> Counter[str]:
    """How often each contribution id is an input of a committed delta version (versions 1..head)."""
    counts: Counter[str] = Counter()
    for fragment, frag in coord.fragments.items():
        for version in range(1, frag.head + 1):
            counts.update(c.contribution_id for c in read_manifest(coord.store, coord.keys, fragment, version).inputs)
    return counts


# ---- the result ---------------------------------------------------------------------------------

@dataclass
class ThroughputResult:
    config: ThroughputConfig
    server: str
    """The S3 server of the stack: "weed" (SeaweedFS) or "minio"."""
    shapes: list[tuple[int, ...]]
    repeats: list[Repeat] = field(default_factory=list)
    sharded: list[ShardedRepeat] = field(default_factory=list)

    def by_shards(self) -> dict[int, dict[str, float]]:
        """Median figures per number of coordinator processes, with `x_one`: contributions/s against one process."""
        out = {k: {name: statistics.median(r.figures()[name] for r in self.sharded if r.shards == k)
                   for name in self.sharded[0].figures()}
               for k in sorted({r.shards for r in self.sharded})}
        one = out.get(1, {}).get("contributions_per_s")
        for figures in out.values():
            figures["x_one"] = figures["contributions_per_s"] / one if one else math.nan
        return out

    def median(self) -> dict[str, float]:
        return {k: statistics.median(r.figures()[k] for r in self.repeats) for k in self.repeats[0].figures()}

    def spread(self) -> dict[str, tuple[float, float]]:
        return {k: (min(r.figures()[k] for r in self.repeats), max(r.figures()[k] for r in self.repeats))
                for k in self.repeats[0].figures()}

    def phases(self) -> dict[str, tuple[float, float]]:
        """Median (seconds, CPU seconds) per phase over the repeats."""
        names = [p for p in (*LOOP_PHASES, *THREAD_PHASES) if any(p in r.phases_s for r in self.repeats)]
        return {p: (statistics.median(r.phases_s.get(p, (0.0, 0.0))[0] for r in self.repeats),
                    statistics.median(r.phases_s.get(p, (0.0, 0.0))[1] for r in self.repeats)) for p in names}

    def table(self) -> str:
        c, first = self.config, self.repeats[0]
        size_mb = first.contribution_bytes / first.contributions / MB
        head = (f"coordinator throughput: {c.fragments} fragments x {c.fragment_mb:g} MB fp32 ({c.tensors} tensors), "
                f"{c.learners} learners, {first.contributions} contributions of {size_mb:.2f} MB "
                f"({c.codec}{'+zstd' if c.compress else ''}), {c.fetch_threads} fetch threads, S3 server "
                f"{'SeaweedFS' if self.server == 'weed' else self.server}")
        columns = ["repeat", "raw GET MB/s", "coord MB/s", "contrib/s", "versions/s", "ratio", "raw CPU ms/MB",
                   "coord CPU ms/MB", "versions", "coord s"]
        keys = ("raw_get_mb_s", "coordinator_mb_s", "contributions_per_s", "versions_per_s", "ratio",
                "raw_cpu_ms_per_mb", "coordinator_cpu_ms_per_mb")
        rows: list[list] = [[str(i + 1), *(r.figures()[k] for k in keys), r.versions, r.coordinator_s]
                            for i, r in enumerate(self.repeats)]
        med, spread = self.median(), self.spread()
        rows.append(["median", *(med[k] for k in keys), None, None])
        rows.append(["min-max", *(f"{spread[k][0]:.3g}-{spread[k][1]:.3g}" for k in keys), None, None])
        wall = statistics.median(r.coordinator_s for r in self.repeats)
        phase_rows = [[p + (" (fetch threads)" if p in THREAD_PHASES else ""), s, cpu, 100 * s / wall]
                      for p, (s, cpu) in self.phases().items()]
        verdict = (f"ratio coordinator / raw GET: median {med['ratio']:.2f} "
                   f"(target >= 0.50: {'met' if med['ratio'] >= 0.5 else 'not met'})")
        shard_lines = []
        if self.sharded:
            shard_rows = [[k, f["coordinator_mb_s"], f["contributions_per_s"], f["ratio"], f["x_one"]]
                          for k, f in self.by_shards().items()]
            shard_lines = ["", "the same workload drained by K `diloco coordinator --shards K` processes (median "
                           "per K over the repeats, a run of its own each; one torch thread per process):",
                           figures_table(["K", "coord MB/s", "contrib/s", "ratio", "x K=1"], shard_rows)]
        return "\n".join([head, "", figures_table(columns, rows), "", verdict, *shard_lines, "",
                          f"where the coordinator's time goes (median per repeat; % of its {wall:.3g}s): seconds and "
                          "CPU seconds of the threads that ran each phase;\nfetch-thread phases overlap each other and "
                          "fetch_wait. CPU ms/MB above: this process + the Redis and S3 servers, per MB of contribution "
                          "objects.",
                          figures_table(["phase", "seconds", "CPU s", "% of wall"], phase_rows)])

    def to_json(self) -> dict:
        med, spread = self.median(), self.spread()
        return {"bench": NAME, "config": asdict(self.config), "server": self.server,
                "tensor_shapes": [list(s) for s in self.shapes],
                "repeats": [asdict(r) | r.figures() | {"consistent": r.consistent} for r in self.repeats],
                "median": med, "spread": {k: list(v) for k, v in spread.items()},
                "phases_median": {p: {"seconds": s, "cpu_s": cpu} for p, (s, cpu) in self.phases().items()},
                "target_met": med["ratio"] >= 0.5,
                "sharded": [asdict(r) | r.figures() | {"consistent": r.consistent} for r in self.sharded],
                "by_shards": {str(k): v for k, v in self.by_shards().items()} if self.sharded else {}}
