"""`diloco whatif`: re-derive a range of a run's versions with other settings, into a scratch run.

"What if the outer lr had been 0.5?" For each fragment, the what-if starts from the recorded
parent of the range (its stored params and outer state) and re-derives every version of the
range from the very inputs its manifest records, with the same functions the coordinator merged
with (`merge_weights`, `outer.apply_round`), under the recorded settings with the asked changes.
It writes each re-derived version (params, outer state, and a manifest whose settings record the
change and whose inputs are the original contributions, weighted as re-derived) under a scratch
prefix: the run root `{into}/{run}/` in the same bucket or export directory. The scratch root
also gets the run spec, the layout, a copy of the range's parent version and a Collection record
that says its history starts at the range, so it is a run the history tools read like any other:
`diloco replay --run R --prefix INTO` re-derives it bit for bit. The run's own prefix is only read.

It reports how far each re-derived version is from the recorded one (relative L2 distance of the
params) and, with a task, the eval loss of the recorded and the what-if global model at the end
of the range.

This is a command of its own rather than an option of `diloco replay`: replay only reads, and its
exit code says "bit-exact"; a what-if writes a new run and its result is a distance, not a verdict.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diloco.coordinator.outer import NesterovState, apply_recorded
from diloco.coordinator.publish import decode_state, write_version
from diloco.coordinator.rederive import recomputed_weights
from diloco.infra.history.rounds import Run, check_fragment, open_run, versions
from diloco.infra.history.task_model import check_task_fits, global_model, load_params
from diloco.storage import codecs
from diloco.storage.errors import ConfigError
from diloco.storage.history import Floor, params_limit, read_input, read_manifest, read_params, read_verified
from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.objects import Store
from diloco.storage.protocol import MAX_RECORD_BYTES, MERGES, Collection, Manifest, Scalar, VersionSettings
from diloco.workers.tasks.demo import DemoTask

log = logging.getLogger(__name__)


# -- the settings a what-if may change -------------------------------------------------------------


def _positive(raw: str) -> float:
    value = float(raw)
    if not 0 < value <= torch.finfo(torch.float32).max:  # the outer step's kernels take it as a float32
        raise ValueError(raw)
    return value


def _momentum(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value < 1.0:
        raise ValueError(raw)
    return value


def _merge(raw: str) -> str:
    if raw not in MERGES:
        raise ValueError(raw)
    return raw


def _steps(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(raw)
    return value


def _share(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise ValueError(raw)
    return value


def _boolean(raw: str) -> bool:
    if raw.lower() not in ("true", "false"):
        raise ValueError(raw)
    return raw.lower() == "true"


SETTINGS: dict[str, tuple[str, Callable[[str], Scalar]]] = {
    "outer_lr": ("a number > 0 that float32 holds", _positive),
    "outer_momentum": ("a number in [0, 1)", _momentum),
    "merge": (" or ".join(MERGES), _merge),
    "staleness_discount": ("true or false", _boolean),
    "staleness_relative": ("true or false", _boolean),
    "rate_steps": ("an integer >= 0; 0: slow learners are not raised to the fleet's rate", _steps),
    "lookahead": ("a number in [0, 1]: the share of the momentum's look-ahead every step takes", _share),
    "stale_momentum": ("true or false: stale inputs enter the momentum buffer", _boolean),
    "bounded_momentum": ("true or false: inputs the merge bounded enter the momentum buffer", _boolean),
}
"""Manifest settings the merge and the outer step are configured by (`outer.apply_round`,
`merge_weights`): name -> (what a value must be, parser)."""


def parse_changes(items: Sequence[str]) -> dict[str, Scalar]:
    """`KEY=VALUE` items -> settings. Refuses unknown keys (naming the known ones), bad values and repeats."""
    changes: dict[str, Scalar] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set takes KEY=VALUE, got {item!r}")
        if key not in SETTINGS:
            raise ConfigError(f"a what-if cannot change {key!r}; it can change "
                              + ", ".join(f"{name} ({what})" for name, (what, _) in SETTINGS.items()))
        if key in changes:
            raise ConfigError(f"--set {key} is given twice")
        what, parse = SETTINGS[key]
        try:
            changes[key] = parse(raw)
        except ValueError:
            raise ConfigError(f"{key} must be {what}, got {raw!r}") from None
    return changes


def describe(changes: Mapping[str, Scalar]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "no change"


def whatif_settings(recorded: VersionSettings, changes: Mapping[str, Scalar], source: str) -> VersionSettings:
    """A re-derived version's manifest settings: the recorded ones with the changes, this machine's
    kernels (the ones that computed it), and where it comes from."""
    return dataclasses.replace(recorded, **changes, torch=torch.__version__,
                               cpu_capability=torch.backends.cpu.get_cpu_capability(), whatif_of=source,
                               whatif_changes=describe(changes))


def relative_l2(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    """||a - b|| / ||b|| over every tensor of `b`, in float64: 0.0 exactly when equal, inf if b is 0 and a is not."""
    diff = math.fsum(float((a[n].double() - b[n].double()).square().sum()) for n in b)
    norm = math.fsum(float(b[n].double().square().sum()) for n in b)
    if diff == 0.0:
        return 0.0
    return math.sqrt(diff / norm) if norm > 0 else math.inf


def check_into(keys: RunKeys, into: str) -> RunKeys:
    """The scratch run's keys. Refuses a prefix whose run root is, contains or lies in the run's own."""
    if not into or into.startswith("/") or into.endswith("/") or "//" in into:
        raise ConfigError(f"--into must be a key prefix without leading, trailing or doubled '/', got {into!r}")
    scratch = RunKeys(into, keys.run)
    if scratch.root.startswith(keys.root) or keys.root.startswith(scratch.root):
        raise ConfigError(f"--into {into!r} would write under the run's own objects ({keys.root}): "
                          "choose a prefix of its own, e.g. whatif-1")
    return scratch


def plan_ranges(latest: Mapping[int, int], floors: Mapping[int, Floor], start: int | None,
                end: int | None) -> dict[int, tuple[int, int]]:
    """Per fragment, the (first, last) versions to re-derive: from `start` (default: the first
    replayable version) to `end` (default: the latest). Version 0, the genesis, is never
    re-derived: it is the parent of version 1. Refuses a start whose inputs gc deleted."""
    ranges = {}
    for f, top in sorted(latest.items()):
        floor = floors.get(f)
        if start is not None and floor is not None and start < floor.version:
            raise ConfigError(f"fragment {f} versions below {floor.version} cannot be re-derived, {floor.reason()}: "
                              f"start at version {floor.version} or later")
        first = max(1, floor.version if floor else 0, start or 0)
        last = top if end is None else min(end, top)
        if first <= last:
            ranges[f] = (first, last)
    if not ranges:
        raise ConfigError(f"no version to re-derive in the range asked for (latest versions: {dict(latest)})")
    return ranges


# -- the report --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One re-derived version against the recorded one."""

    fragment: int
    version: int
    drift: float
    """Relative L2 distance of the what-if params from the recorded ones."""
    params_sha256: str
    recorded_params_sha256: str
    outer_state_identical: bool

    @property
    def identical(self) -> bool:
        return self.params_sha256 == self.recorded_params_sha256 and self.outer_state_identical

    def line(self) -> str:
        head = f"fragment {self.fragment} version {self.version}"
        if self.identical:
            return f"{head}: identical to the recorded version (params sha256 {self.params_sha256[:16]}...)"
        return f"{head}: drift {self.drift:.3e} from the recorded params"


