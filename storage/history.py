"""Reading a run's durable history from S3, verified. Both sides and the tools use these.

Everything here works with S3 alone (no Redis): run spec, layout, manifests, version params.
Every object is size-bounded before it is read and checked (sha256 against the manifest, shapes
against the layout, finite values) before it is returned.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from diloco.storage import codecs
from diloco.storage.errors import Refused
from diloco.storage.intraop import paced_views
from diloco.storage.keys import RunKeys
from diloco.storage.objects import Body, ObjectMissing, Store, views_of
from diloco.storage.protocol import (MAX_MESSAGE_BYTES, MAX_RECORD_BYTES, Collection, Contribution, Layout, Manifest,
                                     RunEnd, RunSpec, VersionEvent)

try:
    import blake3
except ImportError:  # an install without its dependencies (a wheel set copied by hand): sha256 alone
    blake3 = None


def sha256_hex(data: bytes | Body) -> str:
    """The sha256 of an object's bytes, bytes or a `Body` (hashed view by view: no joined copy)."""
    return _hex(hashlib.sha256(), data)


def blake3_hex(data: bytes | Body) -> str:
    """The BLAKE3 (256 bits) of an object's bytes, as `sha256_hex`, on the calling thread only; ""
    where the blake3 package is missing (a dependency, but an install by hand may lack it: then
    manifests record none and learners check the params' sha256)."""
    if blake3 is None:
        return ""
    return _hex(blake3.blake3(max_threads=1), data)


def params_match(body: bytes | Body, recorded: Manifest | VersionEvent) -> bool:
    """Whether a params object's bytes are the ones `recorded` (a version's manifest or event)
    names: by their BLAKE3 where one is recorded and blake3 is installed, else by their sha256."""
    digest = blake3_hex(body) if recorded.params_blake3 else ""
    return digest == recorded.params_blake3 if digest else sha256_hex(body) == recorded.params_sha256


def _hex(digest: Any, data: bytes | Body) -> str:
    for view in views_of(data):
        for part in paced_views(view):
            digest.update(part)
    return digest.hexdigest()


def read_run_spec(store: Store, keys: RunKeys) -> RunSpec | None:
    try:
        return RunSpec.from_wire(store.get(keys.run_spec(), max_bytes=MAX_RECORD_BYTES))
    except ObjectMissing:
        return None


def require_run_spec(store: Store, keys: RunKeys) -> RunSpec:
    """The run's spec, for a tool that needs the run to exist. Raises Refused('missing_object'),
    naming where it looked, if it does not."""
    spec = read_run_spec(store, keys)
    if spec is None:
        raise Refused("missing_object", f"run {keys.run!r} has no run spec at {store.url(keys.run_spec())}: "
                      "wrong run, bucket, DILOCO_S3_PREFIX or --dir?")
    return spec


def read_run_end(store: Store, keys: RunKeys) -> RunEnd | None:
    """The run's end (`finished.msgpack`), or None while it is not finished."""
    try:
        return RunEnd.from_wire(store.get(keys.finished_record(), max_bytes=MAX_MESSAGE_BYTES))
    except ObjectMissing:
        return None


def read_layout(store: Store, keys: RunKeys) -> Layout | None:
    try:
        return Layout.from_wire(store.get(keys.layout(), max_bytes=MAX_RECORD_BYTES))
    except ObjectMissing:
        return None


def read_manifest(store: Store, keys: RunKeys, fragment: int, version: int) -> Manifest:
    manifest = Manifest.from_wire(store.get(keys.manifest(fragment, version), max_bytes=MAX_RECORD_BYTES))
    if manifest.run != keys.run or manifest.fragment != fragment or manifest.version != version:
        raise Refused("misaddressed", f"manifest at {keys.manifest(fragment, version)} describes run "
                      f"{manifest.run!r} fragment {manifest.fragment} version {manifest.version}")
    return manifest


