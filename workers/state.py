"""A learner's own state across preemption: what the global model does not hold.

A learner that rejoins takes the latest global versions of the parameters, but its inner optimizer
(AdamW's moments and step count), its learning-rate schedule, its step and token counts and its
place in its data live only in its process. They are saved to the bucket under the learner's id,
`learners/{id}/state/{seq}` (create-only, seq rising), every `LearnerConfig.state_every` sends of
fragment 0 and when the learner leaves on SIGTERM, and read back when a learner of the same id
joins again. At most `KEEP` are kept per learner (the learner deletes older ones; `diloco gc`
deletes all but the newest, and all of them once the run is finished).

A saved state is restored only if it fits: the same parameters (names and shapes, in the
optimizer's order) and the same fragments, saved at most `LearnerConfig.state_max_age_s` (30 min,
the coordinator's default `--gone-after-s`: a learner away longer is gone for the run) before the
learner rejoins. Otherwise the learner says why and starts afresh. The optimizer's state is kept
as saved, however many versions the run moved on meanwhile: AdamW's moments are statistics of the
gradients, which change far less between the model the state was saved from and the global
version a few minutes later than they do from zero, and its step count keeps the bias correction
where it was (a fresh optimizer warms its moments up again from zero, under a schedule whose
warmup starts again too). The schedule, the data position and the step do not depend on the model.

An island (torchrun ranks, one learner) saves one state too, through rank 0, the only rank that
talks to the run: the optimizer's state in its full form (a sharded parameter's moments gathered
whole, as its values are for a send; a replicated parameter's as rank 0 holds them), and each
rank's own objects (every rank has its own data position) gathered to rank 0. On restore rank 0
hands the state to every rank, and each keeps its own shard of the moments and its own objects. An
island's state is restored only into an island of the same size.

What is saved: `optimizer.state_dict()` and each of the user's objects' `state_dict()` (an LR
scheduler, a data position: anything with `state_dict`/`load_state_dict`), copied to host memory
at a step boundary without waiting (`HostCopies.tree_to_host`: on a device, into pinned memory on a
side stream, and the next optimizer step waits on the device for those copies before it changes the
moments), then serialized and uploaded on a thread of its own, which waits for the copies. The object is a length-prefixed msgpack tree of
plain values (dicts, lists, tuples, numbers, strings) whose tensors are references into a
safetensors blob that follows it: read back, it is parsed, never unpickled.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from diloco.storage.codecs import Streamed, byte_view
from diloco.storage.errors import Refused
from diloco.storage.intraop import Pacer
from diloco.storage.keys import RunKeys
from diloco.storage.objects import Store
from diloco.storage.protocol import pack, unpack
from diloco.workers.hostcopy import Snapshot
from diloco.workers.threads import ThreadLimits

log = logging.getLogger(__name__)

KEEP = 2
"""Saved states kept per learner: the newest, and the one before it while the newest is written."""
FORMAT = 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass(frozen=True, slots=True)
class LearnerState:
    """What a learner saves of itself (see the module docstring)."""

    learner: str
    step: int
    tokens: int
    versions: tuple[int, ...]
    """Per fragment, the global version the learner's values descended from when it was saved."""
    params: tuple[tuple[str, tuple[int, ...]], ...]
    """The parameters' run names and shapes, in the optimizer's order: what the optimizer state fits."""
    optimizer: dict[str, Any]
    """The optimizer's `state_dict()` in its full form (`full_form`): the same for any sharding."""
    user: dict[str, dict[str, Any]]
    """The user's objects' state dicts (rank 0's on an island)."""
    saved_at: float
    ranks: tuple[dict[str, dict[str, Any]], ...] = ()
    """On an island, the user's objects' state dicts of ranks 1, 2, ...; empty for one process."""

    def to_bytes(self) -> bytes:
        """Raises ValueError if a state dict holds something other than tensors and plain values."""
        return bytes(self.to_body())

    def to_body(self) -> Streamed:
        """`to_bytes()` as views of the tensors' memory (`tree_body`): what the saver uploads."""
        return tree_body({"format": FORMAT, "learner": self.learner, "step": self.step, "tokens": self.tokens,
                          "versions": list(self.versions), "params": [[n, list(s)] for n, s in self.params],
                          "optimizer": self.optimizer, "user": self.user, "saved_at": self.saved_at,
                          "ranks": list(self.ranks)})

    @classmethod
    def from_bytes(cls, data: bytes) -> LearnerState:
        """Raises ValueError (with the reason) for anything but a state this module wrote."""
        d = unpack_tree(data, "learner state")
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a learner state of format {FORMAT}")
        try:
            return cls(learner=str(d["learner"]), step=int(d["step"]), tokens=int(d["tokens"]),
                       versions=tuple(int(v) for v in d["versions"]),
                       params=tuple((str(n), tuple(int(x) for x in s)) for n, s in d["params"]),
                       optimizer=dict(d["optimizer"]), user=_user(d["user"]),
                       saved_at=float(d["saved_at"]), ranks=tuple(_user(u) for u in d.get("ranks", ())))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"a learner state with a missing or malformed field: {exc!r}") from exc