@dataclass
class WhatIfReport:
    run: str
    source: str
    """Where the run's history was read (its root)."""
    into: str
    """Where the what-if run was written (its root)."""
    changes: dict[str, Scalar]
    steps: list[Step] = field(default_factory=list)
    final: dict[int, Step] = field(default_factory=dict)
    """Per fragment, the last version re-derived."""
    model_drift: float = 0.0
    """Relative L2 distance of every re-derived fragment's final params, together, from the recorded ones."""
    eval_loss: dict[str, float] | None = None
    """{'recorded': ..., 'whatif': ...}: the task's eval loss of the global model at the end of the range."""
    notes: list[str] = field(default_factory=list)
    replay_command: str = ""
    seconds: float = 0.0

    def summary(self) -> str:
        same = sum(s.identical for s in self.steps)
        lines = [f"what-if of run {self.run} ({describe(self.changes)}) into {self.into}: {len(self.steps)} "
                 f"version(s) re-derived over {len(self.final)} fragment(s), {same} identical to the recorded ones, "
                 f"in {self.seconds:.1f}s",
                 f"drift of the final global model from the recorded one: {self.model_drift:.3e} (relative L2); "
                 + ", ".join(f"fragment {f} at version {s.version}: {s.drift:.3e}" for f, s in self.final.items())]
        if self.eval_loss is not None:
            lines.append(f"eval loss at the end of the range: recorded {self.eval_loss['recorded']:.4f}, "
                         f"what-if {self.eval_loss['whatif']:.4f}")
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(f"replay the what-if run: {self.replay_command}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"run": self.run, "source": self.source, "into": self.into, "changes": self.changes,
                "versions": [dataclasses.asdict(s) | {"identical": s.identical} for s in self.steps],
                "final_drift": {str(f): s.drift for f, s in self.final.items()}, "model_drift": self.model_drift,
                "eval_loss": self.eval_loss, "notes": self.notes, "replay_command": self.replay_command,
                "seconds": round(self.seconds, 3)}


