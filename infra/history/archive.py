"""A run's history as a local directory: `diloco export`, `diloco import`, and `--dir` for the history tools.

An export copies every object under the run's root (`{prefix}/{run}/`: run spec, layout, epoch
claims, genesis proposals, every contribution object, every version's params, outer state and
manifest; not the learners' saved states) to `DIR/{prefix}/{run}/...`, the same keys as files, and records the run in
`DIR/diloco-export.json`. Manifests name their objects by full key, so the keys (prefix included)
are kept as they are: an export is read with `DirStore(DIR)` and the recorded prefix, and an
import puts the objects back under that same prefix. Exports are incremental (objects are
immutable: one already copied with the same size is not fetched again) and every object is
checked against the size the listing reported, so a truncated copy is not mistaken for history.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco.storage.errors import ConfigError, Refused
from diloco.storage.history import params_limit, read_layout, require_run_spec
from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.objects import Store
from diloco.storage.protocol import MAX_RECORD_BYTES
from diloco.storage.settings import ENV_S3_PREFIX

log = logging.getLogger(__name__)

INDEX = "diloco-export.json"
"""The file at the top of an export directory that says which runs it holds, under which prefix."""


@dataclass(frozen=True, slots=True)
class Copied:
    run: str
    objects: int
    """Objects under the run's root."""
    copied: int
    """Of which this call transferred (the others were already there)."""
    bytes: int
    seconds: float

    def line(self, verb: str, where: str) -> str:
        return (f"{verb} run {self.run}: {self.objects} objects ({self.bytes / 1e6:.1f} MB), {self.copied} "
                f"copied, {self.objects - self.copied} already there, {where}, {self.seconds:.1f}s")


def object_limit(store: Store, keys: RunKeys) -> int:
    """The largest object the run may hold: a contribution's limit, a record's, or the read bound of a
    version's params and outer state (`params_limit`) of its largest fragment."""
    spec, layout = require_run_spec(store, keys), read_layout(store, keys)
    versions = [params_limit(layout, f) for f in range(len(layout.fragments))] if layout else []
    return max(spec.max_object_bytes, MAX_RECORD_BYTES, *versions)


def copy_run(source: Store, dest: Store, keys: RunKeys,
             progress: Callable[[int, int], None] | None = None) -> Copied:
    """Copy every object under the run's root from `source` to `dest` (create-only; identical
    objects already in `dest` are kept, different ones raise Conflict). `progress(done, total)`."""
    t0 = time.monotonic()
    limit = object_limit(source, keys)
    present = dict(dest.list_sizes(keys.root))
    # Learners' saved states are not the run's history (a restart's, collected once the run ends).
    listed = [(key, size) for key, size in source.list_sizes(keys.root) if keys.parse_learner_state_key(key) is None]
    copied = total = 0
    for i, (key, size) in enumerate(listed):
        if present.get(key) == size:
            total += size
        else:
            data = source.get(key, max_bytes=limit)
            if len(data) != size:
                raise Refused("truncated", f"{source.url(key)}: read {len(data)} bytes, the listing says {size}")
            dest.put(key, data)
            copied += 1
            total += len(data)
        if progress is not None:
            progress(i + 1, len(listed))
    return Copied(keys.run, len(listed), copied, total, time.monotonic() - t0)


# -- the index of an export directory ------------------------------------------------------------


def read_index(directory: Path) -> dict:
    path = directory / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{directory} is not a diloco export (no {INDEX}): make one with "
                          f"`diloco export --run RUN --dir {directory}`") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from None
    if not isinstance(index, dict) or not isinstance(index.get("runs"), dict):
        raise ConfigError(f"{path} is not an export index (no 'runs' table)")
    return index


def _record(directory: Path, keys: RunKeys, source: str, copied: Copied) -> None:
    try:
        index = read_index(directory)
    except ConfigError:
        index = {"format": 1, "runs": {}}
    index["runs"][keys.run] = {"prefix": keys.prefix, "source": source, "objects": copied.objects,
                               "bytes": copied.bytes, "exported_at": time.time()}
    tmp = directory / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    tmp.replace(directory / INDEX)


def dir_keys(directory: Path, run: str | None) -> RunKeys:
    """The keys of `run` in an export directory (the only run there when `run` is None)."""
    runs = read_index(directory)["runs"]
    if run is None:
        if len(runs) != 1:
            raise ConfigError(f"{directory} holds runs {sorted(runs)}: say which with --run")
        run = next(iter(runs))
    if run not in runs:
        raise ConfigError(f"{directory} holds runs {sorted(runs)}, not {run!r}")
    return RunKeys(str(runs[run]["prefix"]), run)


def export_run(store: Store, keys: RunKeys, directory: Path, *, source: str = "",
               progress: Callable[[int, int], None] | None = None) -> Copied:
    directory.mkdir(parents=True, exist_ok=True)
    copied = copy_run(store, DirStore(directory), keys, progress)
    _record(directory, keys, source or store.url(keys.root), copied)
    return copied


def import_run(directory: Path, store: Store, keys: RunKeys,
               progress: Callable[[int, int], None] | None = None) -> Copied:
    return copy_run(DirStore(directory), store, keys, progress)


def import_keys(directory: Path, run: str | None, env_prefix: str | None) -> RunKeys:
    """The keys an import writes: the exported prefix, which the manifests name. A different
    DILOCO_S3_PREFIX in the environment is refused rather than silently ignored."""
    keys = dir_keys(directory, run)
    if env_prefix and env_prefix != keys.prefix:
        raise ConfigError(f"run {keys.run} was exported from prefix {keys.prefix!r} and its manifests name keys "
                          f"under it, but {ENV_S3_PREFIX}={env_prefix!r}: set {ENV_S3_PREFIX}={keys.prefix} "
                          "to import it")
    return keys
