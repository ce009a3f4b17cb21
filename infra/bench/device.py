"""`diloco bench device`: what the Learner's step hook costs a training loop, on whatever device torch has.

One process trains a GPT-2-small-shaped model (`transformers.GPT2LMHeadModel`, 12 blocks of width
768, the 50257-token vocabulary: 124M parameters; random init and random tokens, AdamW, bf16
autocast on a GPU) from the same initial weights: as a plain loop, then through a `Learner` of a
run served by a coordinator process on a local stack (or the stack the environment names, as
every other command reads it: DILOCO_REDIS_URL, DILOCO_S3_BUCKET...). The run has every default
(P, H, tau, codec, cadence) unless a flag changes it; one learner, so the coordinator's quorum is 1.
The coordinator and the local stack's servers run at nice 19 (their scheduling groups too): in a
deployment they have machines of their own. On the CPU they also get CPUs of their own
(`--helpers-cpus`, default 1 of at least 2): pinned to the last CPUs, while both arms' loops (and
the Learner's threads) run on the others; the coordinator's merges and the servers' hashing and
writes of whole versions would otherwise take cores and memory bandwidth from the very loop measured.

Each arm runs `--warmup` steps (a Learner arm then trains on until it has taken as many versions
as there are fragments, so that the timed window is the steady state with merges in it), then
`--steps` timed steps, each ended by waiting for the device
(`torch.cuda.synchronize()`, as a loop that logs `loss.item()` every step does: every host-side
stall in the hook shows); on a GPU it then runs `--steps` more without that wait, timed as a block
(a loop that never waits for the device hides the hook behind the device's queue). Printed per arm:
mean, median, p90 and max step, the worst step over the median, the steps over 1.5x the median, and
the process's page faults per step (`Arm.page_faults`), where the slow steps' time went (the loop's
own CPU, the process's other threads', or neither: `Arm.where_slow`), and for the Learner the hook's own time,
the versions taken in the timed window (and how many came ready from the fetcher's thread), and the
transfer threads' CPU per step. The verdict holds the Learner's synchronized mean to within 5% of
the plain loop's on the CPU and 2% on a GPU, and no step over 1.5x the median, and gives the plain
loop's own worst step beside it: where that breaks the goal too, the machine stalls by itself. The
plain loop runs again after the Learner arms (`--plain-after`): the Learner is held to both plain
runs' steps pooled, and the verdict says how far apart they were: the machine's drift over the bench
(a VM's plain loop has moved by 10% between runs of it), not the hook's cost.
`--transfer-threads 0,1,16` runs one Learner arm per value of `LearnerConfig.transfer_threads`,
each a run of its own; `--transfer-nice` and `--transfer-share` the same per pair of values of
`LearnerConfig.transfer_nice` and `transfer_share` (default: the learner's choice for the device,
then on the CPU the setting a GPU gets: GPU_NICE, not paced).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from diloco.coordinator.config import RunSettings
from diloco.infra.bench.trial import add_out_arguments, bench_stack
from diloco.infra.options import whole_numbers
from diloco.infra.output import figures_table
from diloco.storage.errors import ConfigError
from diloco.storage.intraop import usable_cpu_ids
from diloco.storage.settings import ENV_REDIS_URL, Endpoints
from diloco.workers.threads import CPU_SHARE, GPU_NICE

log = logging.getLogger(__name__)
T = TypeVar("T")

NAME = "device"
HELP = "the step hook's cost to a training loop (124M GPT-2 shape) on a GPU or the CPU, against a plain loop"

SPIKE = 1.5
"""A step longer than this many medians is a stall."""

PLAIN = "plain"
"""The plain loop's arms: "plain", then "plain after" (`--plain-after`)."""