def _user(tree: Any) -> dict[str, dict[str, Any]]:
    return {str(k): dict(v) for k, v in tree.items()}


def unpack_user(data: bytes, rank: int) -> dict[str, dict[str, Any]]:
    """Rank `rank`'s objects' state dicts, as it packed them (`pack_tree`) for rank 0. Raises ValueError."""
    if not data:
        raise ValueError(f"rank {rank} sent no state (its objects could not be packed: see its log)")
    try:
        return _user(unpack_tree(data, f"state of rank {rank}"))
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"rank {rank} sent a malformed state: {exc!r}") from exc


def pack_tree(tree: Any) -> bytes:
    """A tree of tensors and plain values as bytes: a length-prefixed msgpack header whose tensors are
    references into the safetensors blob that follows it. Raises ValueError for anything else."""
    return bytes(tree_body(tree))


def tree_body(tree: Any) -> Streamed:
    """`pack_tree(tree)`'s bytes as views of the tensors' own memory, not joined: a saved state of a
    billion-parameter optimizer goes up without a copy of it. Joining and copying gigabytes holds the
    GIL (safetensors' own writer copies each tensor, then the whole blob, then this framing copied
    it again): the training thread stalled a second at each save."""
    tensors: dict[str, torch.Tensor] = {}
    head = pack(_flatten(tree, tensors, "state"))
    entries, offset = {}, 0
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"state: a tensor of dtype {t.dtype}, which a saved state cannot hold")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
    views = (memoryview(struct.pack("<Q", len(head)) + head + struct.pack("<Q", len(header)) + header),
             *(byte_view(t.reshape(-1)) for t in tensors.values() if t.numel()))
    return Streamed(views, tuple(tensors.values()), sum(v.nbytes for v in views))


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}
"""The dtypes of the safetensors format a saved state's tensors may have, by their names in its header."""


def unpack_tree(data: bytes, what: str) -> Any:
    """The tree `pack_tree` made of it: parsed, never unpickled. Raises ValueError with the reason."""
    try:
        (size,) = struct.unpack_from("<Q", data)
        if size > len(data) - 8:
            raise ValueError(f"a header of {size} bytes in an object of {len(data)}")
        tensors = safetensors.torch.load(bytes(data[8 + size:]))
        return _unflatten(unpack(data[8:8 + size], max_bytes=size), tensors)
    except (struct.error, ValueError, Refused, KeyError, TypeError, IndexError, safetensors.SafetensorError) as exc:
        raise ValueError(f"not a readable {what}: {exc}") from exc


def full_form(optimizer_state: dict[str, Any], *, keep: bool = True) -> dict[str, Any]:
    """An optimizer's `state_dict()` with every sharded (DTensor) tensor gathered whole: a collective
    on an island (every rank calls it, in the same order); the others as they are. A gathered tensor
    goes to host memory at once on the rank that `keep`s it (dropped on the others), one at a time:
    a device holds one whole tensor beside its shards at most."""
    state = optimizer_state["state"]
    full = {}
    for index in sorted(state):
        entry = {}
        for key, value in sorted(state[index].items()):
            if isinstance(value, DTensor):
                value = value.full_tensor()
                value = value.cpu() if keep else None
            entry[key] = value
        full[index] = entry
    return {**optimizer_state, "state": full}


