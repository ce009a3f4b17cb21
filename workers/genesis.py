"""Proposing a run's version 0: which fragments' initial values this learner uploads.

Every fragment's version 0 is one learner's initial values, uploaded in fp32 and published by the
coordinator as they arrive (the first proposal of a fragment wins; a later one is superseded, and
the first of all fixes the run's layout). Learners built from the same seed hold the same values,
so it does not matter whose go up, only how soon: the whole fleet waits for the last fragment.

- **One fragment at a time, each under a claim.** A joining learner claims a fragment nobody has
  claimed (`Bus.claim_genesis`, `SET NX` with a TTL its heartbeats extend until it joins), uploads
  it, and claims the next as soon as that one is stored. Learners that start together upload
  different fragments side by side, and nobody uploads a fragment twice while its proposer keeps up.
  One claim for the whole model made the fleet wait for whoever asked first: in `bench wan`'s mixed
  links a learner on a 0.156 Mbit/s link that won it held the other three 22 s.
- **A slow proposer is overtaken.** A learner whose own uploads are done, and that sees a fragment
  another claimed still without version 0 after twice its own slowest upload (`steal_after_s`),
  uploads it too. The coordinator publishes whichever arrives first and supersedes the other.
- **A proposer that dies** stops extending its claims; they lapse and the next learner to look
  takes them over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

from diloco.storage.bus import Bus
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Layout
from diloco.workers.transfer import Uploader, UploadJob

log = logging.getLogger(__name__)

CLAIM_TTL_S = 20.0
"""A genesis claim lapses this long after its holder last extended it (it extends it with every
heartbeat until it joins): how long a proposer that died holds its fragments back."""

STEAL_MIN_S = 2.0
"""A fragment another learner claimed is uploaded by this one too no sooner than this: a proposal
this quick is not worth a second upload."""


def steal_after_s(own_uploads_s: list[float]) -> float:
    """How long a fragment that another learner claimed may stay without version 0 before this
    learner uploads it too: twice this learner's own slowest genesis upload (then the claim's holder
    is at least that much slower), at least STEAL_MIN_S; CLAIM_TTL_S for a learner that has uploaded
    none (it knows nothing of its own link)."""
    if not own_uploads_s:
        return CLAIM_TTL_S
    return max(STEAL_MIN_S, 2.0 * max(own_uploads_s))


class GenesisProposer:
    """One joining learner's part in proposing version 0. `step` is called by the learner's join
    loop while some fragment has no version 0, and by the uploader's thread each time one of this
    learner's proposals is stored (so the next claim does not wait for the loop's next poll)."""

    def __init__(self, bus: Bus, store: ObjectStore, uploader: Uploader, learner: str,
                 initial: Mapping[str, torch.Tensor], clock: Callable[[], float] = time.monotonic) -> None:
        self.bus, self.store, self.uploader, self.learner = bus, store, uploader, learner
        self.initial, self.clock = initial, clock
        self.claimed: set[int] = set()
        """Fragments whose claim this learner holds (its heartbeats extend them until it joins)."""
        self.proposed: set[int] = set()
        """Fragments this learner uploaded (or is uploading), claimed or not."""
        self.uploads_s: list[float] = []
        """How long each of its proposals took from submit to stored."""
        self._uploading: int | None = None
        self._layout_stored = False
        self._seen_held: dict[int, float] = {}  # fragment -> when first seen claimed by another
        self._released = False
        self._lock = threading.Lock()

    def step(self, layout: Layout, heads: Mapping[int, int]) -> None:
        """Propose one more fragment of `layout` lacking version 0 (`heads`), if any is this
        learner's to propose: one nobody claimed, else one whose holder is slow (`steal_after_s`).
        Nothing while a proposal of its own is on its way."""
        with self._lock:
            if self._uploading is not None or self._released:
                return
            missing = [f for f in range(len(layout.fragments)) if f not in heads and f not in self.proposed]
            for fragment in missing:
                if self.bus.claim_genesis(self.learner, fragment, CLAIM_TTL_S):
                    self.claimed.add(fragment)
                    self._submit(layout, fragment)
                    return
            now, wait_s = self.clock(), steal_after_s(self.uploads_s)
            for fragment in missing:
                held_s = now - self._seen_held.setdefault(fragment, now)
                if held_s >= wait_s:
                    log.info("learner %s: fragment %d still has no version 0 %.1fs after another learner claimed "
                             "it (this learner waits %.1fs: steal_after_s): uploading it too",
                             self.learner, fragment, held_s, wait_s)
                    self._submit(layout, fragment)
                    return

    def extend(self) -> None:
        """Hold on to this learner's claims (each heartbeat, until it joins)."""
        with self._lock:
            for fragment in sorted(self.claimed):
                self.bus.claim_genesis(self.learner, fragment, CLAIM_TTL_S)

    def release(self) -> None:
        """Give up this learner's claims, and propose nothing more (it leaves before joining): the
        next learner to look takes them."""
        with self._lock:
            self._released = True
            self.bus.release_genesis(self.learner, sorted(self.claimed))
            self.claimed.clear()

    def joined(self) -> None:
        """The learner joined (every fragment has a version 0): it proposes nothing more, and lets go
        of its initial values, a full copy of the model (2 GB at 1B parameters in bf16) that would
        otherwise stay alive for the whole run. A proposal still on its way keeps its own tensors.
        Its claims lapse (CLAIM_TTL_S): they are not extended any more."""
        with self._lock:
            self._released = True
            self.initial = {}

    def _submit(self, layout: Layout, fragment: int) -> None:
        if not self._layout_stored:  # the first proposal the coordinator reads fixes the run's layout: ours, if it is this one
            self.store.put(self.bus.keys.genesis_layout(self.learner), layout.to_wire(), create_only=False)
            self._layout_stored = True
        self.proposed.add(fragment)
        self._uploading = fragment
        started = self.clock()
        tensors = {s.name: self.initial[s.name] for s in layout.fragments[fragment]}
        self.uploader.submit(UploadJob(fragment, tensors, base_version=-1, tokens=0, steps=0, step_time_s=0.0,
                                       kind="genesis",
                                       on_done=lambda sent: self._done(layout, fragment, started, sent)))

    def _done(self, layout: Layout, fragment: int, started: float, sent: bool) -> None:
        """On the uploader's thread: a proposal was stored and announced (`sent`), or dropped after
        its retries (then its claim is given up, for anyone to take again); claim the next."""
        with self._lock:
            self._uploading = None
            if sent:
                self.uploads_s.append(self.clock() - started)
            else:
                self.proposed.discard(fragment)
                if fragment in self.claimed:
                    self.claimed.discard(fragment)
                    self.bus.release_genesis(self.learner, [fragment])
        self.step(layout, self.bus.heads())
