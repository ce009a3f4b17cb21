"""The transfer threads' CPU share (workers/threads.py): the count chosen per device, a cap that holds
for the thread that set it only, a priority below the loop's for that thread only, and their heavy
work paced to a share of a CPU (storage/intraop.py)."""

import os
import threading
import time

import pytest
import torch

from diloco.storage import codecs
from diloco.storage.errors import ConfigError
from diloco.storage import intraop
from diloco.storage.intraop import BURST_S, PACE_ELEMENTS, Budget, Pacer, pace, paced_slices, unpaced
from diloco.workers.learner import LearnerConfig
from diloco.workers.threads import (CPU_SHARE, ThreadLimits, cap_this_thread, lower_this_thread, transfer_nice,
                                    transfer_share, transfer_threads)


def test_beside_a_gpu_a_quarter_of_the_cpus_on_the_cpu_torchs_own():
    assert transfer_threads(0, "cuda", 16) == 4
    assert transfer_threads(0, "cuda", 2) == 1
    assert transfer_threads(0, "cpu", 16) is None
    assert transfer_threads(3, "cpu", 16) == 3
    assert transfer_threads(64, "cuda", 16) == 16  # never more threads than CPUs
    with pytest.raises(ConfigError, match="transfer_threads"):
        transfer_threads(-1, "cuda", 16)
    with pytest.raises(ConfigError, match="transfer_threads"):
        LearnerConfig(transfer_threads=-2)


def _count_in_thread(cap: int | None) -> int:
    seen: list[int] = []

    def body() -> None:
        assert cap_this_thread(cap)
        torch.ones(4096).sum()  # a parallel op after the cap
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen[0]


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread: nothing to cap")
def test_the_cap_holds_for_its_thread_only():
    before = torch.get_num_threads()
    assert _count_in_thread(1) == 1
    assert torch.get_num_threads() == before  # the loop's thread keeps its count
    assert _count_in_thread(None) == before  # and threads started later start from torch's


