"""The workload of the coordinator benchmarks (`diloco bench coordinator`, in process and sharded):
a synthetic model of P fragments, learners that leave a backlog of N contributions in S3 and on the
stream, and the limit any coordinator is measured against, the raw GET of the same objects."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.infra.local.stack import LocalStack, create_bucket
from diloco.infra.options import require_at_least, whole_numbers
from diloco.storage.bus import Bus
from diloco.storage.codecs import CODECS
from diloco.storage.errors import ConfigError, DilocoError
from diloco.storage.keys import MAX_SHARDS
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement
from diloco.storage.settings import Endpoints
from diloco.workers.learner import Learner

MB = 1 << 20


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """The workload and the measurement of `diloco bench coordinator` (one option per field)."""

    fragment_mb: float = 4.0
    """Size of one fragment in MB of fp32 parameters (a contribution decodes to this much)."""
    tensors: int = 6
    """Tensors per fragment (matrices of several sizes and one vector)."""
    fragments: int = 2
    """P: fragments of the run."""
    learners: int = 4
    """M: learners sending contributions."""
    contributions: int = 128
    """N: contributions the learners send in total, spread over learners and fragments (the coordinator
    reads up to 256 announcements at a time, so the default backlog is one batch)."""
    codec: str = RunSettings().codec
    """Codec of the contributions (one of `storage.codecs.CODECS`; the run default)."""
    compress: bool = True
    """zstd on top of the codec (the run default)."""
    fetch_threads: int = CoordinatorConfig().fetch_threads
    """Parallel S3 GETs of the coordinator, and of the raw GET measurement."""
    repeats: int = 3
    """Repeats, each on a fresh run; the table reports the median and the spread."""
    timeout_s: float = 600.0
    """Give up if the coordinator has not committed every contribution after this long."""
    shards: str = "1,2"
    """Besides the in-process coordinator: drain the same workload with this many coordinator processes
    (`diloco coordinator --shards K`), each K in the comma-separated list at most --fragments, on a run
    of its own per repeat ('': none)."""

    @property
    def shard_counts(self) -> tuple[int, ...]:
        return tuple(whole_numbers(self.shards, "--shards"))

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ConfigError(f"--codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        require_at_least(self, tensors=2, fragments=1, learners=1, contributions=1, fetch_threads=1, repeats=1)
        if any(not 1 <= k <= min(self.fragments, MAX_SHARDS) for k in self.shard_counts):
            raise ConfigError(f"--shards: each count must be 1 to --fragments ({self.fragments}), got {self.shards!r}")
        if not self.fragment_mb * MB / 4 >= 1024 * self.tensors:
            raise ConfigError(f"--fragment-mb {self.fragment_mb} is too small for {self.tensors} tensors")


# ---- the synthetic model and its backlog ----------------------------------------------------------

def tensor_shapes(fragment_mb: float, tensors: int) -> list[tuple[int, ...]]:
    """Shapes of one fragment: `tensors - 1` matrices 1024 wide of growing height, then a vector
    of 1024, adding up to `fragment_mb` MB of fp32 (rounded to whole rows)."""
    width = 1024
    rows = int(fragment_mb * MB / 4) // width - 1
    weights = list(range(1, tensors))
    heights = [max(1, rows * w // sum(weights)) for w in weights]
    return [(h, width) for h in heights] + [(width,)]


class SyntheticModel(torch.nn.Module):
    """P blocks of parameters (`blocks.{i}.{j}`): the layout planner puts block i in fragment i."""

    def __init__(self, fragments: int, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=generator) * 0.02) for s in shapes)
            for _ in range(fragments))


def fresh_run(stack: LocalStack) -> tuple[Endpoints, str]:
    """A bucket, key prefix and run id of this repeat's own on the shared stack."""
    tag = uuid.uuid4().hex[:10]
    create_bucket(stack.client(), f"bench-{tag}")
    return replace(stack.endpoints, bucket=f"bench-{tag}", prefix=f"b{tag}"), f"bench-{tag}"


def send(learner: Learner, contributions: int, fragments: int) -> None:
    """Train until `contributions` deltas are sent (H = P: one fragment per step from step P on),
    each stored and announced before the next step, then leave the run."""
    optimizer = learner.optimizer
    sent = learner.stats.uploaded
    for _ in range(fragments - 1 + contributions):
        for p in learner.model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        if not learner.uploader.flush(120):
            raise DilocoError(f"{learner.learner_id}: a contribution was not uploaded within 120s")
    learner.close()
    if learner.stats.uploaded - sent != contributions or learner.stats.upload_failed:
        raise DilocoError(f"{learner.learner_id} sent {learner.stats.uploaded - sent} contributions, "
                          f"{learner.stats.upload_failed} failed; {contributions} were wanted")


def deltas_announced(bus: Bus) -> list[Announcement]:
    return [a for _eid, a in bus.announcement_entries() if isinstance(a, Announcement) and a.kind == "delta"]


def raw_get(store: ObjectStore, keys: list[str], max_bytes: int, threads: int, expect_bytes: int) -> float:
    """Seconds to GET every key with `threads` threads (the coordinator's adapter, nothing else)."""
    with ThreadPoolExecutor(threads, thread_name_prefix="raw-get") as pool:
        t0 = time.perf_counter()
        got = sum(pool.map(lambda key: len(store.get(key, max_bytes=max_bytes)), keys))
        elapsed = time.perf_counter() - t0
    if got != expect_bytes:
        raise DilocoError(f"raw GET read {got} bytes, the announcements say {expect_bytes}")
    return elapsed
