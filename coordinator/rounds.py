"""A fragment's rounds: when one is due, its merge, the outer step and the version it publishes.

`Rounds.maybe_merge` asks `policy.decide_round` whether an open round is due; a due round's pieces
are counted (`influence`: each learner's claims and norms bounded by the others'), ordered
(`policy.merge_order`), weighted (`policy.merge_weights`), merged tensor by tensor on the fetch
threads, each piece's tensor decoded as it is read (`intake.Piece`), scaled against the usual round
(`policy.round_step`) and stepped with the outer optimizer (`outer`); `publish` writes the version
(objects, then its manifest) and commits it in Redis, fenced by the epoch (`publish.commit`). A
step that overflows float32 refuses its largest piece and merges the rest without it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor
from dataclasses import replace

import torch

from diloco.coordinator.influence import Claim, clip_norms, count_claims, usual_fleet
from diloco.coordinator.intake import PendingDelta, Piece
from diloco.coordinator.leadership import Fenced
from diloco.coordinator.outer import (NesterovState, buffered_part, downstream_step, outer_step, round_delta, scale_update,
                                      update_norm)
from diloco.coordinator.policy import (RECENT_ROUNDS, Arrival, RoundSize, RoundState, decide_round, last_in, lookahead,
                                       merge_order, merge_weights, round_size, round_step, served_deadline,
                                       staleness_verdict, usual_pieces)
from diloco.coordinator.publish import commit, commit_existing, decode_state, listed_refusals, write_version
from diloco.coordinator.recovery import Recovery
from diloco.coordinator.state import Fragment, ShardState
from diloco.coordinator.timing import TimedPool
from diloco.storage.bus import CommitResult
from diloco.storage.crashpoints import crash_point
from diloco.storage.errors import Conflict, Refused, StorageUnavailable
from diloco.storage.history import read_manifest, read_params, read_verified
from diloco.storage.protocol import Contribution, Manifest, VersionSettings

log = logging.getLogger(__name__)

MAX_ROUND_PIECES = 4096
"""The most pieces one version merges: its manifest lists each (a few hundred bytes apiece), and must
stay well within the 64 MiB its readers accept, refusals included."""


def _finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def _absmax(tensors: dict[str, torch.Tensor]) -> float:
    return max((float(t.abs().max()) for t in tensors.values() if t.numel()), default=0.0)


class Rounds:
    """Merging this shard's fragments: the loop's, like the state it changes."""

    def __init__(self, state: ShardState, recovery: Recovery, pool: Executor) -> None:
        self.state = state
        self.recovery = recovery
        self.pool = pool
        """The fetch threads (`intake.fetch_pool`): idle while the loop merges, they merge a round's tensors."""
        self.sync_time_s = 0.0
        """How long writing and committing a version takes (a moving average): the grace window allows for it."""

    def maybe_merge(self, fragment: int, frag: Fragment) -> None:
        """Merge the open round of `fragment` if `policy.decide_round` says it is due, or if it holds as
        many pieces as a round may (`_round_cap`), and publish the version."""
        s = self.state
        if s.ended is not None:
            return  # nothing is merged after the run's end
        arrivals = tuple(c.arrival for c in frag.round)
        # The fleet is the live learners and those with a piece in the round: one that sent its piece
        # and left (its lease gone) must not stand in for one still live whose piece is on its way.
        arrived = {a.learner for a in arrivals}
        gone = {a.learner for a in arrivals if a.final} | (arrived & s.view.finished)
        live = len((s.view.waited | arrived) - gone)
        state = RoundState(fragment=fragment, head_version=frag.head, arrivals=arrivals, live_learners=live,
                           sync_time_s=self.sync_time_s, period_s=s.cadence.period_s if s.cadence else 0.0,
                           merged_deadline=frag.merged_deadline, finished=s.view.finished,
                           finish_asked=s.view.finish_asked is not None)
        now = s.now()
        decision = decide_round(now, state, s.round_cfg)
        frag.wake_at = decision.wake_at
        if decision.reason != frag.last_reason:
            log.debug("fragment %d: %s", fragment, decision.reason)
            frag.last_reason = decision.reason
        cap = self._round_cap(fragment)
        if not decision.merge and len(frag.round) < cap:
            return
        reason = decision.reason if decision.merge else (
            f"merge: the round holds {len(frag.round)} pieces, as many as it may ({cap}: --max-round-bytes over "
            f"the fragment's size, at most {MAX_ROUND_PIECES}); the earliest {cap} merge, the rest wait")
        timing = last_in(sorted(arrivals, key=lambda a: a.arrived_at)[:cap])  # the pieces this merge takes
        log.info("fragment %d v%d: %s%s", fragment, frag.head + 1, reason, f" ({timing})" if timing else "")
        s.metrics.round_closed(state, s.round_cfg, now)
        with s.timing("load"):
            self._ensure_loaded(fragment, frag)
        crash_point("fetched")
        assert frag.params is not None and frag.state is not None
        senders = usual_fleet(s.view.waited - gone, arrived=frozenset(arrived), sent=s.view.last_piece,
                              merged=frozenset(c.learner for r in frag.claims for c in r) | frag.pieces.keys(),
                              finished=s.view.finished)
        while frag.round:
            started = time.monotonic()
            taking = sorted(frag.round, key=lambda c: (c.arrival.arrived_at, c.entry_id))[:cap]
            # Each piece as the merge counts it: one learner's claims bounded by the others' (`influence`).
            counted = count_claims([c.arrival for c in taking], frag.claims,
                                   s.round_cfg.max_claim_ratio)
            notes = {a.contribution_id: note for a, note in counted if note}
            ordered = merge_order(tuple(a for a, _ in counted))
            by_id = {c.announcement.contribution_id: c for c in taking}
            contributions = [by_id[a.contribution_id] for a in ordered]
            # ... and how far they move the model: one learner's pieces together by the others' norms.
            clips = clip_norms(ordered, frag.claims, s.round_cfg.max_norm_ratio)
            for a in ordered:
                if clips[a.learner][1]:
                    notes[a.contribution_id] = "; ".join(n for n in (notes.get(a.contribution_id), clips[a.learner][1]) if n)
            usual, interval = self._usual_pieces(frag, senders)
            rate = max(usual.values(), default=0) if interval > 0 else 0
            weights = [w * clips[a.learner][0] for w, a in
                       zip(merge_weights(ordered, frag.head, s.round_cfg, usual, rate), ordered, strict=True)]
            published, settings = self._step_round(fragment, frag, contributions, weights, ordered, usual, interval,
                                                   rate, lookahead(live, len(gone), finishing=state.finish_asked),
                                                   bounded=[a.contribution_id in notes for a in ordered])
            s.metrics.merged(fragment, time.monotonic() - started)
            if published is not None:
                for cid, note in notes.items():
                    log.warning("fragment %d: %s's piece %s bounded: %s", fragment, by_id[cid].announcement.learner,
                                cid, note)
                params, state, blob = published
                # The parent is not needed any more, unless this publish fails before its manifest is
                # written: then the next merge reads it again from S3 (`_ensure_loaded`). Meanwhile its
                # params, momentum and residual are three fragments' worth of memory less.
                frag.params = frag.state = None
                self.publish(fragment, frag, contributions, weights, params, state, settings, ordered, notes,
                             update=blob, clips={g: c for g, (c, _) in clips.items()}, usual=usual, closed_at=now)
                return
            self._refuse_overflow(fragment, frag, contributions)

    def _usual_pieces(self, frag: Fragment, fleet: frozenset[str]) -> tuple[dict[str, int], int]:
        """Each learner of the `fleet` of live learners that send pieces with its usual piece
        (`policy.usual_pieces`), and the interval of steps that makes a whole one (H; the fleet's rate,
        `policy.merge_weights`, is its fastest learner's usual piece). ({}, 0) when rounds are not
        scaled; an interval of 0 when the clock has a fixed period (`round_s`: each learner counts 1)."""
        s = self.state
        if not s.config.scale_rounds:
            return {}, 0
        interval = s.spec.sync_every if s.config.round_s <= 0 else 0
        finished = {n: p for n, p in frag.pieces.items() if n in s.view.finished}
        usual = usual_pieces(fleet, frag.claims, interval, finished)
        frag.pieces |= {c.learner: usual[c.learner] for r in frag.claims for c in r
                        if c.learner in usual and c.learner not in s.view.finished}
        return usual, interval

    def _step_round(self, fragment: int, frag: Fragment, contributions: list[PendingDelta], weights: list[float],
                    ordered: tuple[Arrival, ...], usual: dict[str, int], interval: int, rate: int, ahead: float,
                    bounded: list[bool]
                    ) -> tuple[tuple[dict[str, torch.Tensor], NesterovState, bytes | None] | None, VersionSettings]:
        """Merge the round's pieces (in merge order, with their weights), take the outer step (scaled
        against the round's usual size for the fleet's `usual` pieces, `_usual_pieces`) and the
        downstream step: the version's params, outer state and update object (None if the step
        overflowed float32), and the settings its manifest records. `ahead`: the share of the
        momentum's look-ahead the step takes (`policy.lookahead`); `bounded`: whether each piece's
        learner was bounded (`influence`; such pieces move the params only, `outer.buffered_inputs`).
        These configure the merge itself: a replay's `apply_round` runs the same merge, scale and
        outer step from them.

        Each whole-fragment temporary goes as soon as it has been used, not at the end of the round:
        each piece's tensor once added to the sum (decoded as the merge reads it, `_pieces`), the
        merged update once stepped with, the outer step's exact result when this returns."""
        s = self.state
        settings = replace(self.settings("delta"), rate_steps=rate)
        with s.timing("merge"):
            pool, pieces = TimedPool(self.pool, s.timing, "tensors"), self._pieces(contributions)
            update = round_delta(pieces, weights, settings, pool=pool)
            if s.config.scale_rounds:
                norm = update_norm(update)
                step = round_step(round_size(ordered, norm), frag.recent, usual, interval)
                settings = replace(settings, round_scale=step.scale, progress=step.progress, update_norm=norm,
                                   lookahead=ahead)
                update = scale_update(update, step.scale)
            staleness = [staleness_verdict(a.base_version, frag.head, s.round_cfg)[1] for a in ordered]
            buffered = buffered_part(pieces, weights, staleness, settings, update, bounded=bounded, pool=pool)
        with s.timing("outer"):
            target, state = outer_step(frag.params, frag.state, update, settings, buffered=buffered)
            del buffered
            del update
            return self._downstream(fragment, frag, target, state, settings), settings

    @staticmethod
    def _pieces(contributions: list[PendingDelta]) -> list[Piece]:
        """The pieces' deltas, each tensor decoded as it is read (`intake.Piece`): a merge holds the
        sum and a decoded tensor per merging thread, while the round waits with its pieces in the
        codec's bytes (`PendingDelta.piece`)."""
        pieces = [Piece(c.piece) for c in contributions if c.piece is not None]
        assert len(pieces) == len(contributions), "a round merges deltas: a genesis is published as it arrives"
        return pieces

    def _downstream(self, fragment: int, frag: Fragment, target: dict[str, torch.Tensor], state: NesterovState,
                    settings: VersionSettings) -> tuple[dict[str, torch.Tensor], NesterovState, bytes | None] | None:
        """The params the round publishes and its update object (`outer.downstream_step`); None if the
        outer step overflowed float32."""
        s = self.state
        if not (_finite(target) and _finite(state.momentum)):
            return None
        meta = {"run": s.spec.run, "fragment": fragment, "version": frag.head + 1}
        try:
            return downstream_step(frag.params, target, state, settings, compress=s.spec.compress, meta=meta)
        except Refused:
            return None

    def _round_cap(self, fragment: int) -> int:
        """The most pieces a round of `fragment` holds before it merges: as many decoded deltas as
        `max_round_bytes` holds, at most MAX_ROUND_PIECES (so that its manifest stays small). The
        round holds them compressed and decodes one at a time: the bound is a generous one."""
        s = self.state
        if s.layout is None:
            return MAX_ROUND_PIECES
        return max(1, min(MAX_ROUND_PIECES, s.config.max_round_bytes // max(1, s.layout.fragment_bytes(fragment))))

    def _refuse_overflow(self, fragment: int, frag: Fragment, contributions: list[PendingDelta]) -> None:
        """Each delta is finite, yet the outer step overflowed float32: refuse the largest one (the
        first in merge order on a tie) and let the others merge without it."""
        s = self.state
        largest = [_absmax(delta) for delta in self._pieces(contributions)]  # one decoded at a time
        culprit, absmax = max(zip(contributions, largest), key=lambda pair: pair[1])
        frag.round = [c for c in frag.round if c is not culprit]
        a = culprit.announcement
        s.refuse(culprit.entry_id, a, Refused(
            "non_finite", f"{a.object_key}: merging it into fragment {fragment} version {frag.head} overflows "
            f"float32 (its largest |value| is {absmax:.3g}): the learner has likely diverged"))

    def _adopt_written(self, fragment: int, frag: Fragment, version: int) -> None:
        """The manifest of `version` exists already: a deposed coordinator wrote it just before its
        commit was fenced. It is committed (S3 is the truth): commit it in Redis with our epoch,
        start from it, and keep only the round's contributions it did not merge."""
        s = self.state
        manifest = read_manifest(s.store, s.keys, fragment, version)
        log.warning("fragment %d version %d was written by the coordinator of epoch %d: adopting it", fragment,
                    version, manifest.epoch)
        if commit_existing(s.bus, manifest, epoch=s.epoch, keep_applied=s.keep_applied) is CommitResult.ENDED:
            self._withdraw(manifest, frag)
            return
        merged = {c.contribution_id for c in manifest.inputs}
        frag.round = [c for c in frag.round if c.announcement.contribution_id not in merged]
        frag.record_applied(version, merged, s.keep_applied)
        frag.forget_head(version)
        frag.merged_tokens = manifest.merged_tokens
        s.bus.incr("versions_adopted")

    def _withdraw(self, manifest: Manifest, frag: Fragment) -> None:
        """The run ended (on shard 0) at an earlier version of this fragment while this version was
        written: it is not part of the run. Its objects are deleted (a reader takes the end's versions
        anyway, and a roll-forward stops at them), the round's pieces are refused as the run's end
        refuses any (`run_finished`), and this shard stops merging."""
        s = self.state
        s.ended = s.bus.run_end()
        for c in frag.round:
            s.refuse(c.entry_id, c.announcement, Refused(
                "run_finished", f"run {s.spec.run!r} ended before the round of fragment {manifest.fragment} that "
                                f"holds it was committed"))
        frag.round = []
        keys = [s.keys.manifest(manifest.fragment, manifest.version), manifest.params_key, manifest.outer_state_key,
                *([manifest.update_key] if manifest.update_key else [])]
        try:
            s.store.delete(keys)
        except StorageUnavailable as exc:
            log.warning("could not delete fragment %d version %d, written after the run's end: %s",
                        manifest.fragment, manifest.version, exc)
        log.info("fragment %d version %d not committed: the run ended at version %s of it", manifest.fragment,
                 manifest.version, s.ended.versions[manifest.fragment] if s.ended else "?")

    def _ensure_loaded(self, fragment: int, frag: Fragment) -> None:
        s = self.state
        if frag.params is not None and frag.state is not None:
            return
        assert s.layout is not None
        manifest = read_manifest(s.store, s.keys, fragment, frag.head)
        params = read_params(s.store, s.layout, manifest)
        limit = 2 * s.layout.fragment_bytes(fragment) + (1 << 20)
        state = decode_state(read_verified(s.store, manifest.outer_state_key, manifest.outer_state_sha256,
                                           max_bytes=limit, buffer=True), limit, in_place=True, hashed=True)
        # Both or neither: S3 failing between the two reads leaves the fragment to load again, whole.
        frag.params, frag.state = params, state
        if not frag.recent:
            self.load_recent(fragment, frag, manifest)

    def load_recent(self, fragment: int, frag: Fragment, head: Manifest | None = None) -> None:
        """The fragment's last RECENT_ROUNDS merged rounds and their claims, oldest first, from their
        manifests, and when their learners last sent: a restarted or standby coordinator scales
        rounds, counts claims and knows which of its fleet send pieces as its predecessor did. Also
        what the last `keep_applied` versions merged (`Fragment.applied`): none of it merges again,
        whatever Redis forgets after this process started."""
        s = self.state
        rounds: list[RoundSize] = []
        claims: list[tuple[Claim, ...]] = []
        manifest = head if head is not None or frag.head < 1 else read_manifest(s.store, s.keys, fragment,
                                                                                  frag.head)
        walked, depth = 0, max(RECENT_ROUNDS, s.keep_applied)
        while manifest is not None and manifest.settings.kind == "delta" and walked < depth:
            walked += 1
            if walked <= s.keep_applied:
                frag.record_applied(manifest.version, (c.contribution_id for c in manifest.inputs), s.keep_applied)
            if walked <= RECENT_ROUNDS:
                rounds.append(round_size(manifest.inputs, manifest.settings.update_norm))
                claims.append(tuple(Claim(c.learner, c.tokens, c.steps, c.norm) for c in manifest.inputs))
                for c in manifest.inputs:
                    s.view.sent(c.learner, manifest.committed_at)
            previous = manifest.version - 1
            manifest = read_manifest(s.store, s.keys, fragment, previous) if previous > 0 else None
        frag.recent, frag.claims = rounds[::-1], claims[::-1]

    def settings(self, kind: str) -> VersionSettings:
        """What the manifest of a version of this `kind` records, and what its merge is configured by."""
        s = self.state
        return s.config.settings(s.round_cfg, kind, s.spec.codec)

    def publish(self, fragment: int, frag: Fragment, contributions: list[PendingDelta], weights: list[float],
                params: dict[str, torch.Tensor], state: NesterovState, settings: VersionSettings, counted: list[Arrival],
                notes: dict[str, str] | None = None, update: bytes | None = None,
                clips: dict[str, float] | None = None, usual: dict[str, int] | None = None, *,
                closed_at: float) -> None:
        """Write and commit the next version of `fragment` from `contributions` (in merge order, each
        with its weight and its `counted` arrival: the tokens and steps it weighed by, and its norm;
        `clips`: what each learner's pieces were scaled by; `usual`: each learner's usual piece, when
        the weights were raised to the fleet's rate; `closed_at`: when the round was decided, on the
        arrivals' clock: each input records how long it waited for that)."""
        s = self.state
        t0 = time.monotonic()
        version = frag.head + 1
        notes, clips = notes or {}, clips or {}
        inputs = tuple(
            Contribution(contribution_id=c.announcement.contribution_id, learner=c.announcement.learner,
                  seq=c.announcement.seq, object_key=c.announcement.object_key, sha256=c.announcement.sha256,
                  base_version=c.announcement.base_version,
                  staleness=staleness_verdict(c.announcement.base_version, frag.head, s.round_cfg)[1]
                  if c.announcement.kind == "delta" else 0,
                  tokens=n.tokens, steps=n.steps, weight=w, stream_id=c.entry_id,
                  bounded=notes.get(c.announcement.contribution_id, ""), norm=n.norm,
                  clip=clips.get(n.learner, 1.0), usual=(usual or {}).get(n.learner, 0) if settings.rate_steps else 0,
                  waited_s=round(max(0.0, closed_at - n.arrived_at), 3))
            for c, w, n in zip(contributions, weights, counted, strict=True))
        refused = listed_refusals([*frag.refused, *s.unplaced], s.config.max_refusals_listed)
        merged_tokens = s.merged_tokens(fragment) + sum(c.tokens for c in inputs)
        try:
            manifest = write_version(s.store, s.keys, fragment=fragment, version=version, params=params,
                                     state=state, inputs=inputs, refused=refused, settings=settings,
                                     epoch=s.epoch, timed=s.timing, update=update, merged_tokens=merged_tokens)
        except Conflict:
            self._adopt_written(fragment, frag, version)
            return
        with s.timing("commit"):
            result = commit(s.bus, manifest, epoch=s.epoch, ack_ids=[c.entry_id for c in contributions],
                            keep_applied=s.keep_applied)
        crash_point("committed")
        if result is CommitResult.ENDED:
            self._withdraw(manifest, frag)
            return
        if result is CommitResult.WIPED:
            self.recovery.rebuild()  # rolls our manifest forward: it is the latest in S3
        elif result is CommitResult.FENCED:
            raise s.deposed(f"commit of fragment {fragment} version {version} refused: another coordinator holds "
                            f"{s.label} now (this one had epoch {s.epoch})")
        elif result is CommitResult.HEAD_MOVED and s.bus.heads().get(fragment, -1) < frag.head:
            # Redis forgot commits (restored from an older snapshot, failed over to a lagging replica)
            # before this process noticed it restarted: bring it up to S3, our manifest included.
            log.warning("commit of fragment %d version %d: Redis's head is behind ours, it forgot commits: "
                        "committing them again from S3", fragment, version)
            self.recovery.outage_noticed()
            self.recovery.reconcile()
            if s.bus.heads().get(fragment) != version:
                raise Fenced(f"commit of fragment {fragment} version {version}: Redis's head is "
                             f"{s.bus.heads().get(fragment)} after committing the manifests in S3")
        elif result not in (CommitResult.COMMITTED, CommitResult.ALREADY):
            raise Fenced(f"commit of fragment {fragment} version {version} refused by Redis: {result.name}")
        merged = {c.announcement.contribution_id for c in contributions}
        frag.round = [c for c in frag.round if c.announcement.contribution_id not in merged]
        frag.refused, s.unplaced = [], []
        period_s = s.cadence.period_s if s.cadence else 0.0
        frag.merged_deadline = served_deadline(frag.merged_deadline, counted, period_s)
        if manifest.settings.kind == "delta":
            frag.recent = [*frag.recent, round_size(counted, manifest.settings.update_norm)][-RECENT_ROUNDS:]
            frag.claims = [*frag.claims, tuple(Claim(a.learner, a.tokens, a.steps, a.norm) for a in counted)
                           ][-RECENT_ROUNDS:]
        frag.record_applied(version, merged, s.keep_applied)
        frag.head, frag.wake_at = version, None
        # Without hold_state, the next merge reads them back (`_ensure_loaded`).
        frag.params, frag.state = (params, state) if s.config.hold_state else (None, None)
        frag.merged_tokens = manifest.merged_tokens
        elapsed = time.monotonic() - t0
        self.sync_time_s = elapsed if self.sync_time_s == 0 else 0.8 * self.sync_time_s + 0.2 * elapsed
        log.info("committed fragment %d version %d from %d contribution(s) in %.3fs", fragment, version,
                 len(contributions), elapsed)
        s.metrics.published(manifest, elapsed)
