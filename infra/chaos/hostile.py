"""The chaos suite's hostile learner: valid credentials, hostile input, the real servers.

It holds the Redis and S3 credentials every honest learner has, and uses them as a learner would
(`Bus`, `ObjectStore`), or with raw commands where the API will not write a bad record. Each
`hostile:<variant>` fault is one `HostileLearner.act(variant, ...)`; every input it sends is a
`HostileInput` saying what must become of it:

- `lying_tokens`: a well-formed delta (the run's codec, a real fragment, base = head, the round
  deadline honest learners send for) announced with tokens = 2**64-1 in 1 step. Refused, or
  applied once, weighing at most MAX_WEIGHT_RATIO x the median of the other learners' recent
  pieces (the bound `--max-claim-ratio` promises).
- `many_pieces`: PIECES copies of one well-formed delta (larger than an honest one's), each stored
  under its own key and announced with honest tokens and steps for the round deadline. Each is
  refused, or applied with the others: its learner's pieces in a round weigh together at most
  MAX_WEIGHT_RATIO x the median learner's round, and their norms as merged at most MAX_REACH_RATIO x.
- `lying_deadline`: a well-formed delta announced for the deadline 1e15, and a learner's last piece
  for the same deadline. Refused, or applied once;
  the fragment's rounds keep merging (the suite checks that the heads advance after every hostile
  fault).
- `lying_heartbeat`: heartbeats for LIE_S claiming inner steps of 1e-9 s (the round clock follows
  the fastest learner), and three live ids whose stats do not decode (step_time_s = "fast", bytes
  that are not msgpack, and 8 MB of them written raw). Nothing to account for: nothing may crash.
- `oversize`: an announcement whose size_bytes is over the run's max_object_bytes (too_large, the
  object never stored, so it was refused unread), and an object twice the size it is announced
  as (size_mismatch).
- `undecodable`: random bytes announced with their true size and sha256 (bad_framing).
- `flood`: FLOOD_COUNT announcements within FLOOD_S, half of them naming another learner's object
  (misaddressed), half an object that was never stored (missing_object).
- `sse_c`: a well-formed delta stored with server-side encryption under a key of the sender's own
  (SSE-C), announced correctly (unreadable_object). Skipped, with the reason logged and listed,
  where the S3 server refuses such a PUT or ignores the key (a plain GET returns the object).
- `made_up_ids`: GHOSTS learner ids that join, heartbeat once with a ttl of 1e9 s (live for at most
  MAX_LEASE_S: the script caps it) and for GHOST_S, and never contribute.

The objects' headers name their run, fragment, learner, contribution id and base version, as the
coordinator checks, but not their tokens and steps: like the chaos suite's corrupt objects, the
coordinator's sweep after a Redis outage cannot announce them again, so each is announced once,
by the hostile learner, and accounted for by its id.

`judge_hostile(inputs, ledger)` is pure: what became of each input, and whether that is what must.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import botocore.exceptions
import msgpack
import redis
import torch

from diloco.coordinator.policy import RoundConfig
from diloco.infra.chaos.faults import HOSTILE
from diloco.infra.chaos.ledger import Ledger
from diloco.storage import codecs
from diloco.storage.bus import Bus
from diloco.storage.errors import DilocoError, StorageUnavailable
from diloco.storage.history import sha256_hex
from diloco.storage.objects import ObjectStore, ObjectUnreadable, make_client
from diloco.storage.protocol import SCHEMA_VERSION, Announcement, Layout, LearnerStats, RunSpec
from diloco.storage.settings import Endpoints

log = logging.getLogger(__name__)

HOSTILE_ID = "hostile"
"""The learner id the hostile learner contributes under."""
LIE_TOKENS = 2**64 - 1
LIE_DEADLINE = 1e15
LIE_STEP_TIME_S = 1e-9
LIE_S = 8.0
"""How long the lying heartbeats go on."""
FLOOD_COUNT = 200
FLOOD_S = 5.0
"""A flood stops at FLOOD_COUNT announcements or after FLOOD_S, whichever comes first."""
GHOSTS = 20
GHOST = "ghost"
"""The made-up learner ids start with this."""
GHOST_S = 20.0
"""How long the made-up learner ids heartbeat."""
GHOST_TTL_S = 1e9
"""The ttl the made-up ids ask for once (the heartbeat script keeps them live for MAX_LEASE_S at most)."""
JUNK_STATS = b"\xc1" * (8 << 20)
"""An 8 MB stats record of junk, written raw under a live id: its reader warns once and keeps a digest."""
HEARTBEAT_S = 1.0
HEARTBEAT_TTL_S = 3.0
MAX_REACH_RATIO = 1.5 * RoundConfig().max_norm_ratio
"""Likewise for the norms of a learner's pieces in a round as merged (`influence.clip_norms`)."""
MAX_WEIGHT_RATIO = 1.5 * RoundConfig().max_claim_ratio
"""A lying piece applied: the merge weight it counted may be at most this many times the median of
the pieces of other learners the coordinator bounds it by (`max_claim_ratio` x that median,
`coordinator.influence.count_claims`; the ledger reads the same pieces from the manifests, with a
margin for a coordinator that took over and had fewer of them)."""
PIECES = 16
"""How many copies of one delta `many_pieces` sends into one round."""
HONEST_STEPS = 10
"""The steps a hostile piece that does not lie about them claims (sync_every of the chaos run)."""


