"""What a user wrapping a loop in `Learner` relies on, against the real Redis and S3:

- a token count is required (tokens weigh contributions): none at all is an error at the first
  step, never a silent zero weight; the bytes a learner reads are counted, as its sends are;
- a `torch.compile`d model trains in the same run as an uncompiled one (names without `_orig_mod.`);
- `handle_sigterm=True`: SIGTERM ends the step in progress, sends the progress, leaves as preempted
  (not finished) and raises `Preempted` (exit code 143) out of `optimizer.step()`.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch

from diloco import Preempted
from diloco.storage.errors import ConfigError
from diloco.workers.learner import Learner
from harness import TINY_RUN, Tiny, announcements, join, make_coordinator, merged_ids, start_beside, train

STEPS_RUN = dataclasses.replace(TINY_RUN, cadence="steps")  # H = 4


def test_tokens_per_step_is_required_or_reported_never_a_silent_zero(endpoints, run_id):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, -5, True):
        with pytest.raises(ConfigError, match="tokens_per_step"):
            Learner(model, opt, run=run_id, endpoints=endpoints, tokens_per_step=bad)
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id="uncounted")
    start_beside(coord, learner)
    # Bytes down are counted too: joining read version 0's params of both fragments (and more).
    version_0 = sum(size for key, size in coord.store.list_sizes(coord.keys.versions_prefix())
                    if key.rsplit("/", 1)[-1].startswith("params."))
    assert version_0 > 0 and learner.progress().bytes_downloaded > version_0
    try:
        learner.report(tokens=7)  # a count reported for the step is enough
        train(learner, opt, 1)
        assert learner.tokens == 7
        with pytest.raises(ConfigError, match="no token count"):
            train(learner, opt, 1)
    finally:
        learner.close()
    coord.close()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_compiled_model_trains_in_the_same_run_as_an_uncompiled_one(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    plain, plain_opt = join(endpoints, run_id, coord, "plain")
    torch.manual_seed(0)
    compiled = torch.compile(Tiny(), backend="eager")  # the wrapper names its parameters _orig_mod.<name>
    assert all(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    learner = Learner(compiled, opt, run=run_id, endpoints=endpoints, learner_id="compiled", tokens_per_step=10)
    start_beside(coord, learner)
    try:
        train(learner, opt, 4)  # fragment 0 due at step 4
        sent = [a.contribution_id for _, a in announcements(coord.bus) if a.learner == "compiled"]
        assert sent
        for _ in range(20):
            coord.step(block_ms=50)
        assert set(sent) <= set(merged_ids(endpoints, run_id))
        assert coord.bus.counters().get("contributions_refused", 0) == 0, coord.bus.refusals()
        # The global state comes back under the compiled model's own names.
        assert sorted(learner.global_state_dict()) == sorted(n for n, _ in compiled.named_parameters())
    finally:
        learner.close()
        plain.close()
    coord.close()


def test_sigterm_sends_the_progress_leaves_as_preempted_and_raises_out_of_the_step(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    before = signal.getsignal(signal.SIGTERM)
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id="spot", tokens_per_step=10,
                      handle_sigterm=True)
    start_beside(coord, learner)
    with pytest.raises(Preempted) as raised:
        with learner:
            train(learner, opt, 5)  # fragment 0 sent at step 4
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice between steps: the next step is the last
            assert learner.preempted
            train(learner, opt, 3)
    assert raised.value.code == 143 and learner.step == 6
    sent = sorted((a.fragment, a.steps, a.final) for _, a in announcements(coord.bus) if a.kind == "delta")
    assert sent == [(0, 2, True), (0, 4, False), (1, 6, True)]  # every step sent, the last ones as its way out
    assert "spot" not in coord.bus.finished_learners()  # preempted, not finished: it may come back
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the user's again
    coord.close()


def forward(model: Tiny, x: torch.Tensor) -> torch.Tensor:
    for block in model.blocks:
        x = torch.relu(block(x))
    return x


def test_gradient_accumulation_and_bf16_autocast_count_optimizer_steps_and_their_tokens(endpoints, run_id):
    """A loop that accumulates 4 micro-batches per optimizer step under CPU bf16 autocast: the learner
    counts optimizer steps (its hook is on `optimizer.step()`), tokens_per_step is per optimizer step
    (4 micro-batches of 10), and the fp32 parameters' deltas are merged like any other."""
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id="accumulating", tokens_per_step=4 * 10)
    start_beside(coord, learner)
    with learner:
        for _ in range(4):  # H = 4 optimizer steps: fragment 0 is due after the 4th
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = forward(model, torch.randn(10, 4)).pow(2).mean() / 4
                loss.backward()
            opt.step()
            opt.zero_grad()
        assert learner.step == 4 and learner.tokens == 160
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert learner.uploader.flush(30)
    first = [a for _, a in announcements(coord.bus) if a.kind == "delta" and not a.final]
    assert [(a.fragment, a.steps, a.tokens) for a in first] == [(0, 4, 160)]
    for _ in range(20):
        coord.step(block_ms=50)
    sent = {a.contribution_id for _, a in announcements(coord.bus) if a.learner == "accumulating"}
    assert sent <= set(merged_ids(endpoints, run_id)), "every piece merged"
    coord.close()