def test_a_lowered_thread_runs_below_the_loop_and_the_loop_keeps_its_priority():
    seen: list[int] = []

    def body() -> None:
        assert lower_this_thread(None, 5)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    loop = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [min(19, loop + 5)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == loop
    with pytest.raises(ConfigError, match="transfer_nice"):
        LearnerConfig(transfer_nice=20)


def test_beside_a_gpu_the_transfers_run_below_the_loop_on_the_cpu_beside_it():
    """On the CPU a lowered transfer thread waits behind the loop's own ops: pieces go out and
    versions are made ready later, and the learner trains on longer from a version without the
    others' progress. Beside a GPU the loop's thread only launches kernels and must never wait."""
    assert LearnerConfig().transfer_nice == -1  # chosen for the device
    assert transfer_nice(-1, "cuda") == 10
    assert transfer_nice(-1, "cpu") == 0
    assert transfer_nice(5, "cpu") == 5 and transfer_nice(0, "cuda") == 0  # a setting is kept
    with pytest.raises(ConfigError, match="transfer_nice"):
        transfer_nice(-2, "cpu")
    LearnerConfig(transfer_nice=-1)
    with pytest.raises(ConfigError, match="transfer_nice"):
        LearnerConfig(transfer_nice=-2)


# --- pacing: a transfer thread's heavy work held to a share of a CPU ------------------------------


class _Clocks:
    """A thread's CPU time and the wall clock, moved by hand: work advances both, a sleep the wall's."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.sleeps: list[float] = []

    def work(self, s: float) -> None:
        self.cpu += s
        self.wall += s

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.wall += s

    def pacer(self, share: float) -> Pacer:
        return Pacer(share, cpu=lambda: self.cpu, wall=lambda: self.wall, sleep=self.sleep)


def test_small_work_now_and_then_never_waits_and_a_burst_is_held_to_its_share():
    clocks = _Clocks()
    pacer = clocks.pacer(0.25)
    for _ in range(20):  # a small model's pieces: 5 ms of work a second
        clocks.work(0.005)
        pacer.step()
        clocks.wall += 1.0
        pacer.step()
    assert clocks.sleeps == [] and pacer.slept_s == 0.0

    start_cpu, start_wall = clocks.cpu, clocks.wall
    for _ in range(200):  # a large piece: 200 chunks of 5 ms
        clocks.work(0.005)
        pacer.step()
    cpu, wall = clocks.cpu - start_cpu, clocks.wall - start_wall
    assert cpu == pytest.approx(1.0)
    assert wall == pytest.approx((cpu - BURST_S) / 0.25 + BURST_S, rel=0.02)  # the burst in hand, then its share
    assert pacer.slept_s == pytest.approx(sum(clocks.sleeps)) and all(s <= 0.005 / 0.25 + 1e-9 for s in clocks.sleeps)


def test_threads_paced_from_one_budget_take_its_share_between_them_not_each():
    clocks = _Clocks()
    budget = Budget(0.25, wall=lambda: clocks.wall)
    threads = [[0.0], [0.0]]  # each thread's own CPU time

    def pacer(own: list[float]) -> Pacer:
        return Pacer(0.25, budget=budget, cpu=lambda: own[0], wall=lambda: clocks.wall, sleep=clocks.sleep)

    pacers = [pacer(own) for own in threads]
    start = clocks.wall
    for _ in range(100):  # two threads at work together, 5 ms chunks in turn
        for own, paced in zip(threads, pacers):
            own[0] += 0.005
            clocks.wall += 0.005
            paced.step()
    cpu = sum(own[0] for own in threads)
    assert cpu == pytest.approx(1.0)
    assert clocks.wall - start == pytest.approx((cpu - BURST_S) / 0.25 + BURST_S, rel=0.03)  # a quarter of a CPU together
    assert sum(p.slept_s for p in pacers) == pytest.approx(sum(clocks.sleeps))


def test_a_rushing_thread_is_not_paced_and_leaves_the_budget_to_the_others():
    clocks = _Clocks()
    pacer = clocks.pacer(0.25)
    pacer.rushing = True  # its work queues up: a backlog, not a burst
    for _ in range(200):
        clocks.work(0.005)
        pacer.step()
    assert clocks.sleeps == [] and pacer.rushed_s == pytest.approx(1.0)
    pacer.rushing = False  # caught up: paced again, owing nothing for the rush
    clocks.work(0.005)
    pacer.step()
    assert clocks.sleeps == []
    for _ in range(100):
        clocks.work(0.005)
        pacer.step()
    assert pacer.slept_s > 0 and pacer.rushed_s == pytest.approx(1.0)


def test_a_learners_limits_give_its_threads_one_budget():
    cpu = ThreadLimits.for_device("cpu", 2)
    assert cpu.budget is not None and cpu.budget.share == CPU_SHARE
    assert ThreadLimits.for_device("cuda", 16).budget is None  # not paced beside a device


def test_a_large_elementwise_op_done_in_paced_slices_keeps_a_paced_thread_to_its_share_inside_it():
    assert [(s.start, s.stop) for s in paced_slices(10, 4)] == [(0, 4), (4, 8), (8, 10)]
    assert list(paced_slices(0)) == []
    clocks = _Clocks()
    ticks = []
    pacer = clocks.pacer(0.25)
    pacer.step = lambda step=pacer.step: (ticks.append(1), step())[1]  # count the pace points
    threads_pacer = intraop._local.__dict__.get("pacer")
    intraop._local.pacer = pacer
    try:
        for _ in paced_slices(8 * PACE_ELEMENTS):  # 8 slices, 10 ms of CPU each: past one burst
            clocks.work(0.01)
    finally:
        intraop._local.pacer = threads_pacer
    assert len(ticks) == 8 and sum(clocks.sleeps) > 0  # a pace point after every slice, and the bucket ran dry


class _PacePoints:
    """Counts the calling thread's pace points inside the block (a pacer that never sleeps)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> "_PacePoints":
        pacer = _Clocks().pacer(1.0)
        pacer.step = lambda: setattr(self, "count", self.count + 1)
        self._before, intraop._local.pacer = intraop._local.__dict__.get("pacer"), pacer
        return self

    def __exit__(self, *exc: object) -> None:
        intraop._local.pacer = self._before


def test_one_large_tensors_decode_hash_and_zstd_stop_at_pace_points_inside_it_with_the_one_shot_results():
    import hashlib

    import zstandard

    gen = torch.Generator().manual_seed(0)
    n = 5 * codecs.CHUNK_ELEMENTS + 11  # five chunks and a bit; an odd count: int4's last byte has a pad
    x = {"w": torch.randn(n, generator=gen)}
    for codec in ("int4", "int8"):
        blob = codecs.encode(x, codec, compress=True)
        opened = codecs.open_object(blob, max_bytes=1 << 30)
        (found, seg, spec, block), = codecs._segments(opened)
        scales, values = found._scales_and_values(seg, spec, block)
        whole = found._scaled(values, scales, spec, block)  # the one-pass arithmetic
        with _PacePoints() as points:
            got = codecs.decode_opened(opened)["w"]
        assert points.count >= 6, (codec, points.count)  # a pace point after each chunk
        assert torch.equal(got.view(torch.int32), whole.view(torch.int32)) and got.shape == (n,)
        assert torch.equal(codecs.tensor_decoders(opened, checked=True)["w"]().view(torch.int32),
                           whole.view(torch.int32))
    payload = bytearray(torch.randint(0, 16, (2 * intraop.PACE_BYTES + 5,), dtype=torch.uint8, generator=gen).numpy())
    with _PacePoints() as points:
        digest, frame = codecs._sha256_hex(payload), codecs._compressed(payload)
    assert points.count == 6  # three parts for each
    assert digest == hashlib.sha256(payload).hexdigest()
    assert frame == zstandard.ZstdCompressor(level=codecs.ZSTD_LEVEL).compress(payload)
    assert codecs._compressed(bytearray()) == zstandard.ZstdCompressor(level=codecs.ZSTD_LEVEL).compress(b"")


def test_the_uploaders_delta_in_paced_slices_has_the_bits_of_one_subtraction():
    from diloco.workers.transfer import UploadJob

    class Ready:
        def __init__(self, values: dict) -> None:
            self.values = values

        def wait(self) -> dict:
            return self.values

    gen = torch.Generator().manual_seed(0)
    anchor = {"w": torch.randn(3 * PACE_ELEMENTS + 7, generator=gen), "b": torch.randn(5, 3, generator=gen)}
    local = {n: (t + torch.randn(t.shape, generator=gen)).to(torch.bfloat16) for n, t in anchor.items()}
    later = {n: t + 0.5 for n, t in anchor.items()}
    job = UploadJob(fragment=0, delta={}, base_version=0, tokens=1, steps=1, step_time_s=0.1,
                    pending=[(Ready(anchor), Ready(local)), (Ready(later), Ready(anchor))])
    delta = job.settle()
    for n in anchor:
        want = (anchor[n].float() - local[n]).add_(later[n]).sub_(anchor[n])
        assert delta[n].dtype == torch.float32 and delta[n].shape == anchor[n].shape
        assert torch.equal(delta[n], want)


def test_a_thread_that_was_idle_earns_one_burst_not_its_whole_idle_time():
    clocks = _Clocks()
    pacer = clocks.pacer(0.5)
    clocks.wall += 3600.0  # an hour idle
    pacer.step()
    clocks.work(0.5)
    pacer.step()
    assert pacer.slept_s == pytest.approx((0.5 - BURST_S) / 0.5)
    with pytest.raises(ValueError, match="share"):
        Pacer(0.0)


def test_on_the_cpu_the_transfers_are_paced_on_one_thread_and_beside_a_gpu_not_at_all():
    assert LearnerConfig().transfer_share == 0.0  # chosen for the device
    assert transfer_share(0.0, "cpu") == CPU_SHARE and transfer_share(0.0, "cuda") == 1.0
    assert transfer_share(0.5, "cuda") == 0.5 and transfer_share(1.0, "cpu") == 1.0  # a setting is kept
    assert ThreadLimits.for_device("cpu", 16) == ThreadLimits(threads=1, nice=0, share=CPU_SHARE)
    assert ThreadLimits.for_device("cpu", 16, share=1.0) == ThreadLimits(threads=None, nice=0, share=1.0)
    assert ThreadLimits.for_device("cpu", 16, threads=3) == ThreadLimits(threads=3, nice=0, share=CPU_SHARE)
    assert ThreadLimits.for_device("cuda", 16) == ThreadLimits(threads=4, nice=10, share=1.0)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="transfer_share"):
            LearnerConfig(transfer_share=bad)
        with pytest.raises(ConfigError, match="transfer_share"):
            ThreadLimits.for_device("cpu", 16, share=bad)


