"""The quality benchmark's tasks: which task each name trains, and its budget.

Every task has fixed seeds and a floor (the best eval loss any model can reach). Budgets are sized
so that one arm (4 learners x `steps` on a 2-core machine) takes about 3 minutes or less; `steps`
is a multiple of `sync_every` so that no arm has steps left unsynced at the end (except the demo's
1000 steps with H = 30, kept as the benchmark has always measured it).

- demo: the demo's TinyGPT on its order-2 Markov language (vocab 32), AdamW with warmup, constant lr.
- fast: the same architecture on a harder language (vocab 64, 8 successors per context) at 3x the
  learning rate, a short warmup and no decay, over a short budget: the model is still learning fast
  (its loss falling steeply) when the budget ends.
- gpt2: an unmodified Hugging Face GPT-2 (3 blocks, 96 wide, ~350k parameters, tied embeddings) with
  AdamW (weight decay 0.1) and `get_cosine_schedule_with_warmup` to 0, on a peaky order-2 language.
- vision: a small CNN on noise images labelled by a random teacher CNN with label noise, SGD with
  Nesterov momentum and weight decay, warmup and cosine to 0; the floor is the exact Bayes loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.demo.task import DemoTask
from workers.tasks.base import Task
from workers.tasks.gpt2 import GPT2Task
from workers.tasks.vision import VisionTask


@dataclass(frozen=True, slots=True)
class BenchTask:
    task: Task
    steps: int
    """Inner steps per learner (the baseline trains learners x steps)."""
    sync_every: int
    """H of every DiLoCo arm."""


TASKS: dict[str, BenchTask] = {
    "demo": BenchTask(DemoTask(), steps=1000, sync_every=30),
    "fast": BenchTask(DemoTask(vocab_size=64, branching=8, language_seed=3, lr=1e-2, warmup_steps=10,
                               eval_tokens=16_384), steps=400, sync_every=20),
    "gpt2": BenchTask(GPT2Task(), steps=600, sync_every=30),
    "vision": BenchTask(VisionTask(batch_size=128, eval_samples=2048), steps=1500, sync_every=50),
}


def pick(names: str) -> dict[str, BenchTask]:
    """The tasks a comma-separated list names ('all' for every one), in TASKS order. Raises SystemExit."""
    wanted = list(TASKS) if names.strip() == "all" else [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(TASKS))
    if unknown or not wanted:
        raise SystemExit(f"unknown task(s) {unknown}: choose from {', '.join(TASKS)} or all")
    return {name: TASKS[name] for name in TASKS if name in wanted}