# -- I/O ------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """The run read from (`history`) and the scratch run written (`into`), in one store."""

    history: Run
    into: RunKeys
    changes: dict[str, Scalar]

    @property
    def store(self) -> Store:
        return self.history.store

    @property
    def keys(self) -> RunKeys:
        return self.history.keys

    @property
    def source(self) -> str:
        return self.keys.root.rstrip("/")

    def start_scratch(self, ranges: Mapping[int, tuple[int, int]]) -> None:
        """Run spec, layout and the Collection record that says where the scratch history starts."""
        for src, dst in ((self.keys.run_spec(), self.into.run_spec()), (self.keys.layout(), self.into.layout())):
            self.store.put(dst, self.store.get(src, max_bytes=MAX_RECORD_BYTES))
        floors = tuple(ranges[f][0] if f in ranges else 0 for f in self.history.fragments)
        record = Collection(run=self.keys.run, created_at=time.time(), first_replayable=floors,
                            by=f"whatif of {self.source} ({describe(self.changes)})")
        self.store.put(self.into.collection(1), record.to_wire())

    def copy_parent(self, fragment: int, version: int) -> tuple[dict[str, Tensor], NesterovState]:
        """Copy the recorded version (the range's parent) into the scratch run; return its params and state."""
        m = read_manifest(self.store, self.keys, fragment, version)
        limit = params_limit(self.history.layout, fragment)
        params_blob = read_verified(self.store, m.params_key, m.params_sha256, max_bytes=limit)
        state_blob = read_verified(self.store, m.outer_state_key, m.outer_state_sha256, max_bytes=limit)
        copied = dataclasses.replace(m, params_key=self.into.params(fragment, version, m.epoch),
                                     outer_state_key=self.into.outer_state(fragment, version, m.epoch),
                                     update_key="", update_sha256="", update_bytes=0)  # no learner fetches here
        self.store.put(copied.params_key, params_blob)
        self.store.put(copied.outer_state_key, state_blob)
        self.store.put(self.into.manifest(fragment, version), copied.to_wire())
        params, _ = codecs.decode(params_blob, max_bytes=limit, expect=self.history.layout.shapes(fragment),
                                   hashed=True)
        return params, decode_state(state_blob, limit, hashed=True)

    def rederive(self, m: Manifest, params: Mapping[str, Tensor], state: NesterovState
                 ) -> tuple[dict[str, Tensor], NesterovState, Manifest | None]:
        """Version `m` again from its recorded inputs under the changed settings, written to the
        scratch run unless its params are not finite (then the manifest returned is None)."""
        inputs = [read_input(self.store, self.history.layout, m.fragment, c,
                             max_bytes=self.history.spec.max_object_bytes) for c in m.inputs]
        settings = whatif_settings(m.settings, self.changes, self.source)
        weights = recomputed_weights(m.inputs, m.parent_version, settings)
        new_params, new_state = apply_recorded(params, state, inputs, weights, settings, m.inputs)
        if not all(bool(torch.isfinite(t).all()) for t in [*new_params.values(), *new_state.momentum.values()]):
            return new_params, new_state, None
        written = write_version(self.store, self.into, fragment=m.fragment, version=m.version, params=new_params,
                                state=new_state, refused=m.refused, settings=settings, epoch=m.epoch,
                                inputs=tuple(dataclasses.replace(c, weight=w)
                                             for c, w in zip(m.inputs, weights, strict=True)))
        return new_params, new_state, written


