"""`diloco replay`: re-derive committed versions from S3 alone and check them bit for bit.

For each fragment and each version in the range, in order: read the manifest, fetch every input
object it names (checked against the recorded sha256, decoded against the layout), take the
parent's params and outer state, and let `coordinator.rederive.rederive` recompute the version and
compare sha256s. The stored params and outer-state objects are also checked against the
manifest, since learners and a restarted coordinator read those. Redis is never contacted.

The parent of a version is the re-derived previous version when that one was bit-exact (then its
bytes equal the stored ones), else the stored objects, verified: each version is checked on its
own, so one divergence does not hide another later one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from diloco.coordinator.outer import NesterovState
from diloco.coordinator.rederive import Problem, rederive
from diloco.infra.history.rounds import Run, check_fragment, open_run, read_state, versions
from diloco.storage.errors import Refused
from diloco.storage.history import Floor, blake3_hex, params_limit, read_input, read_manifest, read_verified
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, Store
from diloco.storage.protocol import Manifest
from diloco.storage.updates import apply_update

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VersionCheck:
    """The outcome of replaying one version."""

    fragment: int
    version: int
    inputs: int
    problems: tuple[Problem, ...]
    seconds: float

    @property
    def bit_exact(self) -> bool:
        return not self.problems

    @property
    def collected(self) -> bool:
        """Not checked: `diloco gc` deleted what replaying it needs."""
        return any(p.code == "collected" for p in self.problems)

    def line(self) -> str:
        head = f"fragment {self.fragment} version {self.version}"
        if self.bit_exact:
            return f"{head}: bit-exact ({self.inputs} input(s), {self.seconds:.2f}s)"
        if self.collected:
            return f"{head}: COLLECTED: {self.problems[0].detail}"
        return f"{head}: DIVERGED: " + "; ".join(f"{p.code}: {p.detail}" for p in self.problems)


@dataclass
class ReplayReport:
    run: str
    fragments: list[int]
    checks: list[VersionCheck] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """Things a reader of a divergence should know (another torch build or CPU kernel than recorded)."""

    @property
    def diverged(self) -> list[VersionCheck]:
        return [c for c in self.checks if not c.bit_exact and not c.collected]

    @property
    def collected(self) -> list[VersionCheck]:
        """Versions asked for whose inputs gc deleted: not checked, and not a success."""
        return [c for c in self.checks if c.collected]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.diverged and not self.collected

    def summary(self) -> str:
        exact = len(self.checks) - len(self.diverged) - len(self.collected)
        collected = f", {len(self.collected)} collected (not replayable here)" if self.collected else ""
        lines = [f"replay of run {self.run}: {len(self.checks)} version(s) checked over "
                 f"{len(self.fragments)} fragment(s), {exact} bit-exact, {len(self.diverged)} diverged{collected}, "
                 f"in {self.seconds:.1f}s"]
        if self.collected:
            lines.append(f"first collected: fragment {self.collected[0].fragment} version "
                         f"{self.collected[0].version}: {self.collected[0].problems[0].detail}")
        firsts: dict[int, VersionCheck] = {}
        for c in self.diverged:
            firsts.setdefault(c.fragment, c)
        for i, c in enumerate(firsts.values()):
            p = c.problems[0]
            more = f" (+{len(c.problems) - 1} more)" if len(c.problems) > 1 else ""
            label = "first divergence" if i == 0 else "first divergence of another fragment"
            lines.append(f"{label}: fragment {c.fragment} version {c.version}: {p.code}: {p.detail}{more}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict:
        first = self.diverged[0] if self.diverged else None
        return {"run": self.run, "fragments": self.fragments, "checked": len(self.checks),
                "bit_exact": len(self.checks) - len(self.diverged) - len(self.collected),
                "diverged": len(self.diverged), "collected": len(self.collected),
                "ok": self.ok, "seconds": round(self.seconds, 3), "notes": self.notes,
                "first_divergence": None if first is None else _check_json(first),
                "versions": [_check_json(c) for c in self.checks]}


def _check_json(c: VersionCheck) -> dict:
    return {"fragment": c.fragment, "version": c.version, "inputs": c.inputs, "bit_exact": c.bit_exact,
            "seconds": round(c.seconds, 4), "problems": [asdict(p) for p in c.problems]}


class _Fragment:
    """Replays the versions of one fragment in order, carrying the parent forward."""

    def __init__(self, run: Run, fragment: int) -> None:
        self.run, self.fragment = run, fragment
        self.limit = params_limit(run.layout, fragment)
        self.parent: tuple[dict[str, torch.Tensor], NesterovState] | None = None

    def check(self, version: int, present: bool) -> tuple[VersionCheck, Manifest | None]:
        t0 = time.monotonic()
        # Set again only by a bit-exact re-derivation; else the next version starts from the stored objects.
        parent, self.parent = self.parent, None
        manifest, problems, n_inputs = None, [], 0
        try:
            if not present:
                raise ObjectMissing("no such object, although a later version of the fragment has a manifest")
            manifest = read_manifest(self.run.store, self.run.keys, self.fragment, version)
            n_inputs = len(manifest.inputs)
            problems = self._replay(manifest, parent)
        except (ObjectMissing, Refused) as exc:
            problems = [Problem("manifest", f"{self.run.keys.manifest(self.fragment, version)}: {exc}")]
        return VersionCheck(self.fragment, version, n_inputs, tuple(problems), time.monotonic() - t0), manifest

    def _replay(self, manifest: Manifest, parent: tuple[dict[str, torch.Tensor], NesterovState] | None
                ) -> list[Problem]:
        problems: list[Problem] = []
        inputs = []
        for i, c in enumerate(manifest.inputs):
            try:
                inputs.append(read_input(self.run.store, self.run.layout, self.fragment, c,
                                         max_bytes=self.run.spec.max_object_bytes))
            except ObjectMissing:
                problems.append(Problem("missing_input", f"input {i} ({c.learner}) {c.object_key} is missing "
                                        "from the bucket"))
            except Refused as exc:
                problems.append(Problem("corrupt_input", f"input {i} ({c.learner}): {exc}"))
        if manifest.version > 0 and parent is None:
            try:
                parent = read_state(self.run, read_manifest(self.run.store, self.run.keys, self.fragment,
                                                            manifest.version - 1))
            except (ObjectMissing, Refused) as exc:
                problems.append(Problem("parent", f"the parent version {manifest.version - 1} cannot be read: {exc}"))
        if not problems:
            params, state = parent if parent is not None else (None, None)
            result = rederive(manifest, self.run.keys, inputs, parent_params=params, parent_state=state)
            problems.extend(result.problems)
            if result.bit_exact:
                assert result.params is not None and result.state is not None
                self.parent = (result.params, result.state)
                if params is not None:
                    problems.extend(self._check_update(manifest, params, result.params))
        problems.extend(self._check_stored(manifest))
        return problems

    def _check_update(self, m: Manifest, parent: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
                      ) -> list[Problem]:
        """The update object learners take instead of the params must land on them, bit for bit."""
        if not m.update_key:
            return []
        try:
            blob = read_verified(self.run.store, m.update_key, m.update_sha256, max_bytes=self.limit)
            applied = apply_update(parent, blob, max_bytes=self.limit, expect=self.run.layout.shapes(self.fragment))
        except ObjectMissing:
            return [Problem("stored_update", f"{m.update_key} is missing from the bucket")]
        except Refused as exc:
            return [Problem("stored_update", str(exc))]
        if any(not torch.equal(applied[n], params[n]) for n in params):
            return [Problem("stored_update", f"{m.update_key} applied to the parent does not give the params")]
        return []

    def _check_stored(self, m: Manifest) -> list[Problem]:
        """The stored objects learners read must be the ones the manifest names."""
        problems = []
        for code, key, sha in (("stored_params", m.params_key, m.params_sha256),
                               ("stored_outer_state", m.outer_state_key, m.outer_state_sha256)):
            try:
                blob = read_verified(self.run.store, key, sha, max_bytes=self.limit)
                if code == "stored_params" and m.params_blake3 and blake3_hex(blob) not in ("", m.params_blake3):
                    problems.append(Problem(code, f"{key}: BLAKE3 does not match the recorded {m.params_blake3[:12]}... "
                                                  "(learners check the params they make from updates against it)"))
            except ObjectMissing:
                problems.append(Problem(code, f"{key} is missing from the bucket"))
            except Refused as exc:
                problems.append(Problem(code, str(exc)))
        return problems


def _collected(fragment: int, version: int, floor: Floor) -> VersionCheck:
    return VersionCheck(fragment, version, 0, (Problem(
        "collected", f"not replayable: {floor.reason()}; the first version of fragment {fragment} that can be "
        f"replayed is {floor.version}"),), 0.0)


def replay_run(store: Store, keys: RunKeys, *, fragment: int | None = None, start: int | None = None,
               end: int | None = None, progress: Callable[[VersionCheck], None] | None = None) -> ReplayReport:
    """Replay versions `start`..`end` (default: the latest) of one fragment or all of them.

    By default each fragment starts at its first replayable version: versions whose inputs
    `diloco gc` removed (the run's Collection records) are skipped with a note. A `start` below
    that reports each such version as `collected`, naming the gc pass, rather than as missing objects.
    Raises Refused('missing_object') if the run has no spec or layout in the bucket."""
    t0 = time.monotonic()
    run = open_run(store, keys)
    report = ReplayReport(run=keys.run, fragments=check_fragment(run, fragment))
    recorded: set[tuple[str, str]] = set()
    for f in report.fragments:
        stored = versions(run, f)
        if not stored:
            continue
        replayer = _Fragment(run, f)
        present = set(stored)
        last = stored[-1] if end is None else min(end, stored[-1])
        floor = run.floors.get(f)
        first = start if start is not None else floor.version if floor else 0
        if start is None and floor is not None:
            report.notes.append(f"fragment {f}: replay starts at version {floor.version}: the versions before are "
                                f"not replayable, {floor.reason()}")
        for version in range(first, last + 1):
            if floor is not None and version < floor.version:
                check, manifest = _collected(f, version, floor), None
            else:
                check, manifest = replayer.check(version, version in present)
            report.checks.append(check)
            if manifest is not None and manifest.settings.torch:  # recorded since
                recorded.add((manifest.settings.torch, manifest.settings.cpu_capability))
            if progress is not None:
                progress(check)
    here = (torch.__version__, str(torch.backends.cpu.get_cpu_capability()))
    for torch_version, capability in sorted(recorded - {here}):
        report.notes.append(f"some versions were made with torch {torch_version} on {capability} kernels; this "
                            f"replay ran torch {here[0]} on {here[1]} (pin ATEN_CPU_CAPABILITY={capability.lower()} "
                            "if outer steps diverge)")
    report.seconds = time.monotonic() - t0
    return report
