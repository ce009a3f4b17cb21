"""The transfer threads' CPU share (workers/threads.py): the count chosen per device, a cap that holds
for the thread that set it only, and a priority below the loop's for that thread only."""

import os
import threading

import pytest
import torch

from diloco.storage.errors import ConfigError
from diloco.workers.learner import LearnerConfig
from diloco.workers.threads import cap_this_thread, lower_this_thread, transfer_nice, transfer_threads


def test_beside_a_gpu_a_quarter_of_the_cpus_on_the_cpu_torchs_own():
    assert transfer_threads(0, "cuda", 16) == 4
    assert transfer_threads(0, "cuda", 2) == 1
    assert transfer_threads(0, "cpu", 16) is None
    assert transfer_threads(3, "cpu", 16) == 3
    assert transfer_threads(64, "cuda", 16) == 16  # never more threads than CPUs
    with pytest.raises(ValueError):
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
    with pytest.raises(ValueError):
        transfer_nice(-2, "cpu")
    LearnerConfig(transfer_nice=-1)
    with pytest.raises(ConfigError, match="transfer_nice"):
        LearnerConfig(transfer_nice=-2)
