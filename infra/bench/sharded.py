"""`diloco bench coordinator --shards 1,2`: the same kind of backlog drained by K coordinator processes.

Beside the in-process measurement (`throughput.py`), each K of `--shards` gets a fresh run on the same
stack and the same workload, coordinated by K real `diloco coordinator --shards K --shard k` processes
(each with `--fetch-threads`, one torch thread, as `diloco up` starts them):

1. The K shards start, take their leases and publish version 0 of their fragments as the learners
   join (in this process, as in the in-process arm).
2. The shards are stopped (SIGSTOP) while the learners send the N contributions, and the raw GET of
   the same objects is measured.
3. SIGCONT: the seconds until Redis counts N contributions applied (or refused) are the shards' time.
   Every contribution must be an input of exactly one manifest, written by its fragment's own shard.

A process's start-up (imports, lease, genesis) is outside the timed window, as the in-process arm's is.
Nothing here asserts on time.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.infra.bench.backlog import (SyntheticModel, ThroughputConfig, deltas_announced, fresh_run, raw_get,
                                        send, tensor_shapes)
from diloco.infra.local.fleet import Proc, diloco_command, process_env, wait_until
from diloco.infra.local.stack import LocalStack
from diloco.storage.bus import Bus
from diloco.storage.errors import DilocoError
from diloco.storage.history import read_manifest, read_run_spec
from diloco.storage.keys import Shard
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement
from diloco.workers.learner import Learner

MB = 1 << 20


@dataclass(frozen=True, slots=True)
class ShardedRepeat:
    """One drain of the backlog by `shards` coordinator processes."""

    shards: int
    contributions: int
    contribution_bytes: int
    raw_get_s: float
    coordinator_s: float
    merged: int
    """Inputs of committed manifests among the announced contributions (each must be 1)."""
    merged_distinct: int
    refused: int
    foreign_writes: int
    """Versions written by a shard other than the fragment's own (must be 0)."""

    @property
    def consistent(self) -> bool:
        return (self.merged == self.merged_distinct == self.contributions and self.refused == 0
                and self.foreign_writes == 0)

    def figures(self) -> dict[str, float]:
        mb = self.contribution_bytes / MB
        return {"raw_get_mb_s": mb / self.raw_get_s, "coordinator_mb_s": mb / self.coordinator_s,
                "contributions_per_s": self.contributions / self.coordinator_s,
                "ratio": self.raw_get_s / self.coordinator_s}


def shard_argv(config: ThroughputConfig, run_id: str, shard: Shard) -> list[str]:
    """`diloco coordinator` for one shard of the bench's run: the in-process arm's settings."""
    return diloco_command(
        "coordinator", "--run", run_id, "--fragments", str(config.fragments), "--sync-every", str(config.fragments),
        "--overlap-steps", "0", "--codec", config.codec, "--compress" if config.compress else "--no-compress",
        "--cadence", "steps", "--min-quorum", "1", "--max-grace-s", "0", "--max-staleness", str(config.contributions),
        "--fetch-threads", str(config.fetch_threads), "--shards", str(shard.count), "--shard", str(shard.index),
        "--lease-s", "600", "--keep-serving")


def sharded_repeat(config: ThroughputConfig, stack: LocalStack, shards: int, log_dir: Path) -> ShardedRepeat:
    endpoints, run_id = fresh_run(stack)
    env = process_env(endpoints.to_env() | {k: v for k, v in stack.env().items() if k.startswith("AWS_")})
    layout = Shard(0, shards).layout()
    procs = [Proc(f"shard{s.index}of{s.count}", shard_argv(config, run_id, s), log_dir / f"{run_id}-{s.index}.log",
                  env).start() for s in layout]
    bus, store = Bus(endpoints, run_id), ObjectStore(endpoints)
    try:
        def alive() -> None:
            for p in procs:
                if not p.alive():
                    raise DilocoError(f"{p.name} exited {p.returncode()}:\n{p.tail(20)}")

        if not wait_until(lambda: all(bus.leadership(s)[1] for s in layout), 120, between=alive):
            raise DilocoError(f"the {shards} shard(s) did not take their leases in 120s")
        learners = [_join(endpoints, run_id, f"learner-{i}", config) for i in range(config.learners)]
        for p in procs:
            p.send(signal.SIGSTOP)
        for i, learner in enumerate(learners):
            send(learner, config.contributions // config.learners + (i < config.contributions % config.learners),
                    config.fragments)
        announced = deltas_announced(bus)
        keys, nbytes = [a.object_key for a in announced], sum(a.size_bytes for a in announced)
        spec = read_run_spec(store, bus.keys)
        assert spec is not None  # the shards created the run before taking their leases
        max_bytes = spec.max_object_bytes
        raw_s = raw_get(store, keys, max_bytes, config.fetch_threads, nbytes)
        before = bus.counters()
        t0 = time.perf_counter()
        for p in procs:
            p.send(signal.SIGCONT)
        elapsed = _drained(bus, before, len(announced), t0, config.timeout_s, alive)
        raw_s = (raw_s + raw_get(store, keys, max_bytes, config.fetch_threads, nbytes)) / 2
        merged, foreign = _merged(store, bus, announced, layout, config.fragments)
        return ShardedRepeat(shards=shards, contributions=len(announced), contribution_bytes=nbytes, raw_get_s=raw_s,
                             coordinator_s=elapsed, merged=sum(merged[a.contribution_id] for a in announced),
                             merged_distinct=sum(a.contribution_id in merged for a in announced),
                             refused=bus.counters().get("contributions_refused", 0), foreign_writes=foreign)
    finally:
        for p in procs:
            p.send(signal.SIGCONT)
            p.terminate(10)


def _join(endpoints, run_id: str, name: str, config: ThroughputConfig) -> Learner:  # noqa: ANN001
    """A learner joined to the run: the shard processes publish version 0 of their fragments meanwhile."""
    model = SyntheticModel(config.fragments, tensor_shapes(config.fragment_mb, config.tensors))
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.01), run=run_id, endpoints=endpoints,
                      learner_id=name, tokens_per_step=1024)
    learner.start()
    return learner


def _drained(bus: Bus, before: dict[str, int], contributions: int, t0: float, timeout_s: float, alive) -> float:  # noqa: ANN001
    """Seconds from `t0` until Redis counts `contributions` more applied or refused (polled every 10 ms)."""
    while True:
        now = bus.counters()
        done = sum(now.get(k, 0) - before.get(k, 0) for k in ("contributions_applied", "contributions_refused"))
        if done >= contributions:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise DilocoError(f"the shards dealt with {done} of {contributions} contributions in {timeout_s:.0f}s")
        alive()
        time.sleep(0.01)


def _merged(store: ObjectStore, bus: Bus, announced: list[Announcement], layout: list[Shard],
            fragments: int) -> tuple[Counter[str], int]:
    """How often each contribution is an input of a committed delta version, and how many versions
    were written by another shard than their fragment's own (told by the epoch each shard holds)."""
    epochs = {s.index: bus.leadership(s)[0] for s in layout}
    counts: Counter[str] = Counter()
    foreign = 0
    for fragment, head in bus.heads().items():
        if not 0 <= fragment < fragments:
            continue
        owner = fragment % len(layout)
        for version in range(1, head + 1):
            m = read_manifest(store, bus.keys, fragment, version)
            counts.update(c.contribution_id for c in m.inputs)
            foreign += m.epoch != epochs[owner]
    return counts, foreign