def sharded_like(optimizer_state: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """A full-form optimizer state (`full_form`) made to fit `params` (the optimizer's, in its order):
    each tensor of a sharded parameter's state with that parameter's whole shape becomes this rank's
    shard of it, cut locally (every rank holds the whole value). The others are left as they are."""
    state = {}
    for index, entry in optimizer_state["state"].items():
        p = params[int(index)]
        if isinstance(p, DTensor):
            entry = {key: distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                     if isinstance(value, torch.Tensor) and value.ndim and tuple(value.shape) == tuple(p.shape)
                     else value for key, value in entry.items()}
        state[index] = entry
    return {**optimizer_state, "state": state}


def _flatten(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """`value` as a msgpack tree: every container tagged ({"d": items}, {"l": ...}, {"u": ...}), every
    tensor a reference {"t": name} into `tensors`."""
    if isinstance(value, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = value.detach().cpu().contiguous()
        return {"t": name}
    if isinstance(value, dict):
        if not all(isinstance(k, str | int) for k in value):
            raise ValueError(f"{where}: a dict with keys other than str and int")
        return {"d": [[k, _flatten(v, tensors, f"{where}.{k}")] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return {"l" if isinstance(value, list) else "u": [_flatten(v, tensors, f"{where}[]") for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"{where} is a {type(value).__name__}: a saved state holds tensors and plain values only")


def _unflatten(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        ((tag, body),) = tree.items()
        if tag == "t":
            return tensors[body]
        if tag == "d":
            return {k: _unflatten(v, tensors) for k, v in body}
        if tag in ("l", "u"):
            items = [_unflatten(v, tensors) for v in body]
            return items if tag == "l" else tuple(items)
        raise ValueError(f"unknown tag {tag!r}")
    return tree


def optimizer_params(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(run name, shape) of the optimizer's parameters in its own order ('?' for one outside the model)."""
    return tuple((names.get(id(p), "?"), tuple(p.shape)) for group in optimizer.param_groups for p in group["params"])


def misfit(saved: LearnerState, params: tuple[tuple[str, tuple[int, ...]], ...], heads: Mapping[int, int],
           now: float, max_age_s: float, world: int = 1) -> str | None:
    """Why `saved` cannot be restored into a learner of `world` ranks whose optimizer holds `params`
    and that joins at `heads` at time `now` (None: it fits)."""
    if saved.params != params:
        return "it was saved for other parameters (the model or the optimizer's groups changed)"
    if len(saved.ranks) + 1 != world:
        return (f"it was saved by a learner of {len(saved.ranks) + 1} rank(s), this one has {world}: each rank's "
                "own objects (its data position) have nowhere to go")
    if len(saved.versions) != len(heads):
        return f"it was saved with {len(saved.versions)} fragments, the run has {len(heads)}"
    if now - saved.saved_at > max_age_s:
        return (f"it was saved {now - saved.saved_at:.0f}s ago, more than state_max_age_s ({max_age_s:g}s): "
                "the run has moved on too far for its optimizer state")
    return None


STATE_FREE_S = 2.0
"""A state whose upload takes at most this long is saved whenever it is due: the link's share is
measured on pieces whose time is mostly the request's own (a fast link looks slow), and a state
this quick costs any link little."""


def save_fits_link(state_bytes: int, rate: float, since_s: float, share: float) -> bool:
    """Whether a state of `state_bytes`, uploaded at `rate` bytes/s, takes at most `share` of the
    `since_s` seconds since the last save, or at most STATE_FREE_S: saved states then take at most
    that share of a link they would load. True with no rate measured yet or a share of 1."""
    if share >= 1 or rate <= 0:
        return True
    upload_s = state_bytes / rate
    return upload_s <= STATE_FREE_S or upload_s <= share * since_s


def latest_key(store: Store, keys: RunKeys, learner: str) -> str | None:
    listed = [k for k in store.list(keys.learner_states_prefix(learner)) if keys.parse_learner_state_key(k)]
    return listed[-1] if listed else None


class StateSaver(threading.Thread):
    """Uploads a learner's saved states in the background, the newest only: a state taken while
    the previous one is still uploading replaces any that waits. Deletes all but the last KEEP."""

    def __init__(self, store: Store, keys: RunKeys, learner: str, next_seq: int, *,
                 limits: ThreadLimits = ThreadLimits()) -> None:
        super().__init__(name="state-saver", daemon=True)
        self.limits = limits
        """What this thread may take of the machine (`workers.threads`), applied as it starts."""
        self.pacer: Pacer | None = None
        """Its pacer, once started, when its work is paced (`ThreadLimits.share`)."""
        self.store, self.keys, self.learner = store, keys, learner
        self._seq = next_seq
        self._cond = threading.Condition()
        self._waiting: tuple[LearnerState, Snapshot | None] | None = None
        self._busy = False
        self._closed = False
        self.saved = 0
        self.failed = 0
        self.last_key: str | None = None
        self.last_bytes = 0
        self.last_upload_s = 0.0
        """The size of the last state saved, and how long its upload took."""

    def submit(self, state: LearnerState, landed: Snapshot | None = None) -> None:
        """Save `state`, whose tensors are host copies that may still be on their way from the device
        until `landed` (their `HostCopies.tree_to_host`) says they are done: this thread waits for it."""
        with self._cond:
            self._waiting = (state, landed)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing waits or uploads (True), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def run(self) -> None:
        self.pacer = self.limits.apply()
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                (state, landed), self._waiting, self._busy = self._waiting, None, True
            try:
                if landed is not None:
                    landed.wait()
                self._save(state)
            except Exception as exc:  # noqa: BLE001 (a state not saved costs a cold restart, never the run)
                self.failed += 1
                log.warning("learner %s: state at step %d not saved: %s", self.learner, state.step, exc)
            finally:
                # Let go of this state's host copies now, not when the next save replaces them: held
                # until then, the next save's copies cannot reuse their pinned memory and allocate
                # as much again on the training thread (360 ms for AdamW's moments at 124M on an H200).
                state = landed = None
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _save(self, state: LearnerState) -> None:
        data = state.to_body()
        key = self.keys.learner_state(self.learner, self._seq)
        self._seq += 1
        t0 = time.monotonic()
        self.store.put(key, data, create_only=True)
        self.last_upload_s, self.last_bytes = time.monotonic() - t0, len(data)
        self.saved, self.last_key = self.saved + 1, key
        log.info("learner %s: state at step %d saved (%.1f MB)", self.learner, state.step, len(data) / 1e6)
        older = list(self.store.list(self.keys.learner_states_prefix(self.learner)))[:-KEEP]
        if older:
            self.store.delete([k for k in older if k != key])
