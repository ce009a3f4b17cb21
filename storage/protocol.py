"""The wire protocol: every message and record that crosses a process boundary.

Each type is a frozen dataclass with `to_wire() -> bytes` (msgpack) and `from_wire(bytes)`.
The encoded map always carries `schema` (an int) and `type` (the record's name); decoding
refuses, with a reason, anything that is not exactly what this version writes: unknown schema,
wrong type tag, missing or unknown fields, wrong field types, oversized bodies, msgpack
extension types. Field validation that needs no context (ranges, identifier syntax) happens in
`__post_init__`, so a record that exists is well-formed. Checks that need context (is this
fragment in the run, is this base version plausible) belong to the coordinator.

PROTOCOL.md documents the fields; this module is the source of truth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import msgpack

from diloco.storage.errors import ConfigError, Refused

SCHEMA_VERSION = 3
"""What this build writes. Version 2 made `Manifest.settings` a record (`VersionSettings`); it was a
map of scalars in version 1, which this build still reads (`Manifest._upgrade`), so that histories
written before replay as they did. Version 3 added the merge at the fleet's rate
(`VersionSettings.rate_steps`, `Contribution.usual`)."""
SCHEMAS_READ = (1, 2, 3)
MAX_MESSAGE_BYTES = 1 << 20
"""Stream entries and small records are bounded; a run layout may reach a few MB."""
MAX_RECORD_BYTES = 64 << 20

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""Matched against the whole string (`fullmatch`: a `$` would let a trailing newline through)."""

Scalar = str | int | float | bool
T = TypeVar("T", bound="Record")


