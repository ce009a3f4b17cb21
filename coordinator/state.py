"""What the coordinator's parts share: the servers, the run, this shard's fragments and the clock.

The loop (`service.py`) builds one `ShardState` at start-up and hands it to its parts: the intake
(`intake.Intake`: announcements in, checked and fetched), the rounds (`rounds.Rounds`: merge and
publish), the recovery (`recovery.Recovery`: Redis brought back up to S3) and the fleet view
(`fleet_view.FleetView`). Each part keeps what only it uses; what two of them read or change lives
here. Not thread-safe: the loop's own. The fetch threads only read the run's settings and its
layout, which the first genesis sets once (`Intake._adopt_layout`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.fleet_view import FleetView
from diloco.coordinator.influence import Claim
from diloco.coordinator.intake import PendingDelta
from diloco.coordinator.leadership import Fenced, Leadership
from diloco.coordinator.metrics import Metrics
from diloco.coordinator.outer import NesterovState
from diloco.coordinator.policy import RoundConfig, RoundSize
from diloco.coordinator.timing import PhaseTimes
from diloco.storage.bus import Bus
from diloco.storage.errors import Refused
from diloco.storage.history import read_manifest
from diloco.storage.keys import RunKeys, Shard
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement, Cadence, Layout, Refusal, RunEnd, RunSpec

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 2000
"""A refusal's reason quotes what it refuses (keys, names), which the sender chose: it is cut to this
length so that refusal records and the manifests that list them stay small."""
MAX_KEY_CHARS = 1024
"""A refusal's object key is the announced one, cut to S3's own limit on key length."""


def clip_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


@dataclass
class Fragment:
    """In-memory state of one fragment: its head and the open round."""

    head: int
    params: dict[str, torch.Tensor] | None = None
    state: NesterovState | None = None
    round: list[PendingDelta] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    wake_at: float | None = None
    last_reason: str = ""
    merged_deadline: float = 0.0
    """The latest clock deadline a round merged here served (0: none since this coordinator started)."""
    recent: list[RoundSize] = field(default_factory=list)
    """The last rounds merged here (`policy.round_step`'s usual round)."""
    claims: list[tuple[Claim, ...]] = field(default_factory=list)
    """What the pieces of the same rounds counted (`influence.count_claims` weighs a claim against them)."""
    pieces: dict[str, int] = field(default_factory=dict)
    """Each learner's usual piece (`policy.usual_pieces`) as of its last round in `claims` before it
    finished: a learner that finished keeps that share of the usual round for the rest of the run
    (`influence.usual_fleet`), not its final sliver of a piece. Since this coordinator started."""
    merged_tokens: int | None = None
    """The tokens merged into the fragment up to its head (`Manifest.merged_tokens`); None: read from
    the head's manifest when needed (the head moved by another path than our own commit)."""
    applied: dict[int, frozenset[str]] = field(default_factory=dict)
    """Version -> the contribution ids it merged, for the last versions this process knows the
    manifests of (max_staleness + 1 of them: anything older would be refused as stale): those it
    committed, those it committed again from S3 (a predecessor's, after a crash or a Redis that forgot
    commits), and those it read as it started. Applied, since their manifests are in S3, whatever
    Redis says: a Redis restored from an older snapshot forgets its applied set and hands the
    announcements back, and a coordinator that checked Redis alone would merge them a second time."""

    def record_applied(self, version: int, ids: Iterable[str], keep: int) -> None:
        """`version`'s manifest merged `ids`: keep them among the last `keep` versions' (`applied`)."""
        self.applied[version] = frozenset(ids)
        for old in sorted(self.applied)[:-keep]:
            del self.applied[old]

    def forget_head(self, head: int) -> None:
        """The head moved by another path than this process's own commit: what was loaded for the old one goes."""
        self.head, self.params, self.state, self.wake_at, self.merged_tokens = head, None, None, None, None


@dataclass(eq=False)
class ShardState:
    """The run as this coordinator holds it: its servers and settings, its epoch, its fragments, the
    round clock and the run's end."""

    config: CoordinatorConfig
    round_cfg: RoundConfig
    """The grace window's settings, with the run's own overlap (`RunSpec.overlap_steps`)."""
    spec: RunSpec
    shard: Shard
    """The fragments this coordinator merges; shard 0 also keeps the run's clock and ends it."""
    store: ObjectStore
    bus: Bus
    leadership: Leadership
    metrics: Metrics
    timing: PhaseTimes
    """(seconds, CPU seconds) per phase of the loop since start (`coordinator/timing.py`)."""
    view: FleetView
    """The learners as the loop last saw them: live, sending, finished, waited for."""
    epoch: int
    fragments: dict[int, Fragment]
    """This shard's fragments."""
    layout: Layout | None
    """The run's layout: None until the first genesis fixes it."""
    ended: RunEnd | None = None
    """The run's end once it is finished: every contribution is refused from then on."""
    cadence: Cadence | None = None
    clock_offset_s: float = 0.0
    """Redis server time minus this host's (`now`)."""
    unplaced: list[Refusal] = field(default_factory=list)
    """Refusals of entries that name no fragment of the run: listed in the next manifest committed."""
    read_pending: bool = True
    """Read this consumer's own pending entries again before new ones (after a restart, an outage,
    a base this process had not seen)."""

    @property
    def keys(self) -> RunKeys:
        return self.bus.keys

    @property
    def keep_applied(self) -> int:
        """Versions per fragment whose contributions Redis's applied set keeps: older ones are stale."""
        return self.round_cfg.max_staleness + 1

    @property
    def label(self) -> str:
        """What this coordinator holds, for messages: the run, or its shard of the run."""
        return f"run {self.spec.run!r}" if self.shard.count == 1 else f"{self.shard} of run {self.spec.run!r}"

    def now(self) -> float:
        """Redis server time (unix seconds): the clock that arrivals, deadlines and decisions share."""
        return time.time() + self.clock_offset_s

    def heads(self) -> dict[int, int]:
        """This shard's fragments that have a version, and their heads."""
        return {f: frag.head for f, frag in self.fragments.items() if frag.head >= 0}

    def deposed(self, why: str) -> Fenced:
        """Another coordinator holds this shard now: stop renewing, and the Fenced to raise."""
        self.leadership.deposed()
        return Fenced(why)

    def check_epoch(self, doing: str) -> bool:
        """Raise Fenced if another coordinator took this shard over (`doing` says what found out);
        False if Redis has no epoch (it lost its data: the loop rebuilds it)."""
        current = self.bus.epoch()
        if current is not None and current != self.epoch:
            raise self.deposed(f"another coordinator holds {self.label} (epoch {current}, ours {self.epoch}): {doing}")
        return current is not None

    def merged_tokens(self, fragment: int) -> int:
        """The tokens merged into `fragment` up to its head (`Manifest.merged_tokens`)."""
        frag = self.fragments[fragment]
        if frag.merged_tokens is None:
            frag.merged_tokens = (read_manifest(self.store, self.keys, fragment, frag.head).merged_tokens
                                  if frag.head >= 0 else 0)
        return frag.merged_tokens

    def refuse(self, entry_id: str | None, a: Announcement | None, exc: Refused) -> None:
        """Record a refusal (stream, counters, ack) and list it in the next manifest: its fragment's,
        or the next one committed if the entry names no fragment of this shard."""
        refusal = Refusal(contribution_id=a.contribution_id if a else "", learner=a.learner if a else "",
                          object_key=clip_text(a.object_key, MAX_KEY_CHARS) if a else "",
                          code=exc.code, reason=clip_text(exc.reason, MAX_REASON_CHARS))
        log.warning("refused %s from %s (entry %s): %s", exc.code, refusal.learner or "?", entry_id, refusal.reason)
        self.bus.refuse(entry_id, refusal)
        self.metrics.refused(exc.code, a.fragment if a is not None else None)
        if self.ended is not None:
            return  # no manifest follows the end: the refusals stream and the counters keep it
        frag = self.fragments.get(a.fragment) if a is not None else None
        (frag.refused if frag is not None else self.unplaced).append(refusal)
