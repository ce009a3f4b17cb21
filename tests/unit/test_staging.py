"""Versions made ready to blend on the stager's thread (`workers.staging`): the values, the chunked
copies through two reused pinned buffers (checked on the CPU through the recording seam), and the
CPU's reuse of a fragment's buffer from one take to the next."""

from __future__ import annotations

import threading
import time

import torch

from diloco.workers.hostcopy import HostCopies, Snapshot
from diloco.workers import staging
from diloco.workers.staging import Slot, Staged, Stager
from hoststreams import RecordingStreams


def test_on_a_device_the_difference_goes_through_two_reused_chunks_and_is_there_before_it_is_handed_over():
    streams = RecordingStreams()
    stager = Stager(HostCopies(torch.device("cpu"), streams=streams), chunk_elems=4)
    g = {"w": torch.arange(10.0).reshape(2, 5), "b": torch.tensor([1.5, -2.0])}
    anchor = Snapshot({"w": torch.full((2, 5), 0.25), "b": torch.tensor([0.5, 0.5])})
    staged = stager.stage(0, 7, g, ["w", "b"], anchor)
    assert staged.version == 7 and staged.anchor is anchor
    assert torch.equal(staged.values["w"], g["w"] - 0.25) and torch.equal(staged.values["b"], g["b"] - 0.5)
    # Two pinned buffers of one chunk each, allocated once, whatever the number of chunks (10 + 2 elements: 4).
    assert [entry for entry in streams.log if entry[0] == "host_empty"] == [("host_empty", (4,), "compute")] * 2
    assert len(streams.events) == 4  # one per chunk copied, all on the side stream
    assert all(e.stream == "side" for e in streams.events)
    # A buffer is reused only once its last copy is done, and every copy is done before `stage`
    # returns: all waited for, by this thread (the stager's, in a learner), none twice.
    me = threading.current_thread().name
    assert all(len(e.waits) == 1 and e.waits[0][0] == me for e in streams.events)
    again = stager.stage(0, 8, g, ["w", "b"], None)  # adopt and mix: the values themselves, copied over
    assert torch.equal(again.values["w"], g["w"]) and again.anchor is None
    assert [entry for entry in streams.log if entry[0] == "host_empty"] == [("host_empty", (4,), "compute")] * 2


def test_a_staged_value_is_used_on_the_compute_stream_without_a_copy_and_kept_alive_there():
    streams = RecordingStreams()
    copies = HostCopies(torch.device("cpu"), streams=streams)
    value = torch.ones(3)
    assert copies.on_compute(value) is value
    assert streams.log[-1] == ("keep_alive", (3,), "compute", "compute")


def test_on_the_cpu_a_fragments_buffer_is_reused_once_released_and_never_while_held():
    stager = Stager(HostCopies(torch.device("cpu")))
    g = {"w": torch.randn(64)}
    first = stager.stage(2, 1, g, ["w"], Snapshot({"w": torch.ones(64)}))
    assert torch.equal(first.values["w"], g["w"] - 1)
    held = stager.stage(2, 2, g, ["w"], Snapshot({"w": torch.zeros(64)}))  # the first not released: a new buffer
    assert held.values["w"].data_ptr() != first.values["w"].data_ptr()
    first_ptr = first.values["w"].data_ptr()
    first.release()
    first.release()  # once only
    third = stager.stage(2, 3, g, ["w"], Snapshot({"w": torch.full((64,), 2.0)}))
    assert third.values["w"].data_ptr() == first_ptr and torch.equal(third.values["w"], g["w"] - 2)
    assert torch.equal(held.values["w"], g["w"])  # untouched by the reuse
    other = stager.stage(3, 1, g, ["w"], Snapshot({"w": torch.ones(64)}))  # another fragment: its own buffers
    assert other.values["w"].data_ptr() not in (first_ptr, held.values["w"].data_ptr())
    plain = stager.stage(2, 4, g, ["w"], None)
    assert plain.values["w"] is g["w"] and isinstance(plain, Staged)


def _wait(predicate, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_on_the_cpu_the_buffers_kept_for_reuse_stay_under_pool_bytes_over_all_fragments(monkeypatch):
    """One buffer kept per fragment would be a second fp32 copy of the model: past POOL_BYTES (here
    two fragments' worth), a released buffer is freed instead of kept."""
    monkeypatch.setattr(staging, "POOL_BYTES", 2 * 64 * 4)
    stager = Stager(HostCopies(torch.device("cpu")))
    g = {"w": torch.randn(64)}
    staged = [stager.stage(f, 1, g, ["w"], Snapshot({"w": torch.ones(64)})) for f in range(3)]
    ptrs = [s.values["w"].data_ptr() for s in staged]
    for s in staged:
        s.release()
    again = [stager.stage(f, 2, g, ["w"], Snapshot({"w": torch.ones(64)})).values["w"].data_ptr() for f in range(3)]
    assert again[:2] == ptrs[:2] and stager.scratch.held_bytes == 0  # the two kept are in use again


def test_a_version_asked_again_after_a_send_is_made_ready_against_the_new_anchor_and_the_old_value_freed():
    anchors = {0: Snapshot({"w": torch.ones(8)})}
    stager = Stager(HostCopies(torch.device("cpu")), lambda f, v: (anchors[f], ["w"]))
    stager.start()
    try:
        g = {"w": torch.full((8,), 5.0)}
        slot = Slot()
        stager.submit(0, 3, g, slot)
        assert _wait(lambda: not slot.pending)
        first_ptr = slot._staged.values["w"].data_ptr()
        anchors[0] = Snapshot({"w": torch.full((8,), 2.0)})  # the learner sent: a new anchor
        stager.submit(0, 3, g, slot)  # as Fetcher.restage asks
        assert _wait(lambda: not slot.pending)
        staged = slot.claim()
        assert staged.anchor is anchors[0] and torch.equal(staged.values["w"], torch.full((8,), 3.0))
        # The value against the old anchor went back to the fragment's pool when asked again: reused.
        assert staged.values["w"].data_ptr() == first_ptr
        stager.submit(0, 5, g, slot)  # claimed already: nothing more is computed for it
        assert not slot.pending
    finally:
        stager.close()
        stager.join(5)
    assert not stager.is_alive()


def test_an_answer_to_an_older_request_is_released_not_offered():
    released = []

    class Value(Staged):
        def release(self) -> None:
            released.append(self.version)

    slot = Slot()
    first = slot.ask()
    second = slot.ask()  # asked again before the first answer
    slot.offer(Value(1, None, {}), first)
    assert released == [1] and slot.pending  # stale: dropped, the newer request still open
    slot.offer(Value(2, None, {}), second)
    assert not slot.pending and released == [1]
    slot.release()  # not taken after all
    assert released == [1, 2]
    assert slot.ask() is None  # closed


def test_a_stager_that_cannot_compute_leaves_the_take_to_the_training_loop():
    stager = Stager(HostCopies(torch.device("cpu")), lambda f, v: (Snapshot({"w": torch.ones(3)}), ["w"]))
    stager.start()
    try:
        slot = Slot()
        stager.submit(0, 1, {"w": torch.ones(4)}, slot)  # the shapes differ: it fails, logged
        assert _wait(lambda: not slot.pending) and slot.claim() is None
        never = Slot()
        stager_none = Stager(HostCopies(torch.device("cpu")), lambda f, v: None)  # older than the base: not taken
        stager_none.start()
        stager_none.submit(0, 1, {"w": torch.ones(3)}, never)
        assert _wait(lambda: not never.pending) and never.claim() is None
        stager_none.close()
    finally:
        stager.close()
