"""Announcements in: checking each contribution before it may touch the global state.

`Intake` takes the entries the loop reads, checks each and fetches its object on the fetch threads,
and adds each piece that passes to its fragment's open round (`rounds.Rounds` merges it).
`check_announcement` is pure: it decides from the announcement and what the coordinator knows
(run, layout, head, applied ids) whether the contribution may be fetched. `fetch_tensors`
(`fetch_checked` for a delta, which keeps the checked payload rather than its tensors) then
reads the object (size-bounded), checks its sha256 against the announcement, decodes it
against the run and the layout (codec, shapes, finite values) and checks that its header names what
the announcement says. Each failure is a `Refused` whose reason a person can act on; the caller
records it and the run goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from diloco.coordinator.influence import plausible_deadline
from diloco.coordinator.outer import NesterovState
from diloco.coordinator.policy import Arrival, RoundConfig, staleness_verdict
from diloco.coordinator.timing import Timed, untimed
from diloco.storage import codecs
from diloco.storage.errors import Conflict, Refused, StorageUnavailable
from diloco.storage.history import read_layout, sha256_hex
from diloco.storage.intraop import cap_this_thread
from diloco.storage.keys import SEQ_DIGITS, RunKeys
from diloco.storage.objects import ObjectMissing, ObjectStore, ObjectUnreadable
from diloco.storage.protocol import MAX_RECORD_BYTES, Announcement, Layout, RunSpec

if TYPE_CHECKING:
    from diloco.coordinator.recovery import Recovery
    from diloco.coordinator.rounds import Rounds
    from diloco.coordinator.state import ShardState

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_RECOVERED_IDS = 100_000
"""How many contribution ids announced again from S3 the coordinator remembers (`Intake._recovered`)."""


@dataclass
class PendingDelta:
    """A verified contribution waiting in its fragment's round."""

    entry_id: str
    announcement: Announcement
    arrival: Arrival
    piece: codecs.Opened | None = None
    """The object as read and checked (`fetch_checked`): its payload decompressed, in the codec's own
    bytes (int8: a quarter of its decoded size, int4 an eighth). A round holds its pieces so and
    the merge reads each through `Piece`. None for a genesis proposal, published as it arrives."""


def check_announcement(a: Announcement, *, spec: RunSpec, keys: RunKeys, head: int | None,
                       cfg: RoundConfig) -> None:
    """Refuse what can be refused without reading the object. `head` is None before genesis."""
    if a.run != spec.run:
        raise Refused("misaddressed", f"announcement for run {a.run!r} arrived on run {spec.run!r}'s stream: "
                      "the learner is configured for another run")
    if a.fragment >= spec.num_fragments:
        raise Refused("unknown_fragment", f"fragment {a.fragment} does not exist: run {spec.run!r} has "
                      f"{spec.num_fragments} fragments (0..{spec.num_fragments - 1})")
    if a.kind == "delta" and not a.seq < 10**SEQ_DIGITS:
        raise Refused("bad_message", f"seq {a.seq} from {a.learner} does not fit the {SEQ_DIGITS} digits of an "
                      "object key, so no object of this learner can be at the announced key")
    expected_key = (keys.genesis_params(a.learner, a.fragment) if a.kind == "genesis"
                    else keys.delta(a.fragment, a.learner, a.seq))
    if a.object_key != expected_key:
        raise Refused("misaddressed", f"{a.kind} from {a.learner} points at {a.object_key!r}; "
                      f"a learner may only announce its own object {expected_key!r}")
    if a.size_bytes > spec.max_object_bytes:
        raise Refused("too_large", f"{a.object_key} is announced as {a.size_bytes} bytes, over run {spec.run!r}'s "
                      f"max_object_bytes of {spec.max_object_bytes}: refused unread")
    if a.kind == "genesis":
        return
    if head is None:
        raise Refused("no_genesis", f"fragment {a.fragment} has no version 0 yet, so no delta can be based on it")
    if a.steps < 1:
        raise Refused("empty", f"contribution reports {a.steps} inner steps: nothing to merge")
    ok, _staleness, reason = staleness_verdict(a.base_version, head, cfg)
    if not ok:
        future = a.base_version > head
        hint = ("; no such version was published on this run" if future
                else " (raise --max-staleness to accept contributions this late)")
        raise Refused("future_base" if future else "stale",
                      f"fragment {a.fragment}: {reason.removeprefix('refused: ')}{hint}")