@dataclass(frozen=True, slots=True)
class HostileInput:
    variant: str
    what: str
    """The input, for a person."""
    contribution_id: str = ""
    """The id it was announced under; "" for an input that announces no contribution."""
    codes: frozenset[str] = frozenset()
    """The refusal codes that must catch it; empty for a contribution of a variant whose influence
    is bounded rather than refused: then any refusal, or applied once weighing at most
    MAX_WEIGHT_RATIO x the median of the other learners' recent pieces."""


@dataclass(frozen=True, slots=True)
class Verdict:
    input: HostileInput
    kind: str
    """applied, refused, dropped, pending, lost, duplicated, or no_contribution (heartbeats, joins, a
    skipped input)."""
    outcome: str
    """What became of it, for a person."""
    problem: str = ""
    """"" when the outcome is one it may have."""
    unbounded: bool = False
    """The problem is that a lying learner weighed more than MAX_WEIGHT_RATIO x the others (the influence bound)."""


def judge_hostile(inputs: list[HostileInput], ledger: Ledger) -> list[Verdict]:
    """What became of each hostile input, from the ledger (pure)."""
    return [_judge(h, ledger) for h in inputs]


def _judge(h: HostileInput, led: Ledger) -> Verdict:
    cid = h.contribution_id
    if not cid:
        return Verdict(h, "no_contribution", "no contribution to account for")
    if cid in led.duplicated:
        return Verdict(h, "duplicated", "applied more than once", "applied more than once")
    expected = f"refused as one of {sorted(h.codes)}" if h.codes else "refused, or applied once"
    if cid in led.applied:
        share, learners, ratio, reach = led.round_share.get(cid, (math.nan, 0, math.nan, math.nan))
        outcome = (f"applied once; its learner took {share:.3g} of its round's weight, {learners} learner(s) in "
                   f"it; its pieces there weighed {ratio:.3g} x the median of the other learners' recent rounds, "
                   f"their norms {reach:.3g} x")
        if h.codes:
            return Verdict(h, "applied", outcome, f"applied; must be {expected}")
        if learners > 1 and not ratio <= MAX_WEIGHT_RATIO:
            return Verdict(h, "applied", outcome, f"its pieces weighed {ratio:.3g} x the median of the other learners' "
                           f"recent rounds, over {MAX_WEIGHT_RATIO:g} (its learner took {share:.3g} of its round)",
                           unbounded=True)
        if learners > 1 and reach > MAX_REACH_RATIO:  # (nan: norms not recorded)
            return Verdict(h, "applied", outcome, f"its pieces' norms as merged came to {reach:.3g} x the median of "
                           f"the other learners' recent rounds, over {MAX_REACH_RATIO:g}", unbounded=True)
        return Verdict(h, "applied", outcome)
    if cid in led.refused or cid in led.dropped:
        code = led.refusal_codes.get(cid, "")
        kind = "dropped" if cid in led.dropped else "refused"
        # Dropped as stale before its object was read (it waited out an outage or a takeover) is fine too.
        problem = f"{code}; must be {expected}" if h.codes and kind == "refused" and code not in h.codes else ""
        return Verdict(h, kind, "dropped as stale" if kind == "dropped" else f"refused: {code}", problem)
    if cid in led.pending:
        return Verdict(h, "pending", "still pending at the end", f"still pending; must be {expected}")
    return Verdict(h, "lost", "announced, then no outcome", f"lost; must be {expected}")


# ---- the bytes ------------------------------------------------------------------------------------

