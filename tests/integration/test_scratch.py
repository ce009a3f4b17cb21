"""The uploader reuses its pieces' fragment-sized buffers (`workers.scratch`): the same pieces as
with buffers of their own, against the real Redis and S3 servers, and buffers mapped once."""

from __future__ import annotations

import dataclasses

import torch

from diloco.storage import codecs
from diloco.storage.objects import ObjectStore
from diloco.workers.hostcopy import Snapshot
from diloco.workers.scratch import Scratch
from diloco.workers.transfer import TransferStats, Uploader, UploadJob
from harness import TINY_RUN, make_coordinator

INT4_RUN = dataclasses.replace(TINY_RUN, codec="int4", compress=True)


def test_reused_buffers_send_the_pieces_fresh_ones_send_and_each_residual_survives_until_carried(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=INT4_RUN)
    store = ObjectStore(endpoints)
    reusing = Uploader(store, coord.bus, coord.spec, "reuse", TransferStats())
    fresh = Uploader(store, coord.bus, coord.spec, "fresh", TransferStats())
    reusing.scratch = Scratch(spare=lambda: True)  # as on a machine with memory to spare
    fresh.scratch = Scratch(min_elements=1 << 62)  # never keeps one: every piece maps its own
    gen = torch.Generator().manual_seed(3)
    shapes = {"w": (1 << 10, 1 << 10), "b": (7,)}  # one buffer of 2^20 + 7 values a use
    anchor = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    buffers = set()
    try:
        for piece in range(4):
            local = {n: a + 0.01 * torch.randn(a.shape, generator=gen) for n, a in anchor.items()}
            pieces = {}
            for uploader in (reusing, fresh):
                job = UploadJob(0, {}, base_version=0, tokens=10, steps=4, step_time_s=0.1,
                                pending=[(Snapshot(anchor), Snapshot(local))])
                uploader.submit(job)
                uploader._send(uploader._jobs.pop(0))  # this thread, one piece at a time
                assert job.key is not None and not job.delta and not job.buffers  # stored: delta given back
                pieces[uploader.learner] = (codecs.decode(store.get(job.key, max_bytes=1 << 30),
                                                          max_bytes=1 << 30)[0], job.residual)
                if uploader is reusing:
                    buffers.add(job.residual_buffer.data_ptr())
            (got, got_left), (want, want_left) = pieces["reuse"], pieces["fresh"]
            for n in shapes:  # the same values sent and left for the next piece: no residual overwritten early
                assert torch.equal(got[n], want[n]) and torch.equal(got_left[n], want_left[n]), (piece, n)
            anchor = local
        # Piece 1 maps a delta and a residual, piece 2 reuses the delta's and maps a residual (the
        # first is still to be carried); from then on every use takes one of those three buffers:
        # the residuals alternate between two, and two wait between pieces.
        assert reusing.scratch.reused == 5 and fresh.scratch.reused == 0
        assert len(buffers) == 2 and reusing.scratch.held_bytes == 2 * (2 ** 20 + 7) * 4
    finally:
        reusing.close()
        fresh.close()
        coord.close()