def fetch_tensors(store: ObjectStore, a: Announcement, layout: Layout, max_bytes: int, *,
                  codec: str, timed: Timed = untimed) -> dict[str, torch.Tensor]:
    """Read, check and decode the announced object against the fragment's layout.

    `codec` is the run's codec: a delta must be encoded with it, a genesis proposal with fp32.
    `timed` times the read ("get") and the checks and decoding ("verify")."""
    blob = _read(store, a, max_bytes, timed)
    with timed("verify"):
        return _check_object(blob, a, layout, max_bytes, codec=codec, values=codecs.decode_opened)[1]


def fetch_checked(store: ObjectStore, a: Announcement, layout: Layout, max_bytes: int, *,
                  codec: str, timed: Timed = untimed) -> tuple[codecs.Opened, float]:
    """`fetch_tensors`' read and every one of its checks, but the checked payload is what is
    returned, with the L2 norm of its delta (`codecs.checked_norm`: the values checked as it is
    taken, and not kept): a delta waits for its round in the codec's few bytes, not as a fragment's
    worth of fp32 tensors, and is decoded when the round merges (`Piece`), with nothing to
    decompress or hash again."""
    blob = _read(store, a, max_bytes, timed)
    with timed("verify"):
        return _check_object(blob, a, layout, max_bytes, codec=codec, values=codecs.checked_norm)


class Piece(Mapping[str, torch.Tensor]):
    """A delta waiting in its round as its checked payload (`fetch_checked`), read as its tensors:
    each decoded when it is read (`codecs.tensor_decoders`), and not kept. Its values passed their
    checks at arrival (`codecs.checked_norm`) and are not checked again. The merge reads a tensor of
    every piece at a time (`outer.merge_deltas`): a round holds its pieces in the codec's bytes and,
    while merging, one decoded tensor per merging thread."""

    def __init__(self, opened: codecs.Opened) -> None:
        self._decoders = codecs.tensor_decoders(opened, checked=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._decoders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoders)

    def __len__(self) -> int:
        return len(self._decoders)


def fetch_pool(threads: int) -> ThreadPoolExecutor:
    """The fetch threads: reading and checking pieces (`Intake`), then merging a round's tensors in
    parallel (`Rounds`: the loop merges after its reads). Each one's torch ops on one intra-op
    thread: the pool's parallelism is across pieces or tensors (`storage.intraop`; on 2 cores, 8
    fetch threads with a team each made the merge after them 3x slower)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="fetch", initializer=cap_this_thread, initargs=(1,))


def _read(store: ObjectStore, a: Announcement, max_bytes: int, timed: Timed) -> bytes:
    """The announced object's bytes (size-bounded); Refused if it is missing or unreadable."""
    with timed("get"):
        try:
            return store.get(a.object_key, max_bytes=max_bytes)
        except ObjectMissing:
            raise Refused("missing_object", f"announced object {a.object_key} does not exist in the bucket "
                          "(never uploaded, or deleted since)") from None
        except ObjectUnreadable as exc:
            raise Refused("unreadable_object", f"announced object {a.object_key} cannot be read: {exc}; "
                          "a learner must store its objects so that the run's readers can read them") from None