def test_a_paced_thread_encodes_the_same_bytes_and_sleeps_for_its_share_where_an_unpaced_one_does_not():
    x = {"w": torch.randn(1 << 25, generator=torch.Generator().manual_seed(0))}  # 32M values: ~0.15 s of int4
    made: dict[str, tuple[bytes, float | None]] = {}
    used: dict[str, float] = {}

    def body(name: str, limits: ThreadLimits) -> None:
        pacer = limits.apply()
        wall, cpu = time.monotonic(), time.thread_time()
        blob = codecs.encode(x, "int4", compress=True)
        for _ in range(2):  # about 0.45 s of CPU in all: its share's sleep far above the first 50 ms
            assert codecs.encode(x, "int4", compress=True) == blob
        used[name] = (time.thread_time() - cpu) / (time.monotonic() - wall)
        made[name] = (blob, None if pacer is None else pacer.slept_s)

    for name, limits in (("paced", ThreadLimits(threads=1, share=0.5)), ("free", ThreadLimits(threads=1))):
        t = threading.Thread(target=body, args=(name, limits))
        t.start()
        t.join()
    assert made["paced"][0] == made["free"][0]
    assert made["free"][1] is None
    # It slept about the encodes' CPU time beyond the first 50 ms, again; unless another process
    # held the CPU so much that the thread got no more than its share of it anyway. (One encode of
    # 0.15 s slept 42 ms once, on a quiet machine: its last stretch's debt is paid at the next pace.)
    assert made["paced"][1] > 0.05 or used["paced"] < 0.6, (made["paced"][1], used)
    pace()  # this thread is not paced: a no-op


def test_work_inside_unpaced_is_not_paced_and_the_pacer_comes_back_after():
    seen: list[float] = []

    def body() -> None:
        pacer = ThreadLimits(threads=1, share=0.5).apply()
        with unpaced():
            codecs.encode({"w": torch.ones(1 << 24)}, "int4", compress=True)
            pace()
        seen.append(pacer.slept_s)
        codecs.encode({"w": torch.ones(1 << 25)}, "int4", compress=True)
        seen.append(pacer.slept_s)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen[0] == 0.0 and seen[1] > 0.0


def test_a_stopped_pacer_never_sleeps_again():
    clocks = _Clocks()
    pacer = clocks.pacer(0.25)
    pacer.stop()  # a learner leaving: its final pieces go out as fast as they can
    clocks.work(1.0)
    pacer.step()
    assert clocks.sleeps == [] and pacer.slept_s == 0.0
