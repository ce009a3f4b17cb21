"""How many CPU threads the learner's transfer threads may use, and capping one thread's share.

The uploader, the fetcher and the state saver encode, decode, hash and compress whole fragments
with torch ops, which run on torch's intra-op thread pool: by default as many threads as the
machine has cores, each pool belonging to the thread that started it. Beside a GPU that is the
wrong trade: the training loop's thread launches the kernels, and every core the transfers keep
busy is one it may be descheduled from. There they get a share of the cores
(`LearnerConfig.transfer_threads`). On a CPU learner the loop's own ops run on every core too, and
capping the transfers lengthens the loop's parallel sections instead (each waits for the thread
that shares its core with a transfer): there they keep torch's setting unless told otherwise.

The cap is the OpenMP thread count of the calling thread only (`storage.intraop.cap_this_thread`;
the coordinator's fetch threads use it too).

Beside a GPU the transfer threads also run at a lower priority than the loop
(`LearnerConfig.transfer_nice`: on Linux a thread has a nice value of its own, and the OpenMP
threads it starts inherit it): when they contend for a core, the loop wins. In a probe on 2 cores,
a loop of 2-thread matrix products beside a thread quantizing 31M floats ran 1.9-2.1x slower than
alone, 1.6x with that thread at nice 19, which kept 75-95% of its own throughput.

On the CPU they keep the loop's priority. There the loop's own ops are the work that keeps the
cores busy, and a lowered transfer thread waits behind them: every piece goes out later and every
version is made ready later, so a learner trains on longer from a version that lacks the others'
progress. In `diloco bench quality --tasks vision --at defaults` (4 learners on 2 cores) at nice 10
a learner took each version 12-16 steps after its send, at 0 5-8; the final eval was 1.6719 on
average (6 runs) against 1.6668 (7), waiting's 1.6611, in no more wall time. Lowering either side
alone (the uploader, or the fetcher and stager) halved the gain. The cost: a transfer thread at
nice 0 takes its share of a core while it runs, so a loop confined to one core has slower steps
then (`diloco bench device` on the CPU: worst step 1.91x the median, one run, against 1.3-1.5x).

So on the CPU their heavy work is paced instead (`LearnerConfig.transfer_share`,
`storage.intraop.pace_this_thread`): together they may take CPU_SHARE of a CPU over any stretch
longer than a burst of 50 ms (one `intraop.Budget` that a learner's threads spend from), each on one
intra-op thread (pacing counts the thread's own CPU time). Paced each to a share of its own, an
encode and a take at work together took twice it, and those were the slow steps (`diloco bench
device` splits a slow step's time by thread: docs/benchmarks.md). A piece of a
small model (the quality benchmark's: a few milliseconds) goes out as fast as before; a piece of
31M values (half a CPU second) takes four times as long to go out, and the loop it shares a core
with loses a quarter of that core over a few steps instead of half of it for one. A transfer thread's
average load must stay under its share: a 124M model at 1.6 s a step uses 4% of a CPU for its
transfers, and all its transfer threads' load together must stay under the one share.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field

from diloco.storage.errors import ConfigError
from diloco.storage.intraop import Budget, Pacer, cap_this_thread, pace_this_thread

log = logging.getLogger(__name__)

CPU_NICE, GPU_NICE = 0, 10
"""The transfer threads' nice value below the loop on the CPU and beside a GPU (`transfer_nice`)."""

GPU_SHARE = 4
"""Beside a GPU, the transfer threads each get 1 / GPU_SHARE of the CPUs (at least one)."""

CPU_SHARE = 0.25
"""On the CPU, the share of a CPU a learner's transfer threads' heavy work is paced to, between them
(`transfer_share`)."""

CHOSEN_THREADS = 0
CHOSEN_NICE = -1
CHOSEN_SHARE = 0.0
"""The transfer settings' values that mean "chosen for the device" (`LearnerConfig`'s defaults):
`transfer_threads`, `transfer_nice` and `transfer_share` below say what each chooses."""


def check_settings(threads: int, nice: int, share: float) -> None:
    """The transfer_* settings (`LearnerConfig`'s), each in its range, or ConfigError naming the
    one that is not."""
    _check_threads(threads)
    _check_nice(nice)
    _check_share(share)


def _check_threads(setting: int) -> None:
    if setting < 0:
        raise ConfigError(f"transfer_threads must be >= 0 (0: chosen for the device), got {setting}")


