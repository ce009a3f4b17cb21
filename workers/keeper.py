"""The learner's side of its own state (`workers.state`): saving it at a step boundary, finding it
when the learner joins again, and restoring it on every rank.

Rank 0 alone talks to the bucket: it finds the newest saved state under the learner's id and judges
whether it fits (`state.misfit`), and it uploads each new one on a `StateSaver` thread. Every rank of
an island takes part in a save (its optimizer shard gathered whole, its own objects gathered to rank
0) and in a restore (rank 0 hands the state to every rank, each keeps its own shard and objects).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from diloco.storage.errors import DilocoError
from diloco.storage.keys import RunKeys
from diloco.storage.objects import Store
from diloco.workers.hostcopy import Snapshot
from diloco.workers.island import Replica
from diloco.workers.state import (LearnerState, Stateful, StateSaver, full_form, latest_key, misfit,
                                  optimizer_params, pack_tree, save_fits_link, sharded_like, unpack_user)
from diloco.workers.threads import ThreadLimits

log = logging.getLogger(__name__)

Found = tuple[LearnerState, str, bytes]
"""A saved state that fits, its key and (for an island, to hand to the other ranks) its bytes."""


class StateKeeper:
    """One learner's saved states: the optimizer, the user's objects (`state=`), step and tokens."""

    def __init__(self, learner_id: str, optimizer: torch.optim.Optimizer, replica: Replica,
                 user_state: Mapping[str, Stateful]) -> None:
        self.learner_id = learner_id
        self.optimizer = optimizer
        self.replica = replica
        self.user_state = dict(user_state)
        self.saver: StateSaver | None = None
        """Rank 0, once joined with `save_state`: the thread that uploads saved states."""
        self._found: Found | None = None  # rank 0, joining: a state that fits
        self._copies: Snapshot | None = None  # a saved state's copies to the host, maybe still running
        self._last_save = time.monotonic()  # rank 0: the last save taken, or the join
        self.skipped = 0
        """Rank 0: saves skipped because the link could not carry them (`fits_link`)."""

    def fits_link(self, piece_bytes: int, piece_s: float, share: float) -> bool:
        """Rank 0, a save due: whether a state's upload would keep saved states within `share` of
        the link (`state.save_fits_link`), at the faster of the rates the learner's pieces (`piece_bytes`
        in `piece_s`) and its last saved state went up. Counts and tells a save skipped."""
        saver = self.saver
        if saver is None:
            return False
        size = saver.last_bytes or self.state_bytes()
        rate = max((b / t for b, t in ((piece_bytes, piece_s), (saver.last_bytes, saver.last_upload_s)) if b and t > 0),
                   default=0.0)
        now = time.monotonic()
        if save_fits_link(size, rate, now - self._last_save, share):
            self._last_save = now
            return True
        if not self.skipped:
            log.info("learner %s: state not saved: its %.1f MB would take %.0fs at the %.0f kB/s its uploads go "
                     "up, more than state_link_share %g of the %.0fs since the last save (this is said once)",
                     self.learner_id, size / 1e6, size / rate, rate / 1e3, share, now - self._last_save)
        self.skipped += 1
        return False

    def state_bytes(self) -> int:
        """The optimizer state's size in bytes, whole (a sharded moment counted at its full size)."""
        return sum(v.numel() * v.element_size() for entry in self.optimizer.state.values()
                   for v in entry.values() if isinstance(v, torch.Tensor))

    def optimizer_params(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return optimizer_params(self.optimizer, {id(p): n for n, p in self.replica.params.items()})

    def find(self, store: Store, keys: RunKeys, heads: dict[int, int], clock: Callable[[], float], *,
             max_age_s: float, limits: ThreadLimits) -> None:
        """Rank 0, joining: this learner's newest saved state, kept for `restore` if it fits (else a
        line saying why); starts the saver after it. `clock`: the run's (Redis server time)."""
        key = latest_key(store, keys, self.learner_id)
        seq = 0 if key is None else keys.parse_learner_state_key(key)[1] + 1
        self.saver = StateSaver(store, keys, self.learner_id, next_seq=seq, limits=limits)
        self.saver.start()
        if key is None:
            return
        limit = 4 * sum(p.numel() * p.element_size() for p in self.replica.params.values()) + (64 << 20)
        try:
            data = store.get(key, max_bytes=limit)
            saved = LearnerState.from_bytes(data)
            now = clock()
            why = misfit(saved, self.optimizer_params(), heads, now, max_age_s, world=self.replica.world)
        except (ValueError, DilocoError) as exc:
            why = str(exc)
        if why is not None:
            log.warning("learner %s starts afresh: its saved state %s is not restored: %s", self.learner_id, key, why)
            return
        log.info("learner %s resumes from its state at step %d (%s, saved %.0fs ago at versions %s, now %s)",
                 self.learner_id, saved.step, key, now - saved.saved_at, list(saved.versions),
                 [heads[f] for f in sorted(heads)])
        self._found = saved, key, data if self.replica.island else b""  # the bytes only to hand to other ranks

    def restore(self) -> tuple[int, int, str] | None:
        """Every rank, joined: load the state rank 0 found, if any (rank 0 hands it to the other ranks
        of an island; each keeps its own shard of the optimizer's state and its own objects). Returns
        the saved step, tokens and key."""
        found, self._found = self._found, None
        if self.replica.island:
            leader = self.replica.is_leader
            data = self.replica.share_bytes(None if not leader else found[2] if found else b"")
            if not data:
                return None
            key = self.replica.share_bytes(None if not leader else found[1].encode()).decode()  # type: ignore[index]
            saved = found[0] if found else LearnerState.from_bytes(data)
        elif found is None:
            return None
        else:
            saved, key, _ = found
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.optimizer.load_state_dict(sharded_like(saved.optimizer, params))
        mine = saved.ranks[self.replica.rank - 1] if self.replica.rank else saved.user
        for name, obj in self.user_state.items():
            if name in mine:
                obj.load_state_dict(mine[name])
        missing = sorted(set(self.user_state) - set(mine))
        if missing:
            log.warning("rank %d of learner %s: not in its saved state, left as they are: %s", self.replica.rank,
                        self.learner_id, missing)
        return saved.step, saved.tokens, key

    def save(self, step: int, tokens: int, versions: Sequence[int], saved_at: float) -> None:
        """At a step boundary, every rank of an island in the same one: the optimizer's state in its full
        form and each rank's own objects to rank 0 (collectives), which copies them to the host now
        and uploads them in the background."""
        leader = self.replica.is_leader
        optimizer = full_form(self.optimizer.state_dict(), keep=leader)  # every rank takes part
        user = {k: v.state_dict() for k, v in self.user_state.items()}
        ranks: tuple[dict, ...] = ()
        if self.replica.island:
            try:
                mine = b"" if leader else pack_tree(user)
            except ValueError as exc:
                mine = b""
                log.warning("rank %d of learner %s: its state is not saved: %s", self.replica.rank, self.learner_id,
                            exc)
            parts = self.replica.gather_bytes(mine)
            if parts is None:
                return  # not rank 0
            try:
                ranks = tuple(unpack_user(part, rank) for rank, part in enumerate(parts) if rank)
            except ValueError as exc:
                log.warning("learner %s: state at step %d not saved: %s", self.learner_id, step, exc)
                return
        copies = self.replica.copies.tree_to_host({"optimizer": optimizer, "user": user})
        self._copies = copies  # the next optimizer step waits for them (on the device): `before_step`
        host = copies.unwaited
        state = LearnerState(learner=self.learner_id, step=step, tokens=tokens, versions=tuple(versions),
                             params=self.optimizer_params(), optimizer=host["optimizer"], user=host["user"],
                             saved_at=saved_at, ranks=ranks)
        self.saver.submit(state, copies)  # type: ignore[union-attr]

    def before_step(self) -> None:
        """Before an optimizer step: a state copy still running keeps the step from changing its tensors."""
        copies, self._copies = self._copies, None
        if copies is not None:
            self.replica.copies.before_write(copies)