def _check_object(blob: bytes, a: Announcement, layout: Layout, max_bytes: int, *, codec: str,
                  values: Callable[[codecs.Opened], T]) -> tuple[codecs.Opened, T]:
    """`blob`, the object `a` announces, opened, and what `values` makes of it (which checks the values),
    once every check has passed (see `fetch_tensors`)."""
    if len(blob) != a.size_bytes:
        raise Refused("size_mismatch", f"{a.object_key} is {len(blob)} bytes, the announcement says {a.size_bytes}")
    actual = sha256_hex(blob)
    if actual != a.sha256:
        raise Refused("sha256_mismatch", f"{a.object_key} has sha256 {actual[:16]}..., the announcement "
                      f"says {a.sha256[:16]}...: the object was altered or corrupted after upload")
    try:
        header = codecs.read_header(blob, max_bytes=max_bytes)
        want = codec if a.kind == "delta" else "fp32"
        if header.codec != want:
            raise Refused("wrong_dtype", f"{a.kind} encoded as {header.codec}, but run {a.run!r} takes "
                          f"{a.kind}s encoded as {want!r}")
        opened = codecs.open_object(blob, max_bytes=max_bytes, expect=layout.shapes(a.fragment))
        made, header = values(opened), opened.header
    except Refused as exc:
        raise Refused(exc.code, f"{a.object_key}: {exc.reason}") from None
    labels: dict[str, str | int] = {"run": a.run, "fragment": a.fragment, "learner": a.learner, "kind": a.kind}
    if a.kind == "delta":  # a delta's object names the one contribution it is: re-announcing it under
        # a new id (a replay, to count it twice) or another base (to dodge staleness) is refused.
        # A genesis object may be re-announced by a restarted learner, under a new id.
        labels |= {"contribution_id": a.contribution_id, "base_version": a.base_version}
    for field_name, want_value in labels.items():
        got = header.meta.get(field_name)
        if got is not None and got != want_value:
            raise Refused("misaddressed", f"{a.object_key} says {field_name}={got!r}, the announcement "
                          f"{want_value!r}: an object may only be announced as what it was encoded for")
    return opened, made


def to_arrival(a: Announcement, arrived_at: float) -> Arrival:
    return Arrival(contribution_id=a.contribution_id, learner=a.learner, base_version=a.base_version, tokens=a.tokens,
                   steps=a.steps, arrived_at=arrived_at, step_time_s=a.step_time_s, deadline=a.deadline,
                   final=a.final)


