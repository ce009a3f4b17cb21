"""The uploader measures how long a piece takes to go out (`TransferStats.send_lag_s`), the lag a
learner on the clock cadence sends ahead of a deadline by (`fragments.send_lead`): from the step
that sent it to its announcement, a wait behind the pieces queued before it included. A real
`Uploader` on the session's real Redis and S3 servers (`rig.Rig`)."""

from __future__ import annotations

import time

import torch

from diloco.workers.transfer import UploadJob
from rig import Rig


def _job(rig: Rig, fragment: int) -> UploadJob:
    delta = {s.name: 0.01 * torch.randn(s.shape) for s in rig.layout.fragments[fragment]}
    return UploadJob(fragment, delta, base_version=rig.head(fragment), tokens=40, steps=4, step_time_s=0.01)


def test_a_pieces_lag_runs_from_the_newest_send_it_carries_to_its_announcement(rig):
    u = rig.uploader("lagged")
    assert u.stats.send_lag_s == 0.0  # nothing sent yet: no lead
    t0 = time.monotonic()
    u.submit(_job(rig, 0))
    assert u.flush(30) and u.stats.upload_failed == 0, u.stats.last_error
    alone = u.stats.send_lag_s
    assert 0.0 < alone <= time.monotonic() - t0
    # The uploader's CPU by phase (TransferStats.cpu_phases): encoding, the PUT, the announcement.
    assert set(u.stats.cpu_phases) == {"encode", "put", "announce"} and u.stats.cpu_phases["encode"] > 0

    # A send coalesced into a job still queued: the job's lag counts from the newest send it carries.
    older, newer = _job(rig, 1), _job(rig, 1)
    older.sent_at -= 10.0
    newer.sent_at -= 2.0  # made 2 s ago
    older.absorb(newer)
    assert older.sent_at == newer.sent_at
    u.submit(older)
    assert u.flush(30) and u.stats.upload_failed == 0, u.stats.last_error
    lag = (u.stats.send_lag_s - 0.7 * alone) / 0.3  # the second piece's, from the moving mean
    assert 2.0 <= lag < 3.0