def read_verified(store: Store, key: str, sha256: str, *, max_bytes: int, buffer: bool = False) -> bytes | bytearray:
    """The object at `key`, refused unless its sha256 is `sha256`; `buffer`: read into one writable
    buffer (`Store.get_buffer`), for `codecs.decode(in_place=True)`."""
    blob = store.get_buffer(key, max_bytes=max_bytes) if buffer else store.get(key, max_bytes=max_bytes)
    actual = sha256_hex(blob)
    if actual != sha256:
        raise Refused("sha256_mismatch", f"{key}: sha256 {actual[:12]}... does not match the recorded {sha256[:12]}...")
    return blob


def read_params(store: Store, layout: Layout, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The global parameters of a committed version, checked against manifest and layout: views of
    the one buffer the object was read into (fp32, uncompressed)."""
    limit = params_limit(layout, manifest.fragment)
    blob = read_verified(store, manifest.params_key, manifest.params_sha256, max_bytes=limit, buffer=True)
    tensors, _ = codecs.decode(blob, max_bytes=limit, expect=layout.shapes(manifest.fragment), in_place=True,
                               hashed=True)
    return tensors


def params_limit(layout: Layout, fragment: int) -> int:
    """Read bound of a version's params and outer-state objects: two fp32 copies of the fragment + 1 MiB."""
    return 2 * layout.fragment_bytes(fragment) + (1 << 20)


def read_input(store: Store, layout: Layout, fragment: int, contribution: Contribution, *,
               max_bytes: int) -> dict[str, torch.Tensor]:
    """One input of a committed version (a delta, or the genesis proposal of version 0), checked
    against the sha256 its manifest records and decoded against the layout. Raises ObjectMissing
    if the object is gone and Refused if it is not what the manifest says."""
    blob = read_verified(store, contribution.object_key, contribution.sha256, max_bytes=max_bytes)
    tensors, _ = codecs.decode(blob, max_bytes=max_bytes, expect=layout.shapes(fragment))
    return tensors


def list_versions(store: Store, keys: RunKeys, fragment: int) -> list[int]:
    """Versions of a fragment whose manifest exists in S3 (the commit record), ascending, by listing."""
    versions = []
    for key in store.list(keys.versions_prefix(fragment)):
        parsed = keys.parse_version_key(key)
        if parsed and parsed[2] == "manifest":
            versions.append(parsed[1])
    return versions


def latest_version(store: Store, keys: RunKeys, fragment: int) -> int | None:
    """Highest version of a fragment whose manifest exists in S3 (the commit record), by listing."""
    versions = list_versions(store, keys, fragment)
    return versions[-1] if versions else None


@dataclass(frozen=True, slots=True)
class Floor:
    """Where a fragment's replayable history starts under this prefix, and which record says so."""

    version: int
    """The first version that can be re-derived; the ones below it were collected."""
    key: str
    """The Collection record that set it."""
    record: Collection

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.record.created_at))
        return f"{self.record.by} at {when} ({'/'.join(self.key.split('/')[-2:])})"

    def reason(self) -> str:
        """Why the versions below are not replayable, for a person."""
        if self.record.deleted_objects:
            return f"their inputs were deleted by {self.describe()}"
        return f"this prefix holds the history from version {self.version} on only ({self.describe()})"


def read_collections(store: Store, keys: RunKeys) -> list[tuple[str, Collection]]:
    """Every Collection record of the run, by key, in the order they were written."""
    return [(key, Collection.from_wire(store.get(key, max_bytes=MAX_MESSAGE_BYTES)))
            for key in store.list(keys.collections_prefix())]


def floors_of(collections: list[tuple[str, Collection]]) -> dict[int, Floor]:
    """Per fragment, the highest first replayable version any record names (only fragments above 0)."""
    floors: dict[int, Floor] = {}
    for key, record in collections:
        for fragment, version in enumerate(record.first_replayable):
            if version > 0 and version > floors.get(fragment, Floor(0, "", record)).version:
                floors[fragment] = Floor(version, key, record)
    return floors


def read_floors(store: Store, keys: RunKeys) -> dict[int, Floor]:
    """Where each fragment's replayable history starts under this prefix (absent: at version 0)."""
    return floors_of(read_collections(store, keys))
