"""A hostile learner's rig: a real `Coordinator` on the session's real Redis and S3 servers, driven
one `step()` at a time, with honest learners (the real `Uploader`) and a forger holding the same
valid credentials (tests/adversarial, and a few server-fault tests). `Rig.assert_refused` checks
what the adversarial tests assert: the coordinator survived, the honest contribution of the same
round was merged, the hostile one was refused with a reason, nothing is pending.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace

import pytest
import torch

from diloco.coordinator.config import CoordinatorConfig, RunSettings
from diloco.coordinator.policy import RoundConfig
from diloco.coordinator.service import Coordinator
from diloco.storage import codecs
from diloco.storage.bus import FIELD
from diloco.storage.history import read_manifest, sha256_hex
from diloco.storage.protocol import Announcement
from diloco.storage.settings import Endpoints
from diloco.workers.fragments import model_params, plan_layout
from diloco.workers.transfer import TransferStats, UploadJob, Uploader
from harness import Tiny

LIMIT = 64 << 10
"""The runs' max_object_bytes: every honest object here is a few hundred bytes."""
BAD = "mallory"


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Before:
    counters: dict[str, int]
    refusals: int
    head: int


class Rig:
    """A coordinator whose run has version 0 of both fragments, honest learners and a forger."""

    def __init__(self, endpoints: Endpoints, run_id: str, caplog: pytest.LogCaptureFixture, *, codec: str = "int8",
                 compress: bool = True, max_staleness: int = 4, min_quorum: int = 1, cadence: str = "steps",
                 round_s: float = 0.0, max_grace_s: float = 0.0, max_round_bytes: int = 2 << 30) -> None:
        settings = RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, codec=codec, compress=compress,
                               max_object_bytes=LIMIT, cadence=cadence)
        config = CoordinatorConfig(round_s=round_s, max_round_bytes=max_round_bytes, round=RoundConfig(
            min_quorum=min_quorum, max_grace_s=max_grace_s, max_staleness=max_staleness))
        self.coord = Coordinator(endpoints, run_id, settings=settings, config=config)
        self._settings, self._config = settings, config
        self.bus, self.store, self.keys, self.spec = self.coord.bus, self.coord.store, self.coord.keys, self.coord.spec
        self.caplog = caplog
        self.endpoints = endpoints
        self._uploaders: dict[str, Uploader] = {}
        self._seq = 0
        torch.manual_seed(0)
        # Genesis the way a learner proposes it: its layout, then fp32 parameters per fragment.
        layout = plan_layout(model_params(Tiny()), 2)
        first = self.uploader("good")
        self.store.put(self.keys.genesis_layout("good"), layout.to_wire(), create_only=False)
        for f, specs in enumerate(layout.fragments):
            first.submit(UploadJob(f, {s.name: torch.randn(s.shape) for s in specs}, base_version=-1, tokens=0,
                                   steps=0, step_time_s=0.0, kind="genesis"))
        assert first.flush(30)
        self.coord.step()  # after a start, the first step reads only the coordinator's own pending entries
        self.coord.step()
        assert self.bus.heads() == {0: 0, 1: 0}
        assert self.coord.layout is not None
        self.layout = self.coord.layout

    def restart(self) -> None:
        """The coordinator gives the run up and a successor of the same settings takes it over."""
        self.coord.close()
        self.coord = Coordinator(self.endpoints, self.spec.run, settings=self._settings, config=self._config)

    def close(self) -> None:
        for u in self._uploaders.values():
            u.close()
            u.join(5)
        self.coord.close()

    # ---- honest learners -----------------------------------------------------------------------
    def uploader(self, learner: str) -> Uploader:
        if learner not in self._uploaders:
            self._uploaders[learner] = Uploader(self.store, self.bus, self.spec, learner, TransferStats())
            self._uploaders[learner].start()
        return self._uploaders[learner]

    def head(self, fragment: int = 0) -> int:
        return self.bus.heads()[fragment]

    def send_good(self, learner: str = "good", fragment: int = 0, base_version: int | None = None,
                  deadline: float = 0.0) -> tuple[str, Announcement]:
        """An honest contribution based on the head (unless told otherwise), sent as learners send it."""
        u = self.uploader(learner)
        delta = {s.name: 0.01 * torch.randn(s.shape) for s in self.layout.fragments[fragment]}
        base = self.head(fragment) if base_version is None else base_version
        u.submit(UploadJob(fragment, delta, base_version=base, tokens=40, steps=4, step_time_s=0.01,
                           deadline=deadline))
        assert u.flush(30) and u.stats.upload_failed == 0, u.stats.last_error
        return self.last_entry()

    def last_entry(self) -> tuple[str, Announcement]:
        [(eid, fields)] = self.bus.r.xrevrange(self.keys.announcements, count=1)
        return eid.decode(), Announcement.from_wire(fields[FIELD])

    def advance(self, versions: int) -> None:
        for _ in range(versions):
            head = self.head()
            self.send_good()
            self.coord.step()
            assert self.head() == head + 1

    # ---- the forger ------------------------------------------------------------------------------
    def delta_blob(self, cid: str, *, learner: str = BAD, fragment: int = 0, base_version: int | None = None,
                   codec: str | None = None, tensors: dict[str, torch.Tensor] | None = None, **meta) -> bytes:
        """A valid delta object, encoded and labelled the way workers/transfer.py does it."""
        if tensors is None:
            tensors = {s.name: 0.01 * torch.randn(s.shape) for s in self.layout.fragments[fragment]}
        labels = {"run": self.spec.run, "fragment": fragment, "learner": learner, "kind": "delta",
                  "contribution_id": cid, "base_version": self.head(fragment) if base_version is None else base_version}
        return codecs.encode(tensors, codec or self.spec.codec, compress=self.spec.compress, meta=labels | meta)

    def forge(self, blob: bytes, *, cid: str, learner: str = BAD, fragment: int = 0, upload: bytes | None = None,
              **fields) -> tuple[str, Announcement]:
        """Upload `upload` (default: `blob`; b"" uploads nothing) under the learner's own key and announce
        `blob` truthfully (size, sha256), except for the announcement `fields` given."""
        self._seq += 1
        key = self.keys.delta(fragment, learner, self._seq)
        body = blob if upload is None else upload
        if body:
            self.store.put(key, body)
        a = Announcement(kind="delta", run=self.spec.run, fragment=fragment, learner=learner, seq=self._seq,
                         contribution_id=cid, base_version=self.bus.heads().get(fragment, 0), tokens=40, steps=4,
                         step_time_s=0.01, object_key=key, size_bytes=len(blob), sha256=sha256_hex(blob), sent_at=0.0)
        a = replace(a, **fields)
        return self.bus.announce(a), a

    def bad_delta(self, base_version: int) -> tuple[str, Announcement]:
        cid = new_id()
        return self.forge(self.delta_blob(cid, base_version=base_version), cid=cid, base_version=base_version)

    def xadd(self, fields: dict[bytes, bytes]) -> str:
        return self.bus.r.xadd(self.keys.announcements, fields).decode()

    # ---- what the user relies on -----------------------------------------------------------------
    def before(self) -> Before:
        return Before(self.bus.counters(), len(self.bus.refusals()), self.head(0))

    def assert_refused(self, before: Before, entry_id: str, *, code: str, learner: str, cid: str,
                       says: list[str], good: Announcement, copies_merged: int = 0) -> None:
        """The bad entry `entry_id` was refused as `code` and the good contribution (fragment 0) merged."""
        # Refused with this code and a reason that names the offending thing.
        new = self.bus.refusals()[before.refusals:]
        assert [(r.code, r.learner, r.contribution_id) for r in new] == [(code, learner, cid)], new
        reason = new[0].reason
        for phrase in says:
            assert phrase in reason, f"{phrase!r} not in the reason {reason!r}"
        assert any(reason in r.getMessage() and r.levelno == logging.WARNING for r in self.caplog.records)
        # Counted, exactly once.
        after = self.bus.counters()
        for counter in (f"refused:{code}", "contributions_refused"):
            assert after.get(counter, 0) == before.counters.get(counter, 0) + 1, (counter, after)
        # Acknowledged: nothing is left pending, this entry least of all.
        pending = self.bus.r.xpending_range(self.keys.announcements, self.keys.GROUP, "-", "+", 100)
        assert [p["message_id"].decode() for p in pending] == [], f"entry {entry_id} and others left pending"
        # The run went on: the good contribution is in a new committed version, whose manifest lists the refusal.
        assert self.head(0) == before.head + 1
        manifest = read_manifest(self.store, self.keys, 0, before.head + 1)
        ids = [c.contribution_id for c in manifest.inputs]
        assert good.contribution_id in ids and len(ids) == len(set(ids)), ids
        assert ids.count(cid) == copies_merged, ids
        assert list(manifest.refused) == new
