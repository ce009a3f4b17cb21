"""Publishing a version: objects first, then the manifest, then one atomic Redis commit.

Commit order (invariant 2):
1. PUT versions/{f}/{v}/params and .../outer_state.
2. PUT versions/{f}/{v}/manifest (create-only). The manifest is the commit record in S3: a
   version whose manifest exists is committed, even if the Redis step below never ran.
3. Redis: one Lua script, fenced by the coordinator epoch: head compare-and-set, versions stream
   entry, applied-set update, XACK of the merged announcements.
A crash before 2 leaves orphan objects that the next coordinator overwrites (they are not
committed: no manifest). A crash between 2 and 3 is rolled forward on restart by
`roll_forward`, which replays the Redis step from the manifest; the inputs' announcements are
then acknowledged as applied instead of being merged a second time.
"""

from __future__ import annotations

import logging
import time

import torch

from coordinator.outer import NesterovState
from storage import codecs
from storage.bus import Bus, CommitResult
from storage.errors import Conflict
from storage.history import latest_version, read_manifest, sha256_hex
from storage.keys import RunKeys
from storage.objects import ObjectStore
from storage.protocol import Contribution, Manifest, Refusal, VersionEvent

log = logging.getLogger(__name__)


def encode_params(params: dict[str, torch.Tensor], keys: RunKeys, fragment: int, version: int) -> bytes:
    return codecs.encode(params, "fp32", meta={"run": keys.run, "fragment": fragment, "version": version,
                                               "kind": "params"})


def encode_state(state: NesterovState, keys: RunKeys, fragment: int, version: int) -> bytes:
    return codecs.encode(state.momentum, "fp32", meta={"run": keys.run, "fragment": fragment, "version": version,
                                                       "kind": "outer_state", "steps": state.steps})


def decode_state(blob: bytes, max_bytes: int) -> NesterovState:
    tensors, header = codecs.decode(blob, max_bytes=max_bytes)
    return NesterovState(momentum=tensors, steps=int(header.meta.get("steps", 0)))


def write_version(store: ObjectStore, keys: RunKeys, *, fragment: int, version: int,
                  params: dict[str, torch.Tensor], state: NesterovState, inputs: tuple[Contribution, ...],
                  refused: tuple[Refusal, ...], settings: dict, epoch: int) -> Manifest:
    """Steps 1 and 2. Raises Conflict if a manifest for this version already exists."""
    params_blob = encode_params(params, keys, fragment, version)
    state_blob = encode_state(state, keys, fragment, version)
    for key, blob in ((keys.params(fragment, version), params_blob), (keys.outer_state(fragment, version), state_blob)):
        _put_uncommitted(store, keys, fragment, version, key, blob)
    manifest = Manifest(run=keys.run, fragment=fragment, version=version, parent_version=version - 1,
                        params_key=keys.params(fragment, version), params_sha256=sha256_hex(params_blob),
                        outer_state_key=keys.outer_state(fragment, version),
                        outer_state_sha256=sha256_hex(state_blob), inputs=inputs, settings=settings,
                        refused=refused, committed_at=time.time(), epoch=epoch)
    store.put(keys.manifest(fragment, version), manifest.to_wire(), create_only=True)
    return manifest


def _put_uncommitted(store: ObjectStore, keys: RunKeys, fragment: int, version: int, key: str, blob: bytes) -> None:
    """Write an object of a version not committed yet. Existing objects of the same version are
    leftovers of a coordinator that crashed mid-publish (no manifest): replaced. If the manifest
    exists the version is committed and nothing of it may change: Conflict."""
    try:
        store.put(key, blob, create_only=True)
    except Conflict:
        if store.exists(keys.manifest(fragment, version)):
            raise
        store.put(key, blob, create_only=False)


def event_of(manifest: Manifest, keys: RunKeys) -> VersionEvent:
    return VersionEvent(run=manifest.run, fragment=manifest.fragment, version=manifest.version,
                        params_key=manifest.params_key, params_sha256=manifest.params_sha256,
                        manifest_key=keys.manifest(manifest.fragment, manifest.version),
                        contributions=tuple(c.contribution_id for c in manifest.inputs),
                        committed_at=manifest.committed_at)


def commit(bus: Bus, manifest: Manifest, *, epoch: int, ack_ids: list[str]) -> CommitResult:
    """Step 3."""
    expected = None if manifest.parent_version < 0 else manifest.parent_version
    return bus.commit_version(event_of(manifest, bus.keys), expected_head=expected, epoch=epoch, ack_ids=ack_ids)


def roll_forward(store: ObjectStore, bus: Bus, num_fragments: int, epoch: int) -> dict[int, int]:
    """Make Redis heads agree with the manifests in S3 (the truth); returns the heads.

    Handles both a crash between manifest and Redis commit (S3 one version ahead) and a Redis
    that lost its data (heads missing): every manifest above the Redis head is committed in order.
    """
    heads = bus.heads()
    for fragment in range(num_fragments):
        latest = latest_version(store, bus.keys, fragment)
        if latest is None:
            continue
        start = heads.get(fragment, -1) + 1
        for version in range(start, latest + 1):
            manifest = read_manifest(store, bus.keys, fragment, version)
            stream_ids = [c.stream_id for c in manifest.inputs if c.stream_id]
            result = commit(bus, manifest, epoch=epoch, ack_ids=stream_ids)
            if result not in (CommitResult.COMMITTED, CommitResult.ALREADY):
                raise Conflict(f"cannot roll fragment {fragment} forward to version {version}: {result.name}")
            log.warning("rolled fragment %d forward to version %d from its manifest in S3 (%s)",
                        fragment, version, result.name)
            heads[fragment] = version
    return heads