@pytest.mark.slow  # 6 s; `make test` keeps bf16 autocast with gradient accumulation
def test_a_bf16_model_trains_in_a_run_whose_global_model_is_fp32(endpoints, run_id):
    """Parameters that are bf16 themselves (half the memory of weights, gradients and moments): the
    run's layout records them as such, the global model stays fp32, the learner's pieces merge, its
    error-feedback residual is kept in bf16 (half the memory of an fp32 one), and it takes versions."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(STEPS_RUN, codec="int8"))
    torch.manual_seed(0)
    model = Tiny().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id="bf16", tokens_per_step=10)
    start_beside(coord, learner)
    with learner:
        for step in range(12):
            model.zero_grad()
            forward(model, torch.randn(10, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            if step % 4 == 3:
                assert learner.uploader.flush(30)
                for _ in range(6):
                    coord.step(block_ms=50)
        residuals = learner.uploader._residual  # noqa: SLF001 (what the learner holds)
        assert residuals and all(r.dtype == torch.bfloat16 for res in residuals.values() for r in res.values())
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert learner.adopted >= 1
    for _ in range(10):  # the final pieces
        coord.step(block_ms=50)
    assert {p.dtype for specs in coord.layout.fragments for p in specs} == {"bfloat16"}
    assert all(h >= 2 for h in coord.bus.heads().values()), coord.bus.heads()
    held = learner.global_state_dict()
    assert all(t.dtype == torch.float32 for t in held.values())
    sent = {a.contribution_id for _, a in announcements(coord.bus) if a.learner == "bf16"}
    assert sent <= set(merged_ids(endpoints, run_id)), "every piece merged"
    coord.close()


def test_on_the_cpu_the_transfer_threads_run_at_the_loops_priority_paced_unless_told(endpoints, run_id):
    """The transfer threads' nice value is chosen for the device (`threads.transfer_nice`): on the
    CPU a lowered thread would make every piece and every take wait behind the loop's own ops. A
    learner given `transfer_nice` runs them that far below the loop. On the CPU their work is
    paced to a share of a CPU (`transfer_share`) until the learner leaves; 1 is not paced."""
    import threading
    import time

    from diloco.workers.learner import LearnerConfig
    from diloco.workers.threads import CPU_SHARE

    def priorities(learner: Learner) -> dict[str, int]:
        threads = {"uploader": learner.uploader, "fetcher": learner.fetcher, "stager": learner._stager}
        deadline = time.monotonic() + 10
        while any(t.native_id is None for t in threads.values()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # each lowers itself as it starts running
        return {name: os.getpriority(os.PRIO_PROCESS, t.native_id) for name, t in threads.items()}

    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    coord = make_coordinator(endpoints, run_id)
    chosen, _ = join(endpoints, run_id, coord, "chosen")
    torch.manual_seed(0)
    model = Tiny()
    told = Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), run=run_id, endpoints=endpoints,
                   learner_id="told", tokens_per_step=10, config=LearnerConfig(transfer_nice=7, transfer_share=1.0))
    try:
        start_beside(coord, told)
        assert priorities(chosen) == dict.fromkeys(("uploader", "fetcher", "stager"), loop)
        assert priorities(told) == dict.fromkeys(("uploader", "fetcher", "stager"), min(19, loop + 7))
        paced = [t.pacer for t in (chosen.uploader, chosen.fetcher, chosen._stager)]
        assert all(p is not None and p.share == CPU_SHARE and not p.stopped for p in paced)
        assert [t.pacer for t in (told.uploader, told.fetcher, told._stager)] == [None] * 3
    finally:
        for learner in (chosen, told):
            learner.close()
        coord.close()
    assert all(p.stopped for p in paced)  # leaving: the last pieces go out as fast as they can
