"""Background I/O of a learner: uploading outer gradients and fetching new global versions.

The training loop only ever hands work to these threads and picks up results without waiting:
- `Uploader`: encode -> create-only PUT to S3 -> XADD announcement. With a lossy codec, what it
  lost of a fragment's previous sends goes out with the next one (error feedback, per fragment), so
  the coordinator receives the learner's whole progress over time. A newer job for a fragment
  whose previous one has not been stored yet is coalesced into it (deltas add, tokens and steps
  add, the older base version is kept), so a slow network delays contributions but never grows
  memory or loses progress. A job that fails (S3 or Redis unreachable past the adapters' own
  retries) is retried with the same object key and contribution id, so that an object stored
  before its announcement failed is announced, never stored twice under two ids; once a job is
  older than `deadline_s` it is dropped and counted (`TransferStats.upload_failed`).
- `Fetcher`: follows the versions stream; when the loop wants a fragment newer than some version,
  it fetches the newest one and parks it until taken: as the update objects from the version it
  holds, in the run's codec, while they are fewer bytes than the params (`storage.updates`; the
  result is checked bit for bit against the params' sha256), else the params, verified. A version
  it cannot take (damaged, missing) is skipped: it waits for the next one.
Training goes on whatever happens here.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from dataclasses import dataclass, field

import torch

import redis

from diloco.storage import codecs, heap
from diloco.storage.bus import Bus
from diloco.storage.errors import Conflict, DilocoError, Refused, StorageUnavailable
from diloco.storage.heap import spare_memory
from diloco.storage.history import params_limit, params_match, read_manifest, read_params, read_verified, sha256_hex
from diloco.storage.intraop import Pacer, paced_slices, unpaced
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, ObjectStore, ObjectUnreadable
from diloco.storage.protocol import Announcement, Layout, Manifest, ObjectMeta, RunSpec, VersionEvent
from diloco.storage.updates import apply_update, chain_worth_it, encode_piece, params_body
from diloco.workers.hostcopy import Snapshot
from diloco.workers.scratch import Scratch
from diloco.workers.staging import Slot, Stager
from diloco.workers.threads import ThreadLimits

log = logging.getLogger(__name__)


@dataclass
class UploadJob:
    fragment: int
    delta: dict[str, torch.Tensor]
    """What goes out (the outer gradient; a genesis job's params), plus `pending` once settled."""
    base_version: int
    tokens: int
    steps: int
    step_time_s: float
    kind: str = "delta"
    deadline: float = 0.0
    final: bool = False
    """The learner's last piece for this fragment before it leaves (`Announcement.final`)."""
    on_done: Callable[[bool], None] | None = None
    """Called on the uploader's thread once the job has left: True when stored and announced,
    False when dropped (a genesis proposal's next claim, `workers/genesis.py`)."""
    created_at: float = field(default_factory=time.monotonic)
    sent_at: float = field(default_factory=time.monotonic)
    """When the newest send this job carries was made (`absorb` moves it): its lag is measured from here."""
    contribution_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    blob: bytes | None = None
    """The encoded object, once encoded."""
    key: str | None = None
    """Where the object is stored, once stored: from then on only the announcement is retried."""
    residual: dict[str, torch.Tensor] | None = None
    """What the codec lost of this delta (error feedback), carried by the fragment's next send once
    this one is stored: in each parameter's own dtype (a bf16 model's residual is bf16, half the
    memory of a float32 one; the codec's loss is well above bf16's rounding)."""
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    """The parameters' dtypes, from their snapshots (`settle`)."""
    takes_seen: int = 0
    """With `keep_dropped`: the fragment's takes (`Uploader.taken`) when it was sent."""
    untaken: dict[str, torch.Tensor] = field(default_factory=dict)
    """With `keep_dropped`: what the codec dropped of the fragment's previous piece that no take left
    in the model (no take came between the two sends): it goes out with this piece."""
    seq: int = 0
    attempts: int = 0
    buffers: list[torch.Tensor] = field(default_factory=list)
    """The `Scratch` buffers `delta`'s tensors are views of (`settle`), given back once it is stored."""
    residual_buffer: torch.Tensor | None = None
    """The `Scratch` buffer `residual`'s tensors are views of (None: tensors of their own)."""
    pending: list[tuple[Snapshot, Snapshot]] = field(default_factory=list)
    """(anchor, local) pairs of sends whose deltas, anchor - local, are not computed yet: `local` may
    still be on its way from the device. The uploader's thread computes them (`settle`), so the
    training loop neither waits for the copies nor spends the subtractions."""

    MAX_PENDING = 4
    """Pairs a job holds unsettled (each two host copies of the fragment): an uploader that falls
    further behind has the oldest settled by the send that absorbs one more."""

    def settle(self, scratch: Scratch | None = None) -> dict[str, torch.Tensor]:
        """Add the pending deltas into `delta` (waiting for their snapshots) and return `delta`; its
        new tensors are views of a buffer from `scratch` when given (`buffers`)."""
        while self.pending:
            self._settle_one(scratch)
        return self.delta

    def _settle_one(self, scratch: Scratch | None = None) -> None:
        anchor, local = (s.wait() for s in self.pending.pop(0))
        new = {name: value.shape for name, value in local.items() if name not in self.delta}
        if new:  # in fp32, whatever the model's dtype
            if scratch is not None:
                buffer, views = scratch.views(new)
                self.buffers.append(buffer)
            else:
                views = {name: torch.empty(shape, dtype=torch.float32) for name, shape in new.items()}
        for name, value in local.items():
            self.dtypes[name] = value.dtype
            base, flat = anchor[name].reshape(-1), value.reshape(-1)
            if name in new:
                self.delta[name] = views[name]
                into = self.delta[name].view(-1)
                for part in paced_slices(flat.numel()):  # in parts: the uploader's thread is paced
                    torch.sub(base[part].float(), flat[part], out=into[part])
            else:
                into = self.delta[name].view(-1)
                for part in paced_slices(flat.numel()):
                    into[part].add_(base[part]).sub_(flat[part])

    def absorb(self, newer: UploadJob) -> None:
        """Take in a newer job of the same fragment, on the training thread (`Uploader.submit`), so
        without arithmetic: the newer pairs queue behind this job's. A pair that continues the last
        one (its anchor is that pair's local snapshot: no version was taken between the two sends)
        joins it, as the deltas telescope: (a - s1) + (s1 - s2) = a - s2. Else the pairs add up,
        at most `MAX_PENDING` of them."""
        for pair in newer.pending:
            if self.pending and pair[0] is self.pending[-1][1]:
                self.pending[-1] = (self.pending[-1][0], pair[1])
            else:
                self.pending.append(pair)
        while len(self.pending) > self.MAX_PENDING:
            self._settle_one()
        for name, t in newer.delta.items():
            self.delta[name] = self.delta[name].add_(t) if name in self.delta else t.clone()
        self.tokens += newer.tokens
        self.steps += newer.steps
        self.takes_seen = newer.takes_seen
        self.step_time_s = newer.step_time_s
        self.deadline = newer.deadline
        self.sent_at = newer.sent_at
        self.final = self.final or newer.final


@dataclass
class TransferStats:
    uploaded: int = 0
    coalesced: int = 0
    upload_failed: int = 0
    """Contributions dropped: not stored and announced before the uploader's deadline."""
    upload_retries: int = 0
    bytes_uploaded: int = 0
    """Bytes of the contribution objects stored (up)."""
    bytes_downloaded: int = 0
    """Bytes of every object read from S3 (down): versions' updates, params and manifests, the run's records at join."""
    bytes_joined: int = 0
    """Of those, what joining read (the run's records and every fragment's params)."""
    joined_own: int = 0
    """Fragments joined at without downloading their params: the learner's own initial values were
    version 0 (`Fetcher.from_own`)."""
    fetched: int = 0
    """Versions fetched, by either way below."""
    fetched_updates: int = 0
    """Update objects applied (`storage.updates`): a version one or a few behind the one held."""
    fetched_params: int = 0
    """Versions fetched as full params: at join, after a gap the updates would not save bytes on, or
    when they could not be taken."""
    update_failed: int = 0
    """Chains of updates that could not be read or did not land on the params (then fetched in full)."""
    fetch_failed: int = 0
    upload_s: float = 0.0
    put_s: float = 0.0
    """Seconds in the PUTs of the objects counted in `bytes_uploaded`: what the link carries them at."""
    fetch_s: float = 0.0
    send_lag_s: float = 0.0
    """How long a piece takes to go out, from the step that sent it to its announcement (encode, PUT,
    XADD, and any wait behind the pieces queued before it): a moving mean over the pieces stored at
    the first attempt (a retried one measures an outage, not the link). 0 before the first."""
    cpu_s: float = 0.0
    """CPU seconds of the uploader's and the fetcher's own threads (encode, error feedback, hash,
    compress, PUT; GET, decompress, decode, apply, verify); torch's intra-op pool threads they use
    are not counted."""
    cpu_phases: dict[str, float] = field(default_factory=dict)
    """Part of `cpu_s` by what the threads did: "encode" (the delta, error feedback, the codec,
    zstd), "put", "announce" (the object's sha256, XADD), "get" (an update's GET, and its object's
    sha256 where a manifest names it), "apply" (its checks and decode, added to the params held),
    "verify" (the params' digest, `history.params_match`), "params" (a version's params read in
    full and checked)."""
    last_error: str = ""

    @contextmanager
    def cpu_phase(self, name: str) -> Iterator[None]:
        """Count the calling thread's CPU time inside the block into `cpu_phases[name]`."""
        start = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - start
            with _PHASES_LOCK:
                self.cpu_phases[name] = self.cpu_phases.get(name, 0.0) + spent


_PHASES_LOCK = threading.Lock()


class Uploader(threading.Thread):
    RETRY_PAUSE_S = 1.0

    def __init__(self, store: ObjectStore, bus: Bus, spec: RunSpec, learner: str, stats: TransferStats, *,
                 deadline_s: float = 120.0, error_feedback: bool = True, keep_dropped: bool = False,
                 limits: ThreadLimits = ThreadLimits()) -> None:
        super().__init__(name=f"uploader-{learner}", daemon=True)
        self.limits = limits
        """What this thread may take of the machine (`workers.threads`), applied as it starts."""
        self.pacer: Pacer | None = None
        """Its pacer, once started, when its work is paced (`ThreadLimits.share`)."""
        self.store, self.bus, self.spec, self.learner, self.stats = store, bus, spec, learner, stats
        self.deadline_s = deadline_s
        self.error_feedback = error_feedback
        self.keep_dropped = error_feedback and keep_dropped
        """What the codec drops of a piece stays in the learner's model: the first take of the
        fragment after the send subtracts it from the version's rebase (`taken`), and the next piece,
        measured from the model, carries it. Stored after that take (the model rebased without it),
        it is carried as without `keep_dropped`."""
        self._residual: dict[int, dict[str, torch.Tensor]] = {}  # fragment -> what the codec lost of its sends
        self._dropped: dict[int, dict[str, torch.Tensor]] = {}  # fragment -> its last piece's loss, for the take
        self._takes: dict[int, int] = {}  # fragment -> takes so far (`taken`)
        self._ef_lock = threading.Lock()
        self.scratch = Scratch()
        """The buffers of its pieces' deltas and residuals, reused from piece to piece (`workers.scratch`)."""
        self._residual_buffers: dict[int, torch.Tensor] = {}  # fragment -> the Scratch buffer of its residual
        self.keys = RunKeys(bus.keys.prefix, spec.run)
        self._jobs: list[UploadJob] = []  # FIFO
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._rushing = False  # `_rush`
        # Sequence numbers stay unique across restarts of the same learner id: start from the clock.
        self._seq = int(time.time() * 1000) * 1000

    def submit(self, job: UploadJob) -> str:
        """Queue `job`; returns the contribution id it goes out under (an earlier queued delta of the
        same fragment that has not been stored yet absorbs it and keeps its own id)."""
        with self._ef_lock:
            job.takes_seen = self._takes.get(job.fragment, 0)
        with self._cv:
            open_job = next((q for q in self._jobs if q.fragment == job.fragment and q.key is None
                             and q.kind == "delta"), None)
            if open_job is not None and job.kind == "delta":
                open_job.absorb(job)
                open_job.blob = None  # re-encode with the new content
                self.stats.coalesced += 1
                self._rush(True)
                job = open_job
            else:
                self._jobs.append(job)
                if len(self._jobs) + self._busy > 1 and not spare_memory():
                    self._rush(True)  # each queued piece holds host copies the machine is short of
            self._cv.notify()
            return job.contribution_id

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs) + int(self._busy)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued job has left (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def run(self) -> None:
        self.pacer = self.limits.apply()
        with self._cv:
            if self.pacer is not None:
                self.pacer.rushing = self._rushing
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs and self._closed:
                    return
                job = self._jobs.pop(0)
                self._busy = True
            retry = sent = False
            job.attempts += 1
            cpu = time.thread_time()
            try:
                self._send(job)
                sent = True
            except (StorageUnavailable, redis.RedisError) as exc:  # unreachable past the adapters' retries
                retry = self._failed(job, exc)
            except Exception as exc:  # noqa: BLE001 (a refusal or a bug: never kill the thread)
                self._drop(job, exc)
            self.stats.cpu_s += time.thread_time() - cpu
            with self._cv:
                if retry:
                    self._jobs.insert(0, job)  # first in line again: keeps a fragment's order
                if not self._jobs:
                    self._rush(False)
                self._busy = False
                self._cv.notify_all()
                if retry and not self._closed:
                    self._cv.wait(self.RETRY_PAUSE_S)
            if not retry and job.on_done is not None:
                try:
                    job.on_done(sent)
                except Exception:  # noqa: BLE001 (never kill the thread)
                    log.exception("after the upload to fragment %d", job.fragment)
            del job  # a piece's host copies and buffers freed: memory short, malloc gives them back
            heap.fit()

    def _rush(self, on: bool) -> None:
        """A send found its fragment's previous piece still queued, or queued behind another while
        memory is short (`submit`): the thread works unpaced until its queue is empty. Held to its
        share while pieces come faster than that lets them out, it would fall further behind with
        every send, its pieces arriving later and later and each queued one holding the fragment's
        host copies (a 1B model's learner on 2 CPUs, its transfer work about 0.42 of a CPU against
        a share of 0.25, grew through its training; rushing, it held level)."""
        self._rushing = on
        if self.pacer is not None:
            self.pacer.rushing = on

    def _failed(self, job: UploadJob, exc: BaseException) -> bool:
        """True to retry the job; False when it is past its deadline (then dropped)."""
        age_s = time.monotonic() - job.created_at
        if age_s < self.deadline_s and not self._closed:
            self.stats.upload_retries += 1
            self.stats.last_error = str(exc)
            log.warning("contribution to fragment %d not %s yet (attempt %d, %.0fs old), retrying: %s", job.fragment,
                        "announced" if job.key else "stored", job.attempts, age_s, exc)
            return True
        self._drop(job, exc)
        return False

    def _drop(self, job: UploadJob, exc: BaseException) -> None:
        self.stats.upload_failed += 1
        self.stats.last_error = str(exc)
        log.warning("dropped contribution to fragment %d after %d attempt(s): %s", job.fragment, job.attempts, exc)

    def _send(self, job: UploadJob) -> None:
        t0 = time.monotonic()
        if job.blob is None:
            with self.stats.cpu_phase("encode"), unpaced() if job.kind == "genesis" else nullcontext():
                job.blob = self._encode(job)  # version 0 is proposed before the loop trains: not paced
        if job.key is None:
            with self.stats.cpu_phase("put"):
                self._store(job)
        blob = job.blob
        with self.stats.cpu_phase("announce"):
            self._announce(job, blob)
        self.stats.uploaded += 1
        self.stats.bytes_uploaded += len(blob)
        self.stats.upload_s += time.monotonic() - t0
        if job.kind == "delta" and job.attempts == 1:
            self._lagged(time.monotonic() - job.sent_at)

    def _announce(self, job: UploadJob, blob: bytes) -> None:
        self.bus.announce(Announcement(
            kind=job.kind, run=self.spec.run, fragment=job.fragment, learner=self.learner, seq=job.seq,
            contribution_id=job.contribution_id, base_version=job.base_version, tokens=job.tokens, steps=job.steps,
            step_time_s=job.step_time_s, object_key=job.key, size_bytes=len(blob), sha256=sha256_hex(blob),
            sent_at=time.time(), deadline=job.deadline, final=job.final))

    def _lagged(self, lag_s: float) -> None:
        """Count a piece's lag into `send_lag_s`."""
        mean = self.stats.send_lag_s
        self.stats.send_lag_s = lag_s if mean == 0 else 0.7 * mean + 0.3 * lag_s

    def _encode(self, job: UploadJob) -> bytes:
        codec, compress = ("fp32", False) if job.kind == "genesis" else (self.spec.codec, self.spec.compress)
        # The object describes itself: after Redis lost an announcement, the coordinator can make
        # it again from the object alone (coordinator/recovery.py).
        meta = ObjectMeta(run=self.spec.run, fragment=job.fragment, learner=self.learner, kind=job.kind,
                          contribution_id=job.contribution_id, base_version=job.base_version, tokens=job.tokens,
                          steps=job.steps, step_time_s=job.step_time_s, deadline=job.deadline,
                          final=job.final).to_meta()
        job.settle(self.scratch)
        if job.kind != "delta" or codec == "fp32" or not self.error_feedback:
            return codecs.encode(job.delta, codec, compress=compress, meta=meta)
        # Error feedback: what the codec lost of the previous sends of this fragment goes out with
        # this one; what it loses of this one waits for the next (kept once the object is stored).
        carried = self._residual.get(job.fragment, {})
        if self.keep_dropped:
            with self._ef_lock:
                untaken = self._dropped.pop(job.fragment, {})
            job.untaken = _summed(job.untaken, untaken)  # kept across a re-encode
            carried = _summed(carried, job.untaken)
        if job.residual_buffer is not None:  # encoded before, not stored: that residual is replaced
            self.scratch.give(job.residual_buffer)
            job.residual_buffer = None
        # The residual in each parameter's dtype, written so by the encoder: a bf16 model's never
        # exists in float32 (at 1B parameters a 252 MB buffer less per piece in flight).
        wide = {n: t.shape for n, t in job.delta.items() if job.dtypes.get(n, torch.float32) == torch.float32}
        into: dict[str, torch.Tensor] = {}
        if wide:
            job.residual_buffer, into = self.scratch.views(wide)
        into |= {n: torch.empty(t.shape, dtype=job.dtypes[n]) for n, t in job.delta.items() if n not in wide}
        blob, job.residual = encode_piece(job.delta, carried, codec, compress=compress, meta=meta, into=into)
        return blob

    def _store(self, job: UploadJob) -> None:
        """Create-only PUT under a fresh key; sets job.key (and, for genesis, the stored bytes)."""
        assert job.blob is not None
        while True:
            self._seq += 1
            key = (self.keys.genesis_params(self.learner, job.fragment) if job.kind == "genesis"
                   else self.keys.delta(job.fragment, self.learner, self._seq))
            try:
                t0 = time.monotonic()
                self.store.put(key, job.blob, create_only=True)
                self.stats.put_s += time.monotonic() - t0
                break
            except Conflict:
                if job.kind == "genesis":
                    # An earlier incarnation of this learner proposed already: announce that one.
                    job.blob = self.store.get(key, max_bytes=self.spec.max_object_bytes)
                    break
                continue  # a sequence number from an earlier incarnation: take the next one
        job.key, job.seq = key, self._seq
        buffers, job.buffers, job.delta = job.buffers, [], {}  # stored: nothing reads the delta again
        for buffer in buffers:
            self.scratch.give(buffer)
        if job.residual is None:
            return
        with self._ef_lock:
            if self.keep_dropped and self._takes.get(job.fragment, 0) == job.takes_seen:
                # Its take is still to come: left to it, on the training thread (not reused).
                self._dropped[job.fragment] = job.residual
                self._residual.pop(job.fragment, None)
                kept = None
            else:
                self._residual[job.fragment] = job.residual
                kept = job.residual_buffer
        # The fragment's previous residual was carried by this piece (encoded, now stored): read no more.
        old = self._residual_buffers.pop(job.fragment, None)
        if kept is not None:
            self._residual_buffers[job.fragment] = kept
        if old is not None:
            self.scratch.give(old)

    def taken(self, fragment: int) -> dict[str, torch.Tensor] | None:
        """The training thread takes a version of `fragment` (rebase): what the codec dropped of the
        last piece, to leave in the model (None: nothing, or not stored yet, then carried instead)."""
        with self._ef_lock:
            self._takes[fragment] = self._takes.get(fragment, 0) + 1
            return self._dropped.pop(fragment, None)


def _summed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """a + b by name (a name in one only: its tensor)."""
    return {n: a[n] + b[n] if n in a and n in b else a[n] if n in a else b[n] for n in a.keys() | b.keys()}


@dataclass
class Fetched:
    version: int
    params: dict[str, torch.Tensor]
    slot: Slot = field(default_factory=Slot)
    """What the learner blends to take this version, made ready on the stager's thread (`workers.staging`)."""

    def release(self) -> None:
        """Not taken after all: a staged buffer goes back for reuse."""
        self.slot.release()


@dataclass
class _Want:
    newer_than: int
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Fragment:
    """What the fetcher knows of one fragment (under its lock)."""

    head: int | None = None
    """The newest version the versions stream (or a manifest read) has named."""
    want: _Want | None = None
    """The learner asked for a version newer than this one, and none has come yet."""
    ready: Fetched | None = None
    """Downloaded, waiting for the learner to take it."""
    held: Fetched | None = None
    """The newest version fetched (or joined at): updates apply to it."""
    unreadable: int | None = None
    """A head version that could not be read: skipped until a newer one."""
    events: dict[int, VersionEvent] = field(default_factory=dict)
    """The newest versions' events from the versions stream (at most `Fetcher.MAX_CHAIN`): the
    params' key and sha256 of each, enough to take them as updates without a manifest."""


class Fetcher(threading.Thread):
    def __init__(self, store: ObjectStore, bus: Bus, layout: Layout, stats: TransferStats, *,
                 stager: Stager | None = None, limits: ThreadLimits = ThreadLimits()) -> None:
        super().__init__(name="fetcher", daemon=True)
        self.limits = limits
        """What this thread may take of the machine (`workers.threads`), applied as it starts."""
        self.pacer: Pacer | None = None
        """Its pacer, once started, when its work is paced (`ThreadLimits.share`)."""
        self.store, self.bus, self.layout, self.stats = store, bus, layout, stats
        self._stager = stager
        """Makes each version downloaded ready to take, on its own thread (`workers.staging`)."""
        self._fragments: dict[int, _Fragment] = {}
        self._merged: OrderedDict[str, int] = OrderedDict()  # contribution id -> the version that merged it
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._done_taking = False  # `done_taking`
        self._last_id = "$"
        self._max_staleness: int | None = None  # as the newest manifest read records it
        self._update_share: float | None = None
        """The newest manifest read (past version 0): its update's bytes over its params' (None: no
        update, or none read yet). `_by_events` sizes a chain by it, as `chain_worth_it` does."""

    def too_stale(self, fragment: int, base_version: int) -> bool:
        """A piece based on `base_version` would be refused as stale: the fragment's head, as the
        versions stream last said, is more than the coordinator's `max_staleness` (as the newest
        manifest read records it) ahead of it. False while either is unknown."""
        with self._lock:
            head, limit = self._at(fragment).head, self._max_staleness
        return head is not None and limit is not None and head - base_version > limit

    def note(self, manifest: Manifest) -> None:
        """Learn the coordinator's settings from a manifest read (its `max_staleness`: `too_stale`)
        and the fragment's head, if the manifest is newer than the one known."""
        limit = manifest.settings.max_staleness
        with self._lock:
            if limit is not None:
                self._max_staleness = limit
            if manifest.version > 0:
                self._update_share = (manifest.update_bytes / manifest.params_bytes
                                      if manifest.update_key and manifest.update_bytes > 0 and manifest.params_bytes > 0
                                      else None)
            self._saw(manifest.fragment, manifest.version)

    def _at(self, fragment: int) -> _Fragment:
        """The fragment's record (the caller holds the lock)."""
        return self._fragments.setdefault(fragment, _Fragment())

    def _saw(self, fragment: int, version: int) -> None:
        """`version` of `fragment` exists (the caller holds the lock)."""
        at = self._at(fragment)
        if at.head is None or version > at.head:
            at.head = version

    def want(self, fragment: int, newer_than: int) -> None:
        with self._lock:
            if self._done_taking:
                return
            at = self._at(fragment)
            if at.ready is not None and at.ready.version > newer_than:
                return
            at.want = _Want(newer_than)

    MAX_CHAIN = 16
    """A learner further behind than this many versions downloads the params without looking at the updates."""

    MERGED_MEMORY = 4096
    """How many recently merged contribution ids `merged_in` remembers."""

    def merged_in(self, contribution_id: str | None) -> int | None:
        """The version that merged this contribution, if the versions stream has said so since we started."""
        with self._lock:
            return self._merged.get(contribution_id) if contribution_id else None

    def take(self, fragment: int, wait_s: float = 0.0) -> Fetched | None:
        """The newest fetched version of `fragment`, if any; waits up to `wait_s` for one."""
        with self._arrived:
            if wait_s > 0:
                self._arrived.wait_for(lambda: self._at(fragment).ready is not None or self._closing.is_set(),
                                       timeout=wait_s)
            at = self._at(fragment)
            fetched, at.ready = at.ready, None
            return fetched

    def ready(self, fragment: int) -> int | None:
        """The version of `fragment` downloaded and waiting to be taken, if any."""
        with self._lock:
            fetched = self._at(fragment).ready
        return None if fetched is None else fetched.version

    def staging(self, fragment: int) -> bool:
        """The fragment's version waiting to be taken is still being made ready."""
        with self._lock:
            fetched = self._at(fragment).ready
        return fetched is not None and fetched.slot.pending

    def done_taking(self) -> None:
        """The learner is leaving: it takes no version again, so none is downloaded from now on
        (wants dropped and ignored) and those waiting to be taken are released. Each final piece
        used to ask for the version that merges it, and every such version was staged for nothing:
        at 1B parameters a fragment's fp32 delta, 252 MB, each."""
        with self._lock:
            self._done_taking = True
            waiting = [at.ready for at in self._fragments.values() if at.ready is not None]
            for at in self._fragments.values():
                at.want, at.ready = None, None
        for fetched in waiting:
            fetched.release()

    def restage(self, fragment: int) -> None:
        """The fragment's anchor changed (a send): the version waiting to be taken, if any, is made
        ready again against the new one."""
        with self._lock:
            fetched = self._at(fragment).ready
            if fetched is not None and self._stager is not None:
                self._stager.submit(fragment, fetched.version, fetched.params, fetched.slot)

    def close(self) -> None:
        self._closing.set()

    def run(self) -> None:
        self.pacer = self.limits.apply()
        while not self._closing.is_set():
            cpu = time.thread_time()
            try:
                self._poll()
            except DilocoError as exc:
                self.stats.last_error = str(exc)
                log.warning("fetching new versions failed, retrying: %s", exc)
                self._closing.wait(1.0)
            except Exception as exc:  # redis errors past the adapter's retries
                self.stats.last_error = str(exc)
                log.warning("versions stream unavailable, retrying: %s", exc)
                self._closing.wait(1.0)
            finally:
                self.stats.cpu_s += time.thread_time() - cpu

    def _poll(self) -> None:
        if self._last_id == "$":
            # Start from the heads, then follow the stream from its current end.
            last = self.bus.newest(self.bus.keys.versions, 1)
            self._last_id = last[0][0] if last else "0"
            heads = self.bus.heads()
            with self._lock:
                for fragment, version in heads.items():
                    self._at(fragment).head = version
        with self._lock:
            due = [(f, at.head) for f, at in self._fragments.items()
                   if at.want is not None and at.head is not None and at.head > at.want.newer_than
                   and at.unreadable != at.head]
        for fragment, head in due:
            self._download(fragment, head)
            heap.fit()  # the version it replaced is freed once taken; memory short, malloc gives it back
        for entry_id, event in self.bus.read_versions(self._last_id, block_ms=500):
            self._last_id = entry_id
            if not isinstance(event, VersionEvent):
                continue
            with self._lock:
                self._saw(event.fragment, event.version)
                events = self._at(event.fragment).events
                events[event.version] = event
                while len(events) > self.MAX_CHAIN:
                    del events[min(events)]
                for cid in event.contributions:
                    self._merged[cid] = event.version
                while len(self._merged) > self.MERGED_MEMORY:
                    self._merged.popitem(last=False)

    def hold(self, fragment: int, version: int, params: dict[str, torch.Tensor]) -> None:
        """The learner holds `version` of `fragment` (as it joined): the next versions can come as updates."""
        with self._lock:
            self._at(fragment).held = Fetched(version, params)

    def held(self, fragment: int) -> Fetched | None:
        """The newest version of `fragment` fetched (or joined at): what the next update applies to."""
        with self._lock:
            return self._at(fragment).held

    def _download(self, fragment: int, version: int) -> None:
        t0 = time.monotonic()
        keys = self.bus.keys
        try:
            params, broken = self._by_events(fragment, version)
            if params is not None and version % self.MANIFEST_EVERY == 0:
                self._refresh(fragment, version)
            if params is None:
                manifest = read_manifest(self.store, keys, fragment, version)
                self.note(manifest)
                params = None if broken else self._by_updates(fragment, manifest)
                if params is None:
                    with self.stats.cpu_phase("params"):
                        params = read_params(self.store, self.layout, manifest)
                    self.stats.fetched_params += 1
        except (Refused, ObjectMissing, ObjectUnreadable) as exc:
            # This version cannot be taken, and will not become takeable: skip it and keep following
            # the stream, so that the next version is taken (a transient StorageUnavailable is
            # retried instead, by `run`).
            self.stats.fetch_failed += 1
            with self._lock:
                self._at(fragment).unreadable = version
            log.error("version %d of fragment %d cannot be taken (%s): waiting for a newer one", version, fragment,
                      _why(exc))
            return
        fetched = Fetched(version, params)
        with self._lock:
            if self._done_taking:
                return  # downloaded as the learner left: nothing will take it
            at = self._at(fragment)
            if at.want is not None and version > at.want.newer_than:
                at.want = None
            replaced, at.ready, at.held = at.ready, fetched, Fetched(version, params)
            if self._stager is not None:  # asked before the step hook can see it: it waits for the value
                self._stager.submit(fragment, version, params, fetched.slot)
            self._arrived.notify_all()
        if replaced is not None:
            replaced.release()
        self.stats.fetched += 1
        self.stats.fetch_s += time.monotonic() - t0

    def from_own(self, manifest: Manifest, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The params of `manifest`'s version with nothing downloaded but manifests and updates, when
        `own` (a learner's initial values of the fragment, fp32) is version 0 bit for bit, as for
        learners built from the same seed as the proposer: `own` at version 0, else the update
        objects from version 0 on while they are fewer bytes than the params (`_by_updates`). None
        otherwise: the params are downloaded."""
        fragment, keys = manifest.fragment, self.bus.keys
        try:
            genesis = manifest if manifest.version == 0 else read_manifest(self.store, keys, fragment, 0)
        except (Refused, ObjectMissing, ObjectUnreadable):
            genesis = None
        if genesis is None:  # a history without its version 0 (pruned, or unreadable): download
            return None
        if not params_match(params_body(own, keys, fragment, 0), genesis):
            return None
        if manifest.version == 0:
            self.stats.joined_own += 1
            return own
        self.hold(fragment, 0, own)
        params = self._by_updates(fragment, manifest)
        if params is not None:
            self.stats.joined_own += 1
        return params

    def _by_events(self, fragment: int, version: int) -> tuple[dict[str, torch.Tensor] | None, bool]:
        """The params of `version` from the version held and the update objects in between, found by
        the versions stream's events alone (each update lies beside its version's params, written by
        the same coordinator): no manifest is read, and the params are checked bit for bit against
        the digest the newest event names (`_chained`). On a thin link a manifest is a fifth of a
        version's bytes and a round trip more. (None, False) when the manifest path decides: no
        manifest read yet has shown this run's updates and their size, an event is missing, an update
        object is missing, or the chain would be as many bytes as the params. (None, True) when an
        update was there but wrong: the params are downloaded, the same updates not read again."""
        with self._lock:
            at = self._at(fragment)
            held, share = at.held, self._update_share
            if share is None or held is None or not 0 < version - held.version <= self.MAX_CHAIN:
                return None, False
            events = [at.events.get(v) for v in range(held.version + 1, version + 1)]
        if None in events or len(events) * share >= 1.0:
            return None, False
        keys, limit = self.bus.keys, params_limit(self.layout, fragment)
        update_keys = [keys.update_beside(e.params_key, fragment, e.version) for e in events]  # type: ignore[union-attr]
        if None in update_keys:
            return None, False
        try:
            return self._chained(fragment, held, [partial(self.store.get, k, max_bytes=limit) for k in update_keys],
                                 events[-1]), False
        except ObjectMissing:
            return None, False
        except (Refused, ObjectUnreadable) as exc:
            self.stats.update_failed += 1
            log.warning("fragment %d: the updates from version %d to %d cannot be taken (%s): downloading the "
                        "params", fragment, held.version, version, _why(exc))
            return None, True

    def _chained(self, fragment: int, held: Fetched, reads: list[Callable[[], bytes]],
                 recorded: Manifest | VersionEvent) -> dict[str, torch.Tensor]:
        """`held`'s params with the update objects `reads` return applied in order (`storage.updates`),
        checked bit for bit against the digest `recorded` (the manifest or event of the version they
        lead to) gives of its params: BLAKE3 where recorded, else sha256. Raises what a read raises,
        Refused for an update that is not one of these tensors or a result that is not those params."""
        version = recorded.version
        limit, params = params_limit(self.layout, fragment), held.params
        for read in reads:
            with self.stats.cpu_phase("get"):
                blob = read()
            with self.stats.cpu_phase("apply"):
                # The params' digest below checks the result bit for bit: no update payload is hashed on its own.
                params = apply_update(params, blob, max_bytes=limit, expect=self.layout.shapes(fragment), hashed=True)
        with self.stats.cpu_phase("verify"):
            ok = params_match(params_body(params, self.bus.keys, fragment, version), recorded)
        if not ok:
            raise Refused("sha256_mismatch", f"applied to version {held.version} they do not give version "
                                             f"{version}'s params bit for bit")
        self.stats.fetched_updates += len(reads)
        return params

    def _refresh(self, fragment: int, version: int) -> None:
        """Read `version`'s manifest for the coordinator's settings only (`note`); a failure is logged."""
        try:
            self.note(read_manifest(self.store, self.bus.keys, fragment, version))
        except (Refused, ObjectMissing, ObjectUnreadable) as exc:
            log.warning("fragment %d: version %d's manifest cannot be read (%s): its settings stay unknown",
                        fragment, version, _why(exc))

    MANIFEST_EVERY = 16
    """Versions taken through `_by_events` still read every 16th version's manifest: the coordinator's
    settings (`max_staleness`) stay known when it restarts with others."""

    def _by_updates(self, fragment: int, manifest: Manifest) -> dict[str, torch.Tensor] | None:
        """The params of `manifest`'s version from the version held and the update objects in between
        (`storage.updates`), checked bit for bit against the params' recorded sha256; None when
        there is no such chain, it is not smaller than the params, or it does not land on them."""
        with self._lock:
            held = self._at(fragment).held
        if held is None or not 0 < manifest.version - held.version <= self.MAX_CHAIN:
            return None
        chain = [manifest]
        for version in range(manifest.version - 1, held.version, -1):
            chain.append(read_manifest(self.store, self.bus.keys, fragment, version))
        chain.reverse()
        params_bytes = manifest.params_bytes or self.layout.fragment_bytes(fragment)
        if not chain_worth_it([m.update_bytes if m.update_key else 0 for m in chain], params_bytes):
            return None
        limit = params_limit(self.layout, fragment)
        reads = [partial(read_verified, self.store, m.update_key, m.update_sha256, max_bytes=limit) for m in chain]
        try:
            return self._chained(fragment, held, reads, manifest)
        except (Refused, ObjectMissing, ObjectUnreadable) as exc:
            self.stats.update_failed += 1
            log.warning("fragment %d: the updates from version %d to %d cannot be taken (%s): downloading the "
                        "params", fragment, held.version, manifest.version, _why(exc))
            return None


def _why(exc: Exception) -> object:
    """What to log of a storage error: a refusal's reason, else the error itself."""
    return exc.reason if isinstance(exc, Refused) else exc
