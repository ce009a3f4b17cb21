"""`diloco demo`: a whole run on the embedded local stack, with a learner killed midway, vs a baseline.

M learner processes (one of them markedly slower) and a coordinator process train the built-in
model through a real Redis and a real S3 server. Midway one learner is SIGKILLed and restarted;
it rejoins from the latest global versions. At the end the same token budget is spent on a
single-replica AdamW baseline, and both eval losses are printed next to the entropy floor of the
synthetic language. `summary.json` in the output directory holds the figures, and `history/` the
run's whole history (an export), which `diloco replay --dir OUT/history` re-derives bit for bit.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diloco.coordinator.config import RunSettings
from diloco.infra.history.archive import export_run
from diloco.infra.history.task_model import global_model
from diloco.infra.local.fleet import Supervisor, diloco_command, learner_argv, process_env, wait_until
from diloco.infra.local.stack import LocalStack, aws_env
from diloco.storage.bus import Bus
from diloco.storage.objects import ObjectStore
from diloco.storage.settings import Endpoints, redact_url
from diloco.workers.tasks.base import train_baseline
from diloco.workers.tasks.demo import DemoTask

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    out: Path
    learners: int = 4
    """M: learner processes."""
    steps: int = 1000
    """Inner steps per learner; the baseline trains learners x steps steps on one replica. Below ~750 the
    model has not yet learnt to use its second token of context and DiLoCo lags the baseline."""
    slow_factor: float = 2.0
    """Step-time multiplier of the last learner."""
    kill_at: float = 0.5
    """Fraction of its steps after which learner 1 is SIGKILLed (then restarted)."""
    text: str | None = None
    """Train on this text file (byte level) instead of the synthetic language."""
    run: str = "demo"
    """Run id."""
    settings: RunSettings = field(default_factory=lambda: RunSettings(num_fragments=2, sync_every=30,
                                                                       overlap_steps=3, codec="int8"))
    min_quorum: int = 1
    """K: learners a round waits for before its grace window opens."""


def say(msg: str) -> None:
    print(msg, flush=True)


STATE_EVERY = 2
"""The demo's learners save their own state every 2 sends of fragment 0 (60 steps at H = 30): the
restarted learner resumes from the last one, retraining at most that many steps."""


def _learner_argv(cfg: DemoConfig, index: int, task_path: Path) -> list[str]:
    """Learner `index`'s command, the same for its restarts: it resumes from its saved state."""
    slowdown = cfg.slow_factor if index == cfg.learners - 1 else 1.0
    return learner_argv(cfg.run, f"learner-{index}", task_path, steps=cfg.steps, slowdown=slowdown,
                        data_seed=1000 * index, extra=("--state-every", str(STATE_EVERY)))


