"""Publishing a version: objects first, then the manifest, then one atomic Redis commit.

Commit order (invariant 2):
1. PUT versions/{f}/{v}/params, .../outer_state and .../update (concurrently; no update in fp32).
2. PUT versions/{f}/{v}/manifest (create-only). The manifest is the commit record in S3: a
   version whose manifest exists is committed, even if the Redis step below never ran.
3. Redis: one Lua script, fenced by the coordinator epoch: head compare-and-set, versions stream
   entry, applied-set update, XACK of the merged announcements.
Version objects are named with the writer's epoch, so two coordinators never write the same one.
A crash before 2 leaves orphan objects (not committed: no manifest names them). A crash between
2 and 3 is rolled forward by `roll_forward` (on start) or `commit_existing` (a live coordinator
that finds the manifest already written by a deposed one): the Redis step is replayed from the
manifest, and the inputs' announcements are acknowledged as applied instead of being merged a
second time.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from diloco.coordinator.leadership import Fenced
from diloco.coordinator.outer import NesterovState
from diloco.coordinator.timing import Timed, untimed
from diloco.storage import codecs
from diloco.storage.bus import Bus, CommitResult
from diloco.storage.crashpoints import crash_point
from diloco.storage.errors import Conflict, Refused
from diloco.storage.history import blake3_hex, latest_version, read_manifest, read_run_end, sha256_hex
from diloco.storage.keys import RunKeys
from diloco.storage.objects import Body, ObjectStore, Store
from diloco.storage.protocol import Contribution, Manifest, Refusal, VersionEvent, VersionSettings
from diloco.storage.updates import params_body

log = logging.getLogger(__name__)


RESIDUAL = "residual:"
"""Prefix of the residual tensors' names in an outer-state object (after the momentum buffers)."""


def state_body(state: NesterovState, keys: RunKeys, fragment: int, version: int) -> codecs.Streamed:
    """The outer-state object: the momentum buffers, then (meta `residuals` = how many) the
    downstream residual's tensors under RESIDUAL + name. A state without residual encodes as before
    residuals existed. As views of the state's own tensors (`codecs.encode_streamed`): PUT and
    hashed without a copy of them."""
    meta = {"run": keys.run, "fragment": fragment, "version": version, "kind": "outer_state", "steps": state.steps}
    tensors = dict(state.momentum)
    if state.residual:
        meta["residuals"] = len(state.residual)
        tensors |= {RESIDUAL + name: t for name, t in state.residual.items()}
    return codecs.encode_streamed(tensors, meta=meta)


def decode_state(blob: bytes | bytearray, max_bytes: int, *, in_place: bool = False, hashed: bool = False
                 ) -> NesterovState:
    """The outer state of a `state_body` object; `in_place` and `hashed`: see `codecs.decode`."""
    tensors, header = codecs.decode(blob, max_bytes=max_bytes, in_place=in_place, hashed=hashed)
    count = header.meta.get("residuals", 0)
    names = list(tensors)
    if not isinstance(count, int) or not 0 <= count <= len(names):
        raise Refused("bad_header", f"outer state says it holds {count!r} residual tensors, it has {len(names)} in all")
    split = len(names) - count
    if not all(n.startswith(RESIDUAL) for n in names[split:]):
        raise Refused("bad_header", f"outer state's last {count} tensors are not all named {RESIDUAL}...")
    return NesterovState(momentum={n: tensors[n] for n in names[:split]}, steps=int(header.meta.get("steps", 0)),
                         residual={n.removeprefix(RESIDUAL): tensors[n] for n in names[split:]})


def listed_refusals(refused: Sequence[Refusal], limit: int) -> tuple[Refusal, ...]:
    """The refusals a manifest lists: all of them up to `limit`; beyond, the first `limit` - 1 and
    one `more_refused` line that counts the rest by code."""
    if len(refused) <= limit:
        return tuple(refused)
    kept, rest = refused[:limit - 1], refused[limit - 1:]
    by_code = Counter(r.code for r in rest)
    summary = ", ".join(f"{code} x{n}" for code, n in sorted(by_code.items(), key=lambda kv: (-kv[1], kv[0])))
    return (*kept, Refusal(contribution_id="", learner="", code="more_refused",
                           reason=f"{len(rest)} more refusals since the parent version ({summary}): each one is on "
                                  "the refusals stream and in the counters"))