class Intake:
    """Announcements in: each one this shard deals with is checked, its object fetched and checked on
    the fetch threads, and the piece added to its fragment's open round, or refused with a reason.
    Another shard's entries are acknowledged at once (it reads them through its own group)."""

    def __init__(self, state: ShardState, rounds: Rounds, recovery: Recovery, pool: Executor) -> None:
        self.state, self.rounds, self.recovery = state, rounds, recovery
        self.retry: list[tuple[str, Announcement]] = []
        """Entries whose object S3 could not serve: fetched again with the next read."""
        self._recovered: dict[str, None] = {}
        """Contribution ids taken in from a `recovered` announcement (bounded): the learner's own copy,
        should it come too, is acknowledged as repeated."""
        self._pool = pool
        """The fetch threads (`fetch_pool`), the service's."""

    def _mine(self, item: Announcement | Refused) -> bool:
        """Whether this shard deals with an entry: one for a fragment it owns; shard 0 also refuses the
        ones that name no fragment of the run or do not decode."""
        s = self.state
        if isinstance(item, Refused) or not 0 <= item.fragment < s.spec.num_fragments:
            return s.shard.leads
        return s.shard.owns(item.fragment)

    def take(self, entries: list) -> None:
        """Deal with stream entries (`Bus.read_announcements`: an announcement, or the Refused of one
        that does not decode): those of this shard's fragments go into their rounds or are refused."""
        self._fetch_all(self._checked(entries))

    def _checked(self, entries: list) -> list[tuple[str, Announcement]]:
        """The entries to fetch: every check that needs no object passed. Others are refused, left
        pending (held already, or based on a version this process has not seen) or acknowledged
        (another shard's, a superseded genesis, a repeated recovered one)."""
        s = self.state
        to_fetch: list[tuple[str, Announcement]] = []
        foreign: list[str] = []
        seen = {c.announcement.contribution_id for f in s.fragments.values() for c in f.round}
        held = {c.entry_id for f in s.fragments.values() for c in f.round}
        with s.timing("check"):
            ids = [item.contribution_id for _, item in entries if not isinstance(item, Refused)]
            # Applied: what Redis says, and what the manifests this process knows merged (in S3, whatever
            # Redis forgot: `Fragment.applied`).
            ours = set().union(*(merged for frag in s.fragments.values() for merged in frag.applied.values()))
            applied = s.bus.applied_among(ids) | (ours & set(ids))
            for entry_id, item in entries:
                if entry_id in held:
                    # The same entry again (the re-read of our pending entries after a restart or a
                    # Redis outage, a claim) while its contribution waits in an open round or in this
                    # batch: not a duplicate to refuse and acknowledge, which would leave the
                    # contribution in memory only. It stays pending until its round commits.
                    continue
                held.add(entry_id)
                if not self._mine(item):
                    foreign.append(entry_id)
                    continue
                if isinstance(item, Refused):
                    s.refuse(entry_id, None, item)
                    continue
                if item.kind == "genesis" and (frag := s.fragments.get(item.fragment)) is not None and frag.head >= 0:
                    self._superseded(entry_id, item)
                    continue
                try:
                    self._check(item, seen, applied)
                except Refused as exc:
                    if exc.code == "duplicate" and (item.recovered or item.contribution_id in self._recovered):
                        self._repeated(entry_id, item)
                    elif exc.code == "future_base" and self._behind(item):
                        pass  # left pending: read again once this process has caught up
                    else:
                        s.refuse(entry_id, item, exc)
                    continue
                seen.add(item.contribution_id)
                if item.recovered:
                    self._recovered[item.contribution_id] = None
                    while len(self._recovered) > MAX_RECOVERED_IDS:
                        del self._recovered[next(iter(self._recovered))]
                to_fetch.append((entry_id, item))
            s.bus.ack(foreign)  # another shard's: it reads them through its own group
        return to_fetch

    def _fetch_all(self, to_fetch: list[tuple[str, Announcement]]) -> None:
        """Fetch and check the objects on the fetch threads; each piece joins its round, in order."""
        s = self.state
        futures = [(eid, a, self._pool.submit(self._fetch, a)) for eid, a in to_fetch]
        for entry_id, a, future in futures:
            try:
                with s.timing("fetch_wait"):
                    fetched = future.result()
            except Refused as exc:
                s.refuse(entry_id, a, exc)
                continue
            except StorageUnavailable as exc:
                log.warning("S3 unavailable reading %s, will retry: %s", a.object_key, exc)
                self.retry.append((entry_id, a))
                continue
            except Exception as exc:  # noqa: BLE001
                # Whatever one learner's object does, the coordinator goes on: refused, logged with
                # its traceback; every later coordinator would otherwise die on the same entry.
                log.exception("reading %s from %s failed unexpectedly", a.object_key, a.learner)
                s.refuse(entry_id, a, Refused("unreadable_object", f"{a.object_key} could not be read: "
                                              f"{type(exc).__name__}: {exc}"))
                continue
            if a.kind == "genesis":
                self._genesis(entry_id, a, fetched)
            else:
                piece, norm = fetched
                now = s.now()
                arrival = to_arrival(a, now)
                arrival = replace(arrival, norm=norm, deadline=plausible_deadline(
                    arrival.deadline, now=now, cadence=s.cadence, fragment=a.fragment,
                    num_fragments=s.spec.num_fragments, final=a.final))
                s.view.sent(a.learner, now)
                s.fragments[a.fragment].round.append(PendingDelta(entry_id, a, arrival, piece))
            s.metrics.accepted(a)

    def _behind(self, a: Announcement) -> bool:
        """A base ahead of our head is a version this process has not seen: forged, or published by
        a coordinator that took the run over (raises Fenced), or committed again from S3 since.
        True (and Redis is brought up to S3 before reading on) if Redis's head has it."""
        s = self.state
        s.check_epoch(f"{a.learner} sent a piece based on its version {a.base_version} of fragment {a.fragment}")
        if s.bus.heads().get(a.fragment, -1) < a.base_version:
            return False
        self.recovery.reconcile_due = s.read_pending = True
        return True

    def _check(self, a: Announcement, seen: set[str], applied: set[str]) -> None:
        """Refuse a duplicate (`seen` in an open round or this batch, or `applied`), then whatever
        `check_announcement` refuses."""
        s = self.state
        if a.contribution_id in seen or a.contribution_id in applied:
            where = "is already in an open round" if a.contribution_id in seen else "was applied in a committed version"
            raise Refused("duplicate", f"contribution {a.contribution_id} from {a.learner} {where}: this is "
                          "the same announcement delivered again, and it is applied at most once")
        if s.ended is not None:
            raise Refused("run_finished", f"run {s.spec.run!r} is finished ({s.ended.reason}): nothing is "
                          f"merged after its final versions {list(s.ended.versions)}")
        frag = s.fragments.get(a.fragment)
        head = None if frag is None or frag.head < 0 else frag.head
        check_announcement(a, spec=s.spec, keys=s.keys, head=head, cfg=s.round_cfg)

    def _fetch(self, a: Announcement) -> dict[str, torch.Tensor] | tuple[codecs.Opened, float]:
        """A genesis proposal's tensors (published as it arrives), or a delta's checked object, which
        waits in its round as its checked payload (`PendingDelta.piece`), and its norm."""
        s = self.state
        layout = s.layout
        if a.kind == "genesis" and layout is None:
            layout = self._adopt_layout(a.learner)
        assert layout is not None
        fetch = fetch_tensors if a.kind == "genesis" else fetch_checked
        return fetch(s.store, a, layout, s.spec.max_object_bytes, codec=s.spec.codec, timed=s.timing)

    def _adopt_layout(self, learner: str) -> Layout:
        """The first genesis fixes the run's layout (create-only: concurrent proposals, one winner)."""
        s = self.state
        try:
            blob = s.store.get(s.keys.genesis_layout(learner), max_bytes=MAX_RECORD_BYTES)
        except ObjectMissing:
            raise Refused("missing_object", f"{learner} proposed version 0 but its layout "
                          f"{s.keys.genesis_layout(learner)} does not exist") from None
        proposed = Layout.from_wire(blob)
        if len(proposed.fragments) != s.spec.num_fragments:
            raise Refused("bad_layout", f"{learner} proposed {len(proposed.fragments)} fragments, "
                          f"run {s.spec.run!r} has {s.spec.num_fragments}")
        try:
            s.store.put(s.keys.layout(), proposed.to_wire(), create_only=True)
        except Conflict:
            pass
        layout = read_layout(s.store, s.keys)
        assert layout is not None
        s.layout = layout
        return layout

    def _repeated(self, entry_id: str, a: Announcement) -> None:
        """The second copy of a contribution that was announced again from S3 (`recovery`): the learner's
        announcement was late, not lost. Not an error: acknowledged and counted, merged once."""
        s = self.state
        log.info("contribution %s from %s: announced by the learner and again from S3; the second copy is "
                 "acknowledged", a.contribution_id, a.learner)
        s.bus.ack([entry_id])
        s.bus.incr("repeated_after_recovery")
        s.metrics.repeated()

    def _superseded(self, entry_id: str, a: Announcement) -> None:
        """A genesis proposal for a fragment that already has version 0: not an error, not a contribution."""
        s = self.state
        log.info("fragment %d already has a version; %s's initial parameters are not needed", a.fragment, a.learner)
        s.bus.ack([entry_id])
        s.bus.incr("genesis_superseded")

    def _genesis(self, entry_id: str, a: Announcement, tensors: dict[str, torch.Tensor]) -> None:
        s = self.state
        frag = s.fragments[a.fragment]
        if frag.head >= 0:
            self._superseded(entry_id, a)
            return
        c = PendingDelta(entry_id, a, to_arrival(a, s.now()))
        self.rounds.publish(a.fragment, frag, [c], [1.0], tensors, NesterovState(), self.rounds.settings("genesis"),
                            [c.arrival], closed_at=c.arrival.arrived_at)  # a proposal is its own round
