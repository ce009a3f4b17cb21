"""The coordinator's settings: how a new run is laid out and how each fragment's rounds merge.

Run settings (`RunSettings`) are written into the run spec when the coordinator creates a run and
read back from it afterwards: a restarted coordinator, or one pointed at an existing run, uses
the stored values. Merge settings (`CoordinatorConfig`) belong to this process and are recorded
in every manifest they shaped.
"""

from __future__ import annotations

import math
import time

import torch
from dataclasses import dataclass, field, fields

from diloco.coordinator.policy import RoundConfig
from diloco.storage.bus import LEARNERS_FORGOTTEN_S
from diloco.storage.errors import ConfigError
from diloco.storage.intraop import usable_cpus
from diloco.storage.keys import MAX_SHARDS, Shard
from diloco.storage import codecs
from diloco.storage.protocol import CadenceKind, RunSpec, TakeRule, VersionSettings, check_choices


@dataclass(frozen=True, slots=True)
class RunSettings:
    num_fragments: int = 4
    """P: fragments the model is split into; each syncs on its own staggered schedule."""
    sync_every: int = 50
    """H: inner steps between two contributions of the same fragment."""
    overlap_steps: int = 2
    """tau: inner steps a learner keeps training after a send before it merges the new version: a
    floor on the merge lag, which is otherwise the round's own latency (learners never wait for it).
    A floor above that latency only delays every merge (docs/benchmarks.md)."""
    merge_rule: TakeRule = "rebase"
    """How learners take a new version: 'rebase' keeps the steps trained since the send on top of it,
    'adopt' takes it as it is (those steps, computed from a model the version replaced, are dropped),
    'mix' blends (docs/benchmarks.md: the cost of never waiting)."""
    alpha: float = 0.5
    """For merge_rule 'mix': local = alpha * local + (1 - alpha) * global."""
    codec: str = "int4"
    """Outer-gradient codec, both ways (deltas up, updates down, each with error feedback): one of
    `storage.codecs.CODECS`. int4 is within 1% of fp32 on every task of the quality benchmark at H = 50;
    int2 (ternary) and sparse (the top 1/64 of each block, 16x smaller than int4) lose badly at the
    outer optimizer's defaults (docs/benchmarks.md)."""
    compress: bool = True
    """zstd on top of the codec."""
    max_object_bytes: int = 1 << 30
    """Fragment objects larger than this are refused unread."""
    cadence: CadenceKind = "clock"
    """When learners send: 'clock' (at round deadlines the coordinator publishes) or 'steps' (every H steps)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.codec not in codecs.CODECS:
            raise ConfigError(f"codec must be one of {', '.join(codecs.CODECS)}, got {self.codec!r}")

    def spec(self, run: str) -> RunSpec:
        return RunSpec(run=run, num_fragments=self.num_fragments, sync_every=self.sync_every,
                       overlap_steps=self.overlap_steps, merge_rule=self.merge_rule, alpha=self.alpha,
                       codec=self.codec, compress=self.compress, max_object_bytes=self.max_object_bytes,
                       created_at=time.time(), cadence=self.cadence)


def settings_differ(spec: RunSpec, settings: RunSettings) -> dict[str, tuple[object, object]]:
    """The run settings `settings` gives otherwise than the stored `spec`: name -> (stored, given)."""
    given = settings.spec(spec.run)
    return {f.name: (getattr(spec, f.name), getattr(given, f.name)) for f in fields(RunSettings)
            if getattr(spec, f.name) != getattr(given, f.name)}


DROPPING_DOWNSTREAM = "int4"
"""The codec of the versions of a run whose pieces drop most of their elements (`Codec.drops`)."""


def downstream_of(downstream_codec: str, run_codec: str) -> str:
    """The codec versions go down in (`CoordinatorConfig.downstream_codec`): 'run' is the run's codec,
    or `DROPPING_DOWNSTREAM` for a codec that drops most of a piece."""
    if downstream_codec != "run":
        return downstream_codec
    return DROPPING_DOWNSTREAM if codecs.get(run_codec).drops else run_codec


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    outer_lr: float = 0.7
    """Outer Nesterov learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    radial_directional: bool = False
    """Average norms and directions of deltas separately instead of a plain weighted mean."""
    scale_rounds: bool = True
    """Size each round's outer step by the progress it carries, against the fragment's usual round
    (`policy.round_step`: every live learner that sends pieces, each with its usual piece of at most
    H steps): a round of fewer learners or steps than usual (a learner late for the round that merged, the last pieces
    at the end of a run) takes a fractional Nesterov step, momentum included, rather than a whole
    one; a round carrying more than two usual rounds of progress per learner (a backlog after an
    outage) is scaled down to that. Off: a whole step every round."""
    downstream_codec: str = "run"
    """The codec learners download new versions in: each version is also stored as an update of its
    parent in this codec, its quantization error carried into the next version (error feedback), and
    learners one or a few versions behind take the updates instead of the fp32 params. 'run': the
    run's outer-gradient codec, but int4 for one that drops most of a piece (sign8, sparse:
    `Codec.drops`; the outer step's update is dense, and re-sparsifying it with error feedback under
    outer momentum lost the run: docs/benchmarks.md, "Codecs"); 'fp32': learners download the params
    (no update objects)."""
    round: RoundConfig = field(default_factory=RoundConfig)
    """Quorum, grace window and staleness rules."""
    round_s: float = 0.0
    """Clock cadence: seconds between two rounds of a fragment; 0 = H inner steps of the fastest live learner."""
    min_round_s: float = 0.25
    """Clock cadence: the measured round period is never shorter than this (a guard against a
    fleet reporting absurdly short steps; above it, a round is H steps of the fastest learner)."""
    max_link_share: float = 0.5
    """Clock cadence: the share of a round period the learners' links may be busy with its pieces and
    versions (`LearnerStats.link_round_s`, the lower median of the learners that train). Over it the
    round clock stretches, up to MAX_LINK_STRETCH x H steps of the fastest learner: rounds carry
    more steps and move fewer bytes per second each way (`policy.link_bound_period`). A nearly full
    link makes pieces late for their round, each then a version of its own for every learner to
    download, and the fleet falls behind the versions and sends stale pieces. 1: never stretched."""
    consumer: str = "coordinator"
    """Consumer name in the announcements group; a restarted coordinator re-reads its own pending entries."""
    fetch_threads: int = min(8, 2 * usable_cpus())
    """Parallel S3 GETs and checks of a batch of contributions (default: twice the CPUs this
    process may use, at most 8: beyond that the checks wait on each other for the GIL and the cores)."""
    read_batch_bytes: int = 2 << 30
    """The most decoded (fp32) bytes one read of the announcements takes in: a backlog is read in
    batches of at most this many bytes of the largest fragment (at least one announcement, at most
    256), so a coordinator that restarts on a long backlog of large fragments does not decode it all
    into memory at once (a delta's decoded tensors are dropped once checked: its round keeps the
    checked payload, in the codec's bytes). Open rounds hold their contributions on top of this."""
    max_round_bytes: int = 2 << 30
    """The most decoded (fp32) bytes one fragment's open round may stand for: a round whose pieces
    reach it merges at once (the earliest arrivals, at most 4096 pieces), the rest wait for the next
    round. The round holds its pieces in the codec's bytes (int8: a quarter of the fp32) and the
    merge decodes one at a time, so this bounds the memory generously. With `read_batch_bytes`, it bounds the coordinator's
    memory whatever a flood of valid pieces does."""
    max_refusals_listed: int = 1000
    """Refusals a version's manifest lists one by one; the rest since its parent are summed up in
    one more line, by code (each stays on the refusals stream and in the counters). A thousand
    refusals, reasons clipped to 2000 characters, keep a manifest within a few MB of its 64 MiB read
    limit whatever a flood of forged announcements does."""
    token_budget: int = 0
    """End the run once every fragment has merged this many tokens of the fleet's training (0: no
    budget; the run ends when its learners finish). Learners see the run end and stop; a fast
    learner trains on while a slow one lags, so the fleet, not each learner, spends the budget.
    The count survives a restart: each manifest records its fragment's merged tokens so far."""
    gone_after_s: float = 1800.0
    """A learner that joined and has sent no heartbeat for this long is gone: the run no longer waits
    for it to finish (it ends once the others have), so that an id no machine will take again (a
    slot scaled away, a learner restarted under another id) cannot hold a run open. Keep it longer
    than a preempted learner takes to come back under its id. At most 3600 s (heartbeats older
    than that are forgotten)."""
    claim_idle_s: float = 60.0
    """Entries pending on another consumer for longer than this are claimed."""
    lease_s: float = 10.0
    """The coordinator lease: a coordinator that stops renewing it is replaced after this long."""
    shards: int = 1
    """How many coordinator processes share the run, each merging the fragments f with f % shards ==
    its --shard, under a lease of its own (a standby per shard takes its place). Every shard of a run
    is started with the same number; it changes once every shard of the old number has stopped. At
    most the run's fragments."""
    shard: int = 0
    """Which shard of --shards this coordinator is (0 to shards - 1). Shard 0 also keeps the round
    clock and ends the run."""
    standby: bool = False
    """Wait as a hot standby while another coordinator holds the run, and take over when its lease lapses.
    Without it, a coordinator that finds the lease held and renewed exits."""
    cover_shards: bool = False
    """With --shards > 1, also stand by for every other shard: when one's lease lapses (its coordinator
    died) and no standby of its own takes it first, this process takes that shard's fragments over
    too, beside its own, until the run ends. Size its memory for both."""
    hold_state: bool = True
    """Keep each fragment's params and outer state (its momentum and downstream residual: three fp32
    copies of the fragment) in memory between its rounds. --no-hold-state reads them back from S3
    at each merge instead: memory per shard for one fragment at a time, not the whole model, for a
    GET of three fragments' worth per round (a 1B model on one machine: docs/benchmarks.md)."""
    keep_serving: bool = False
    """Once the run is finished, keep running (refusing what learners still send, serving metrics)
    instead of returning from `serve`: `diloco coordinator` exits 0 then, so that a Kubernetes Job or
    a SkyPilot job completes with the run."""
    reach_timeout_s: float = 10.0
    """At start, how long to wait for Redis and S3 to answer before exiting with a line that names the
    setting to check (a wrong password, key, secret or bucket exits at once). Raise it to start the
    coordinator before its servers."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port at /metrics, also while standing by (0: off). Needs
    pip install 'diloco[metrics]'; docs/metrics.md lists the metrics."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        if not self.outer_lr > 0:
            raise ConfigError(f"outer_lr must be positive, got {self.outer_lr}")
        if not self.round_s >= 0:
            raise ConfigError(f"round_s must be >= 0 seconds (0: H steps of the fastest learner), got {self.round_s}")
        if not self.reach_timeout_s >= 0:
            raise ConfigError(f"reach_timeout_s must be >= 0 seconds, got {self.reach_timeout_s}")
        if not 0.0 < self.max_link_share <= 1.0:
            raise ConfigError(f"max_link_share must be in (0, 1] (1: the clock never stretches for the links), "
                              f"got {self.max_link_share}")
        if not self.min_round_s > 0:
            raise ConfigError(f"min_round_s must be > 0 seconds, got {self.min_round_s}")
        if not 0 < self.gone_after_s <= LEARNERS_FORGOTTEN_S:
            raise ConfigError(f"gone_after_s must be in (0, {LEARNERS_FORGOTTEN_S:g}] seconds, got {self.gone_after_s}")
        if not self.claim_idle_s > 0:
            raise ConfigError(f"claim_idle_s must be > 0 seconds, got {self.claim_idle_s}")
        if self.fetch_threads < 1:
            raise ConfigError(f"fetch_threads must be at least 1, got {self.fetch_threads}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.max_refusals_listed < 1:
            raise ConfigError(f"max_refusals_listed must be at least 1, got {self.max_refusals_listed}")
        if self.max_round_bytes < 1:
            raise ConfigError(f"max_round_bytes must be positive, got {self.max_round_bytes}")
        if self.read_batch_bytes < 1:
            raise ConfigError(f"read_batch_bytes must be positive, got {self.read_batch_bytes}")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ConfigError(f"shards must be 1 to {MAX_SHARDS}, got {self.shards}")
        if not 0 <= self.shard < self.shards:
            raise ConfigError(f"shard must be 0 to shards - 1 ({self.shards - 1}), got {self.shard}")
        if not self.lease_s >= 1.0:
            raise ConfigError(f"lease_s must be at least 1 second, got {self.lease_s}")
        if self.downstream_codec not in ("run", *codecs.CODECS):
            raise ConfigError(f"downstream_codec must be 'run' or one of {', '.join(codecs.CODECS)}, got {self.downstream_codec!r}")
        if self.token_budget < 0:
            raise ConfigError(f"token_budget must be >= 0 (0: no budget), got {self.token_budget}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port (0: off), got {self.metrics_port}")

    def shard_of_run(self) -> Shard:
        """The part of the run this coordinator merges (`storage.keys.Shard`)."""
        return Shard(self.shard, self.shards)

    def settings(self, r: RoundConfig, kind: str, run_codec: str) -> VersionSettings:
        """What the manifest of a version of this `kind` records about how it was made, and on which
        kernels (replay needs them); a delta's merge is configured by it."""
        downstream = downstream_of(self.downstream_codec, run_codec)
        return VersionSettings(kind=kind, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                               outer="fractional_nesterov" if self.scale_rounds else "nesterov",
                               merge="radial_directional" if self.radial_directional else "weighted_mean",
                               staleness_discount=r.staleness_discount, max_staleness=r.max_staleness,
                               staleness_relative=r.staleness_relative,
                               stale_momentum=r.stale_momentum or not self.scale_rounds,
                               bounded_momentum=r.bounded_momentum or not self.scale_rounds,
                               min_quorum=r.min_quorum, grace_gamma=r.grace_gamma,
                               downstream=downstream if kind == "delta" else "fp32",  # genesis publishes as proposed
                               torch=torch.__version__, cpu_capability=torch.backends.cpu.get_cpu_capability())