def write_version(store: Store, keys: RunKeys, *, fragment: int, version: int,
                  params: dict[str, torch.Tensor], state: NesterovState, inputs: tuple[Contribution, ...],
                  refused: tuple[Refusal, ...], settings: VersionSettings, epoch: int, timed: Timed = untimed,
                  update: bytes | None = None, merged_tokens: int = 0) -> Manifest:
    """Steps 1 and 2. Raises Conflict if a manifest for this version already exists, ValueError if
    the manifest would be too large for its readers (nothing is written then). `update` is the
    version as an update of its parent (`outer.downstream_step`), stored beside the params;
    `merged_tokens` the fragment's merged tokens so far, this version's included.

    `timed` times the encoding ("encode"), the objects' PUTs ("put") and the manifest's ("manifest")."""
    with timed("encode"):
        # The manifest's size is known before anything is written: no object of a version that
        # could never be read.
        update_key = keys.update(fragment, version, epoch) if update is not None else ""
        draft = Manifest(run=keys.run, fragment=fragment, version=version, parent_version=version - 1,
                         params_key=keys.params(fragment, version, epoch), params_sha256="0" * 64,
                         outer_state_key=keys.outer_state(fragment, version, epoch), outer_state_sha256="0" * 64,
                         inputs=inputs, settings=settings, refused=refused, committed_at=0.0, epoch=epoch,
                         update_key=update_key, update_sha256="0" * 64 if update is not None else "",
                         update_bytes=len(update or b""), params_bytes=1 << 40,  # sizes: no smaller than the real ones
                         merged_tokens=merged_tokens)
        size = len(draft.to_wire())
        if size > Manifest.MAX_BYTES:
            raise ValueError(f"the manifest of fragment {fragment} version {version} would be {size} bytes, over "
                             f"the {Manifest.MAX_BYTES} its readers accept ({len(inputs)} inputs, {len(refused)} "
                             "refusals)")
        # Views of the version's own tensors, not copies: hashed here and sent by the PUTs below.
        params_blob = params_body(params, keys, fragment, version)
        state_blob = state_body(state, keys, fragment, version)
        params_sha256, state_sha256 = sha256_hex(params_blob), sha256_hex(state_blob)
        params_blake3 = blake3_hex(params_blob)
        update_sha256 = sha256_hex(update) if update is not None else ""
    params_key, state_key = keys.params(fragment, version, epoch), keys.outer_state(fragment, version, epoch)
    objects = [(params_key, params_blob), (state_key, state_blob)] + ([(update_key, update)] if update else [])
    with timed("put"), ThreadPoolExecutor(len(objects), thread_name_prefix="put") as pool:
        # All at once: none is committed before the manifest below names them.
        puts = [pool.submit(_put_uncommitted, store, keys, fragment, version, key, blob) for key, blob in objects]
        for put in puts:
            put.result()
    crash_point("params_written")
    manifest = Manifest(run=keys.run, fragment=fragment, version=version, parent_version=version - 1,
                        params_key=params_key, params_sha256=params_sha256, outer_state_key=state_key,
                        outer_state_sha256=state_sha256, inputs=inputs, settings=settings,
                        refused=refused, committed_at=time.time(), epoch=epoch, update_key=update_key,
                        update_sha256=update_sha256, update_bytes=len(update or b""),
                        params_bytes=len(params_blob), merged_tokens=merged_tokens, params_blake3=params_blake3)
    with timed("manifest"):
        store.put(keys.manifest(fragment, version), manifest.to_wire(), create_only=True)
    crash_point("manifest_written")
    return manifest


def _put_uncommitted(store: Store, keys: RunKeys, fragment: int, version: int, key: str, blob: bytes | Body) -> None:
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
                        committed_at=manifest.committed_at, params_blake3=manifest.params_blake3)


