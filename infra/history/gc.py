"""`diloco gc --keep-last N`: delete the objects a run no longer needs, and keep its whole record.

What stays, per fragment whose latest listed manifest is version H:
- each learner's newest saved state (`learners/{id}/state/`: what a restart resumes from), none once the
  run is finished;
- every manifest (the run's record), the run spec, the layouts, the epoch claims, the
  Collection records and the learners' loss logs (`losses/`, bounded per learner: `workers/losses.py`);
- everything replaying versions H-N+1..H needs: their inputs (and any object their manifests
  name), the params and outer state of their parent H-N, and their own (learners and a restarted
  coordinator load the head's);
- every object of a version that has no manifest yet: a coordinator is writing it;
- contribution objects that no manifest merged and that may still be merged: the base version in
  their header is within `max_staleness` (as the head's manifest records it) + 1 of the head (the
  coordinator's head may be one behind the listed manifests). Such an object is pending in Redis,
  is being announced, or waits for `reannounce_lost` after Redis lost its data. Heads only grow,
  so one that is too stale now stays too stale;
- every object younger than `min_age_s`: a margin for readers in flight (a learner still
  downloading a version that was just superseded) and for what gc cannot see (a coordinator
  restarted with a larger max_staleness).
Once the run is finished, a version above its end (written as the run ended, withdrawn, its delete
failed) is not part of the run: all of it goes, its manifest too, and so do contributions no
manifest merged (none can be merged any more).
What goes: the params, outer state and update objects of older versions, version objects of another epoch than
the one their manifest names (a deposed or crashed coordinator's), contributions merged only by
older versions, genesis proposals that version 0 did not take, and unmerged contributions too
stale to be merged or whose header does not describe a contribution.

A live run is safe: gc deletes only keys it listed, and every key is written once (create-only,
unique names), so nothing written after the listing is touched. Before its first delete, a pass
writes a Collection record (`collections/{n}`) that says from which version on each fragment can
still be replayed, so a pass cut short is accounted for; running gc again finishes its work.

`plan_gc` is pure (it decides from a listing, the manifests and a header reader); `collect` does
the I/O around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from diloco.infra.output import human_bytes
from diloco.storage import codecs
from diloco.storage.errors import ConfigError, Conflict, Refused
from diloco.storage.history import floors_of, read_collections, read_manifest, read_run_end, require_run_spec
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, Store
from diloco.storage.protocol import Collection, Manifest, ObjectMeta

log = logging.getLogger(__name__)

DEFAULT_MIN_AGE_S = 3600.0
STALENESS_MARGIN = 1
"""Versions beyond max_staleness an unmerged contribution must be behind the listed head to be deleted."""

DELETED = {
    "old_params": "params of versions older than the kept range",
    "old_outer_state": "outer state of versions older than the kept range",
    "old_updates": "update objects of versions older than the kept range (a learner that far behind takes the params)",
    "other_epoch_objects": "version objects their manifest does not name (a deposed or crashed coordinator's)",
    "old_inputs": "contributions and genesis proposals merged only into versions older than the kept range",
    "unchosen_genesis": "genesis proposals that version 0 did not take",
    "stale_contributions": "contributions no manifest merged, too stale to be merged any more",
    "unreadable_contributions": "objects under fragments/ whose header does not describe a contribution",
    "old_learner_states": "learners' saved states older than each learner's newest, or all of them once the run is finished",
    "withdrawn_versions": "every object of a version above the run's end, manifest included (not part of the run)",
    "unmerged_at_end": "contributions no manifest merged, left when the run ended",
}
"""What gc deletes, by kind."""

KEPT = {
    "may_merge": "contributions no manifest merged yet that are recent enough to be merged",
    "young": "objects gc would delete but that are younger than the minimum age",
    "uncommitted_version": "objects of versions whose manifest is not written yet",
}
"""Objects gc looked at and kept, by reason (everything a kept manifest names is kept without a word)."""


@dataclass(frozen=True, slots=True)
class Listed:
    """One object of the listing gc plans from."""

    key: str
    size_bytes: int
    age_s: float
    """Seconds since it was last modified, on the store's clock against this machine's."""


@dataclass(frozen=True, slots=True)
class Deletion:
    key: str
    size_bytes: int
    kind: str
    """A key of DELETED."""


@dataclass
class GcPlan:
    heads: dict[int, int]
    """Per fragment, the latest version whose manifest was listed."""
    first_replayable: dict[int, int]
    """Per fragment, the first version whose replay still has everything it needs once the plan is carried out."""
    deletions: list[Deletion] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=lambda: {reason: [] for reason in KEPT})
    """Keys by a reason of KEPT."""

    def by_kind(self) -> dict[str, list[Deletion]]:
        kinds: dict[str, list[Deletion]] = {kind: [] for kind in DELETED}
        for d in self.deletions:
            kinds[d.kind].append(d)
        return kinds


def committed_versions(keys: RunKeys, listed: list[Listed]) -> dict[int, set[int]]:
    """Per fragment, the versions whose manifest is in the listing."""
    committed: dict[int, set[int]] = {}
    for item in listed:
        parsed = keys.parse_version_key(item.key)
        if parsed and parsed[2] == "manifest":
            committed.setdefault(parsed[0], set()).add(parsed[1])
    return committed


def kept_from(committed: Mapping[int, set[int]], previous: Mapping[int, int], keep_last: int) -> dict[int, int]:
    """Per fragment, the first of the last `keep_last` versions (never below an earlier pass's floor)."""
    return {f: max(previous.get(f, 0), max(vs) - keep_last + 1, 0) for f, vs in committed.items() if vs}


def manifests_to_read(committed: Mapping[int, set[int]], previous: Mapping[int, int]) -> list[tuple[int, int]]:
    """(fragment, version) of the manifests a plan needs, of the `committed_versions`: from the parent
    of the previous pass's first replayable version up (older ones' objects went in earlier passes)."""
    return [(f, v) for f, vs in sorted(committed.items()) for v in sorted(vs) if v >= previous.get(f, 0) - 1]


def _objects(m: Manifest) -> set[str]:
    return {m.params_key, m.outer_state_key} | ({m.update_key} if m.update_key else set())


def _inputs(m: Manifest) -> set[str]:
    return {c.object_key for c in m.inputs}


@dataclass
class _Planner:
    """The facts a plan is decided from, and the decision for one listed object."""

    keys: RunKeys
    committed: Mapping[int, set[int]]
    target: dict[int, int]
    """Per fragment, the first kept version (its parent's objects are kept too)."""
    manifests: Mapping[tuple[int, int], Manifest]
    min_age_s: float
    base_version_of: Callable[[str], int | None]
    kept_names: set[str] = field(default_factory=set)
    """Named by a kept manifest: all a kept version names (refusals too), the parent's params and outer state."""
    old_inputs: set[str] = field(default_factory=set)
    """Merged into a version older than the kept range."""
    newest_states: dict[str, int] = field(default_factory=dict)
    """Per learner, the seq of its newest saved state (what it resumes from); empty once the run is finished."""
    end: Mapping[int, int] | None = None
    """Per fragment, the run's final version (`RunEnd.versions`) once it is finished; None before."""

    def __post_init__(self) -> None:
        for (f, v), m in self.manifests.items():
            if v >= self.target[f] - 1:
                self.kept_names |= _objects(m)
            if v >= self.target[f]:
                self.kept_names |= _inputs(m) | {r.object_key for r in m.refused if r.object_key}
            else:
                self.old_inputs |= _inputs(m)

    def label(self, item: Listed) -> str | None:
        """A kind of DELETED, a reason of KEPT, or None (kept: part of the record or named by a kept manifest)."""
        if item.key in self.kept_names:
            return None
        if (version_key := self.keys.parse_version_key(item.key)) is not None:
            if withdrawn(self.end, version_key[0], version_key[1]):
                return "withdrawn_versions"
            return self._version_object(*version_key)
        if (delta := self.keys.parse_delta_key(item.key)) is not None:
            return self._contribution(item, delta[0])
        if (state := self.keys.parse_learner_state_key(item.key)) is not None:
            return None if self.newest_states.get(state[0]) == state[1] else "old_learner_states"
        if (genesis := self.keys.parse_genesis_key(item.key)) is not None:
            if 0 not in self.committed.get(genesis[1], ()):
                return None  # no version 0 yet: the proposal may still be taken
            return "old_inputs" if item.key in self.old_inputs else "unchosen_genesis"
        return None  # run spec, layouts, epoch claims, Collection records, loss logs

    def _version_object(self, fragment: int, version: int, leaf: str) -> str | None:
        if leaf == "manifest":
            return None
        if version not in self.committed.get(fragment, ()):
            return "uncommitted_version"
        if version >= self.target[fragment] - 1:
            return "other_epoch_objects"  # a kept version's own objects are in kept_names
        if leaf.startswith("params."):
            return "old_params"
        if leaf.startswith("update."):
            return "old_updates"
        return "old_outer_state" if leaf.startswith("outer_state.") else None

    def _contribution(self, item: Listed, fragment: int) -> str:
        if item.key in self.old_inputs:
            return "old_inputs"
        if item.age_s < self.min_age_s:
            return "young"  # and its header need not be read
        if self.end is not None:
            return "unmerged_at_end"
        base = self.base_version_of(item.key)
        if base is None:
            return "unreadable_contributions"
        head = max(self.committed[fragment]) if self.committed.get(fragment) else None
        limit = self._max_staleness(fragment, head)
        # The coordinator refuses a base more than max_staleness behind its head, and heads only grow.
        # Its head may be one behind the listed one (a manifest written, its Redis commit not yet): a margin.
        stale = head is not None and limit is not None and base < head - limit - STALENESS_MARGIN
        return "stale_contributions" if stale else "may_merge"

    def _max_staleness(self, fragment: int, head: int | None) -> int | None:
        m = self.manifests.get((fragment, head)) if head is not None else None
        return m.settings.max_staleness if m is not None else None


def withdrawn(end: Mapping[int, int] | None, fragment: int, version: int) -> bool:
    """Whether `version` of `fragment` lies above the run's end (not part of the run)."""
    return end is not None and end.get(fragment, -1) >= 0 and version > end[fragment]


def plan_gc(keys: RunKeys, listed: list[Listed], committed: Mapping[int, set[int]],
            manifests: Mapping[tuple[int, int], Manifest], previous: Mapping[int, int], *, keep_last: int,
            min_age_s: float, base_version_of: Callable[[str], int | None],
            end: Mapping[int, int] | None = None) -> GcPlan:
    """What to delete and what to keep (see the module docstring). `committed` is
    `committed_versions(keys, listed)`; `manifests` holds at least those `manifests_to_read` names;
    `previous` is each fragment's first replayable version after the earlier passes;
    `base_version_of(key)` reads a contribution's header (None if it does not describe a delta) and
    is called only for unmerged contributions old enough to be deleted. `end`: the run's final
    versions (`RunEnd.versions`) once it is finished."""
    committed = {f: {v for v in vs if not withdrawn(end, f, v)} for f, vs in committed.items()}
    manifests = {(f, v): m for (f, v), m in manifests.items() if not withdrawn(end, f, v)}
    target = kept_from(committed, previous, keep_last)
    planner = _Planner(keys, committed, target, manifests, min_age_s, base_version_of, end=end)
    if end is None and not any(item.key == keys.finished_record() for item in listed):  # a finished run resumes nobody
        for item in listed:
            if (state := keys.parse_learner_state_key(item.key)) is not None:
                planner.newest_states[state[0]] = max(state[1], planner.newest_states.get(state[0], -1))
    plan = GcPlan(heads={f: max(vs) for f, vs in committed.items() if vs}, first_replayable={})
    for item in listed:
        what = planner.label(item)
        if what in DELETED and item.age_s < min_age_s:
            what = "young"
        if what in DELETED:
            plan.deletions.append(Deletion(item.key, item.size_bytes, what))
        elif what in KEPT:
            plan.kept[what].append(item.key)
    doomed = {d.key for d in plan.deletions}
    for f, first in target.items():
        # Objects kept for their age may leave older versions replayable still: the record says so.
        while first > previous.get(f, 0) and _replayable(manifests, f, first - 1, doomed):
            first -= 1
        plan.first_replayable[f] = first
    return plan


def _replayable(manifests: Mapping[tuple[int, int], Manifest], fragment: int, version: int, doomed: set[str]) -> bool:
    """Whether replay of `version` finds all it reads once `doomed` is deleted: its inputs, its own
    objects and its parent's."""
    m = manifests.get((fragment, version))
    parent = manifests.get((fragment, version - 1))
    if m is None or (version > 0 and parent is None):
        return False
    needed = _inputs(m) | _objects(m) | (_objects(parent) if parent is not None else set())
    return not needed & doomed


# -- I/O ------------------------------------------------------------------------------------------


@dataclass
class GcResult:
    run: str
    keep_last: int
    min_age_s: float
    dry_run: bool
    plan: GcPlan
    record_key: str | None
    """The Collection record written before deleting (None on a dry run or when nothing was deleted)."""
    seconds: float

    @property
    def deleted_bytes(self) -> int:
        return sum(d.size_bytes for d in self.plan.deletions)

    def summary(self, *, list_keys: bool = False) -> str:
        n, verb = len(self.plan.deletions), "would delete" if self.dry_run else "deleted"
        lines = [f"gc of run {self.run}: keeping the last {self.keep_last} version(s) of each fragment and every "
                 f"object younger than {self.min_age_s:g}s" + (" (dry run: nothing deleted)" if self.dry_run else ""),
                 f"{verb} {n} object(s), {_size(self.deleted_bytes)}"
                 + (f", after writing {self.record_key}" if self.record_key else "") + (":" if n else "")]
        for kind, items in self.plan.by_kind().items():
            if items:
                lines.append(f"  {kind:<26} {len(items):>6} object(s) {_size(sum(d.size_bytes for d in items)):>10}")
                lines.extend(f"    {d.key}" for d in items if list_keys)
        kept = self.plan.kept
        lines.append(f"kept: {len(kept['may_merge'])} unmerged contribution(s) that may still be merged, "
                     f"{len(kept['young'])} object(s) younger than {self.min_age_s:g}s, "
                     f"{len(kept['uncommitted_version'])} object(s) of versions being written")
        if list_keys:
            lines.extend(f"    {reason}: {key}" for reason, keys in kept.items() for key in keys)
        lines.append("replayable: " + (", ".join(
            f"fragment {f} " + _versions(self.plan.first_replayable[f], h) for f, h in sorted(self.plan.heads.items()))
            or "no committed version"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"run": self.run, "dry_run": self.dry_run, "keep_last": self.keep_last, "min_age_s": self.min_age_s,
                "heads": self.plan.heads, "first_replayable": self.plan.first_replayable, "record": self.record_key,
                "deleted": {"objects": len(self.plan.deletions), "bytes": self.deleted_bytes,
                            "by_kind": {kind: {"objects": len(items), "bytes": sum(d.size_bytes for d in items),
                                               "keys": [d.key for d in items]}
                                        for kind, items in self.plan.by_kind().items()}},
                "kept": self.plan.kept, "seconds": round(self.seconds, 3)}


def _versions(first: int, last: int) -> str:
    return f"version {last}" if first == last else f"versions {first}..{last}"


def _size(n: int) -> str:
    return human_bytes(n)


def list_objects(store: Store, prefix: str, now: float) -> list[Listed]:
    """Every object under `prefix` with its size and age, from one listing."""
    return [Listed(key, size, now - modified) for key, size, modified in store.list_stat(prefix)]


def header_reader(store: Store, max_bytes: int) -> Callable[[str], int | None]:
    """base_version_of for plan_gc: the base version a contribution's header names, or None."""
    def base_version(key: str) -> int | None:
        try:
            meta = ObjectMeta.from_meta(codecs.read_header(store.get(key, max_bytes=max_bytes),
                                                           max_bytes=max_bytes).meta, key)
            return meta.base_version if meta.kind == "delta" else None
        except (Refused, ObjectMissing, KeyError, ValueError, TypeError):
            return None
    return base_version


def collect(store: Store, keys: RunKeys, *, keep_last: int, min_age_s: float = DEFAULT_MIN_AGE_S,
            dry_run: bool = False, progress: Callable[[int, int], None] | None = None) -> GcResult:
    """Plan a gc pass of the run and, unless `dry_run`, record it and carry it out. `progress(done,
    total)` follows the manifests read, the long part of a pass over a long run."""
    if keep_last < 1:
        raise ConfigError(f"--keep-last must be at least 1, got {keep_last}: the head's params are what learners "
                          "and a restarted coordinator load, and its inputs are what replay checks")
    if min_age_s < 0:
        raise ConfigError(f"--min-age-s must be >= 0, got {min_age_s}")
    t0, now = time.monotonic(), time.time()
    spec = require_run_spec(store, keys)
    collections = read_collections(store, keys)
    previous = {f: floor.version for f, floor in floors_of(collections).items()}
    listed = list_objects(store, keys.root, now)
    committed = committed_versions(keys, listed)
    wanted = list(manifests_to_read(committed, previous))
    manifests = {}
    for i, (f, v) in enumerate(wanted):
        manifests[f, v] = read_manifest(store, keys, f, v)
        if progress is not None:
            progress(i + 1, len(wanted))
    end = read_run_end(store, keys)
    plan = plan_gc(keys, listed, committed, manifests, previous, keep_last=keep_last, min_age_s=min_age_s,
                   base_version_of=header_reader(store, spec.max_object_bytes),
                   end=dict(enumerate(end.versions)) if end is not None else None)
    result = GcResult(keys.run, keep_last, min_age_s, dry_run, plan, None, 0.0)
    if not dry_run and plan.deletions:
        result.record_key = _record(store, keys, collections, result, spec.num_fragments, previous)
        store.delete([d.key for d in plan.deletions])
    result.seconds = time.monotonic() - t0
    return result


def _record(store: Store, keys: RunKeys, collections: list[tuple[str, Collection]], result: GcResult,
            num_fragments: int, previous: Mapping[int, int]) -> str:
    """Write the pass's Collection record (create-only, numbered after the last one) and return its key."""
    number = int(collections[-1][0].rsplit("/", 1)[1]) + 1 if collections else 1
    key = keys.collection(number)
    floors = tuple(result.plan.first_replayable.get(f, previous.get(f, 0)) for f in range(num_fragments))
    record = Collection(run=keys.run, created_at=time.time(),
                        by=f"gc --keep-last {result.keep_last} --min-age-s {result.min_age_s:g}",
                        first_replayable=floors, deleted_objects=len(result.plan.deletions),
                        deleted_bytes=result.deleted_bytes)
    try:
        store.put(key, record.to_wire(), create_only=True)
    except Conflict:
        raise Conflict(f"{store.url(key)} was written by another gc pass while this one planned: nothing was "
                       "deleted; run gc again") from None
    return key
