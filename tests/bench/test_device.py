"""`diloco bench device`: the verdict it prints, and (make test-slow) a whole small run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from diloco.infra.bench import device
from diloco.infra.bench.device import Arm, DeviceResult, _transfer_settings, _thread_settings
from diloco.storage.errors import ConfigError


def _result(device: str, plain: list[float], learner: list[float], hooks: list[float],
            marks: list[str] | None = None) -> DeviceResult:
    result = DeviceResult(device, device, 124_000_000, {"P": 4, "H": 50})
    result.arms = [Arm("plain", plain), Arm("learner", learner, hook_steps_s=hooks, taken=2, taken_ready=2,
                                           phases={"send": [0.01, 0.004]}, step_marks=marks or [])]
    return result


def test_each_value_of_transfer_threads_is_an_arm_of_its_own():
    assert _thread_settings("0,1,16") == [0, 1, 16]
    for bad in ("", "a", "-1", "1,,2"):
        with pytest.raises(ConfigError):
            _thread_settings(bad)


def test_the_cpu_run_also_times_the_transfer_threads_as_beside_a_gpu_and_a_gpu_its_default_alone():
    assert _transfer_settings(None, None, gpu=False) == [(-1, 0.0), (10, 1.0)]  # the GPU's: nice 10, not paced
    assert _transfer_settings(None, None, gpu=True) == [(-1, 0.0)]
    assert _transfer_settings("0,19", None, gpu=False) == [(0, 0.0), (19, 0.0)]
    assert _transfer_settings(None, "0,1", gpu=False) == [(-1, 0.0), (-1, 1.0)]
    assert _transfer_settings("0", "0.5,1", gpu=True) == [(0, 0.5), (0, 1.0)]
    for nices, shares in (("", None), ("20", None), ("-2", None), ("a", None), (None, ""), (None, "1.5"),
                          (None, "-0.1"), (None, "x"), (None, "nan")):
        with pytest.raises(ConfigError):
            _transfer_settings(nices, shares, gpu=False)


def test_the_verdict_holds_the_mean_to_2_percent_on_a_gpu_and_5_on_the_cpu_and_names_each_slow_step():
    plain = [1.0] * 20
    learner = [1.03] * 19 + [1.6]  # mean +6%, one step 1.55x the median
    gpu = _result("cuda", plain, learner, [0.0] * 19 + [0.25], [""] * 19 + ["download,saved"]).table()
    assert "goal within 2%: NOT met" in gpu and "goal <= 1.5: NOT met" in gpu
    assert ("slow steps (#index: ms, of which in the hook; what the Learner did meanwhile): "
            "#19: 1600 (250; download,saved)") in gpu
    assert "hook phases over the arm (total / longest ms): send 10 / 4" in gpu
    calm = [1.02] * 20
    cpu = _result("cpu", plain, calm, [0.0] * 20).table()
    assert "mean +2.0%" in cpu and "goal within 5%: met" in cpu and "goal <= 1.5: met" in cpu
    assert "slow steps" not in cpu and "no version taken" not in cpu
    idle = _result("cpu", plain, calm, [0.0] * 20)
    idle.arms[1].taken = idle.arms[1].taken_ready = 0
    assert "no version taken in the timed window: merges not measured" in idle.table()


def test_the_learner_is_held_to_the_plain_runs_before_and_after_it_pooled_and_their_drift_is_said():
    result = _result("cpu", [1.0] * 20, [1.1] * 20, [0.0] * 20)
    result.arms.append(Arm("plain after", [1.2] * 20))
    table = result.table()
    assert "mean +0.0% against the plain loop (its runs before and after: 1000 and 1200 ms, +20.0%; goal" in table
    rows = {line[:11].strip(): line[11:].split() for line in table.splitlines()[3:6]}
    assert rows["plain after"][0] == "1200" and rows["plain after"][6] == "1.091"  # its mean against the pooled 1.1 s
    assert rows["plain after"][10] == "-" and rows["learner"][10] == "2/2"  # a plain run has no takes
    result.arms[2].steps_s = [1.0] * 19 + [1.7]  # the stalls of the run after count as the plain loop's own
    assert "the plain loop's own: 1.70x, 1 of its steps over 1.5x" in result.table()
    one = _result("cpu", [1.0] * 20, [1.1] * 20, [0.0] * 20).table()
    assert "mean +10.0% against the plain loop (goal" in one  # --no-plain-after: its one run


def test_the_verdict_gives_the_plain_loops_own_worst_step_and_says_when_the_machine_alone_breaks_the_goal():
    calm = [1.0] * 20
    quiet = _result("cpu", calm, [1.01] * 20, [0.0] * 20).table()
    assert "the plain loop's own: 1.00x)" in quiet and "the machine's own stalls" not in quiet
    stalling = [1.0] * 18 + [1.74, 1.6]  # a plain loop with no Learner in it: 2 steps over 1.5x its median
    noisy = _result("cpu", stalling, [1.03] * 19 + [2.07], [0.0] * 20)
    noisy.arms[0].page_faults, noisy.arms[1].page_faults = 20 * 203_000, 20 * 210_000
    table = noisy.table()
    assert ("worst step 2.01x the median (goal <= 1.5: NOT met; the plain loop's own: 1.74x, 2 of its steps over "
            "1.5x: the machine's own stalls") in table
    header, _rule, plain_row, learner_row = table.splitlines()[1:5]
    assert header.split()[-1] == "faults/step" and plain_row.split()[-1] == "203000" and learner_row.split()[-1] == "210000"


def test_each_slow_step_says_how_busy_the_coordinators_cpus_were_and_steps_beside_a_busy_one_are_counted_apart():
    plain = [1.0] * 20
    learner = [1.0] * 16 + [1.2, 1.3, 1.7, 1.6]
    result = _result("cpu", plain, learner, [0.0] * 20, [""] * 18 + ["uploaded", ""])
    result.arms[1].helpers_busy = [0.05] * 16 + [0.9, 0.1, 0.95, 0.8]
    table = result.table()
    assert "#18: 1700 (0; uploaded, helpers 95% busy), #19: 1600 (0; helpers 80% busy)" in table
    assert ("steps while the coordinator's and servers' CPUs were at least 50% busy: 3, mean 1500 ms, max 1.70x "
            "the median; the other 17: mean 1018 ms, max 1.30x") in table


def test_the_slow_steps_time_is_split_into_the_loops_cpu_the_other_threads_and_what_neither_took():
    steps = [1.0] * 16 + [1.5, 1.4, 1.3, 1.6]
    arm = Arm("learner", steps, loop_cpu_s=[0.9] * 16 + [1.2, 0.9, 0.9, 0.9], others_cpu_s=[0.05] * 16 + [0.05, 0.35, 0.05, 0.05],
              step_faults=[100] * 16 + [100, 100, 100, 30_100],
              threads_cpu_s=[{"stager": 0.05}] * 16 + [{"stager": 0.05}, {"uploader": 0.3, "stager": 0.05}, {}, {"saver": 0.0001}])
    # Over 1.25x: the last four. Beside the median step (1000 ms; 900 on the loop's CPU, 50 the others'):
    # +450 ms on average, of which the loop +75 (its 300 in one step), the other threads +75, neither +300.
    assert arm.where_slow() == ("the 4 steps over 1.25x the median, on average +450 ms beside a median step (1000 ms, "
                                "of which 900 on the loop's CPU and 50 the other threads'): the loop's CPU +75 ms, "
                                "the other threads' +75 (in those steps, ms: uploader 75, stager 25), neither +300; page faults +7500")
    assert Arm("plain", [1.0] * 4, loop_cpu_s=[1.0] * 4, others_cpu_s=[0.0] * 4,
               step_faults=[0] * 4).where_slow() == "no step over 1.25x the median"
    assert Arm("old", steps).where_slow() == ""  # figures from before steps were split: nothing to say


def test_each_timed_step_records_the_loops_own_cpu_and_the_other_threads():
    import threading

    loop = object.__new__(device.Loop)
    loop.helpers, loop.sync = (), lambda: None
    spin = {"s": 0.05}

    def step() -> None:
        until = time.thread_time() + spin["s"]
        while time.thread_time() < until:
            pass

    loop.step = step
    alone = loop.timed("plain", 2)
    assert len(alone.loop_cpu_s) == len(alone.others_cpu_s) == len(alone.step_faults) == len(alone.steps_s) == 2
    assert min(alone.loop_cpu_s) >= 0.05 and max(alone.others_cpu_s) < 0.02
    busy = threading.Event()

    def beside() -> None:  # another thread of the process at work through the steps
        until = time.thread_time() + 0.3
        busy.set()
        while time.thread_time() < until:
            pass

    other = threading.Thread(target=beside, name="uploader-test")
    other.start()
    busy.wait(5)
    spin["s"] = 0.1
    shared = loop.timed("plain", 2)
    other.join()
    assert min(shared.loop_cpu_s) >= 0.1 and sum(shared.others_cpu_s) > 0.05
    assert sum(step.get("uploader-test", 0.0) for step in shared.threads_cpu_s) > 0.05  # named by its name
    assert device._thread_kind("fetch_3") == "fetch" and device._thread_kind("state-saver") == "state-saver"


def test_the_busy_ticks_of_a_cpu_grow_by_the_work_done_on_it_and_are_none_without_cpus():
    cpu = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # this thread works on `cpu` alone
    try:
        first = device.busy_ticks([cpu])
        assert first is not None and first >= 0
        spun = time.thread_time()
        while time.thread_time() - spun < 0.3:  # 0.3 s of CPU, all on `cpu`: 30 ticks at 100 Hz
            pass
        grown = device.busy_ticks([cpu]) - first
    finally:
        os.sched_setaffinity(0, allowed)
    assert grown >= 0.2 * os.sysconf("SC_CLK_TCK"), grown  # at least 0.2 s of it (ticks are counted coarsely)
    assert device.busy_ticks([]) is None
    assert device.busy_ticks([10_000]) == 0  # no such CPU: nothing counted


# About two and a half minutes: a stack, a coordinator and two arms of a small model. The coordinator
# keeps its priority and shares both cores: at nice 19 (and its scheduling group) beside a loop that
# fills both cores it barely ran, and alone on one core beside the servers it merged too slowly to see
# two takes in the window. 40 timed steps (about 40 s here): 16 saw 5 takes in one run on this machine
# and 1 in one CI run, where the learner's transfer threads, at the loop's priority on the CPU, held
# the coordinator back.
@pytest.mark.slow
def test_a_small_run_on_the_cpu_times_both_arms_in_the_steady_state_and_every_take_is_made_ready_off_the_loop(tmp_path):
    out = tmp_path / "device.json"
    done = subprocess.run([sys.executable, "-m", "diloco.infra.cli", "bench", "device", "--device", "cpu",
                           "--n-layer", "1", "--steps", "40", "--warmup", "1", "--seq-len", "16", "--batch-size", "1",
                           "--sync-every", "4", "--transfer-threads", "2", "--transfer-nice", "-1", "--helpers-nice", "0", "--helpers-cpus", "0",
                           "--out", str(tmp_path / "run"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    plain, learner, after = result["arms"]
    assert [plain["name"], learner["name"], after["name"]] == ["plain", "learner", "plain after"]
    assert len(plain["steps_s"]) == len(learner["steps_s"]) == len(learner["hook_steps_s"]) == len(after["steps_s"]) == 40
    # Timed once every fragment had been taken (the steady state); at H = 4 a fragment is sent every
    # 4 steps, before its round commits: the versions taken were made ready again after those sends.
    assert learner["sent"] >= 2 and learner["settle_steps"] >= 1
    assert learner["transfer_phases"]["encode"] > 0 and "transfer threads' CPU a step (ms): " in done.stdout + done.stderr
    # A take still waited for after takes.STAGE_WAIT_STEPS is computed by the hook (at H = 4 the next send
    # may come first); the deterministic same-step test holds every take there to the stager's value.
    assert learner["taken"] >= 2 and 2 * learner["taken_ready"] >= learner["taken"]
    assert "mean ratio" in done.stdout and "against the plain loop (its runs before and after: " in done.stdout
    assert "the plain loop's own: " in done.stdout and learner["page_faults"] > 0


def test_the_helpers_get_the_last_cpus_on_the_cpu_and_none_on_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(device, "usable_cpu_ids", lambda: [0, 1, 2, 3])
    assert device._helper_cpus(None, gpu=False) == [3]
    assert device._helper_cpus(None, gpu=True) == []
    assert device._helper_cpus(2, gpu=True) == [2, 3]
    assert device._helper_cpus(0, gpu=False) == []
    with pytest.raises(ConfigError, match="the loop needs one"):
        device._helper_cpus(4, gpu=False)
    monkeypatch.setattr(device, "usable_cpu_ids", lambda: [0])
    assert device._helper_cpus(None, gpu=False) == []  # one CPU: nothing to give away


def test_pinning_a_process_pins_every_thread_of_it() -> None:
    import os
    import threading

    cpus = sorted(os.sched_getaffinity(0))
    started, stop = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def worker() -> None:
        started.set()
        stop.wait(10)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(10)
    try:
        device._pin(os.getpid(), cpus[:1])
        assert os.sched_getaffinity(0) == set(cpus[:1])
    finally:
        stop.set()
        thread.join()
        device._pin(os.getpid(), cpus)
    assert seen == [set(cpus[:1])]  # a thread started before the pin is pinned too
