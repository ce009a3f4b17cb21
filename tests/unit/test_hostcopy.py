"""Copies between the device and the host (`workers.hostcopy`), on the CPU: what a device is asked to
do, in which order, through the recording seam; and the values that come out."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco.workers.hostcopy import HostCopies, Snapshot
from diloco.workers.island import Replica
from diloco.workers.transfer import UploadJob
from hoststreams import RecordingStreams


def test_a_snapshot_copies_on_the_side_stream_after_the_compute_stream_and_keeps_the_clones_alive():
    streams = RecordingStreams()
    copies = HostCopies(torch.device("cpu"), streams=streams)
    clones = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    threads = []
    streams.host_empty = lambda shape, dtype=torch.float32, empty=streams.host_empty: (
        threads.append(threading.current_thread().name), empty(shape, dtype))[1]
    snapshot = copies.snapshot(clones)
    assert streams.log[0] == ("record", "compute", "compute")  # the training thread does only this
    values = snapshot.wait()
    assert streams.log == [
        ("record", "compute", "compute"),  # the clones' values are queued on the compute stream before it
        ("wait_event", "side", "compute"),  # the lander's copies wait for them (on the device)
        ("using", "side"),
        ("host_empty", (2, 3), "side"), ("keep_alive", (2, 3), "side", "side"),
        ("host_empty", (4,), "side"), ("keep_alive", (4,), "side", "side"),
        ("record", "side", "side"),  # after every copy
        ("done", "side"),
    ]
    # Pinned memory is allocated on the lander's thread: when more snapshots are alive than ever
    # before, the driver's allocation took 150 ms on an H200, on the training thread before.
    assert threads == ["snapshot-lander"] * 2
    ready, event = streams.events
    assert not ready.waits and len(event.waits) == 1 and snapshot.landed
    assert torch.equal(values["a"], clones["a"]) and torch.equal(values["b"], clones["b"])
    assert values["a"].data_ptr() != clones["a"].data_ptr()  # host buffers, not the device clones
    snapshot.wait()
    assert len(event.waits) == 1  # the event is waited for once
    copies.close()
    assert copies._lander is None and "snapshot-lander" not in [t.name for t in threading.enumerate()]


def test_a_snapshot_whose_copies_failed_says_so_to_its_reader_and_the_next_one_lands():
    streams = RecordingStreams()
    copies = HostCopies(torch.device("cpu"), streams=streams)
    failing = {"w": torch.ones(3)}
    empty = streams.host_empty

    def host_empty(shape, dtype=torch.float32):  # noqa: ANN001, ANN202
        if shape == (3,):
            raise RuntimeError("CUDA error: out of memory")
        return empty(shape, dtype)

    streams.host_empty = host_empty
    bad, good = copies.snapshot(failing), copies.snapshot({"v": torch.ones(2)})
    with pytest.raises(RuntimeError, match="copies to the host failed.*out of memory"):
        bad.wait()
    assert torch.equal(good.wait()["v"], torch.ones(2))
    copies.close()


def test_on_the_cpu_the_clones_are_the_snapshot_and_nothing_waits():
    copies = HostCopies(torch.device("cpu"))
    assert copies.streams is None
    clone = torch.randn(3)
    snapshot = copies.snapshot({"w": clone})
    assert snapshot.landed and snapshot.wait()["w"] is clone
    value = copies.host_empty((3,))
    assert copies.to_device(value) is value


def test_a_replica_snapshot_keeps_the_values_of_its_step_and_blend_updates_in_place():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    replica = Replica({"w": w})
    snapshot = replica.snapshot(["w"])
    with torch.no_grad():
        w.add_(10.0)  # the next optimizer step
    assert torch.equal(snapshot.wait()["w"], torch.tensor([1.0, 2.0, 3.0]))
    storage = w.data_ptr()
    replica.blend({"w": torch.tensor([0.5, 0.5, 0.5])}, ["w"])  # rebase: p += global - anchor
    assert torch.equal(w.detach(), torch.tensor([11.5, 12.5, 13.5])) and w.data_ptr() == storage
    replica.blend({"w": torch.zeros(3)}, ["w"], keep=0.5, add=0.5)  # mix: alpha * p + (1 - alpha) * global
    assert torch.equal(w.detach(), torch.tensor([5.75, 6.25, 6.75]))


def test_an_upload_job_computes_its_delta_when_settled_and_absorbing_does_no_arithmetic():
    anchor = Snapshot({"w": torch.tensor([4.0, 4.0])})
    first = Snapshot({"w": torch.tensor([3.0, 5.0])})
    job = UploadJob(0, {}, base_version=1, tokens=10, steps=1, step_time_s=0.1, pending=[(anchor, first)])
    assert job.delta == {}  # nothing computed on the training thread
    for i, local in enumerate([torch.tensor([2.0, 5.0]), torch.tensor([2.0, 7.0])], start=1):
        newer = UploadJob(0, {}, base_version=2, tokens=10, steps=1, step_time_s=0.1,
                          pending=[(job.pending[-1][1], Snapshot({"w": local}))])
        job.absorb(newer)
        # Consecutive sends telescope into one pair: (anchor, the newest local); still nothing computed.
        assert job.delta == {} and len(job.pending) == 1 and job.pending[0][0] is anchor
        assert job.pending[0][1] is newer.pending[0][1] and job.tokens == 10 * (i + 1)
    assert job.base_version == 1
    # The sum of the three deltas: (4-3, 4-5) + (3-2, 5-5) + (2-2, 5-7) = anchor - the last local.
    assert torch.equal(job.settle()["w"], torch.tensor([2.0, -3.0])) and job.pending == []


def test_a_version_taken_between_two_sends_keeps_their_pairs_apart_and_their_number_bounded():
    job = UploadJob(0, {}, base_version=1, tokens=1, steps=1, step_time_s=0.1,
                    pending=[(Snapshot({"w": torch.tensor([1.0])}), Snapshot({"w": torch.tensor([0.0])}))])
    expected = torch.tensor([1.0])
    for k in range(1, 7):  # each send after a take: its anchor is the taken version, not the last local
        g, local = torch.tensor([10.0 * k]), torch.tensor([10.0 * k - k])
        job.absorb(UploadJob(0, {}, base_version=1 + k, tokens=1, steps=1, step_time_s=0.1,
                             pending=[(Snapshot({"w": g}), Snapshot({"w": local}))]))
        expected = expected + (g - local)
        assert 1 <= len(job.pending) <= UploadJob.MAX_PENDING
    assert len(job.delta) == 1  # the oldest pairs were settled into the delta once past the bound
    assert torch.equal(job.settle()["w"], expected) and job.tokens == 7

def test_a_state_tree_is_copied_on_the_side_stream_and_the_next_write_waits_for_it_on_the_device():
    streams = RecordingStreams()
    copies = HostCopies(torch.device("cpu"), streams=streams)
    moments = torch.arange(4.0, dtype=torch.bfloat16)
    tree = {"state": {0: {"exp_avg": moments, "step": 3}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    snapshot = copies.tree_to_host(tree)
    assert streams.log[:2] == [("wait_stream", "side", "compute"), ("using", "side")]
    assert ("host_empty", (4,), "side") in streams.log and streams.log[-1] == ("done", "side")
    [event] = streams.events
    assert not event.waits  # the training thread waited for nothing
    copies.before_write(snapshot)  # the next optimizer step: the compute stream waits for the copies
    assert streams.log[-1] == ("wait_event", "compute", "side") and not event.waits
    host = snapshot.wait()
    assert host["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(host["state"][0]["exp_avg"], moments) and host["state"][0]["exp_avg"] is not moments
    assert host["state"][0]["step"] == 3 and host["param_groups"] == tree["param_groups"]
    copies.before_write(snapshot)  # landed: nothing more to wait for
    assert streams.log[-1] == ("wait_event", "compute", "side") and len([e for e in streams.log if e[0] == "wait_event"]) == 1


def test_on_the_cpu_a_state_tree_is_copied_at_once():
    moments = torch.ones(3)
    snapshot = HostCopies(torch.device("cpu")).tree_to_host({"m": [moments]})
    assert snapshot.landed
    copy = snapshot.wait()["m"][0]
    moments.add_(1.0)
    assert torch.equal(copy, torch.ones(3))