SLOW = 1.25
"""Steps over this many times the median are the slow ones `Arm.where_slow` accounts for (below
SPIKE, so that a plain loop's own have a few)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RunSettings()
    add_out_arguments(parser, "device")
    parser.add_argument("--device", default="auto", help="torch device: auto (cuda if available, else cpu), cuda, cpu...")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per arm (default: 200 on a GPU, 110 on the CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 20 on a GPU, 10 on the CPU)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 16 on a GPU, 1 on the CPU)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 256 on a GPU, 64 on the CPU)")
    parser.add_argument("--n-layer", type=int, default=12, help="blocks (default: %(default)s, GPT-2 small)")
    parser.add_argument("--fragments", type=int, default=defaults.num_fragments, help="P (default: the run's, %(default)s)")
    parser.add_argument("--sync-every", type=int, default=defaults.sync_every, help="H (default: the run's, %(default)s)")
    parser.add_argument("--codec", default=defaults.codec, help="the run's codec (default: the run's, %(default)s)")
    parser.add_argument("--helpers-nice", type=int, default=19,
                        help="nice value of the coordinator and the local stack's servers and of their scheduling "
                             "groups, so that the figures are the learner's (default: %(default)s; 0: left as they are)")
    parser.add_argument("--helpers-cpus", type=int, default=None,
                        help="CPUs of their own for the coordinator and the local stack's servers, pinned to the last "
                             "ones; the loop (both arms) runs on the others (default: 1 on the CPU with at least 2 CPUs, "
                             "0 on a GPU; 0: no pinning)")
    parser.add_argument("--settle-s", type=float, default=300.0,
                        help="before timing a Learner arm, train on (untimed) until it has taken as many versions as "
                             "there are fragments, at most this long (default: %(default)s)")
    parser.add_argument("--plain-after", action=argparse.BooleanOptionalAction, default=True,
                        help="time the plain loop again after the Learner arms; the Learner is then held to the mean "
                             "of both plain runs, so that the machine's drift over the bench (a VM's neighbours, its "
                             "memory returned to the host) shows as the plain runs' spread, not as the hook's cost "
                             "(default: %(default)s)")
    parser.add_argument("--transfer-threads", default="0",
                        help="one Learner arm per comma-separated value of LearnerConfig.transfer_threads (default: "
                             "%(default)s, the learner's default: a quarter of the CPUs beside a GPU, one on the CPU "
                             "where the transfers are paced); the verdict is the first arm's")
    parser.add_argument("--transfer-nice", default=None,
                        help="one Learner arm per comma-separated value of LearnerConfig.transfer_nice (-1: the "
                             "learner's default, chosen for the device: its loop's priority on the CPU, %d below it "
                             "beside a GPU) (default: -1 on a GPU; -1,%d on the CPU, so that the CPU proxy also times "
                             "the GPU's setting, not paced); the verdict is the first arm's" % (GPU_NICE, GPU_NICE))
    parser.add_argument("--transfer-share", default=None,
                        help="one Learner arm per comma-separated value of LearnerConfig.transfer_share, for each "
                             "--transfer-nice (0: the learner's default, chosen for the device: %g of a CPU on the "
                             "CPU, not paced beside a GPU; 1: not paced) (default: 0)" % CPU_SHARE)


@dataclass
class Arm:
    name: str
    steps_s: list[float]
    unsynced_s: float | None = None
    """Mean step of the block run without waiting for the device (GPU only)."""
    hook_s: float = 0.0
    hook_steps_s: list[float] = field(default_factory=list)
    """The Learner's step hook's share of each timed step."""
    step_marks: list[str] = field(default_factory=list)
    """What the Learner did during each timed step (`MARKS`, comma-separated; "" for none)."""
    helpers_busy: list[float] = field(default_factory=list)
    """The share of the coordinator's and the servers' CPUs that was busy during each timed step
    (empty without CPUs of their own): on a machine whose cores share memory bandwidth and caches,
    the coordinator's merge and publish slow the loop beside them, where a deployment runs it elsewhere."""
    phases: dict = field(default_factory=dict)
    """The hook's phases (`Learner.hook_phases`): name -> [total s, longest s], over the whole arm."""
    taken: int = 0
    taken_ready: int = 0
    transfer_cpu_s: float = 0.0
    transfer_phases: dict[str, float] = field(default_factory=dict)
    """`transfer_cpu_s` by what the transfer threads did (`Learner.transfer_cpu_phases`)."""
    process_cpu_s: float = 0.0
    paced_s: float = 0.0
    """Seconds the transfer threads slept to keep to their CPU share (`Learner.transfer_paced_s`)."""
    sent: int = 0
    coalesced: int = 0
    """Sends in the timed window that found the fragment's previous piece not yet uploaded (absorbed into it)."""
    settle_steps: int = 0
    """Untimed steps after the warmup until the Learner had taken as many versions as there are fragments."""
    loop_cpu_s: list[float] = field(default_factory=list)
    """CPU seconds the loop's own thread spent in each timed step: a step much longer than its CPU
    time waited (for the CPU, taken by the process's other threads, `others_cpu_s`, or by the machine)."""
    others_cpu_s: list[float] = field(default_factory=list)
    """CPU seconds the process's other threads (the Learner's) spent during each timed step."""
    step_faults: list[int] = field(default_factory=list)
    """The process's minor page faults during each timed step."""
    threads_cpu_s: list[dict[str, float]] = field(default_factory=list)
    """`others_cpu_s` by thread ("uploader-<learner>", "fetcher", "stager", "state-saver"...; `_thread_kind`),
    each timed step."""
    page_faults: int = 0
    """Minor page faults of this process over the timed window (every thread's; Linux `ru_minflt`): pages
    the kernel faulted in and zeroed for fresh allocations. On a CPU each step's large tensors, freed
    and mapped again, come to hundreds of thousands, and how long a fault takes is the machine's."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.steps_s)

    @property
    def median(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def p90(self) -> float:
        return statistics.quantiles(self.steps_s, n=10)[-1] if len(self.steps_s) > 1 else self.steps_s[0]

    @property
    def worst(self) -> float:
        """The longest step over the median."""
        return max(self.steps_s) / self.median

    @property
    def spikes(self) -> int:
        return sum(1 for s in self.steps_s if s > SPIKE * self.median)

    def summary(self, plain: Arm) -> str:
        """One line of the arm's figures, logged as soon as it is done."""
        line = (f"{self.name}: mean {1e3 * self.mean:.2f} ms ({self.mean / plain.mean:.3f}x plain), median "
                f"{1e3 * self.median:.2f}, max {1e3 * max(self.steps_s):.1f} ({self.worst:.2f}x), "
                f"{self.spikes} steps > {SPIKE}x median")
        if self.unsynced_s is not None and plain.unsynced_s:
            line += f"; unsynced {1e3 * self.unsynced_s:.2f} ms ({self.unsynced_s / plain.unsynced_s:.3f}x)"
        if not self.name.startswith(PLAIN):
            line += (f"; hook {1e3 * self.hook_s / len(self.steps_s):.2f} ms/step, taken {self.taken_ready}/{self.taken} "
                     f"ready, {self.settle_steps} settling steps")
        return line

    def where_slow(self, over: float = SLOW) -> str:
        """Where the time of the steps over `over` x the median went, beside a median step's: the loop
        thread's own CPU, the process's other threads' CPU, and the rest, when the loop's CPU (one
        thread on a CPU of its own) was taken by neither: waits inside the process or the machine's
        (its kernel threads, its hypervisor). "" without per-step CPU figures."""
        if not self.loop_cpu_s:
            return ""
        slow = [i for i, s in enumerate(self.steps_s) if s > over * self.median]
        if not slow:
            return f"no step over {over}x the median"
        mid = statistics.median
        typical = [mid(self.steps_s), mid(self.loop_cpu_s), mid(self.others_cpu_s), mid(self.step_faults)]

        def excess(values: list[float], base: float) -> float:
            return statistics.fmean(values[i] for i in slow) - base

        wall, own, others = (1e3 * excess(v, b) for v, b in zip((self.steps_s, self.loop_cpu_s, self.others_cpu_s),
                                                              typical))
        faults = excess(self.step_faults, typical[3])
        by_thread = ""
        if self.threads_cpu_s:
            kinds = sorted({k for i in slow for k in self.threads_cpu_s[i]})
            spent = {k: 1e3 * statistics.fmean(self.threads_cpu_s[i].get(k, 0.0) for i in slow) for k in kinds}
            named = [f"{k} {v:.0f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.5]
            by_thread = f" (in those steps, ms: {', '.join(named)})" if named else ""
        return (f"the {len(slow)} steps over {over}x the median, on average {wall:+.0f} ms beside a median step "
                f"({1e3 * typical[0]:.0f} ms, of which {1e3 * typical[1]:.0f} on the loop's CPU and "
                f"{1e3 * typical[2]:.0f} the other threads'): the loop's CPU {own:+.0f} ms, the other threads' "
                f"{others:+.0f}{by_thread}, neither {wall - own - others:+.0f}; page faults {faults:+.0f}")

    def details(self) -> str:
        """A Learner arm's slow steps with their hook share, its sends, and the hook's phases."""
        marks = self.step_marks or [""] * len(self.steps_s)
        busy = self.helpers_busy or [None] * len(self.steps_s)
        slow = [(i, s, h, _with_busy(m, b))
                for i, (s, h, m, b) in enumerate(zip(self.steps_s, self.hook_steps_s, marks, busy))
                if s > SPIKE * self.median]
        lines = [f"timed from {self.settle_steps} steps after the warmup (the first takes); {self.sent} pieces "
                 f"uploaded and {self.taken} versions taken in the timed window, {self.coalesced} sends absorbed "
                 f"into a queued one"]
        if slow:
            lines.append("slow steps (#index: ms, of which in the hook; what the Learner did meanwhile): "
                         + ", ".join(f"#{i}: {1e3 * s:.0f} ({1e3 * h:.0f}{'; ' + m if m else ''})"
                                     for i, s, h, m in slow))
        if (where := self.where_slow()):
            lines.append(where)
        if self.transfer_phases:
            n = len(self.steps_s)
            lines.append("transfer threads' CPU a step (ms): " + ", ".join(
                f"{k} {1e3 * v / n:.1f}" for k, v in sorted(self.transfer_phases.items(), key=lambda kv: -kv[1])))
        if self.helpers_busy:
            loaded = [s for s, b in zip(self.steps_s, self.helpers_busy) if b >= HELPERS_BUSY]
            quiet = [s for s, b in zip(self.steps_s, self.helpers_busy) if b < HELPERS_BUSY]
            if loaded and quiet:
                lines.append(f"steps while the coordinator's and servers' CPUs were at least {HELPERS_BUSY:.0%} busy: "
                             f"{len(loaded)}, mean {1e3 * statistics.fmean(loaded):.0f} ms, max "
                             f"{max(loaded) / self.median:.2f}x the median; the other {len(quiet)}: mean "
                             f"{1e3 * statistics.fmean(quiet):.0f} ms, max {max(quiet) / self.median:.2f}x")
        if self.paced_s:
            lines.append(f"transfer threads paced to their CPU share: slept {self.paced_s:.2f} s in the timed window")
        if self.phases:
            lines.append("hook phases over the arm (total / longest ms): "
                         + ", ".join(f"{k} {1e3 * v[0]:.0f} / {1e3 * v[1]:.0f}" for k, v in sorted(self.phases.items())))
        return "\n  ".join(lines)


@dataclass
class DeviceResult:
    device: str
    device_name: str
    params: int
    settings: dict
    arms: list[Arm] = field(default_factory=list)

    @property
    def plain_arms(self) -> list[Arm]:
        """The plain loop's runs: before the Learner arms, and after them unless `--no-plain-after`."""
        return [a for a in self.arms if a.name.startswith(PLAIN)]

    @property
    def learner_arms(self) -> list[Arm]:
        return [a for a in self.arms if not a.name.startswith(PLAIN)]

    @property
    def reference(self) -> Arm:
        """The plain loop every ratio is against: its one run, or its runs before and after the
        Learner arms pooled (their steps together, so a mean of the two means)."""
        runs = self.plain_arms
        if len(runs) == 1:
            return runs[0]
        return Arm(PLAIN, [s for a in runs for s in a.steps_s],
                   unsynced_s=None if any(a.unsynced_s is None for a in runs)
                   else statistics.fmean(a.unsynced_s for a in runs))

    def table(self) -> str:
        plain = self.reference
        rows = []
        for arm in self.arms:
            n = len(arm.steps_s)
            rows.append([arm.name, 1e3 * arm.mean, 1e3 * arm.median, 1e3 * arm.p90, 1e3 * max(arm.steps_s),
                         arm.worst, arm.spikes, arm.mean / plain.mean,
                         None if arm.unsynced_s is None else 1e3 * arm.unsynced_s,
                         None if arm.unsynced_s is None or plain.unsynced_s is None else arm.unsynced_s / plain.unsynced_s,
                         1e3 * arm.hook_s / n if arm in self.learner_arms else None,
                         f"{arm.taken_ready}/{arm.taken}" if arm in self.learner_arms else None,
                         1e3 * arm.transfer_cpu_s / n if arm in self.learner_arms else None, arm.page_faults // n])
        head = (f"{self.device_name}: {self.params / 1e6:.1f}M parameters, "
                + ", ".join(f"{k} {v}" for k, v in self.settings.items()))
        table = figures_table(["arm", "mean ms", "median ms", "p90 ms", "max ms", "max/median",
                               f"steps > {SPIKE}x median", "mean ratio", "unsynced ms", "unsynced ratio",
                               "hook ms/step", "taken (ready)", "transfer CPU ms/step", "page faults/step"], rows)
        for run in self.plain_arms:
            if (where := run.where_slow()):
                table += f"\n{run.name}: {where}"
        for learner in self.learner_arms:
            table += f"\n{learner.name}: " + learner.details()
        learner = self.learner_arms[0]
        goal = 0.02 if self.device != "cpu" else 0.05
        ratio = learner.mean / plain.mean
        worst = learner.worst
        if not learner.taken:
            verdict = "no version taken in the timed window: merges not measured (more --steps, or --settle-s)\n"
        else:
            verdict = ""
        runs = self.plain_arms
        own = max(runs, key=lambda a: a.worst)
        verdict += (f"mean {100 * (ratio - 1):+.1f}% against the plain loop ({self._drift(runs)}goal within "
                    f"{100 * goal:.0f}%: {'met' if ratio <= 1 + goal else 'NOT met'}); worst step {worst:.2f}x the "
                    f"median (goal <= {SPIKE}: {'met' if worst <= SPIKE else 'NOT met'}; the plain loop's own: "
                    f"{own.worst:.2f}x{self._noise(own)})")
        return f"{head}\n{table}\n{verdict}"

    @staticmethod
    def _drift(runs: list[Arm]) -> str:
        """The plain runs before and after the Learner arms, when both were timed: how far apart the
        machine put them."""
        if len(runs) < 2:
            return ""
        before, after = runs[0].mean, runs[-1].mean
        return (f"its runs before and after: {1e3 * before:.0f} and {1e3 * after:.0f} ms, "
                f"{100 * (after / before - 1):+.1f}%; ")

    @staticmethod
    def _noise(plain: Arm) -> str:
        """Said when the plain loop alone breaks the worst-step goal: this machine's own stalls, which
        the Learner's steps have too and no hook can remove."""
        return (f", {plain.spikes} of its steps over {SPIKE}x: the machine's own stalls, beyond what the goal "
                "can tell apart") if plain.spikes else ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _pick_device(name: str):  # noqa: ANN202 (torch.device)
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cpu":
        module = torch.get_device_module(device)
        if not module.is_available():
            raise ConfigError(f"--device {name}: torch sees no such device here (torch {torch.__version__})")
    return device


def _model(n_layer: int, seq_len: int, device):  # noqa: ANN001, ANN202
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=seq_len, n_embd=768, n_layer=n_layer, n_head=12)
    return GPT2LMHeadModel(config).to(device)


class Loop:
    """The training loop both arms run: random tokens, AdamW, bf16 autocast on a GPU."""

    def __init__(self, args: argparse.Namespace, device, helpers: Sequence[int] = ()) -> None:  # noqa: ANN001
        import torch

        self.device, self.args = device, args
        self.helpers = tuple(helpers)
        """The CPUs of the coordinator and the servers, whose load beside each step `timed` measures."""
        self.model = _model(args.n_layer, args.seq_len, device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        self.generator = torch.Generator(device=device).manual_seed(1)
        self.sync = torch.get_device_module(device).synchronize if device.type != "cpu" else (lambda: None)

    def step(self) -> None:
        import torch

        tokens = torch.randint(0, 50257, (self.args.batch_size, self.args.seq_len), device=self.device,
                               generator=self.generator)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type != "cpu"):
            loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, name: str, steps: int, learner=None) -> Arm:  # noqa: ANN001
        """An arm of `steps` timed steps, with each one's figures (the per-step fields of `Arm`;
        `helpers_busy` from `busy_ticks`, empty without helper CPUs)."""
        arm = Arm(name, [])
        ticks = busy_ticks(self.helpers)
        for _ in range(steps):
            hook0 = learner.sync_s if learner is not None else 0.0
            seen = _marks(learner)
            faults0, cpu0, own0, threads0 = _page_faults(), time.process_time(), time.thread_time(), _threads_cpu()
            t0 = time.perf_counter()
            self.step()
            self.sync()
            arm.steps_s.append(time.perf_counter() - t0)
            own = time.thread_time() - own0
            arm.loop_cpu_s.append(own)
            arm.others_cpu_s.append(max(0.0, time.process_time() - cpu0 - own))
            arm.step_faults.append(_page_faults() - faults0)
            threads = _threads_cpu()
            arm.threads_cpu_s.append({k: v - threads0.get(k, 0.0) for k, v in threads.items() if v > threads0.get(k, 0.0)})
            arm.hook_steps_s.append(learner.sync_s - hook0 if learner is not None else 0.0)
            arm.step_marks.append(",".join(n for n, a, b in zip(MARKS, seen, _marks(learner)) if a != b))
            if ticks is not None and (now := busy_ticks(self.helpers)) is not None:
                arm.helpers_busy.append(min(1.0, (now - ticks) / (_TICKS_PER_S * len(self.helpers) * arm.steps_s[-1])))
                ticks = now
        return arm

    def unsynced(self, steps: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        return (time.perf_counter() - t0) / steps


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_ticks(cpus: Sequence[int]) -> int | None:
    """The clock ticks `cpus` have spent busy since boot (/proc/stat: all but idle and iowait), summed;
    None without CPUs or where /proc/stat cannot be read (not Linux)."""
    if not cpus:
        return None
    wanted, total = {f"cpu{c}" for c in cpus}, 0
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if name in wanted:
                    values = [int(v) for v in fields[:8]]
                    total += sum(values) - values[3] - values[4]
    except (OSError, ValueError, IndexError):
        return None
    return total


MARKS = ("take", "sent", "uploaded", "download", "fetched", "saved")
"""What a Learner did during a step, named beside its slow steps: a version taken (in the hook), a
piece queued (in the hook), a piece stored and announced, bytes read from S3, a version fetched,
its state saved (the last four on its threads)."""


HELPERS_BUSY = 0.5
"""A step during which the helpers' CPUs were at least this busy is counted apart in `Arm.details`."""


def _with_busy(marks: str, busy: float | None) -> str:
    """A slow step's marks with the helpers' load during it."""
    if busy is None:
        return marks
    return ", ".join(m for m in (marks, f"helpers {busy:.0%} busy") if m)


def _marks(learner) -> tuple:  # noqa: ANN001
    if learner is None:
        return ()
    stats, saver = learner.stats, learner.keeper.saver
    return (learner.adopted, tuple(f.sent_id for f in learner.fragments), stats.uploaded + stats.coalesced, learner.store.bytes_read,
            stats.fetched, saver.saved if saver is not None else 0)


def _arm(name: str, loop: Loop, args: argparse.Namespace, learner=None) -> Arm:  # noqa: ANN001
    for _ in range(args.warmup):
        loop.step()
    settle = 0
    if learner is not None:
        # The timed window is the steady state: every fragment sent, merged and taken once already
        # (the first rounds wait for the round clock and the coordinator's first publishes).
        until = time.monotonic() + args.settle_s
        while learner.adopted < args.fragments and time.monotonic() < until:
            loop.step()
            settle += 1
    loop.sync()
    hook0 = learner.sync_s if learner else 0.0
    taken0 = (learner.adopted, learner.taken_staged) if learner else (0, 0)
    cpu0, transfer0 = time.process_time(), learner.transfer_cpu_s if learner else 0.0
    phases0 = learner.transfer_cpu_phases if learner else {}
    paced0 = learner.transfer_paced_s if learner else 0.0
    sent0 = (learner.stats.uploaded, learner.stats.coalesced) if learner else (0, 0)
    faults0 = _page_faults()
    arm = loop.timed(name, args.steps, learner)
    arm.process_cpu_s, arm.settle_steps, arm.page_faults = time.process_time() - cpu0, settle, _page_faults() - faults0
    if learner is not None:
        arm.hook_s = learner.sync_s - hook0
        arm.taken, arm.taken_ready = learner.adopted - taken0[0], learner.taken_staged - taken0[1]
        arm.transfer_cpu_s = learner.transfer_cpu_s - transfer0
        arm.transfer_phases = {k: v - phases0.get(k, 0.0) for k, v in learner.transfer_cpu_phases.items()}
        arm.paced_s = learner.transfer_paced_s - paced0
        arm.sent, arm.coalesced = learner.stats.uploaded - sent0[0], learner.stats.coalesced - sent0[1]
    if loop.device.type != "cpu":
        arm.unsynced_s = loop.unsynced(args.steps)
    if learner is not None:
        arm.phases = {k: list(v) for k, v in learner.hook_phases.items()}
    return arm


def run(args: argparse.Namespace) -> DeviceResult:
    import torch

    from diloco.infra.local.fleet import Supervisor, process_env
    from diloco.workers.learner import LearnerConfig

    device = _pick_device(args.device)
    gpu = device.type != "cpu"
    # On the CPU a step of this model takes seconds: a smaller batch, and enough steps past the
    # first sends (at H) to see every fragment sent and taken about twice.
    args.steps = args.steps or (200 if gpu else 110)
    args.warmup = args.warmup if args.warmup is not None else (20 if gpu else 10)
    args.batch_size = args.batch_size or (16 if gpu else 1)
    args.seq_len = args.seq_len or (256 if gpu else 64)
    helpers = _helper_cpus(args.helpers_cpus, gpu)
    if helpers:
        loop_cpus = sorted(set(usable_cpu_ids()) - set(helpers))
        _pin(os.getpid(), loop_cpus)
        torch.set_num_threads(len(loop_cpus))
        log.info("the loop on CPUs %s, the coordinator and the servers on %s", loop_cpus, helpers)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} ({torch.get_num_threads()} threads)"
    settings = {"P": args.fragments, "H": args.sync_every, "codec": args.codec, "batch": args.batch_size,
                "seq": args.seq_len, "steps": args.steps, "warmup": args.warmup, "helper CPUs": len(helpers),
                "torch": torch.__version__}

    loop = Loop(args, device, helpers)
    params = sum(p.numel() for p in loop.model.parameters())
    result = DeviceResult(device.type, name, params, settings)
    log.info("device: %s, %s parameters; the plain loop first", name, f"{params:,}")
    result.arms.append(_arm(PLAIN, loop, args))
    log.info("%s", result.arms[-1].summary(result.arms[0]))
    del loop
    if gpu:
        torch.get_device_module(device).empty_cache()

    threads = _thread_settings(args.transfer_threads)
    transfers = _transfer_settings(args.transfer_nice, args.transfer_share, gpu)
    with ExitStack() as stack:
        if os.environ.get(ENV_REDIS_URL):
            endpoints = Endpoints.from_env()
        else:
            local = stack.enter_context(bench_stack(args.out, keep=args.keep_stack))
            endpoints = local.endpoints
            # The storage servers too run elsewhere in a deployment: lowest priority here, as the coordinator.
            for server in (local.redis_server, local.s3_server):
                if server is not None and server.pid > 0:
                    _lowest_priority(server.pid, args.helpers_nice)
                    _pin(server.pid, helpers)
        fleet = stack.enter_context(Supervisor(process_env(endpoints.to_env() | _credentials()), args.out / "logs"))
        for n, (nice, share) in [(n, t) for t in transfers for n in threads]:
            name = " ".join(["learner"] + [f"t={n}"] * (len(threads) > 1) + [f"nice={nice}"] * (nice >= 0)
                            + [f"share={share:g}"] * (share > 0))
            result.arms.append(_learner_arm(name, args, device, endpoints, fleet,
                                            LearnerConfig(transfer_threads=n, transfer_nice=nice, transfer_share=share),
                                            helpers, result.arms[0]))
            if gpu:
                torch.get_device_module(device).empty_cache()
    if args.plain_after:
        log.info("the plain loop again, after the Learner arms")
        result.arms.append(_arm(f"{PLAIN} after", Loop(args, device, helpers), args))
        log.info("%s", result.arms[-1].summary(result.arms[0]))
    return result


def _thread_settings(text: str) -> list[int]:
    values = whole_numbers(text, "--transfer-threads")
    if not values or min(values) < 0:
        raise ConfigError(f"--transfer-threads takes numbers >= 0 (0: the learner's default), got {text!r}")
    return values


def _transfer_settings(nices: str | None, shares: str | None, gpu: bool) -> list[tuple[int, float]]:
    """The Learner arms' (`transfer_nice`, `transfer_share`): every pair of the values asked (each
    list the learner's default, chosen for the device, where not given); with neither given, the
    default, and on the CPU also the GPU's setting (GPU_NICE, not paced), so that the CPU proxy also
    times what a GPU's loop gets beside its transfer threads."""
    from diloco.workers.learner import LearnerConfig

    if nices is None and shares is None:
        return [(-1, 0.0)] if gpu else [(-1, 0.0), (GPU_NICE, 1.0)]
    pairs = [(nice, share) for nice in _values(nices, "--transfer-nice", whole_numbers, [-1])
             for share in _values(shares, "--transfer-share", _fractions, [0.0])]
    for nice, share in pairs:
        try:
            LearnerConfig(transfer_nice=nice, transfer_share=share)  # the learner's own checks of the ranges
        except ConfigError as exc:
            raise ConfigError(f"--transfer-nice {nices} --transfer-share {shares}: {exc}") from None
    return pairs


def _values(text: str | None, option: str, parse: Callable[[str, str], list[T]], default: list[T]) -> list[T]:
    if text is None:
        return default
    values = parse(text, option)
    if not values:
        raise ConfigError(f"{option} takes at least one value, got {text!r}")
    return values


def _fractions(text: str, option: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated numbers, got {text!r}") from None


def _learner_arm(name: str, args: argparse.Namespace, device, endpoints: Endpoints, fleet,  # noqa: ANN001
                 config, helpers: list[int], plain: Arm) -> Arm:  # noqa: ANN001
    """One Learner arm: a run of its own, served by a coordinator started for it. Its figures are
    logged as soon as it is done, before the coordinator's end is waited for (a run cut short
    still tells them)."""
    from diloco.infra.local.fleet import diloco_command, wait_until
    from diloco.storage.bus import Bus
    from diloco.workers.learner import Learner

    run_id = f"device-{int(time.time() * 1000)}"
    coordinator = f"coordinator-{run_id}"
    # The coordinator runs elsewhere in a deployment; here it shares the learner's host, so it
    # runs at the lowest priority: the figures are the learner's.
    member = fleet.add(coordinator, diloco_command(
        "coordinator", "--run", run_id, "--fragments", str(args.fragments), "--sync-every", str(args.sync_every),
        "--codec", args.codec, "--min-quorum", "1"), service=True)
    _lowest_priority(member.proc.pid, args.helpers_nice)
    _pin(member.proc.pid, helpers)  # while it starts: the threads it starts later inherit the CPUs
    loop = Loop(args, device, helpers)
    learner = Learner(loop.model, loop.optimizer, run=run_id, endpoints=endpoints, learner_id="device",
                      tokens_per_step=args.batch_size * args.seq_len, config=config)
    with learner:
        arm = _arm(name, loop, args, learner)
    log.info("%s\n  %s", arm.summary(plain), arm.details())
    bus = Bus(endpoints, run_id)
    wait_until(lambda: bus.run_end() is not None, 60.0)
    fleet.stop([coordinator])
    return arm


def _thread_kind(name: str) -> str:
    """A thread's name, a pool's workers under one: "fetch_3" -> "fetch", "stager" -> "stager"."""
    head, _, tail = name.rpartition("_")
    return head if head and tail.isdigit() else name


def _threads_cpu() -> dict[str, float]:
    """CPU seconds so far of every thread of this process but the calling one, summed by kind
    (`_thread_kind`; each thread's CPU clock, Linux and most Unixes; {} elsewhere)."""
    totals: dict[str, float] = {}
    me = threading.get_ident()
    for thread in threading.enumerate():
        if thread.ident is None or thread.ident == me:
            continue
        try:
            spent = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):  # not supported here, or the thread just ended
            continue
        kind = _thread_kind(thread.name)
        totals[kind] = totals.get(kind, 0.0) + spent
    return totals


def _page_faults() -> int:
    """This process's minor page faults so far (0 where `resource` has none: not Unix)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _lowest_priority(pid: int, nice: int) -> None:
    """`nice` for process `pid` and for its session's scheduling group: started in a session of its
    own (as the fleet and the stack start theirs), a process on Linux with autogroups enabled gets a
    share of the CPU equal to this one's whatever its nice value, unless its group's is raised too."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        group = Path(f"/proc/{pid}/autogroup")
        if group.exists():
            group.write_text(str(nice))
    except OSError as exc:  # not Linux, or not allowed: the figures then include their share
        log.warning("could not lower the priority of process %d: %s", pid, exc)


def _helper_cpus(asked: int | None, gpu: bool) -> list[int]:
    """The CPUs the helpers get (the last `asked`; default: 1 on the CPU with at least 2, none on a GPU)."""
    cpus = usable_cpu_ids()
    count = asked if asked is not None else (0 if gpu or len(cpus) < 2 else 1)
    if count < 0 or (count and count >= len(cpus)):
        raise ConfigError(f"--helpers-cpus {count}: this process may use {len(cpus)} CPUs, the loop needs one")
    return cpus[len(cpus) - count:] if count else []


def _pin(pid: int, cpus: list[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit their starter's)."""
    if not cpus:
        return
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = [pid]
    for tid in tasks:
        try:
            os.sched_setaffinity(tid, cpus)
        except (AttributeError, OSError) as exc:  # gone, not Linux or not allowed: the figures then share the CPUs
            log.warning("could not pin thread %d of process %d to CPUs %s: %s", tid, pid, cpus, exc)


def _credentials() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