def check_id(kind: str, value: str) -> str:
    """Run ids and learner ids go into object keys: letters, digits, '_', '.', '-', 1..64 chars."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise Refused("bad_id", f"{kind} id {value!r} must be 1-64 chars of [A-Za-z0-9_.-], starting alphanumeric")
    return value


def _refuse_ext(code: int, data: bytes) -> Any:
    raise Refused("bad_message", f"msgpack extension type {code} is not part of the protocol")


def unpack(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """msgpack-decode untrusted bytes with a size bound and no extension types."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise Refused("bad_message", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise Refused("too_large", f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except Refused:
        raise
    except Exception as exc:  # msgpack raises several unrelated exception types on garbage
        raise Refused("bad_message", f"not valid msgpack ({type(exc).__name__}: {exc})") from None


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` (from msgpack) against a field annotation; return it in the field's type."""
    origin = typing.get_origin(tp)
    if origin is Literal:  # a choice of strings
        if type(value) is not str or value not in typing.get_args(tp):
            raise Refused("bad_message", f"{where}: {value!r:.80} is not one of {', '.join(typing.get_args(tp))}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except Refused as exc:
                errors.append(exc.reason)
        raise Refused("bad_message", f"{where}: {'; '.join(errors)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise Refused("bad_message", f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise Refused("bad_message", f"{where}: expected a map, got {type(value).__name__}")
        return {_coerce(k, key_tp, f"{where} key"): _coerce(v, val_tp, f"{where}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return tp._from_map(value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Refused("bad_message", f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Refused("bad_message", f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if tp in (str, bool, bytes):
        if type(value) is not tp:
            raise Refused("bad_message", f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"unsupported field type {tp!r} at {where}")


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


class Record:
    """Mixin: msgpack encoding with a schema version and a type tag, strict decoding."""

    MAX_BYTES: ClassVar[int] = MAX_MESSAGE_BYTES

    def to_wire(self) -> bytes:
        body = _to_plain(self)
        body["schema"] = SCHEMA_VERSION
        body["type"] = type(self).__name__
        return pack(body)

    @classmethod
    def from_wire(cls: type[T], data: bytes) -> T:
        body = unpack(data, max_bytes=cls.MAX_BYTES)
        if not isinstance(body, dict):
            raise Refused("bad_message", f"{cls.__name__}: expected a map, got {type(body).__name__}")
        schema = body.get("schema")
        if type(schema) is not int or schema not in SCHEMAS_READ:
            raise Refused("unknown_schema",
                          f"{cls.__name__} has schema version {schema!r}; this build reads "
                          f"{', '.join(map(str, SCHEMAS_READ))}: upgrade the older side")
        if body.get("type") != cls.__name__:
            raise Refused("bad_message", f"expected a {cls.__name__} record, got type {body.get('type')!r}")
        fields = {k: v for k, v in body.items() if k not in ("schema", "type")}
        return cls._from_map(cls._upgrade(fields, schema), cls.__name__)

    @classmethod
    def _upgrade(cls, body: dict[str, Any], schema: int) -> dict[str, Any]:
        """The fields of a record written at an older `schema`, as this build writes them."""
        return body

    @classmethod
    def _from_map(cls: type[T], body: Any, where: str) -> T:
        if not isinstance(body, dict):
            raise Refused("bad_message", f"{where}: expected a map, got {type(body).__name__}")
        hints, names, required = _schema(cls)
        unknown = sorted(set(body) - set(names))
        if unknown:
            raise Refused("bad_message", f"{where}: unknown fields {unknown}")
        missing = [n for n in required if n not in body]
        if missing:
            raise Refused("bad_message", f"{where}: missing fields {missing}")
        kwargs = {n: _coerce(body[n], hints[n], f"{where}.{n}") for n in names if n in body}
        try:
            return cls(**kwargs)
        except Refused:
            raise
        except (ValueError, TypeError) as exc:
            raise Refused("bad_message", f"{where}: {exc}") from None


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], tuple[str, ...], tuple[str, ...]]:
    """A record class's field types, field names and required fields, worked out once per class
    (`typing.get_type_hints` evaluates every annotation anew: 1.6 ms per LearnerStats record, which
    made reading 4096 learners' stats take 7 s)."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return (typing.get_type_hints(cls), tuple(f.name for f in fields),
            tuple(f.name for f in fields if f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING))


@functools.cache
def _choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The fields of the dataclass `cls` typed as a Literal (a choice of strings), with their choices."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


def check_choices(config: Any) -> None:
    """Raise ConfigError, naming the choices, for a field of the dataclass `config` typed as a Literal
    whose value is not one of them: a setting is checked where it is made, as the wire checks a
    record where it is read (`_coerce`). Options take their `choices=` from the same types."""
    for name, choices in _choices(type(config)).items():
        value = getattr(config, name)
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


TakeRule = Literal["adopt", "rebase", "mix"]
"""How a learner takes a new version (RunSpec.merge_rule)."""
MERGE_RULES = typing.get_args(TakeRule)
CadenceKind = Literal["clock", "steps"]
"""When learners send (RunSpec.cadence)."""
CADENCES = typing.get_args(CadenceKind)


@dataclass(frozen=True, slots=True)
class RunSpec(Record):
    """A run's settings (`run.msgpack`), written once by the coordinator creating the run."""

    run: str
    num_fragments: int
    """P: fragments the model is split into, each synced on its own schedule."""
    sync_every: int
    """H: inner steps between two contributions of a fragment."""
    overlap_steps: int
    """tau: inner steps a learner trains on before it merges the new global fragment."""
    merge_rule: TakeRule
    """How a learner takes a new global fragment: 'adopt' as is (steps since the send dropped), 'rebase'
    with that progress kept on top, 'mix' blended with alpha."""
    alpha: float
    """For merge_rule 'mix': local = alpha * local + (1 - alpha) * global (0 = adopt)."""
    codec: str
    """Outer-gradient codec: one of `storage.codecs.CODECS`."""
    compress: bool
    """zstd on top of the codec."""
    max_object_bytes: int
    """Larger objects are refused unread."""
    created_at: float
    """Unix seconds."""
    cadence: CadenceKind = "clock"
    """When learners send: 'clock' (at the round deadlines, `Cadence`) or 'steps' (every H steps)."""

    def __post_init__(self) -> None:
        check_id("run", self.run)
        _require(self.cadence in CADENCES, f"cadence must be 'clock' or 'steps', got {self.cadence!r}")
        _require(1 <= self.num_fragments <= 9999, f"num_fragments must be in 1..9999, got {self.num_fragments}")
        _require(self.sync_every >= 1, f"sync_every must be >= 1, got {self.sync_every}")
        _require(0 <= self.overlap_steps < self.sync_every,
                 f"overlap_steps must be in [0, sync_every), got {self.overlap_steps}")
        _require(self.merge_rule in MERGE_RULES, f"merge_rule must be one of {MERGE_RULES}, got {self.merge_rule!r}")
        _require(0.0 <= self.alpha < 1.0, f"alpha must be in [0, 1), got {self.alpha}")
        _require(bool(CODEC_NAME.fullmatch(self.codec)), f"codec {self.codec!r} is not a codec's name")
        _require(self.max_object_bytes > 0, "max_object_bytes must be positive")


CODEC_NAME = re.compile(r"[a-z0-9_]{1,32}")
"""What a codec's name looks like; which codecs this build has is `storage.codecs.CODECS` (a reader
refuses an object in one it lacks, saying so)."""


@dataclass(frozen=True, slots=True)
class ParamSpec(Record):
    """One parameter of a `Layout` (a plain map inside it)."""

    name: str
    """Its name in the model's state dict, not empty."""
    shape: tuple[int, ...]
    dtype: str
    """The model's dtype, e.g. 'float32' (tensor objects are float32 regardless)."""

    def __post_init__(self) -> None:
        _require(bool(self.name), "empty parameter name")
        _require(all(d >= 0 for d in self.shape), f"negative dimension in {self.name}: {self.shape}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Layout(Record):
    """Which parameters make up each fragment (`layout.msgpack`), fixed for the run's life."""

    MAX_BYTES: ClassVar[int] = MAX_RECORD_BYTES
    fragments: tuple[tuple[ParamSpec, ...], ...]
    """P arrays of parameters: no name twice, no empty fragment."""

    def __post_init__(self) -> None:
        names = [p.name for frag in self.fragments for p in frag]
        _require(len(names) == len(set(names)), "a parameter appears in two fragments")
        _require(all(frag for frag in self.fragments), "empty fragment in layout")

    def shapes(self, fragment: int) -> dict[str, tuple[int, ...]]:
        return {p.name: p.shape for p in self.fragments[fragment]}

    def fragment_bytes(self, fragment: int) -> int:
        return 4 * sum(p.numel for p in self.fragments[fragment])


PieceKind = Literal["delta", "genesis"]
KINDS = typing.get_args(PieceKind)


@dataclass(frozen=True, slots=True)
class Announcement(Record):
    """Learner -> coordinator: "my contribution for this fragment is at object_key"."""

    kind: PieceKind
    """'delta' (an outer gradient) or 'genesis' (initial parameters proposed as version 0)."""
    run: str
    fragment: int
    learner: str
    seq: int
    """Per-learner counter, part of the object key."""
    contribution_id: str
    """Unique; deduplicates a re-sent XADD."""
    base_version: int
    """Version of the fragment the delta was computed against (-1 for genesis)."""
    tokens: int
    """Tokens trained since the learner's previous contribution to the fragment."""
    steps: int
    """Inner steps in that interval."""
    step_time_s: float
    """Recent mean inner-step time, for the grace window."""
    object_key: str
    size_bytes: int
    """Of the whole object (> 0)."""
    sha256: str
    """Hex sha256 of the whole object."""
    sent_at: float
    """Learner wall clock, informational."""
    deadline: float = 0.0
    """The `Cadence` deadline (unix seconds) it was sent for; 0: sent on a step count."""
    final: bool = False
    """The sender's last piece for the fragment: it leaves (finished or preempted), so no round waits
    for more from it."""
    recovered: bool = False
    """Made again by the coordinator from the stored object (`coordinator.recovery`), the learner's
    announcement lost with Redis's last writes or only late; the second copy is acknowledged as
    repeated, not refused."""

    def __post_init__(self) -> None:
        _require(self.kind in KINDS, f"unknown kind {self.kind!r}")
        check_id("run", self.run)
        check_id("learner", self.learner)
        _require(self.fragment >= 0, f"negative fragment {self.fragment}")
        _require(self.seq >= 0, f"negative seq {self.seq}")
        _require(bool(re.fullmatch(r"[0-9a-f]{32}", self.contribution_id)), "contribution_id must be 32 hex chars")
        _require(self.base_version >= -1, f"base_version {self.base_version} < -1")
        _require(self.tokens >= 0 and self.steps >= 0, "tokens and steps must be >= 0")
        _require(self.step_time_s >= 0.0, "step_time_s must be >= 0")
        for name in ("step_time_s", "sent_at", "deadline"):
            value = getattr(self, name)
            _require(math.isfinite(value), f"{name} must be a finite number of seconds, got {value}")
        _require(self.size_bytes > 0, "size_bytes must be positive")
        _require(bool(re.fullmatch(r"[0-9a-f]{64}", self.sha256)), "sha256 must be 64 hex chars")


@dataclass(frozen=True, slots=True)
class ObjectMeta(Record):
    """A contribution object's header `meta`, written by its learner: from it the coordinator can
    announce the object again after Redis lost the announcement (`coordinator.recovery`), unless it
    lacks the counts (as the chaos suite's hostile learner's does). Values are str, int or float:
    `to_meta` writes `final` as 1, only when true."""

    run: str
    fragment: int
    learner: str
    kind: PieceKind
    contribution_id: str
    base_version: int
    tokens: int
    steps: int
    step_time_s: float
    deadline: float = 0.0
    final: bool = False

    def to_meta(self) -> dict[str, str | int | float]:
        meta = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "final"}
        return meta | {"final": 1} if self.final else meta

    @classmethod
    def from_meta(cls, meta: Any, where: str) -> ObjectMeta:
        """The record a header's meta map holds; Refused (`bad_header`) when it holds none."""
        try:
            if not isinstance(meta, dict) or meta.get("final", 0) not in (0, 1):
                raise Refused("bad_message", f"a map with final 0 or 1 expected, got {meta!r:.200}")
            return cls._from_map(meta | {"final": bool(meta.get("final", 0))}, "meta")
        except Refused as exc:
            raise Refused("bad_header", f"{where}: its header does not describe a contribution ({exc.reason})") from None

    def announcement(self, key: str, seq: int, size_bytes: int, sha256: str, sent_at: float) -> Announcement:
        """The announcement of the object at `key` this meta describes, made again (`recovered`)."""
        return Announcement(kind=self.kind, run=self.run, fragment=self.fragment, learner=self.learner, seq=seq,
                            contribution_id=self.contribution_id, base_version=self.base_version,
                            tokens=self.tokens, steps=self.steps, step_time_s=self.step_time_s, object_key=key,
                            size_bytes=size_bytes, sha256=sha256, sent_at=sent_at, deadline=self.deadline,
                            final=self.final, recovered=True)


@dataclass(frozen=True, slots=True)
class Contribution(Record):
    """One input of a version, as recorded in its manifest."""

    contribution_id: str
    learner: str
    seq: int
    object_key: str
    sha256: str
    base_version: int
    staleness: int
    """The fragment's head version at the merge minus `base_version`."""
    tokens: int
    """Tokens counted (see `bounded`)."""
    steps: int
    weight: float
    """Merge weight (`coordinator.policy.merge_weights`): a version's weights sum to 1 unless the
    staleness discount shrank a stale input's or the fleet's rate raised a slow learner's."""
    stream_id: str
    """The announcement's Redis stream entry id (informational: S3 history never needs Redis)."""
    bounded: str = ""
    """Set when the merge counted fewer tokens or more steps than claimed (`tokens`, `steps` are the
    counts, `coordinator.influence.count_claims`) or scaled the pieces down (`clip`): the claim and why
    it was cut."""
    norm: float | None = None
    """L2 norm of the piece's decoded delta, measured when the coordinator read it; None in versions
    made before it was recorded."""
    clip: float = 1.0
    """In (0, 1]: the factor its learner's pieces in the round were scaled by, their summed norm against
    the other learners' (`coordinator.influence.clip_norms`); `weight` includes it."""
    usual: int = 0
    """Its learner's usual piece in inner steps (`coordinator.policy.usual_pieces`) when the version's
    weights are at the fleet's rate (`VersionSettings.rate_steps`); else 0."""
    waited_s: float = 0.0
    """Seconds from its arrival (read and checked) to its round's close (the merge decision): pieces
    that held a round open waited for nothing, the others for them (`diloco inspect`). About 0 for the
    piece that closed it; 0 in versions made before it was recorded."""

    def __post_init__(self) -> None:
        _require(0.0 < self.clip <= 1.0, f"clip {self.clip!r} must be in (0, 1]")
        _require(math.isfinite(self.waited_s) and self.waited_s >= 0, f"waited_s {self.waited_s!r} must be >= 0")
        _require(self.usual >= 0, f"usual {self.usual!r} must be >= 0")
        _require(self.norm is None or (math.isfinite(self.norm) and self.norm >= 0),
                 f"norm {self.norm!r} must be a finite number >= 0")


@dataclass(frozen=True, slots=True)
class Refusal(Record):
    """A refused contribution (`refusals` stream, `Manifest.refused`); learner and ids are empty when
    the entry did not decode."""

    contribution_id: str
    learner: str
    code: str
    """Why: one of the refusal codes (PROTOCOL.md)."""
    reason: str
    """For a person: at most 2000 characters plus a note of how many were cut."""
    object_key: str = ""
    """The refused object ("": the entry named none, e.g. a malformed one)."""


MergeKind = Literal["weighted_mean", "radial_directional"]
"""How a round's pieces are merged (`VersionSettings.merge`, `coordinator.outer.merge_deltas`)."""
MERGES = typing.get_args(MergeKind)
OuterStep = Literal["nesterov", "fractional_nesterov"]
OUTER_STEPS = typing.get_args(OuterStep)
"""The outer step (`VersionSettings.outer`): 'nesterov' takes a whole step every round (versions made
before fractional steps existed); 'fractional_nesterov' takes the step of the round's `progress`."""


@dataclass(frozen=True, slots=True)
class VersionSettings(Record):
    """How a version was made (`Manifest.settings`): merge and outer-step configuration, the round's own
    figures, the kernels used. The live coordinator configures the arithmetic from it
    (`coordinator.outer.apply_round`); replay reads it back. Defaults: what versions made before a field
    existed meant."""

    kind: PieceKind
    """'genesis' (version 0, a learner's parameters) or 'delta' (a merged round)."""
    outer_lr: float
    outer_momentum: float
    """In [0, 1)."""
    outer: OuterStep = "nesterov"
    """One of OUTER_STEPS."""
    merge: MergeKind = "weighted_mean"
    """One of MERGES."""
    weights: str = "tokens*tokens/steps"
    """How inputs are weighed (`coordinator.policy.merge_weights`), for a person."""
    staleness_discount: bool = True
    """Weights discount stale inputs."""
    staleness_relative: bool = False
    """The discount is relative to the round's median staleness; False in older manifests."""
    rate_steps: int = 0
    """The fastest fleet learner's usual piece, in inner steps: a slower learner's weight is raised by
    this over its own (`Contribution.usual`), at most to the heaviest other's. 0: not raised."""
    max_staleness: int | None = None
    """Inputs based further behind the head than this were refused (None: not recorded)."""
    min_quorum: int = 1
    grace_gamma: float = 0.5
    round_scale: float = 1.0
    """In (0, 1]: the merged update's scale (`coordinator.policy.round_step`)."""
    progress: float = 1.0
    """In (0, 1]: the fractional step's progress; 1 for whole ('nesterov') steps."""
    lookahead: float = 1.0
    """In [0, 1]: the share of the momentum's push taken, that of the round's learners training on from
    the version (`coordinator.policy.lookahead`); 1 for whole steps and older manifests."""
    stale_momentum: bool = True
    """Stale inputs (staleness > 0) enter the momentum buffer too. False: only the fresh inputs'
    part (`coordinator.outer.buffered_part`); True in older manifests."""
    bounded_momentum: bool = True
    """Bounded inputs (`Contribution.bounded` set) enter the momentum buffer too. False: they move the
    params only (`coordinator.outer.buffered_inputs`); True in older manifests."""
    update_norm: float | None = None
    """L2 norm of the merged update before its scale; None: not measured."""
    downstream: str = "fp32"
    """Codec of the version's update object; 'fp32': the outer step's result is published as is."""
    torch: str = ""
    """The torch version that computed it ("": not recorded); a replay elsewhere may differ."""
    cpu_capability: str = ""
    """torch's CPU kernels (e.g. 'AVX2') that computed it."""
    whatif_of: str = ""
    """A version re-derived by `diloco whatif`: the root of the run it comes from ("" otherwise)."""
    whatif_changes: str = ""
    """And what it changed, e.g. 'outer_lr=0.35', or 'no change'."""

    def __post_init__(self) -> None:
        _require(self.kind in KINDS, f"unknown kind {self.kind!r}")
        _require(self.merge in MERGES, f"merge rule {self.merge!r} is not one this build knows ({', '.join(MERGES)})")
        _require(self.outer in OUTER_STEPS,
                 f"outer optimizer {self.outer!r} is not one this build knows ({', '.join(OUTER_STEPS)})")
        _require(bool(CODEC_NAME.fullmatch(self.downstream)), f"downstream {self.downstream!r} is not a codec's name")
        _require(math.isfinite(self.outer_lr) and math.isfinite(self.outer_momentum) and 0.0 <= self.outer_momentum < 1.0,
                 f"outer_lr {self.outer_lr!r} must be finite and outer_momentum {self.outer_momentum!r} in [0, 1)")
        _require(0.0 < self.round_scale <= 1.0, f"round_scale {self.round_scale!r} must be a number in (0, 1]")
        _require(0.0 < self.progress <= 1.0 and (self.outer != "nesterov" or self.progress == 1.0),
                 f"progress {self.progress!r} must be a number in (0, 1], and 1 for whole steps")
        _require(self.stale_momentum or self.outer != "nesterov",
                 "stale_momentum False needs the fractional outer step")
        _require(self.bounded_momentum or self.outer != "nesterov",
                 "bounded_momentum False needs the fractional outer step")
        _require(0.0 <= self.lookahead <= 1.0 and (self.outer != "nesterov" or self.lookahead == 1.0),
                 f"lookahead {self.lookahead!r} must be a number in [0, 1], and 1 for whole steps")
        _require(self.update_norm is None or (math.isfinite(self.update_norm) and self.update_norm >= 0),
                 f"update_norm {self.update_norm!r} must be a finite number >= 0")
        _require(math.isfinite(self.grace_gamma), f"grace_gamma {self.grace_gamma!r} must be finite")
        _require(self.max_staleness is None or self.max_staleness >= 0, f"max_staleness {self.max_staleness!r} < 0")
        _require(self.rate_steps >= 0, f"rate_steps {self.rate_steps!r} < 0")


def _v1_settings(settings: Any, version: Any) -> dict[str, Any]:
    """The `VersionSettings` fields of a schema-1 manifest's settings map (a version 0 without `kind`
    is genesis; a recorded progress of a whole step was not used and is dropped)."""
    if not isinstance(settings, dict):
        raise Refused("bad_message", f"Manifest.settings: expected a map, got {type(settings).__name__}")
    body = {"kind": "genesis" if version == 0 else "delta"} | settings
    if body.get("outer", "nesterov") == "nesterov":
        body.pop("progress", None)
    return body


@dataclass(frozen=True, slots=True)
class Manifest(Record):
    """The commit record of one version of one fragment (`versions/{f}/{v}/manifest`)."""

    MAX_BYTES: ClassVar[int] = MAX_RECORD_BYTES
    run: str
    fragment: int
    version: int
    parent_version: int
    """-1 for version 0 (genesis)."""
    params_key: str
    """The version's parameters: a tensor object, fp32."""
    params_sha256: str
    outer_state_key: str
    """The outer optimizer's state after this version (momentum), a tensor object."""
    outer_state_sha256: str
    inputs: tuple[Contribution, ...]
    """In merge order: replayed in it, they reproduce params_sha256 bit for bit."""
    settings: VersionSettings
    """Everything the merge and the outer step used."""
    refused: tuple[Refusal, ...]
    """Contributions to this fragment refused since the parent version."""
    committed_at: float
    """Unix seconds."""
    epoch: int
    """Fencing epoch of the coordinator that wrote it."""
    update_key: str = ""
    """The version as an update of its parent in the downstream codec (`storage.updates`), downloaded
    instead of the params by a learner holding the parent. Empty: none (version 0, or published in
    fp32)."""
    update_sha256: str = ""
    update_bytes: int = 0
    """Size of the update object (a chain of updates is taken only while smaller than the params)."""
    params_bytes: int = 0
    """Size of the params object (0 in older manifests)."""
    merged_tokens: int = 0
    """Tokens merged into the fragment since version 0, this version's inputs included, as they weighed:
    what `--token-budget` measures. Restarts from 0 after older manifests."""
    params_blake3: str = ""
    """BLAKE3 of the params object (the bytes params_sha256 covers; about 3x sha256's speed on one
    core): what a learner checks params built from update objects against, bit for bit. Empty in older
    manifests (then params_sha256 is checked)."""

    @classmethod
    def _upgrade(cls, body: dict[str, Any], schema: int) -> dict[str, Any]:
        if schema == 1:  # settings were a map of scalars
            return body | {"settings": _v1_settings(body.get("settings"), body.get("version"))}
        return body

    def __post_init__(self) -> None:
        check_id("run", self.run)
        _require(bool(self.update_key) == bool(self.update_sha256) and self.update_bytes >= 0
                 and self.params_bytes >= 0 and self.merged_tokens >= 0,
                 "update_key and update_sha256 go together, sizes and merged tokens >= 0")
        _require(self.params_blake3 == "" or bool(re.fullmatch(r"[0-9a-f]{64}", self.params_blake3)),
                 "params_blake3 must be empty or 64 hex chars")
        _require(self.version >= 0 and self.parent_version == self.version - 1,
                 f"version {self.version} must follow parent {self.parent_version}")


@dataclass(frozen=True, slots=True)
class Collection(Record):
    """Where the replayable history of a run's prefix starts (`collections/{n}`), written by `diloco gc`
    before its first delete (so a pass cut short leaves a record of what it removes) and by
    `diloco whatif` (its history starts at its first re-derived version). Replay starts each fragment at
    the highest `first_replayable` of all; older versions are reported as collected."""

    run: str
    created_at: float
    by: str
    """What wrote it, for a person: e.g. 'gc --keep-last 3 --min-age-s 3600' or 'whatif of diloco/r1'."""
    first_replayable: tuple[int, ...]
    """Per fragment (index = fragment): versions below this one cannot be re-derived under this prefix."""
    deleted_objects: int = 0
    deleted_bytes: int = 0

    def __post_init__(self) -> None:
        check_id("run", self.run)
        _require(all(v >= 0 for v in self.first_replayable), "first_replayable versions must be >= 0")
        _require(self.deleted_objects >= 0 and self.deleted_bytes >= 0, "deleted counts must be >= 0")


@dataclass(frozen=True, slots=True)
class Cadence(Record):
    """The coordinator's round clock, in Redis: fragment p of P has a deadline at origin + (k + p/P) *
    period_s for every integer k >= 0. A learner sends a fragment at its last step boundary before the
    deadline less its pieces' time to go out, with the steps it managed; the round merges then. Times:
    Redis server time (unix seconds), one clock for all."""

    origin: float
    """Redis server time (unix seconds)."""
    period_s: float
    """> 0."""

    def __post_init__(self) -> None:
        _require(self.period_s > 0, f"period_s must be positive, got {self.period_s}")

    def next_deadline(self, fragment: int, num_fragments: int, after: float) -> float:
        """The first deadline of `fragment` strictly after `after`. The clock starts at its origin:
        fragment p's first deadline is origin + p/P * period_s, whenever `after` is before it."""
        phase = self.origin + self.period_s * fragment / num_fragments
        return phase + max(0, math.floor((after - phase) / self.period_s) + 1) * self.period_s


@dataclass(frozen=True, slots=True)
class VersionEvent(Record):
    """Coordinator -> learners (versions stream): a new global version of a fragment is committed."""

    run: str
    fragment: int
    version: int
    params_key: str
    params_sha256: str
    manifest_key: str
    """The version's `Manifest`, which a learner reads only when it needs more than the params."""
    contributions: tuple[str, ...] = field(default=())
    """contribution_ids merged into this version."""
    committed_at: float = 0.0
    params_blake3: str = ""
    """`Manifest.params_blake3` (empty: none recorded)."""


@dataclass(frozen=True, slots=True)
class LearnerFinished(Record):
    """A learner that finished its part (`finished_learners` hash), written as it leaves, after its
    final pieces were announced."""

    learner: str
    finished_at: float
    """Redis server time (unix seconds)."""
    steps: int
    """Inner steps it trained in its last incarnation."""
    final: tuple[str, ...] = ()
    """Contribution ids of its final pieces (none for a fragment it had just sent)."""

    def __post_init__(self) -> None:
        check_id("learner", self.learner)


@dataclass(frozen=True, slots=True)
class LearnerLeft(Record):
    """A learner that left without finishing (`left` hash): preempted (SIGTERM, its progress sent; it
    may come back) or failed (its training loop raised; nothing sent)."""

    learner: str
    left_at: float
    """Redis server time (unix seconds)."""
    steps: int
    """Inner steps it trained in that incarnation."""
    preempted: bool
    """True: preempted; false: failed."""

    def __post_init__(self) -> None:
        check_id("learner", self.learner)
        _require(self.steps >= 0, f"steps must be >= 0, got {self.steps}")


MAX_LOSS_SAMPLES = 4096
"""A LossLog holds at most this many samples (the learner writes far fewer, `workers/losses.py`)."""


@dataclass(frozen=True, slots=True)
class LossLog(Record):
    """Some of a learner's reported losses (`losses/{learner}/{seq}`, create-only): parallel arrays, one
    sample per entry, in time order."""

    learner: str
    incarnation: str
    """`LearnerStats.incarnation` of the process that wrote it."""
    steps: tuple[int, ...]
    """Inner steps of that incarnation at the sample."""
    tokens: tuple[int, ...]
    """Tokens of those steps."""
    losses: tuple[float, ...]
    """The last loss given to `Learner.report` (finite)."""
    times: tuple[float, ...]
    """Redis server time of the sample (unix seconds)."""

    def __post_init__(self) -> None:
        check_id("learner", self.learner)
        n = len(self.steps)
        _require(n <= MAX_LOSS_SAMPLES, f"{n} samples, over {MAX_LOSS_SAMPLES}")
        _require(len(self.tokens) == len(self.losses) == len(self.times) == n, "arrays of different lengths")
        _require(all(s >= 0 for s in self.steps) and all(t >= 0 for t in self.tokens), "negative step or tokens")
        _require(all(map(math.isfinite, self.losses)) and all(map(math.isfinite, self.times)), "non-finite value")
        _require(len(self.incarnation) <= 64, "incarnation longer than 64 characters")


@dataclass(frozen=True, slots=True)
class LearnerStats(Record):
    """A learner's progress, sent with every heartbeat (`learner_stats` hash): the round clock uses
    `step_time_s`; `diloco demo`, the benchmarks and the tests read the rest. Readers skip, with a
    warning, a record failing its checks."""

    learner: str
    step: int = 0
    """Inner steps of this incarnation."""
    tokens: int = 0
    """Tokens of those steps."""
    loss: float = math.nan
    """The last loss given to `Learner.report` (nan: none)."""
    step_time_s: float = 0.0
    """Moving average of the wall time of an inner step (0: not measured yet)."""
    adopted: int = 0
    """Global versions merged into the local model."""
    steps_through: int = 0
    """Inner steps trained on the old base before a take (since the fragment's last send or take),
    summed over takes: the training on through rounds (mean per take: steps_through / adopted); with the
    adopt rule, the steps dropped."""
    uploaded: int = 0
    """Contributions stored and announced."""
    upload_failed: int = 0
    """Contributions dropped after the upload deadline."""
    bytes_uploaded: int = 0
    """Bytes of the contribution objects it stored (up)."""
    bytes_downloaded: int = 0
    """Bytes of every object it read from S3 (down): versions, manifests, the run's records."""
    bytes_joined: int = 0
    """Of those, what joining read (the run's records, every fragment's params): once per incarnation."""
    sync_s: float = 0.0
    """Time the training loop spent in the learner's step hook."""
    background_cpu_s: float = 0.0
    """CPU seconds of the learner's transfer threads (`TransferStats.cpu_s`)."""
    wall_s: float = 0.0
    """Wall time since the end of the first step."""
    link_round_s: float = 0.0
    """Seconds per round period its S3 transfers keep its link's busier direction in use
    (`storage.linkuse`; 0: not measured); the round clock stretches for it (`max_link_share`)."""
    pid: int = 0
    """The learner's process id, for a person looking at the machine."""
    incarnation: str = ""
    """Random per process: tells a restarted learner of the same id from its previous life."""

    def __post_init__(self) -> None:
        check_id("learner", self.learner)
        counts = {"step": self.step, "tokens": self.tokens, "adopted": self.adopted,
                  "steps_through": self.steps_through, "uploaded": self.uploaded,
                  "upload_failed": self.upload_failed, "bytes_uploaded": self.bytes_uploaded,
                  "bytes_downloaded": self.bytes_downloaded, "bytes_joined": self.bytes_joined, "pid": self.pid}
        for name, value in counts.items():
            _require(value >= 0, f"{name} must be >= 0, got {value}")
        for name, value in {"step_time_s": self.step_time_s, "sync_s": self.sync_s, "wall_s": self.wall_s,
                            "background_cpu_s": self.background_cpu_s, "link_round_s": self.link_round_s}.items():
            _require(math.isfinite(value) and value >= 0.0, f"{name} must be a finite number >= 0, got {value}")
        _require(len(self.incarnation) <= 64, "incarnation longer than 64 characters")


@dataclass(frozen=True, slots=True)
class FinishRequest(Record):
    """Operator -> coordinator (`finish_request` key, `diloco finish`): finish the run now."""

    run: str
    asked_at: float
    """Redis server time (unix seconds)."""
    by: str
    """Who asked, for a person: e.g. 'diloco finish on host-1 (pid 42)'."""

    def __post_init__(self) -> None:
        check_id("run", self.run)


RUN_ENDERS = ("learners", "operator", "budget")
"""Who may end a run (`RunEnd.by`)."""


@dataclass(frozen=True, slots=True)
class RunEnd(Record):
    """The end of a run (`finished.msgpack`, create-only, and the `finished` key): no contribution is
    merged after it; `versions` are the model to take."""

    run: str
    finished_at: float
    """Redis server time (unix seconds)."""
    by: str
    """'learners' (every learner that joined has finished), 'operator' (`diloco finish`) or 'budget'
    (every fragment merged the coordinator's `--token-budget`)."""
    reason: str
    """The sentence the coordinator logged."""
    versions: tuple[int, ...]
    """Per fragment (index = fragment): its final version (-1: it never had one)."""
    epoch: int
    """Fencing epoch of the coordinator that wrote it."""

    def __post_init__(self) -> None:
        check_id("run", self.run)
        _require(self.by in RUN_ENDERS, f"by must be one of {', '.join(RUN_ENDERS)}, got {self.by!r}")
        _require(all(v >= -1 for v in self.versions), "final versions must be >= -1")