def commit(bus: Bus, manifest: Manifest, *, epoch: int, ack_ids: list[str], keep_applied: int, rebuild: bool = False,
           check_applied: bool = True) -> CommitResult:
    """Step 3. The head must be the manifest's parent; with `rebuild`, Redis must have no head yet.
    Redis's applied set keeps the contributions of the fragment's last `keep_applied` versions."""
    expected = None if rebuild or manifest.parent_version < 0 else manifest.parent_version
    return bus.commit_version(event_of(manifest, bus.keys), expected_head=expected, epoch=epoch, ack_ids=ack_ids,
                              keep_applied=keep_applied, check_applied=check_applied)


def commit_existing(bus: Bus, manifest: Manifest, *, epoch: int, keep_applied: int,
                    rebuild: bool = False) -> CommitResult:
    """Commit a version whose manifest is already in S3; its announcements are acknowledged as applied.

    S3 is the truth: the manifest is written, so the version is committed whatever Redis says of its
    contributions. Redis's applied set is not consulted (should history already name a contribution
    twice, refusing to commit would only leave every later coordinator unable to start). The one
    exception: a version above the run's end (written by a shard that had not seen it) is not
    committed, and ENDED is returned."""
    stream_ids = [c.stream_id for c in manifest.inputs if c.stream_id]
    result = commit(bus, manifest, epoch=epoch, ack_ids=stream_ids, keep_applied=keep_applied, rebuild=rebuild,
                    check_applied=False)
    if result is CommitResult.FENCED:
        raise Fenced(f"cannot commit fragment {manifest.fragment} version {manifest.version} from its manifest: "
                     f"another coordinator holds the run now (this one has epoch {epoch})")
    if result is CommitResult.ENDED:
        return result
    if result not in (CommitResult.COMMITTED, CommitResult.ALREADY):
        raise Conflict(f"cannot commit fragment {manifest.fragment} version {manifest.version} from its "
                       f"manifest: {result.name}")
    log.warning("committed fragment %d version %d from its manifest in S3 (%s)", manifest.fragment,
                manifest.version, result.name)
    return result


def roll_forward(store: ObjectStore, bus: Bus, fragments: Iterable[int], epoch: int, *,
                 keep_applied: int, committed: Callable[[Manifest], None] = lambda manifest: None
                 ) -> dict[int, int]:
    """Make Redis heads of `fragments` (a shard's) agree with the manifests in S3 (the truth); returns
    their heads.

    - S3 ahead of Redis by a few versions (a crash between manifest and Redis commit): every
      manifest above the Redis head is committed in order.
    - Redis has no head for a fragment that S3 has versions of (Redis lost its data): the latest
      version becomes the head directly, and the contributions of the `keep_applied` versions
      before it are marked applied again. Older ones cannot come back: they are staler than
      max_staleness and would be refused anyway (a commit keeps no more of them either).

    Never past the run's end: a version written above a fragment's final version (by a shard that
    had not seen the end) is not part of the run. `committed` is called with each manifest whose
    contributions this marks applied.
    """
    fragments = list(fragments)
    heads = {f: v for f, v in bus.heads().items() if f in fragments}
    end = read_run_end(store, bus.keys)
    for fragment in fragments:
        latest = latest_version(store, bus.keys, fragment)
        if latest is None:
            continue
        if end is not None and fragment < len(end.versions) and latest > end.versions[fragment]:
            log.warning("fragment %d has versions up to %d in S3, written after the run's end at version %d: "
                        "not part of the run", fragment, latest, end.versions[fragment])
            latest = end.versions[fragment]
            if latest < 0:
                continue
        if fragment not in heads:
            for version in range(max(0, latest - keep_applied), latest):
                manifest = read_manifest(store, bus.keys, fragment, version)
                bus.mark_applied(fragment, [c.contribution_id for c in manifest.inputs], keep_applied=keep_applied)
                committed(manifest)
            manifest = read_manifest(store, bus.keys, fragment, latest)
            commit_existing(bus, manifest, epoch=epoch, keep_applied=keep_applied, rebuild=True)
            committed(manifest)
            heads[fragment] = latest
            continue
        for version in range(heads[fragment] + 1, latest + 1):
            manifest = read_manifest(store, bus.keys, fragment, version)
            commit_existing(bus, manifest, epoch=epoch, keep_applied=keep_applied)
            committed(manifest)
            heads[fragment] = version
    return heads