def _open(store: Store, keys: RunKeys, into: str, changes: dict[str, Scalar]) -> _Run:
    scratch = check_into(keys, into)
    history = open_run(store, keys)
    if next(iter(store.list(scratch.root)), None) is not None:
        raise ConfigError(f"{store.url(scratch.root)} already holds objects (an earlier what-if?): choose another "
                          "--into, or delete them first")
    return _Run(history, scratch, changes)


def what_if(store: Store, keys: RunKeys, into: str, changes: dict[str, Scalar], *, fragment: int | None = None,
            start: int | None = None, end: int | None = None, task: DemoTask | None = None,
            progress: Callable[[Step], None] | None = None) -> tuple[WhatIfReport, dict[int, dict[str, Tensor]]]:
    """Re-derive the range under `changes` into the scratch prefix `into`. Returns the report and,
    per fragment, the what-if params at the end of its range. With a `task` (checked against the
    run's layout before anything is written), the report also gets the eval losses (`eval_losses`)."""
    t0 = time.monotonic()
    run = _open(store, keys, into, changes)
    fragments = check_fragment(run.history, fragment)
    if task is not None:
        check_task_fits(task, run.history.layout, keys.run)
    latest = {f: vs[-1] for f in fragments if (vs := versions(run.history, f))}
    ranges = plan_ranges(latest, run.history.floors, start, end)
    run.start_scratch(ranges)
    where = f" --dir {store.root}" if isinstance(store, DirStore) else ""
    report = WhatIfReport(keys.run, store.url(keys.root), store.url(run.into.root), changes,
                          replay_command=f"diloco replay{where} --run {keys.run} --prefix {into}")
    finals: dict[int, dict[str, Tensor]] = {}
    recorded_finals: dict[int, dict[str, Tensor]] = {}
    for f, (first, last) in ranges.items():
        params, state = run.copy_parent(f, first - 1)
        for version in range(first, last + 1):
            m = read_manifest(store, keys, f, version)
            params, state, written = run.rederive(m, params, state)
            if written is None:
                report.notes.append(f"fragment {f} version {version}: the what-if's params are not finite (the "
                                    "setting diverges): the fragment stops at the version before")
                break
            recorded = read_params(store, run.history.layout, m)
            step = Step(f, version, relative_l2(params, recorded), written.params_sha256, m.params_sha256,
                        written.outer_state_sha256 == m.outer_state_sha256)
            report.steps.append(step)
            report.final[f], finals[f], recorded_finals[f] = step, params, recorded
            if progress is not None:
                progress(step)
    report.model_drift = relative_l2(_merged(finals), _merged(recorded_finals))
    report.seconds = time.monotonic() - t0
    if task is not None:
        report.eval_loss = eval_losses(task, run.history, report, finals, end)
    return report, finals


def _merged(per_fragment: Mapping[int, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    return {name: t for tensors in per_fragment.values() for name, t in tensors.items()}


def eval_losses(task: DemoTask, run: Run, report: WhatIfReport, finals: Mapping[int, Mapping[str, Tensor]],
                end: int | None) -> dict[str, float]:
    """The demo task's eval loss of the recorded global model at the end of the range (every
    fragment at its last version there) and of the same model with the what-if's fragments."""
    ends = {f: s.version for f, s in report.final.items()}
    for f in run.fragments:
        committed = versions(run, f, end=end)
        if f not in ends and committed:
            ends[f] = committed[-1]
    recorded = global_model(task, run.store, run.keys, ends)
    whatif = copy.deepcopy(recorded)
    for tensors in finals.values():
        load_params(whatif, tensors)
    return {"recorded": task.eval_loss(recorded), "whatif": task.eval_loss(whatif)}
