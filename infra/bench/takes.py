"""`diloco bench takes`: what a learner's take rule costs against waiting for every merge, in one
process, with no servers: the figures behind `--merge-rule` (docs/benchmarks.md, "the cost of
never waiting").

M replicas of a quality task (`--task`, default fast) train in this process, replica i on data
stream i, from the same initial weights. The model is cut into P fragments as a run cuts it
(`workers.fragments.plan_layout`); fragment f is sent every H steps at the learners' offsets
(`due_fragments`). A round is every replica's piece of that step (equal speeds, equal tokens: the
plain mean), merged with the outer step of the coordinator (Nesterov, `--outer-lr`,
`--outer-momentum`; fp32, no codec, a whole step per round), and each replica takes the new
version exactly k steps after its send (`--lags`), by the rule under test:

- wait: k = 0, the version taken at the send (learners that wait for each merge);
- rebase: the steps trained since the send are kept on top of the version (the default);
- adopt: local = the version; those steps are dropped and never sent;
- mix: local = alpha x local + (1 - alpha) x the version (`--alpha`).

Everything is deterministic: the same seeds give the same figures. Prints the global model's eval
loss at the end and at `--mid` of the budget, per rule and k.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from diloco.infra.bench.quality_tasks import TASKS
from diloco.infra.output import figures_table
from diloco.workers.fragments import due_fragments, model_params, plan_layout
from diloco.workers.tasks.base import Task, train_step

log = logging.getLogger(__name__)

NAME = "takes"
HELP = "in one process: the take rules (rebase, adopt, mix) k steps after each send, against waiting for every merge"
RULES = ("wait", "rebase", "adopt", "mix")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="fast", choices=list(TASKS), help="quality task (default: %(default)s)")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps per replica (default: %(default)s)")
    parser.add_argument("--sync-every", type=int, default=50, help="H (default: %(default)s)")
    parser.add_argument("--fragments", type=int, default=4, help="P (default: %(default)s)")
    parser.add_argument("--rules", default="wait,rebase,adopt", help=f"comma-separated subset of {','.join(RULES)}")
    parser.add_argument("--lags", default="5", help="comma-separated k: steps from a send to its take (default: 5)")
    parser.add_argument("--alpha", type=float, default=0.5, help="mix's alpha (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seeds start here (default: %(default)s)")
    parser.add_argument("--mid", type=float, default=0.6, help="also evaluate at this share of the budget")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)


@dataclass(frozen=True, slots=True)
class Setting:
    rule: str
    lag: int


@dataclass
class TakesResult:
    task: str
    rows: list[tuple[Setting, float, float]]
    """(rule and k, eval at the mid point, final eval)."""
    mid_step: int

    def table(self) -> str:
        head = f"takes: {self.task}, eval of the global model at step {self.mid_step} and at the end"
        rows = [[s.rule, s.lag, mid, final] for s, mid, final in self.rows]
        return "\n".join([head, figures_table(["rule", "k", f"step {self.mid_step}", "final"], rows)])

    def to_json(self) -> dict:
        return {"bench": NAME, "task": self.task, "mid_step": self.mid_step,
                "runs": [{"rule": s.rule, "k": s.lag, "mid": mid, "final": final} for s, mid, final in self.rows]}


class Replicas:
    """M replicas and the global model, fragment by fragment."""

    def __init__(self, task: Task, args: argparse.Namespace, setting: Setting) -> None:
        self.task, self.args, self.setting = task, args, setting
        models = [task.make_model(args.seed) for _ in range(args.learners)]
        self.models = models
        self.optimizers = [task.make_inner_optimizer(m) for m in models]
        self.schedules = [task.make_lr_schedule(o, args.steps) for o in self.optimizers]
        self.batches = [task.train_batches(args.seed + i) for i in range(args.learners)]
        layout = plan_layout(model_params(models[0]), args.fragments)
        self.names = [[p.name for p in fragment] for fragment in layout.fragments]
        params = [dict(m.named_parameters()) for m in models]
        self.params = params
        self.globals = {n: p.detach().clone() for n, p in params[0].items()}
        self.momentum = {n: torch.zeros_like(p) for n, p in self.globals.items()}
        self.anchors = [{n: p.detach().clone() for n, p in ps.items()} for ps in params]
        self.takes: dict[int, list[int]] = {}  # step -> fragments taken after it
        self.away: set[int] = set()
        """Replicas that are not in the run (`bench rejoin`): they send no piece and take no version, but
        the last piece of each fragment in `leaving` (the progress a preempted learner sends as it leaves)."""
        self.leaving: dict[int, set[int]] = {}

    @torch.no_grad()
    def send(self, fragment: int, step: int) -> None:
        """Every replica's piece of the fragment, merged into the next version; each takes it k steps later."""
        names = self.names[fragment]
        live = [i for i in range(len(self.models)) if i not in self.away or fragment in self.leaving.get(i, ())]
        for i in live:
            self.leaving.get(i, set()).discard(fragment)
        for n in names:
            delta = sum(self.anchors[i][n] - self.params[i][n] for i in live) / len(live)
            buf = self.momentum[n].mul_(self.args.outer_momentum).add_(delta)
            self.globals[n] -= self.args.outer_lr * (delta + self.args.outer_momentum * buf)
            for i in live:
                self.anchors[i][n] = self.params[i][n].detach().clone()  # what was sent: the next piece starts here
        self.takes.setdefault(step + self.setting.lag, []).append(fragment)

    @torch.no_grad()
    def take(self, fragment: int) -> None:
        rule, alpha = self.setting.rule, self.args.alpha
        for n in self.names[fragment]:
            g = self.globals[n]
            for i in (i for i in range(len(self.models)) if i not in self.away):
                p, anchor = self.params[i][n], self.anchors[i][n]
                if rule == "rebase":
                    p += g - anchor  # the steps since the send, on top of the version
                elif rule == "mix":
                    p.mul_(alpha).add_(g, alpha=1 - alpha)
                else:  # wait (k = 0) and adopt
                    p.copy_(g)
                self.anchors[i][n] = g.clone()  # the next piece is the progress from the version, as a learner sends it

    def eval_global(self) -> float:
        model = self.task.make_model(self.args.seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(self.globals[n])
        return self.task.eval_loss(model)


def run_setting(task: Task, args: argparse.Namespace, setting: Setting, mid_step: int) -> tuple[float, float]:
    fleet = Replicas(task, args, setting)
    mid = float("nan")
    for step in range(1, args.steps + 1):
        for i, model in enumerate(fleet.models):
            train_step(task, model, fleet.optimizers[i], fleet.schedules[i], next(fleet.batches[i]))
        for fragment in due_fragments(step, args.fragments, args.sync_every):
            fleet.send(fragment, step)
        for fragment in fleet.takes.pop(step, []):
            fleet.take(fragment)
        if step == mid_step:
            mid = fleet.eval_global()
    return mid, fleet.eval_global()


def run(args: argparse.Namespace) -> TakesResult:
    torch.set_num_threads(1)
    task = TASKS[args.task].task
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = set(rules) - set(RULES)
    if unknown:
        raise SystemExit(f"unknown rule(s) {sorted(unknown)}: choose from {', '.join(RULES)}")
    lags = [int(k) for k in args.lags.split(",") if k.strip()]
    if any(k < 1 or k >= args.sync_every for k in lags):
        raise SystemExit(f"every k must be in [1, H), got {lags}")
    settings = [Setting(r, 0) if r == "wait" else Setting(r, k) for r in rules for k in ([0] if r == "wait" else lags)]
    mid_step = max(1, round(args.mid * args.steps))
    rows = []
    for setting in settings:
        mid, final = run_setting(task, args, setting, mid_step)
        log.info("takes %s k=%d: step %d %.4f, final %.4f", setting.rule, setting.lag, mid_step, mid, final)
        rows.append((setting, mid, final))
    return TakesResult(args.task, rows, mid_step)
