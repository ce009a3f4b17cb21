"""What a codec drops of a piece stays in the learner's model (`LearnerConfig.dropped`), against
the real Redis and S3 servers.

A lone learner, a coordinator stepping by 1 with no momentum and versions downloaded in fp32: each
version is the previous one less the learner's decoded piece. Rebasing onto it without the dropped
part moves the model back by what sign8 dropped (it keeps one element in eight); keeping it leaves
the model where its own optimizer put it, take after take, and the next pieces send the rest.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.workers.learner import Learner, LearnerConfig
from harness import TINY_RUN, Tiny, make_coordinator, start_beside

SIGN8_RUN = dataclasses.replace(TINY_RUN, codec="sign8", compress=True, cadence="steps")


def trained(endpoints, run_id, dropped: str) -> tuple[float, Learner]:  # noqa: ANN001
    """The largest |model - plain SGD| over 16 steps, and the learner (closed)."""
    coord = make_coordinator(endpoints, run_id, settings=SIGN8_RUN, outer_lr=1.0, outer_momentum=0.0,
                             downstream_codec="fp32", scale_rounds=False)
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id="l0", tokens_per_step=10,
                      config=LearnerConfig(dropped=dropped))
    gen = torch.Generator().manual_seed(1)
    try:
        start_beside(coord, learner)
        plain = {n: p.detach().clone() for n, p in model.named_parameters()}
        worst = 0.0
        for _ in range(16):
            for n, p in model.named_parameters():
                p.grad = torch.randn(p.shape, generator=gen)
                plain[n] -= 0.1 * p.grad
            opt.step()  # sends and takes in its hook
            worst = max(worst, *(float((p.detach() - plain[n]).abs().max()) for n, p in model.named_parameters()))
            assert learner.uploader.flush(30)
            for _ in range(3):
                coord.step(block_ms=50)
        assert learner.adopted >= 4, learner.adopted
        return worst, learner
    finally:
        learner.close()
        coord.close()


@pytest.mark.slow  # 14 s; `make test` keeps the dropped part's other test
def test_kept_dropped_progress_stays_in_the_model_and_carried_progress_leaves_it(endpoints, run_id):
    kept, learner = trained(endpoints, run_id, dropped="auto")  # sign8 drops: kept
    assert kept < 1e-5 and learner.kept_dropped >= 4, (kept, learner.kept_dropped)
    carried, learner = trained(endpoints, run_id + "-carry", dropped="carry")
    assert carried > 1e-2 and learner.kept_dropped == 0, carried


def test_a_dropped_part_no_take_claimed_goes_with_the_next_piece_and_one_stored_after_its_take_is_carried(
        endpoints, run_id):
    """The uploader's bookkeeping, one piece at a time on this thread (the uploader not started)."""
    from diloco.storage.objects import ObjectStore
    from diloco.workers.transfer import TransferStats, Uploader, UploadJob

    coord = make_coordinator(endpoints, run_id, settings=SIGN8_RUN)
    uploader = Uploader(ObjectStore(endpoints), coord.bus, coord.spec, "l0", TransferStats(), keep_dropped=True)
    gen = torch.Generator().manual_seed(2)

    def sent() -> UploadJob:
        job = UploadJob(0, {"w": torch.randn(64, generator=gen)}, base_version=0, tokens=10, steps=1, step_time_s=0.1)
        uploader.submit(job)
        uploader._send(uploader._jobs.pop(0))
        return job

    try:
        first = sent()  # no take yet: its dropped part waits for one
        assert uploader._dropped[0] is first.residual and float(first.residual["w"].abs().sum()) > 0
        second = sent()  # no take came between the two sends: the first's dropped part goes with the second
        assert torch.equal(second.untaken["w"], first.residual["w"])
        assert uploader._dropped[0] is second.residual
        third = UploadJob(0, {"w": torch.randn(64, generator=gen)}, base_version=0, tokens=10, steps=1,
                          step_time_s=0.1)
        uploader.submit(third)
        assert uploader.taken(0) is second.residual  # the take after the second send claims its part
        uploader._send(uploader._jobs.pop(0))  # the third is stored after that take: carried instead
        assert 0 not in uploader._dropped and uploader._residual[0] is third.residual
        fourth = sent()
        assert not fourth.untaken and 0 not in uploader._residual and uploader._dropped[0] is fourth.residual
    finally:
        uploader.close()
        coord.close()
