"""A paced uploader whose pieces queue up works unpaced until it has caught up (`Uploader._rush`):
pacing spreads a burst, it must not build a backlog. Against the real Redis and S3 servers."""

from __future__ import annotations

import dataclasses

import torch

from diloco.storage.intraop import BURST_S, Budget
from diloco.storage.objects import ObjectStore
from diloco.workers import transfer
from diloco.workers.hostcopy import Snapshot
from diloco.workers.threads import ThreadLimits
from diloco.workers.transfer import TransferStats, Uploader, UploadJob
from harness import TINY_RUN, make_coordinator

INT4_RUN = dataclasses.replace(TINY_RUN, codec="int4", compress=True)
SLOW = 0.01
"""A share at which these pieces (about 0.1 CPU s each, past a burst) would take seconds each, paced."""


def _job(fragment: int, gen: torch.Generator) -> UploadJob:
    anchor = {"w": torch.randn(1 << 23, generator=gen)}
    local = {"w": anchor["w"] + 0.01 * torch.randn(1 << 23, generator=gen)}
    return UploadJob(fragment, {}, base_version=0, tokens=10, steps=4, step_time_s=0.1,
                     pending=[(Snapshot(anchor), Snapshot(local))])


def _uploader(endpoints, coord, name: str) -> Uploader:
    limits = ThreadLimits(threads=1, share=SLOW, budget=Budget(SLOW))
    return Uploader(ObjectStore(endpoints), coord.bus, coord.spec, name, TransferStats(), limits=limits)


def test_a_send_that_finds_its_fragments_last_piece_still_queued_lifts_the_pacing_until_the_queue_is_empty(
        endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=INT4_RUN)
    uploader = _uploader(endpoints, coord, "behind")
    gen = torch.Generator().manual_seed(0)
    try:
        for fragment in (0, 1, 0):  # the third finds fragment 0's piece not started: a period behind
            uploader.submit(_job(fragment, gen))
        assert uploader.stats.coalesced == 1
        uploader.start()
        assert uploader.flush(120)
        pacer = uploader.pacer
        assert pacer is not None and pacer.slept_s == 0.0 and pacer.rushed_s > BURST_S  # unpaced past a burst
        assert not pacer.rushing and uploader.stats.uploaded == 2  # caught up: paced again
    finally:
        uploader.close()
        coord.close()


def test_pieces_queued_behind_one_another_while_memory_is_short_are_sent_unpaced(endpoints, run_id, monkeypatch):
    coord = make_coordinator(endpoints, run_id, settings=INT4_RUN)
    uploader = _uploader(endpoints, coord, "short")
    gen = torch.Generator().manual_seed(1)
    monkeypatch.setattr(transfer, "spare_memory", lambda: False)  # the machine's state, as `storage.heap` reads it
    try:
        uploader.submit(_job(0, gen))
        assert not uploader._rushing  # one piece alone: a burst, paced as ever
        uploader.submit(_job(1, gen))
        assert uploader._rushing and uploader.stats.coalesced == 0
        uploader.start()
        assert uploader.flush(120)
        assert uploader.pacer.slept_s == 0.0 and uploader.pacer.rushed_s > BURST_S and not uploader.pacer.rushing and uploader.stats.uploaded == 2
    finally:
        uploader.close()
        coord.close()