def _check_nice(setting: int) -> None:
    if not -1 <= setting <= 19:
        raise ConfigError(f"transfer_nice must be in 0..19 (or -1: chosen for the device), got {setting}")


def _check_share(setting: float) -> None:
    if not (math.isfinite(setting) and 0.0 <= setting <= 1.0):
        raise ConfigError(f"transfer_share must be in (0, 1] (or 0: chosen for the device), got {setting!r}")


def transfer_threads(setting: int, device_type: str, cpus: int) -> int | None:
    """The intra-op threads each transfer thread may use: `setting` when > 0 (at most `cpus`);
    0 (the default) means a quarter of `cpus` beside a device, torch's own (None) on the CPU."""
    _check_threads(setting)
    if setting != CHOSEN_THREADS:
        return min(setting, cpus)
    return None if device_type == "cpu" else max(1, cpus // GPU_SHARE)


def transfer_nice(setting: int, device_type: str) -> int:
    """How far below the loop's priority the transfer threads run: `setting` when >= 0; -1 (the
    default) means GPU_NICE beside a device, CPU_NICE on the CPU."""
    _check_nice(setting)
    if setting != CHOSEN_NICE:
        return setting
    return CPU_NICE if device_type == "cpu" else GPU_NICE


def transfer_share(setting: float, device_type: str) -> float:
    """The share of a CPU each transfer thread's heavy work is paced to: `setting` when > 0 (1: not
    paced); 0 (the default) means CPU_SHARE on the CPU, not paced beside a device (where the
    transfer threads have cores of their own, `transfer_threads`, and run below the loop)."""
    _check_share(setting)
    if setting != CHOSEN_SHARE:
        return setting
    return CPU_SHARE if device_type == "cpu" else 1.0


@dataclass(frozen=True, slots=True)
class ThreadLimits:
    """What one of the learner's transfer threads may take of the machine; the thread applies them
    to itself as it starts (`apply`)."""

    threads: int | None = None
    """Intra-op threads of its torch ops (None: torch's own count; `transfer_threads`)."""
    nice: int = 0
    """Steps below the loop's priority (`transfer_nice`)."""
    share: float = 1.0
    """Share of a CPU its heavy work is paced to (1: not paced; `transfer_share`)."""
    budget: Budget | None = field(default=None, compare=False)
    """The CPU time the threads given these limits spend together, `share` of a CPU between them
    (None: each thread its own share)."""

    @classmethod
    def for_device(cls, device_type: str, cpus: int, *, threads: int = CHOSEN_THREADS, nice: int = CHOSEN_NICE,
                   share: float = CHOSEN_SHARE) -> ThreadLimits:
        """The limits the settings (`LearnerConfig`'s transfer_*, 0 or -1: chosen) give on `device_type`."""
        paced = transfer_share(share, device_type)
        count = transfer_threads(threads, device_type, cpus)
        if paced < 1.0 and count is None:
            count = 1  # pacing counts the thread's own CPU time: its ops run on it alone
        return cls(count, transfer_nice(nice, device_type), paced, Budget(paced) if paced < 1.0 else None)

    def apply(self) -> Pacer | None:
        """Apply the limits to the calling thread; its pacer, None when it is not paced."""
        lower_this_thread(self.threads, self.nice)
        return pace_this_thread(self.share, self.budget)


def lower_this_thread(threads: int | None, nice: int = 0) -> bool:
    """Run the calling thread `nice` steps below its priority (Linux: this thread only; elsewhere
    not at all) and cap its torch ops' intra-op threads (`cap_this_thread`)."""
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except (AttributeError, OSError) as exc:  # not Linux, or not allowed
            log.debug("transfer thread keeps its priority: %s", exc)
    return cap_this_thread(threads)


_abandoned: list[threading.Thread] = []


def abandon(thread: threading.Thread) -> None:
    """`thread` outlived its deadline and is left running (an upload still encoding when the learner
    left): `lingering` names it to the process's exit."""
    _abandoned.append(thread)


def lingering() -> list[str]:
    """The abandoned threads still running. A process that lets the interpreter tear down under
    one inside a torch op aborts (SIGABRT) instead of exiting with its own code: `diloco`'s commands
    then leave at once (`infra.cli.run`)."""
    return [t.name for t in _abandoned if t.is_alive()]

