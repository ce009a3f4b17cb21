"""`diloco bench scale`: a GPT-2-small-sized model (124M parameters) through the whole system.

The model is `transformers.GPT2LMHeadModel` in GPT-2 small's shape (12 blocks of width 768, 12
heads, the 50257-token vocabulary; the context is `--seq-len`, so the position table is smaller
than GPT-2's 1024), trained by the gpt2 task's loop (AdamW, cosine schedule) on its synthetic
language, a few steps per learner: enough rounds of every fragment to measure the per-round and
per-step costs, not to train. M learner processes and a coordinator process on the local stack,
P fragments, H steps between two sends of a fragment, the run's codec (updates downstream too).

Measured, per learner:
- wall time per step, and the step hook's share of it (`sync_s`: what the training loop waits for);
- CPU per step of the learner process (from /proc, from its first step on: joining is not counted)
  against a plain training loop of the same model,
  optimizer and steps in a process of its own (`baseline`): the difference is what the system costs
  the learner's cores (snapshot, delta, encode, error feedback, hash, compress, PUT; GET, decode,
  apply, verify; heartbeats); the transfer threads' own CPU (`background_cpu_s`) is the part
  counted inside them;
- peak resident memory (VmHWM) against the baseline's: the learner's memory overhead;
- bytes up and down (heartbeats), and the size of a contribution, an update and a params object.
Per coordinator (`--shards K`: K processes, each merging its share of the fragments): peak
resident memory, CPU per committed version, and the wall time of each publish (its log's
`committed fragment F version V ... in X s`). The learners' takes (`adopted`) say whether the
coordinators keep up: a learner takes a fragment's version only once its piece is merged.

Not measured here: a GPU (none on these machines), objects above the 5 GB single-PUT limit (a
fragment of this model is ~125 MB; multipart is tested with a lowered threshold).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from diloco.coordinator.config import RunSettings
from diloco.infra.bench.trial import add_out_arguments, bench_stack, positive_int
from diloco.infra.local.fleet import Supervisor, diloco_command, learner_argv, process_env, wait_until
from diloco.infra.output import figures_table, human_bytes
from diloco.storage.bus import Bus
from diloco.storage.history import list_versions, read_layout, read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore

log = logging.getLogger(__name__)

NAME = "scale"
HELP = ("a 124M-parameter GPT-2 through the whole system: step hook and CPU per step, memory, coordinator "
        "time per round, bytes each way")

_PUBLISHED = re.compile(r"committed fragment (\d+) version (\d+) from (\d+) contribution\(s\) in ([0-9.]+)s")
_TICK = os.sysconf("SC_CLK_TCK")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_arguments(parser, "scale")
    parser.add_argument("--learners", type=int, default=2, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="inner steps per learner (default: %(default)s)")
    parser.add_argument("--sync-every", type=int, default=4, help="H (default: %(default)s)")
    parser.add_argument("--fragments", type=int, default=4, help="P (default: %(default)s)")
    parser.add_argument("--codec", default=RunSettings().codec, help="the run's codec (default: the run default, %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step (default: %(default)s)")
    parser.add_argument("--n-layer", type=int, default=12, help="blocks (default: %(default)s, GPT-2 small)")
    parser.add_argument("--n-embd", type=int, default=768, help="width (default: %(default)s, GPT-2 small)")
    parser.add_argument("--n-head", type=int, default=12, help="attention heads (default: %(default)s)")
    parser.add_argument("--hold-state", action=argparse.BooleanOptionalAction, default=True,
                        help="the coordinator's --hold-state (default: on, the coordinator's default); "
                             "--no-hold-state: one fragment in its memory at a time")
    parser.add_argument("--shards", type=positive_int, default=1,
                        help="coordinator processes, each merging its share of the fragments (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the learners' parameters (default: %(default)s); the global model is float32. "
                             "About 1B parameters: --n-layer 18 --n-embd 2048 --n-head 16 --dtype bfloat16")


def scale_task(args: argparse.Namespace):  # noqa: ANN201 (a GPT2Task)
    from diloco.workers.tasks.gpt2 import GPT2Task

    return GPT2Task(vocab_size=50257, order=1, branching=3, n_layer=args.n_layer, n_embd=args.n_embd,
                    n_head=args.n_head, dtype=args.dtype,
                    seq_len=args.seq_len, batch_size=args.batch_size, eval_tokens=args.seq_len, warmup_steps=2)


@dataclass
class Usage:
    """A process's peak resident memory and CPU time, as last sampled from /proc."""

    peak_rss: int = 0
    peak_at: float = 0.0
    """When the peak was reached (unix time of the sample that first saw it): set against the
    process's log, it says which phase holds the most memory."""
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the sampler started, resident bytes) at every sample: the memory over the run."""
    cpu_s: float = 0.0
    joined_cpu_s: float | None = None
    """A learner's CPU time when its heartbeat first showed a step: joining (genesis, first download)
    is not part of the per-step figures."""
    joined_step: int = 0


class Sampler(threading.Thread):
    """Samples VmHWM and utime + stime of the fleet's processes every `every_s` until stopped: the
    last sample before a process exits is its figure."""

    def __init__(self, fleet: Supervisor, names: list[str], steps, every_s: float = 0.25) -> None:  # noqa: ANN001
        super().__init__(name="sampler", daemon=True)
        self.fleet, self.names, self.every_s = fleet, names, every_s
        self.steps = steps
        """() -> {learner: step} from the heartbeats."""
        self.usage: dict[str, Usage] = {name: Usage() for name in names}
        self.stop = threading.Event()
        self.started = time.time()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        try:
            steps = self.steps()
        except Exception:  # noqa: BLE001 (Redis busy: the next sample)
            steps = {}
        for name in self.names:
            proc = self.fleet.proc(name)
            if proc is None or proc.pid <= 0:
                continue
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                stat = Path(f"/proc/{proc.pid}/stat").read_text()
            except OSError:
                continue  # exited: the last sample stands
            hwm, rss = re.search(r"VmHWM:\s+(\d+) kB", status), re.search(r"VmRSS:\s+(\d+) kB", status)
            fields = stat.rsplit(")", 1)[1].split()
            usage = self.usage[name]
            now = time.time()
            if hwm and int(hwm.group(1)) * 1024 > usage.peak_rss:
                usage.peak_rss, usage.peak_at = int(hwm.group(1)) * 1024, now
            if rss:
                usage.rss.append((round(now - self.started, 2), int(rss.group(1)) * 1024))
            usage.cpu_s = max(usage.cpu_s, (int(fields[11]) + int(fields[12])) / _TICK)  # utime, stime
            if usage.joined_cpu_s is None and steps.get(name, 0) >= 1:
                usage.joined_cpu_s, usage.joined_step = usage.cpu_s, steps[name]


@dataclass
class Baseline:
    steps: int
    wall_s: float
    cpu_s: float
    peak_rss: int


def baseline(task_path: Path, steps: int) -> Baseline:
    """A plain training loop of the task (no diloco) in a process of its own, one torch thread as a
    learner has: its wall and CPU time for `steps` steps (after one warm-up step) and peak memory."""
    out = subprocess.run([sys.executable, "-m", "diloco.infra.bench.scale", "--baseline-child", str(task_path),
                          str(steps)], capture_output=True, text=True, timeout=3600, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return Baseline(steps, got["wall_s"], got["cpu_s"], got["peak_rss"])


def _baseline_child(task_path: str, steps: int) -> None:
    import torch

    from diloco.workers.tasks.base import train_step
    from diloco.workers.tasks.kinds import load_task

    torch.set_num_threads(1)
    task = load_task(Path(task_path))
    model = task.make_model(0)
    optimizer = task.make_inner_optimizer(model)
    schedule = task.make_lr_schedule(optimizer, steps + 1)
    batches = task.train_batches(0)
    train_step(task, model, optimizer, schedule, next(batches))  # warm-up: optimizer state allocated
    wall, cpu = time.monotonic(), time.process_time()
    for _ in range(steps):
        train_step(task, model, optimizer, schedule, next(batches))
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_rss": peak}))


@dataclass
class ScaleResult:
    params: int
    fragments: int
    learners: int
    steps: int
    codec: str
    baseline: Baseline
    learner_stats: dict[str, dict]
    usage: dict[str, Usage]
    publish_s: dict[str, list[float]]
    """Coordinator (one per shard) -> the wall time of each of its publishes."""
    versions: int
    sizes: dict[str, int] = field(default_factory=dict)
    """Mean bytes of a contribution, an update and a params object (one fragment)."""
    wall_s: float = 0.0
    started_at: float = 0.0
    """When the fleet started (unix time)."""

    def table(self) -> str:
        b = self.baseline
        rows = [["plain loop (baseline)", b.wall_s / b.steps, None, b.cpu_s / b.steps, None, None,
                 human_bytes(b.peak_rss), None, None, None]]
        for name, s in sorted(self.learner_stats.items()):
            steps = max(1, int(s.get("step", 0)))
            u = self.usage.get(name, Usage())
            cpu = (u.cpu_s - u.joined_cpu_s) / max(1, steps - u.joined_step) if u.joined_cpu_s is not None else None
            rows.append([name, s.get("wall_s", 0.0) / steps, s.get("sync_s", 0.0) / steps, cpu,
                         None if cpu is None else cpu - b.cpu_s / b.steps, s.get("background_cpu_s", 0.0) / steps,
                         human_bytes(u.peak_rss), human_bytes(u.peak_rss - b.peak_rss),
                         human_bytes(int(s.get("bytes_uploaded", 0))), human_bytes(int(s.get("bytes_downloaded", 0)))])
        head = (f"scale: {self.params:,} parameters, P = {self.fragments}, M = {self.learners}, "
                f"{self.steps} steps per learner, {self.codec} both ways; a contribution "
                f"{human_bytes(self.sizes.get('contribution', 0))}, an update {human_bytes(self.sizes.get('update', 0))}, "
                f"a params object {human_bytes(self.sizes.get('params', 0))} (one fragment)")
        tails = []
        for name, publish in sorted(self.publish_s.items()):
            coord, publish = self.usage.get(name, Usage()), sorted(publish)
            tails.append(f"{name}: {len(publish)} versions committed (version 0 of its fragments included), publish {_mean(publish):.2f} s mean / "
                         f"{publish[-1] if publish else 0:.2f} s max, {coord.cpu_s / max(1, len(publish)):.2f} CPU s "
                         f"per version (start-up and genesis included), peak memory {human_bytes(coord.peak_rss)}"
                         + (f" (reached {coord.peak_at - self.started_at:.0f} s after the start)" if coord.peak_at else ""))
        takes = ", ".join(f"{name} took {int(s.get('adopted', 0))} versions in {int(s.get('step', 0))} steps"
                          for name, s in sorted(self.learner_stats.items()))
        return "\n".join([head, figures_table(["process", "wall s/step", "hook s/step", "CPU s/step", "CPU overhead",
                                               "transfer threads CPU", "peak memory", "memory overhead", "up",
                                               "down"], rows), *tails, takes])

    def to_json(self) -> dict:
        return {"bench": NAME, "params": self.params, "fragments": self.fragments, "learners": self.learners,
                "steps": self.steps, "codec": self.codec, "wall_s": self.wall_s,
                "baseline": self.baseline.__dict__, "learner_stats": self.learner_stats,
                "usage": {k: v.__dict__ for k, v in self.usage.items()}, "publish_s": self.publish_s,
                "versions": self.versions, "sizes": self.sizes, "started_at": self.started_at}


def coordinator_names(shards: int) -> list[str]:
    """The coordinator processes' names: "coordinator" alone, else one per shard."""
    return ["coordinator"] if shards == 1 else [f"coordinator-{k}" for k in range(shards)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def run(args: argparse.Namespace) -> ScaleResult:
    task = scale_task(args)
    import torch

    with torch.device("meta"):  # counted without building it
        params = sum(p.numel() for p in task.make_model(0).parameters())
    args.out.mkdir(parents=True, exist_ok=True)
    task_path = args.out / "task.json"
    task_path.write_text(json.dumps(task.to_wire()))
    log.info("scale: %s parameters; baseline loop first", f"{params:,}")
    base = baseline(task_path, args.steps)
    run_id = f"scale-{int(time.time())}"
    names = [f"learner-{i}" for i in range(args.learners)]
    coordinators = coordinator_names(args.shards)
    with bench_stack(args.out, keep=args.keep_stack) as stack:
        started, started_at = time.monotonic(), time.time()
        with Supervisor(process_env(stack.env()), args.out / "logs") as fleet:
            for shard, coordinator in enumerate(coordinators):
                fleet.add(coordinator, diloco_command(
                    "coordinator", "--run", run_id, "--fragments", str(args.fragments), "--sync-every",
                    str(args.sync_every), "--overlap-steps", "1", "--codec", args.codec, "--cadence", "steps",
                    "--min-quorum", str(args.learners), "--max-grace-s", "30", "--shards", str(args.shards),
                    "--shard", str(shard), *([] if args.hold_state else ["--no-hold-state"])), service=True)
            for i, name in enumerate(names):
                # A large model's last pieces take a while to encode and upload on one thread.
                fleet.add(name, learner_argv(run_id, name, task_path, steps=args.steps, data_seed=i,
                                             extra=["--close-timeout-s", "600"]))
            bus = Bus(stack.endpoints, run_id)
            sampler = Sampler(fleet, [*coordinators, *names],
                              lambda: {k: v.step for k, v in bus.learner_stats().items()})
            sampler.start()
            try:
                while fleet.busy(names):
                    time.sleep(0.2)
                    fleet.check()
                wait_until(lambda: bus.run_end() is not None, 120.0)
                sampler.sample()
                stats = {k: dataclasses.asdict(v) for k, v in bus.learner_stats().items()}
            finally:
                sampler.stop.set()
                fleet.stop(names, timeout_s=10)
                fleet.stop(coordinators)
        wall_s = time.monotonic() - started
        store, keys = ObjectStore(stack.endpoints), RunKeys(stack.endpoints.prefix, run_id)
        layout = read_layout(store, keys)
        manifests = [read_manifest(store, keys, f, v) for f in range(len(layout.fragments))
                     for v in list_versions(store, keys, f)[1:]] if layout else []
        contributions = [n for _, n in store.list_sizes(keys.deltas_prefix())]
    publish = {name: [float(m.group(4)) for m in _PUBLISHED.finditer((args.out / "logs" / f"{name}.log").read_text())]
               for name in coordinators}
    sizes = {"contribution": int(_mean(contributions)),
             "update": int(_mean([m.update_bytes for m in manifests])),
             "params": int(_mean([m.params_bytes for m in manifests]))}
    return ScaleResult(params, args.fragments, args.learners, args.steps, args.codec, base, stats,
                       sampler.usage, publish, len(manifests), sizes, wall_s, started_at)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--baseline-child":
    _baseline_child(sys.argv[2], int(sys.argv[3]))