def well_formed(shapes: Mapping[str, tuple[int, ...]], *, codec: str, compress: bool,
                meta: Mapping[str, str | int | float], seed: int, scale: float = 1e-4) -> bytes:
    """A delta object that passes every check of the coordinator: random values of `scale` (small
    by default) in `codec`."""
    gen = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=gen) * scale for name, shape in shapes.items()}
    return codecs.encode(delta, codec, compress=compress, meta=dict(meta))


def random_bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def bad_stats(learner: str) -> list[tuple[str, bytes]]:
    """(learner id, stats record) pairs that `LearnerStats.from_wire` must refuse: a field of the
    wrong type, and bytes that are not msgpack at all."""
    wrong_type = msgpack.packb({"schema": SCHEMA_VERSION, "type": "LearnerStats", "learner": f"{learner}-typed",
                                "step_time_s": "fast"}, use_bin_type=True)
    return [(f"{learner}-typed", wrong_type), (f"{learner}-garbage", b"\xc1 not msgpack")]


# ---- the learner ----------------------------------------------------------------------------------

class HostileLearner:
    """Sends hostile input through the real servers (see the module docstring). Its heartbeats go
    on in a thread of their own, each for a bounded time; `stop()` ends them."""

    def __init__(self, bus: Bus, store: ObjectStore, endpoints: Endpoints, *, tokens_per_step: int) -> None:
        self.bus, self.store, self.keys = bus, store, bus.keys
        self._s3 = make_client(endpoints)  # raw: `ObjectStore.put` stores nothing encrypted
        self.tokens_per_step = tokens_per_step
        self._seq = int(time.time() * 1000) * 1000
        self._sent = 0
        self._live: dict[str, tuple[float, LearnerStats | None]] = {}
        """Learner id -> (until, monotonic; the stats its heartbeats carry)."""
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def act(self, variant: str, spec: RunSpec, layout: Layout, heads: Mapping[int, int],
            sink: list[HostileInput]) -> None:
        """Send one variant's input; each input goes to `sink` once it is sent (so that a failure
        half-way leaves the record of what went out). Raises what the servers raise."""
        if variant not in HOSTILE:
            raise ValueError(f"unknown hostile variant {variant!r}; known: {', '.join(HOSTILE)}")
        fragment = self._sent % spec.num_fragments
        self._sent += 1
        ctx = _Context(spec, layout, fragment, heads[fragment])
        acts = {"lying_tokens": self._lying_tokens, "many_pieces": self._many_pieces,
                "lying_deadline": self._lying_deadline,
                "lying_heartbeat": self._lying_heartbeat, "oversize": self._oversize, "undecodable": self._undecodable,
                "flood": self._flood, "sse_c": self._sse_c, "made_up_ids": self._made_up_ids}
        acts[variant](ctx, sink)

    def stop(self) -> None:
        self._halt.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    # ---- variants --------------------------------------------------------------------------
    def _lying_tokens(self, ctx: _Context, sink: list[HostileInput]) -> None:
        key, blob, cid = self._store_delta(ctx)
        self._announce(ctx, key, blob, cid, tokens=LIE_TOKENS, steps=1, deadline=self._round_deadline(ctx))
        sink.append(HostileInput("lying_tokens", f"{key}: a well-formed delta announced with {LIE_TOKENS} tokens in "
                                 "1 step", cid))

    def _many_pieces(self, ctx: _Context, sink: list[HostileInput]) -> None:
        deadline = self._round_deadline(ctx)
        for _ in range(PIECES):
            key, blob, cid = self._store_delta(ctx, seed=ctx.head, scale=1e-2)  # the same tensors each time
            self._announce(ctx, key, blob, cid, deadline=deadline)
            sink.append(HostileInput("many_pieces", f"{key}: one of {PIECES} copies of a delta sent into one round",
                                     cid))

    def _lying_deadline(self, ctx: _Context, sink: list[HostileInput]) -> None:
        for final in (False, True):
            key, blob, cid = self._store_delta(ctx)
            self._announce(ctx, key, blob, cid, deadline=LIE_DEADLINE, final=final)
            sink.append(HostileInput("lying_deadline", f"{key}: a well-formed {'last ' if final else ''}delta "
                                     f"announced for the deadline {LIE_DEADLINE:g}", cid))

    def _lying_heartbeat(self, ctx: _Context, sink: list[HostileInput]) -> None:
        stats = LearnerStats(learner=HOSTILE_ID, step=1000, tokens=1000 * self.tokens_per_step,
                             step_time_s=LIE_STEP_TIME_S, pid=1)
        self._keep_alive({HOSTILE_ID: stats}, LIE_S)
        sink.append(HostileInput("lying_heartbeat", f"heartbeats of {HOSTILE_ID} for {LIE_S:g}s claiming "
                                 f"{LIE_STEP_TIME_S:g}s per inner step"))
        for name, raw in [*bad_stats(HOSTILE_ID), (f"{HOSTILE_ID}-junk", JUNK_STATS)]:
            self.bus.r.hset(self.keys.learner_stats, name, raw)  # raw: the heartbeat script writes none of these
            self._keep_alive({name: None}, LIE_S)
            sink.append(HostileInput("lying_heartbeat", f"heartbeats of {name} for {LIE_S:g}s whose stats record "
                                     f"does not decode: {raw[:60]!r}"))

    def _oversize(self, ctx: _Context, sink: list[HostileInput]) -> None:
        key, cid = self._next_key(ctx), uuid.uuid4().hex
        size = ctx.spec.max_object_bytes + 1
        self._announce(ctx, key, b"", cid, size_bytes=size, sha256=sha256_hex(key.encode()))
        sink.append(HostileInput("oversize", f"{key} (never stored) announced as {size} bytes, over "
                                 f"max_object_bytes {ctx.spec.max_object_bytes}", cid, frozenset({"too_large"})))
        key, blob, cid = self._store_delta(ctx)
        self._announce(ctx, key, blob, cid, size_bytes=len(blob) // 2)
        sink.append(HostileInput("oversize", f"{key}: {len(blob)} bytes announced as {len(blob) // 2}", cid,
                                 frozenset({"size_mismatch"})))

    def _undecodable(self, ctx: _Context, sink: list[HostileInput]) -> None:
        key, cid = self._next_key(ctx), uuid.uuid4().hex
        blob = random_bytes(4096, self._seq)
        self.store.put(key, blob)
        self._announce(ctx, key, blob, cid)
        sink.append(HostileInput("undecodable", f"{key}: {len(blob)} random bytes with their true size and sha256",
                                 cid, frozenset({"bad_framing"})))

    def _flood(self, ctx: _Context, sink: list[HostileInput]) -> None:
        victim = next((n for n in sorted(self.bus.live_learners()) if not n.startswith((HOSTILE_ID, GHOST))),
                      "victim")
        started = time.monotonic()
        for i in range(FLOOD_COUNT):
            if time.monotonic() - started > FLOOD_S:
                log.warning("hostile: flood cut at %d announcements after %.0fs", i, FLOOD_S)
                break
            cid = uuid.uuid4().hex
            if i % 2:
                key, code, why = self._next_key(ctx), "missing_object", "never stored"
            else:
                self._seq += 1
                key, code, why = self.keys.delta(ctx.fragment, victim, self._seq), "misaddressed", "another learner's"
            self._announce(ctx, key, b"", cid, size_bytes=1000, sha256=sha256_hex(cid.encode()))
            sink.append(HostileInput("flood", f"flood {i}: {key} ({why})", cid, frozenset({code})))

    def _sse_c(self, ctx: _Context, sink: list[HostileInput]) -> None:
        key, cid = self._next_key(ctx), uuid.uuid4().hex
        blob = well_formed(ctx.layout.shapes(ctx.fragment), codec=ctx.spec.codec, compress=ctx.spec.compress,
                           meta=self._meta(ctx, cid), seed=self._seq)
        secret = random.Random(self._seq).randbytes(32)
        try:
            self._s3.put_object(Bucket=self.store.bucket, Key=key, Body=blob, SSECustomerAlgorithm="AES256",
                                SSECustomerKey=secret)
        except botocore.exceptions.ClientError as exc:
            self._skip(sink, f"skipped: the S3 server refused a PUT with SSE-C ({exc})")
            return
        except botocore.exceptions.BotoCoreError as exc:  # no answer: try again on a later tick
            raise StorageUnavailable(f"S3 PUT with SSE-C of {key} failed: {exc}") from exc
        try:
            self.store.get(key, max_bytes=len(blob))
        except ObjectUnreadable:
            pass  # what SSE-C does: nobody without the key reads it
        else:
            self._skip(sink, "skipped: the S3 server ignores SSE-C (a GET without the key returned the object)")
            return
        self._announce(ctx, key, blob, cid)
        sink.append(HostileInput("sse_c", f"{key}: a well-formed delta stored with SSE-C under a key of the "
                                 "sender's own", cid, frozenset({"unreadable_object"})))

    def _made_up_ids(self, ctx: _Context, sink: list[HostileInput]) -> None:
        names = [f"{GHOST}-{self._sent:03d}-{i:02d}" for i in range(GHOSTS)]
        for name in names:
            self.bus.join(name)
            self.bus.heartbeat(name, GHOST_TTL_S, joined=True)  # live for at most MAX_LEASE_S, not for good
        self._keep_alive(dict.fromkeys(names), GHOST_S)
        sink.extend(HostileInput("made_up_ids", f"{name} joined, heartbeat once with a ttl of {GHOST_TTL_S:g}s and then "
                                 f"for {GHOST_S:g}s, never contributing") for name in names)

    # ---- helpers ---------------------------------------------------------------------------
    def _skip(self, sink: list[HostileInput], why: str) -> None:
        log.warning("hostile: sse_c %s", why)
        sink.append(HostileInput("sse_c", why))

    def _next_key(self, ctx: _Context) -> str:
        self._seq += 1
        return self.keys.delta(ctx.fragment, HOSTILE_ID, self._seq)

    def _meta(self, ctx: _Context, cid: str) -> dict[str, str | int]:
        return {"run": ctx.spec.run, "fragment": ctx.fragment, "learner": HOSTILE_ID, "kind": "delta",
                "contribution_id": cid, "base_version": ctx.head}

    def _store_delta(self, ctx: _Context, *, seed: int | None = None, scale: float = 1e-4) -> tuple[str, bytes, str]:
        key, cid = self._next_key(ctx), uuid.uuid4().hex
        blob = well_formed(ctx.layout.shapes(ctx.fragment), codec=ctx.spec.codec, compress=ctx.spec.compress,
                           meta=self._meta(ctx, cid), seed=self._seq if seed is None else seed, scale=scale)
        self.store.put(key, blob)
        return key, blob, cid

    def _round_deadline(self, ctx: _Context) -> float:
        """The deadline an honest learner would send this fragment for now (0 without a round clock)."""
        cadence = self.bus.cadence()
        if cadence is None:
            return 0.0
        return cadence.next_deadline(ctx.fragment, ctx.spec.num_fragments, after=self.bus.server_time())

    def _announce(self, ctx: _Context, key: str, blob: bytes, cid: str, *, tokens: int | None = None,
                  steps: int = HONEST_STEPS, deadline: float = 0.0, size_bytes: int | None = None,
                  sha256: str | None = None, final: bool = False) -> None:
        seq = int(key.rsplit("/", 1)[1])
        self.bus.announce(Announcement(
            kind="delta", run=ctx.spec.run, fragment=ctx.fragment, learner=HOSTILE_ID, seq=seq, contribution_id=cid,
            base_version=ctx.head, tokens=steps * self.tokens_per_step if tokens is None else tokens, steps=steps,
            step_time_s=0.1, object_key=key, size_bytes=len(blob) if size_bytes is None else size_bytes,
            sha256=sha256_hex(blob) if sha256 is None else sha256, sent_at=time.time(), deadline=deadline,
            final=final))

    def _keep_alive(self, learners: Mapping[str, LearnerStats | None], for_s: float) -> None:
        """Heartbeat `learners` now, then every HEARTBEAT_S for `for_s` in the heartbeat thread."""
        for name, stats in learners.items():
            self.bus.heartbeat(name, HEARTBEAT_TTL_S, stats, joined=True)
        until = time.monotonic() + for_s
        with self._lock:
            self._live.update({name: (until, stats) for name, stats in learners.items()})
            if self._thread is None:
                self._thread = threading.Thread(target=self._heartbeats, name="hostile-heartbeats", daemon=True)
                self._thread.start()

    def _heartbeats(self) -> None:
        """Until nothing is left to keep alive (each id for a bounded time) or `stop()`."""
        while not self._halt.wait(HEARTBEAT_S):
            now = time.monotonic()
            with self._lock:
                self._live = {n: v for n, v in self._live.items() if v[0] > now}
                due = [(n, stats) for n, (_until, stats) in self._live.items()]
                if not due:
                    self._thread = None  # the next `_keep_alive` starts another
                    return
            try:
                for name, stats in due:
                    self.bus.heartbeat(name, HEARTBEAT_TTL_S, stats, joined=True)
            except (DilocoError, redis.RedisError) as exc:
                log.warning("hostile: heartbeats failed this time: %s", exc)


@dataclass(frozen=True, slots=True)
class _Context:
    spec: RunSpec
    layout: Layout
    fragment: int
    head: int
