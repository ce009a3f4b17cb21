"""The step hook as a device would run it, checked on the CPU through the copy seam
(`workers.hostcopy`, a recording `Streams`), against the real Redis and S3:

- a send hands (anchor, snapshot) to the uploader: the training thread never waits for a snapshot
  its own step took; the uploader's thread waits for it and computes the delta, and the stored
  contribution is exactly anchor - the parameters at the send, whatever the loop did since;
- a merge adds global - anchor to the parameters in place (the rebase rule), without reading them;
- the adopt rule takes the global values as they are, and the steps trained between
  a send and the take are dropped, counted in `steps_through` and in no piece.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import pytest
import torch

from diloco.storage import codecs
from diloco.storage.history import read_manifest, read_params
from diloco.workers.hostcopy import HostCopies
from harness import TINY_RUN, announcements, make_coordinator, serving, start_beside, tiny_learner, wait_until
from hoststreams import RecordingStreams


STEPS_RUN = dataclasses.replace(TINY_RUN, cadence="steps", merge_rule="rebase")  # H = 4, fp32, overlap 1
ADOPT_RUN = dataclasses.replace(STEPS_RUN, merge_rule="adopt")


class Recorded(NamedTuple):
    before: dict[int, dict[str, torch.Tensor]]  # step -> params after the optimizer, before the learner's hook
    anchors: dict[int, list[dict[str, torch.Tensor]]]  # step -> each fragment's anchor before the hook
    after: dict[int, dict[str, torch.Tensor]]  # step -> params after the learner's hook
    versions: dict[int, dict[int, int]]  # step -> fragment -> version held after the hook
    sent_at: dict[str | None, int]  # contribution id -> the step it was sent at


def record_steps(coord, learner, opt, steps: int = 40) -> Recorded:  # noqa: ANN001
    """Join `learner` beside `coord`, train `steps` steps of random gradients, record what each
    step did around the learner's hook, flush the uploads and close both."""
    model, r = learner.model, Recorded({}, {}, {}, {}, {})

    def ahead(*_: object) -> None:
        r.before[learner.step + 1] = {n: p.detach().clone() for n, p in model.named_parameters()}
        r.anchors[learner.step + 1] = [dict(s.anchor.wait()) for s in learner.fragments]

    def behind(*_: object) -> None:
        r.after[learner.step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        r.versions[learner.step] = dict(learner.versions)
        for state in learner.fragments:
            r.sent_at.setdefault(state.sent_id, learner.step)

    opt.register_step_post_hook(ahead)  # before the learner's own (registered when it starts)
    start_beside(coord, learner)
    opt.register_step_post_hook(behind)
    try:
        with serving(coord):
            for _ in range(steps):
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                opt.step()
                time.sleep(0.05)
            assert learner.uploader.flush(30)
    finally:
        learner.close()
    coord.close()
    return r


def test_the_training_thread_never_waits_for_a_fresh_copy_and_sends_and_merges_are_exact(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner, opt = tiny_learner(endpoints, run_id, "hook")
    streams = RecordingStreams(step=lambda: learner.step)
    learner.replica.copies = HostCopies(torch.device("cpu"), streams=streams)
    before, anchors, after, versions, _ = record_steps(coord, learner, opt)

    # Every send's snapshot was first waited for by a background thread (the uploader, to compute the
    # delta, or the stager, to make a version ready against it); the training thread waited for none.
    # The stager's own copies to the device were waited for by the stager alone, a saved state's
    # copies by the state saver.
    # Joining (step 0) reads the parameters and waits: once. The events the training thread records
    # on the compute stream, behind each snapshot's clones, are waited for by the device alone (the
    # lander's copies on the side stream wait for them).
    events = [event for event in streams.events if event.step > 0 and event.stream == "side"]
    assert all(not event.waits for event in streams.events if event.stream == "compute")
    assert len(events) >= 8
    for event in events:
        assert event.waits, "a copy was never waited for"
        for thread, step in event.waits:
            assert thread.startswith("uploader-") or thread in ("stager", "state-saver"), event
    # Each take added what the stager had computed: the training thread did no arithmetic of its own.
    assert learner.adopted >= 4 and learner.taken_staged == learner.adopted

    # Each contribution is anchor - the parameters at its step (fp32: exactly; none was coalesced,
    # so the steps they count add up to the step each was sent at).
    assert learner.stats.coalesced == 0
    limit = 1 << 20
    checked = 0
    for fragment in range(2):
        names, step = learner.fragments[fragment].names, 0
        for _, a in announcements(coord.bus):
            if a.learner != "hook" or a.kind != "delta" or a.fragment != fragment:
                continue
            step += a.steps
            sent, _ = codecs.decode(coord.store.get(a.object_key, max_bytes=limit), max_bytes=limit)
            anchor, params = anchors[step][fragment], before[step]
            if versions[step][fragment] != versions[step - 1][fragment]:  # taken first, in the same step
                anchor = read_params(coord.store, learner.layout,
                                     read_manifest(coord.store, coord.keys, fragment, versions[step][fragment]))
                params = after[step]
            for n in names:
                assert torch.equal(sent[n], anchor[n] - params[n]), (fragment, step, n)
            checked += 1
    assert checked >= 6

    # Each merge moved the parameters by global - anchor, in place: p = p + (G - anchor).
    merges = 0
    for step in sorted(versions)[1:]:
        for fragment, version in versions[step].items():
            if version == versions[step - 1][fragment]:
                continue
            g = read_params(coord.store, learner.layout, read_manifest(coord.store, coord.keys, fragment, version))
            for n in learner.fragments[fragment].names:
                assert torch.equal(after[step][n], before[step][n] + (g[n] - anchors[step][fragment][n]))
            merges += 1
    assert merges >= 4


@pytest.mark.slow  # make test stays under 8 minutes: the rebase tests stay
def test_adopting_takes_the_global_values_and_every_step_is_sent_once_or_dropped(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id, settings=ADOPT_RUN)
    learner, opt = tiny_learner(endpoints, run_id, "adopt")
    before, anchors, after, versions, sent_at = record_steps(coord, learner, opt)

    merges = 0
    for step in sorted(versions)[1:]:
        for fragment, version in versions[step].items():
            if version != versions[step - 1][fragment]:
                g = read_params(coord.store, learner.layout, read_manifest(coord.store, coord.keys, fragment, version))
                assert all(torch.equal(after[step][n], g[n]) for n in learner.fragments[fragment].names)
                merges += 1
    assert merges >= 4 and learner.steps_through >= merges  # overlap 1: at least a step dropped per take
    # A piece is the progress since the take before it (anchor = G): nothing of the dropped steps.
    limit, pieces = 1 << 20, 0
    sent_steps = 0
    for _, a in announcements(coord.bus):
        if a.learner != "adopt" or a.kind != "delta":
            continue
        step, names = sent_at[a.contribution_id], learner.fragments[a.fragment].names
        sent, _ = codecs.decode(coord.store.get(a.object_key, max_bytes=limit), max_bytes=limit)
        assert all(torch.equal(sent[n], anchors[step][a.fragment][n] - before[step][n]) for n in names)
        sent_steps += a.steps
        pieces += 1
    assert pieces >= 6 and learner.stats.coalesced == 0
    # Every step of every fragment went out once in a piece, was dropped at a take, or is still unsent.
    unsent = sum(state.steps for state in learner.fragments)
    assert sent_steps + learner.steps_through + unsent == 40 * len(learner.fragments)


def test_a_loss_tensor_is_kept_detached_and_read_when_progress_is_reported(endpoints, run_id):
    learner, _ = tiny_learner(endpoints, run_id, "loss")
    w = torch.ones(2, requires_grad=True)
    loss = (w * 1.25).sum()
    learner.report(loss=loss)  # no .item() in the training loop
    assert not learner._loss.requires_grad
    assert learner.last_loss == 2.5 and learner.progress().loss == 2.5


def test_a_take_and_a_send_of_one_fragment_in_one_step_wait_for_no_copy_and_the_take_is_exact(endpoints, run_id):
    # Deterministic: the coordinator serves only between steps 7 and 8, so fragment 0's version that
    # merges its step-4 piece is downloaded and made ready before step 8, the step fragment 0 is
    # due again (H = 4, tau = 1): step 8 both takes a version of fragment 0 and sends it.
    coord = make_coordinator(endpoints, run_id, settings=STEPS_RUN)
    learner, opt = tiny_learner(endpoints, run_id, "same-step")
    streams = RecordingStreams(step=lambda: learner.step)
    learner.replica.copies = HostCopies(torch.device("cpu"), streams=streams)
    model, seen = learner.model, {}
    # Before the learner's hook: the optimizer's result, and the anchor read without waiting (on the
    # CPU its copy is done at once; a wait here would be this thread's, not the learner's).
    opt.register_step_post_hook(lambda *_: seen.update(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        anchor=({n: t.clone() for n, t in learner.fragments[0].anchor.unwaited.items()}
                if learner.fragments else None)))
    start_beside(coord, learner)

    def step() -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()

    try:
        for _ in range(7):
            step()
        assert learner.versions == {0: 0, 1: 0} and learner.stats.uploaded >= 1
        sent_before, fetched = learner.fragments[0].sent_id, learner.stats.fetched
        with serving(coord):
            assert wait_until(lambda: learner.stats.fetched >= fetched + 2, 30.0)  # both fragments' first versions
        assert wait_until(lambda: not learner.fetcher.staging(0), 10.0)  # made ready on the stager's thread
        step()  # step 8
        assert learner.step == 8 and learner.versions[0] == 1  # taken ...
        assert learner.fragments[0].sent_id not in (None, sent_before)  # ... and sent, in the same step
        assert learner.taken_staged == learner.adopted >= 1  # what was added was made on the stager's thread
        g = read_params(coord.store, learner.layout, read_manifest(coord.store, coord.keys, 0, 1))
        for n in learner.fragments[0].names:
            assert torch.equal(dict(model.named_parameters())[n].detach(), seen["params"][n] + (g[n] - seen["anchor"][n]))
        # The training thread waited for no copy after joining, step 8's own snapshot included.
        assert all(thread != "MainThread" for event in streams.events if event.step > 0 for thread, _ in event.waits)
    finally:
        learner.close()
        coord.close()