def run_demo(cfg: DemoConfig) -> dict:
    started = time.monotonic()
    for old in ("stack", "history"):  # a demo starts from scratch, not from the previous run's servers
        if (cfg.out / old).exists():
            shutil.rmtree(cfg.out / old)
    cfg.out.mkdir(parents=True, exist_ok=True)
    task = DemoTask(text_path=cfg.text) if cfg.text else DemoTask()
    task_path = cfg.out / "task.json"
    task_path.write_text(json.dumps(task.to_wire()))
    floor = task.entropy_floor()
    say(f"demo: {cfg.learners} learners x {cfg.steps} steps, learner-{cfg.learners - 1} {cfg.slow_factor}x slower, "
        f"learner-1 killed at {cfg.kill_at:.0%}; entropy floor "
        + (f"{floor:.4f} nats/token" if floor is not None else "unknown (text)"))
    with LocalStack(cfg.out / "stack") as stack, aws_env(stack.env()):  # its credentials for our own S3 reads
        endpoints = stack.start()
        say(f"stack: redis {redact_url(endpoints.redis_url)}, s3 {endpoints.s3_endpoint} bucket {endpoints.bucket}")
        s = cfg.settings
        with Supervisor(process_env(stack.env()), cfg.out / "logs") as fleet:
            fleet.add("coordinator", diloco_command(
                "coordinator", "--run", cfg.run, "--fragments", str(s.num_fragments), "--sync-every",
                str(s.sync_every), "--overlap-steps", str(s.overlap_steps), "--codec", s.codec, "--min-quorum",
                str(cfg.min_quorum)), service=True)
            for i in range(cfg.learners):
                fleet.add(f"learner-{i}", _learner_argv(cfg, i, task_path))
            _watch(cfg, endpoints, fleet, task_path)
            fleet.stop(["coordinator"])
        store = ObjectStore(endpoints)
        bus = Bus(endpoints, cfg.run)
        heads = bus.heads()
        counters = bus.counters()
        model = global_model(task, store, bus.keys, heads)
        eval_loss = task.eval_loss(model)
        exported = export_run(store, bus.keys, cfg.out / "history")
        say(exported.line("exported", f"into {cfg.out / 'history'}") + "; replay it with "
            f"`diloco replay --dir {cfg.out / 'history'}`")
    distributed_s = time.monotonic() - started
    say(f"decoupled DiLoCo: eval loss {eval_loss:.4f} after {sum(heads.values())} fragment versions "
        f"({distributed_s:.0f}s)")
    say(f"baseline: single-replica AdamW, {cfg.learners * cfg.steps} steps on the same token budget...")
    torch.set_num_threads(2)
    t0 = time.monotonic()
    curve = train_baseline(task, cfg.learners * cfg.steps, seed=0, eval_every=max(1, cfg.learners * cfg.steps // 4))
    baseline = curve[-1][1]
    for step, loss in curve:
        say(f"  baseline step {step}: eval {loss:.4f}")
    result = {
        "run": cfg.run,
        "eval_loss": eval_loss,
        "baseline_eval_loss": baseline,
        "ratio_to_baseline": eval_loss / baseline,
        "entropy_floor": floor,
        "versions_committed": counters.get("versions_committed", 0),
        "contributions_applied": counters.get("contributions_applied", 0),
        "contributions_refused": counters.get("contributions_refused", 0),
        "learner_restarts": fleet.restarts,
        "heads": {str(k): v for k, v in sorted(heads.items())},
        "tokens_per_learner_step": task.tokens_per_step(),
        "learners": cfg.learners,
        "steps_per_learner": cfg.steps,
        "distributed_wall_s": distributed_s,
        "baseline_wall_s": time.monotonic() - t0,
        "wall_s": time.monotonic() - started,
        "settings": asdict(cfg.settings),
        "history": str(cfg.out / "history"),
    }
    (cfg.out / "summary.json").write_text(json.dumps(result, indent=2))
    say(f"\nresult: DiLoCo eval {eval_loss:.4f} vs baseline {baseline:.4f} (ratio {eval_loss / baseline:.3f})"
        + (f", entropy floor {floor:.4f}" if floor is not None else "")
        + f"; {result['versions_committed']} versions, {result['contributions_applied']} contributions applied, "
        f"{result['contributions_refused']} refused, {result['learner_restarts']} restart(s); "
        f"{result['wall_s']:.0f}s. Summary in {cfg.out / 'summary.json'}")
    return result


def _watch(cfg: DemoConfig, endpoints: Endpoints, fleet: Supervisor, task_path: Path) -> None:
    """Print progress, kill learner 1 midway and restart it a second later, return when every learner
    has finished and the coordinator has ended the run (or 30 s later)."""
    bus = Bus(endpoints, cfg.run)
    learners = [f"learner-{i}" for i in range(cfg.learners)]
    victim, killed = 1 % cfg.learners, False
    victim_name = learners[victim]
    last_print = 0.0
    while fleet.busy(learners):
        time.sleep(0.5)
        fleet.check()  # the coordinator must not exit, a learner must finish with 0
        stats = bus.learner_stats()
        if not killed and victim_name in stats and stats[victim_name].step >= cfg.kill_at * cfg.steps:
            done = stats[victim_name].step
            fleet.kill(victim_name, back_in_s=1.0, argv=_learner_argv(cfg, victim, task_path))
            say(f"!! SIGKILL {victim_name} at step {done}; restarting it: it resumes from its last saved "
                "state (optimizer, schedule, data position, step)")
            killed = True
        if time.monotonic() - last_print > 3.0:
            last_print = time.monotonic()
            heads = bus.heads()
            parts = [f"{n}: step {s.step} loss {s.loss:.3f}"
                     for n, s in sorted(stats.items())]
            say(f"versions {dict(sorted(heads.items()))} | " + " | ".join(parts))
    # Every learner has finished: the coordinator merges their final pieces and ends the run.
    wait_until(lambda: bus.run_end() is not None, 30.0, tick_s=0.5)
    end = bus.run_end()
    say(f"run finished: final versions {dict(enumerate(end.versions))}" if end else
        "the coordinator did not end the run within 30s of the last learner: taking the heads as they are")
