"""The chaos suite's accounting: what became of every announced contribution, from S3 and Redis.

Identity is the announcement's `contribution_id`. The sources of truth:
- announced: every distinct id of a `delta` entry on the announcements stream (XRANGE at the end;
  the stream is never trimmed), united with what a `StreamWatcher` saw while the run went on. An
  entry Redis forgot (a restart that lost writes, a restore from an older snapshot) counts all the
  same, and once: the coordinator announces such a contribution again from S3, under a new entry
  id and the same contribution id;
- applied: the `inputs` of every manifest in S3;
- refused, and dropped as stale (code `stale`): the refusals stream in Redis and the `refused`
  lists of the manifests (a refusal reaches a manifest only once a version is committed after it);
- pending: entries still in the consumer group's pending list, or not delivered to it yet.

It reads Redis itself, not through `Bus`: an auditor that shared the readers it audits would share
their mistakes.

`account(evidence)` is pure and sorts every announced id into exactly one outcome, in this
order: applied (in some manifest), dropped (refused as stale), refused (any other code except
`duplicate`), pending, else lost. A `duplicate` refusal is not an outcome: it refuses a second
copy of an entry (a retried XADD may land twice), and the first copy must have an outcome of its
own. An id in the inputs of two manifests, or twice in one, is duplicated.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import Counter
from dataclasses import dataclass, field

import redis

from diloco.coordinator.policy import RECENT_ROUNDS
from diloco.storage.bus import Bus
from diloco.storage.history import read_manifest
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Announcement, Contribution, Manifest, Refusal

log = logging.getLogger(__name__)


@dataclass
class Evidence:
    """Everything the accounting reads, gathered from S3 and Redis once the run has stopped."""

    announced: set[str]
    manifests: dict[int, list[Manifest]]
    """Fragment -> its manifests found in S3, by version."""
    s3_versions: dict[int, list[int]]
    """Fragment -> the version numbers whose manifest exists in S3 (listing)."""
    redis_heads: dict[int, int]
    refusals: list[Refusal]
    """The refusals stream (the manifests' `refused` lists are read from `manifests`)."""
    pending: set[str]


@dataclass
class Ledger:
    announced: set[str]
    applied: set[str]
    refused: set[str]
    dropped: set[str]
    pending: set[str]
    lost: set[str]
    duplicated: set[str]
    unannounced: set[str]
    """Applied ids that no announcement names (other than genesis): should be empty."""
    refusal_codes: dict[str, str] = field(default_factory=dict)
    """id -> the code of the refusal that decided its outcome (refused or dropped)."""
    round_share: dict[str, tuple[float, int, float, float]] = field(default_factory=dict)
    """Applied id -> (the share of its round's weight that its learner's pieces took, the learners
    in that round, its learner's counted weight and its pieces' norms in that round over the
    median of the other learners' rounds they are bounded by: `round_shares`)."""
    versions_committed: int = 0
    problems: list[str] = field(default_factory=list)
    """Broken version chains: gaps, wrong parents, Redis heads that disagree with S3."""

    def figures(self) -> dict[str, int]:
        return {"versions_committed": self.versions_committed, "applied": len(self.applied),
                "refused": len(self.refused), "dropped": len(self.dropped), "pending": len(self.pending),
                "announced": len(self.announced), "lost": len(self.lost), "duplicated": len(self.duplicated)}


def account(ev: Evidence) -> Ledger:
    inputs = Counter(c.contribution_id for ms in ev.manifests.values() for m in ms for c in m.inputs)
    genesis = {c.contribution_id for ms in ev.manifests.values() for m in ms if m.version == 0 for c in m.inputs}
    applied = ev.announced & set(inputs)
    codes: dict[str, str] = {}
    for r in [*ev.refusals, *(r for ms in ev.manifests.values() for m in ms for r in m.refused)]:
        if r.contribution_id and r.code != "duplicate" and codes.get(r.contribution_id) != "stale":
            codes[r.contribution_id] = r.code  # a stale verdict wins: the id is dropped, whatever else
    left = ev.announced - applied
    dropped = {i for i in left if codes.get(i) == "stale"}
    refused = {i for i in left - dropped if i in codes}
    pending = (left - dropped - refused) & ev.pending
    lost = left - dropped - refused - pending
    return Ledger(announced=set(ev.announced), applied=applied, refused=refused, dropped=dropped, pending=pending,
                  lost=lost, duplicated={i for i, n in inputs.items() if n > 1},
                  unannounced=set(inputs) - ev.announced - genesis,
                  refusal_codes={i: codes[i] for i in refused | dropped}, round_share=round_shares(ev),
                  versions_committed=sum(len(v) for v in ev.s3_versions.values()),
                  problems=chain_problems(ev))


def round_shares(ev: Evidence) -> dict[str, tuple[float, int, float, float]]:
    """For every input: the share of its version's weight its learner took (all of that learner's
    pieces in the version), how many learners the version merged, and what its learner's pieces in
    that version counted together against the other learners' rounds that the coordinator bounds
    them by (`coordinator.influence.count_claims` and `clip_norms`: those of the same version and of
    the fragment's RECENT_ROUNDS merged versions before it): their merge weight (tokens x tokens per
    step, summed) over the median of the others', and the sum of their norms as merged (x clip) over
    the median of the others' sums, or of this version's other learners' when larger (a backlog: the
    bound `clip_norms` applies) (nan with no other learner, or no norms recorded)."""
    out = {}
    for ms in ev.manifests.values():
        deltas = sorted((m for m in ms if m.version > 0), key=lambda m: m.version)
        rounds = [_per_learner(m.inputs) for m in deltas]
        for i, m in enumerate(deltas):
            total = math.fsum(c.weight for c in m.inputs)
            took = {learner: math.fsum(c.weight for c in m.inputs if c.learner == learner)
                    for learner in {c.learner for c in m.inputs}}
            window = [e for r in rounds[max(0, i - RECENT_ROUNDS):i + 1] for e in r.items()]
            for c in m.inputs:
                weight, reach = rounds[i][c.learner]
                others = [e for g, e in window if g != c.learner]
                here = [n for g, (_, n) in rounds[i].items() if g != c.learner and not math.isnan(n)]
                # Norms against the others' recent rounds, or this round's others when they sent more
                # (a backlog), as `clip_norms` bounds them.
                floor = statistics.median(here) if here else 0.0
                out[c.contribution_id] = (took[c.learner] / total if total > 0 else 0.0, len(took),
                                          _ratio(weight, [w for w, _ in others]),
                                          _ratio(reach, [n for _, n in others], floor))
    return out


def _per_learner(inputs: tuple[Contribution, ...]) -> dict[str, tuple[float, float]]:
    """Each learner of a version: its pieces' merge weight together, and their norms' sum as merged
    (nan if a norm is not recorded)."""
    out = {}
    for learner in {c.learner for c in inputs}:
        mine = [c for c in inputs if c.learner == learner]
        tokens, steps = sum(c.tokens for c in mine), sum(c.steps for c in mine)
        reach = math.fsum(math.nan if c.norm is None else c.clip * c.norm for c in mine)
        out[learner] = (tokens * tokens / steps if steps > 0 else 0.0, reach)
    return out


def _ratio(value: float, others: list[float], floor: float = 0.0) -> float:
    """`value` over the median of `others` (or `floor` when larger); nan without others."""
    others = [o for o in others if not math.isnan(o)]
    if not others or math.isnan(value):
        return math.nan
    median = max(statistics.median(others), floor)
    return value / median if median > 0 else math.inf


def chain_problems(ev: Evidence) -> list[str]:
    """Versions contiguous per fragment: manifests 0..head all in S3, and Redis's head the last
    one. (Each manifest names version - 1 as its parent: `Manifest` refuses anything else.)"""
    problems = []
    for fragment, versions in sorted(ev.s3_versions.items()):
        if versions != list(range(len(versions))):
            missing = sorted(set(range(max(versions, default=-1) + 1)) - set(versions))
            problems.append(f"fragment {fragment}: versions {missing} missing in S3")
        head = versions[-1] if versions else None
        if ev.redis_heads.get(fragment) != head:
            problems.append(f"fragment {fragment}: Redis head {ev.redis_heads.get(fragment)}, S3 head {head}")
    return problems


# ---- gathering the evidence ----------------------------------------------------------------

def gather(store: ObjectStore, bus: Bus, num_fragments: int, watched: set[str]) -> Evidence:
    """Read S3 and Redis once the run has stopped (no coordinator or learner running)."""
    keys = bus.keys
    stream = {eid: a if isinstance(a, Announcement) else None for eid, a in bus.announcement_entries()}
    announced = {a.contribution_id for a in stream.values() if a is not None and a.kind == "delta"} | watched
    s3_versions: dict[int, list[int]] = {}
    manifests: dict[int, list[Manifest]] = {}
    for fragment in range(num_fragments):
        found = [keys.parse_version_key(k) for k in store.list(keys.versions_prefix(fragment))]
        s3_versions[fragment] = sorted(p[1] for p in found if p and p[2] == "manifest")
        manifests[fragment] = [read_manifest(store, keys, fragment, v) for v in s3_versions[fragment]]
    refusals = bus.refusals(count=10**7)
    pending_ids = bus.unfinished_entries(list(stream))
    pending = {a.contribution_id for eid, a in stream.items() if eid in pending_ids and a is not None}
    return Evidence(announced=announced, manifests=manifests, s3_versions=s3_versions, redis_heads=bus.heads(),
                    refusals=refusals, pending=pending)


class StreamWatcher(threading.Thread):
    """Tails the announcements stream while the run goes on, so that an entry Redis forgot later
    (a restart that lost writes, a restore from an older snapshot) still counts as announced. Rides
    out Redis restarts; after a restore, entries are new ids past the last one it saw (Redis
    stamps them with its clock), so it reads on from there."""

    def __init__(self, bus: Bus) -> None:
        super().__init__(name="stream-watcher", daemon=True)
        self.bus = bus
        self.seen: set[str] = set()
        self.errors = 0
        self._halt = threading.Event()
        self._last = "0"

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll(block_ms=500)
            except redis.RedisError:
                self.errors += 1
                self._halt.wait(0.5)

    def poll(self, block_ms: int | None = None) -> None:
        for eid, a in self.bus.announcements_after(self._last, count=1000, block_ms=block_ms):
            self._last = eid
            if isinstance(a, Announcement) and a.kind == "delta":
                self.seen.add(a.contribution_id)

    def stop(self) -> set[str]:
        """Stop, after one last read to the end of the stream; what it saw."""
        self._halt.set()
        if self.ident is not None:  # started
            self.join(timeout=5.0)
        try:
            while True:
                before = self._last
                self.poll()
                if self._last == before:
                    break
        except redis.RedisError as exc:
            log.warning("stream watcher: last read failed: %s", exc)
        return set(self.seen)
