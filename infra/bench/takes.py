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

With `--codecs` other than fp32 the pieces and the versions travel as a run's do: each replica's
piece through the codec with error feedback (`storage.updates.encode_carrying`, zstd on), each
version as an update of its parent in the downstream codec with the coordinator's residual
(`encode_update`; `--downstream`, default as a run's coordinator chooses: the same codec, int4 for
sign8 and sparse). `--versions gradient` sends the merged outer gradient down instead, through the
downstream codec with the coordinator's residual, each replica then applying the outer step to
it (momentum included) as the coordinator does: the same global everywhere, no version to lag
behind it. `--unsent` says what a replica does
with what its codec dropped of a piece:

- carry: it goes out with the next piece, and the take rebases the model onto the version without
  it (the learner's way today);
- keep: it stays in the model (the take rebases by version - anchor - dropped) and, being in the
  model, in the next piece; nothing is carried beside the model.

Everything is deterministic: the same seeds give the same figures. Prints the global model's eval
loss at the end and at `--mid` of the budget, and the bits per parameter of a piece and of a
version (zstd included), per setting.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from diloco.coordinator.config import downstream_of
from diloco.infra.bench.quality_tasks import TASKS
from diloco.infra.options import chosen, whole_numbers
from diloco.infra.output import figures_table
from diloco.storage import codecs
from diloco.storage.updates import encode_carrying, encode_update
from diloco.workers.fragments import due_fragments, model_params, plan_layout
from diloco.workers.tasks.base import Task, train_step

log = logging.getLogger(__name__)

NAME = "takes"
HELP = ("in one process: the take rules (rebase, adopt, mix) k steps after each send, against waiting for every merge, "
        "and the codecs both ways")
RULES = ("wait", "rebase", "adopt", "mix")
UNSENT = ("carry", "keep")
VERSIONS = ("update", "gradient")


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
    parser.add_argument("--codecs", default="fp32", help=f"comma-separated codecs of the pieces, of {', '.join(codecs.CODECS)} "
                                                         "(default: %(default)s, no codec: the take rules alone)")
    parser.add_argument("--downstream", default="run", help="codec of the versions: run (as a run's coordinator "
                                                            "chooses by default: the setting's own codec, int4 for "
                                                            "sign8 and sparse) or a codec (default: %(default)s)")
    parser.add_argument("--versions", default="update", choices=VERSIONS, help="update: a version goes down as the update of its parent "
                        "(the coordinator's residual carried); gradient: as the merged outer gradient through the "
                        "codec (its residual carried), each replica applying the outer step itself")
    parser.add_argument("--unsent", default="carry", help=f"comma-separated subset of {','.join(UNSENT)}: what a "
                                                          "replica does with what its codec dropped (default: carry)")


@dataclass(frozen=True, slots=True)
class Setting:
    rule: str
    lag: int
    codec: str = "fp32"
    downstream: str = "fp32"
    unsent: str = "carry"
    versions: str = "update"


@dataclass(frozen=True, slots=True)
class Row:
    setting: Setting
    mid: float
    """Eval of the global model at the mid point."""
    final: float
    up_bits: float
    """Bits per parameter of a piece, zstd included (32 in fp32)."""
    down_bits: float
    """Bits per parameter of a version's update."""


@dataclass
class TakesResult:
    task: str
    rows: list[Row]
    mid_step: int

    def table(self) -> str:
        head = f"takes: {self.task}, eval of the global model at step {self.mid_step} and at the end"
        rows = [[r.setting.rule, r.setting.lag, r.setting.codec,
                 r.setting.downstream + (" grad" if r.setting.versions == "gradient" else ""), r.setting.unsent,
                 r.up_bits, r.down_bits, r.mid, r.final] for r in self.rows]
        return "\n".join([head, figures_table(["rule", "k", "codec", "down", "unsent", "bits up", "bits down",
                                               f"step {self.mid_step}", "final"], rows)])

    def to_json(self) -> dict:
        return {"bench": NAME, "task": self.task, "mid_step": self.mid_step,
                "runs": [{"rule": r.setting.rule, "k": r.setting.lag, "codec": r.setting.codec,
                          "downstream": r.setting.downstream, "versions": r.setting.versions, "unsent": r.setting.unsent, "up_bits": r.up_bits,
                          "down_bits": r.down_bits, "mid": r.mid, "final": r.final} for r in self.rows]}


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
        self.dropped: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in models]
        """Per replica and fragment, what its codec dropped of its last piece (error feedback)."""
        self.down_residual: dict[int, dict[str, torch.Tensor]] = {}
        self.bits = {"up": [0, 0], "down": [0, 0]}  # bytes and parameters sent each way
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
        pieces = [self._piece(i, fragment) for i in live]
        target = {}
        merged = {n: sum(piece[n] for piece in pieces) / len(live) for n in names}
        down = self.setting.downstream
        as_gradient = self.setting.versions == "gradient" and down != "fp32"
        if as_gradient:  # what goes down is the merged gradient, through the codec
            blob, merged, self.down_residual[fragment] = encode_carrying(
                merged, self.down_residual.get(fragment, {}), down, compress=True)
            self._count("down", blob, merged)
        for n in names:
            delta = merged[n]
            buf = self.momentum[n].mul_(self.args.outer_momentum).add_(delta)
            target[n] = self.globals[n] - self.args.outer_lr * (delta + self.args.outer_momentum * buf)
            for i in live:
                self.anchors[i][n] = self.params[i][n].detach().clone()  # what was sent: the next piece starts here
        if down != "fp32" and not as_gradient:  # what goes down is the version's update, through the codec
            parent = {n: self.globals[n] for n in names}
            blob, target, self.down_residual[fragment] = encode_update(
                parent, target, self.down_residual.get(fragment, {}), down, compress=True)
            self._count("down", blob, parent)
        for n in names:
            self.globals[n].copy_(target[n])
        self.takes.setdefault(step + self.setting.lag, []).append(fragment)

    def _piece(self, i: int, fragment: int) -> dict[str, torch.Tensor]:
        """Replica i's piece of the fragment as the coordinator decodes it: through the codec, with
        what the codec dropped of its last piece when that is carried."""
        delta = {n: self.anchors[i][n] - self.params[i][n] for n in self.names[fragment]}
        if self.setting.codec == "fp32":
            return delta
        carried = self.dropped[i].get(fragment, {}) if self.setting.unsent == "carry" else {}
        blob, decoded, self.dropped[i][fragment] = encode_carrying(delta, carried, self.setting.codec, compress=True)
        self._count("up", blob, delta)
        return decoded

    def _count(self, way: str, blob: bytes, tensors: dict[str, torch.Tensor]) -> None:
        self.bits[way][0] += len(blob)
        self.bits[way][1] += sum(t.numel() for t in tensors.values())

    def bits_per_param(self, way: str) -> float:
        sent, params = self.bits[way]
        return 8 * sent / params if params else 32.0

    @torch.no_grad()
    def take(self, fragment: int) -> None:
        rule, alpha = self.setting.rule, self.args.alpha
        for i in (i for i in range(len(self.models)) if i not in self.away):
            kept = self.dropped[i].pop(fragment, {}) if self.setting.unsent == "keep" else {}
            for n in self.names[fragment]:
                g, p, anchor = self.globals[n], self.params[i][n], self.anchors[i][n]
                if rule == "rebase":
                    p += g - anchor  # the steps since the send, on top of the version
                    if n in kept:
                        p -= kept[n]  # what the codec dropped stays in the model
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


def run_setting(task: Task, args: argparse.Namespace, setting: Setting, mid_step: int) -> Row:
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
    return Row(setting, mid, fleet.eval_global(), fleet.bits_per_param("up"), fleet.bits_per_param("down"))


def run(args: argparse.Namespace) -> TakesResult:
    torch.set_num_threads(1)
    task = TASKS[args.task].task
    rules = chosen(args.rules, "--rules", RULES)
    lags = whole_numbers(args.lags, "--lags")
    if any(k < 1 or k >= args.sync_every for k in lags):
        raise SystemExit(f"every k must be in [1, H), got {lags}")
    names = chosen(args.codecs, "--codecs", codecs.CODECS)
    unsent = chosen(args.unsent, "--unsent", UNSENT)
    if args.downstream != "run":
        chosen(args.downstream, "--downstream", codecs.CODECS)
    settings = [Setting(r, 0 if r == "wait" else k, c, downstream_of(args.downstream, c), u, args.versions)
                for c in names for u in unsent for r in rules for k in ([0] if r == "wait" else lags)]
    mid_step = max(1, round(args.mid * args.steps))
    rows = []
    for setting in settings:
        row = run_setting(task, args, setting, mid_step)
        log.info("takes %s k=%d %s/%s %s: step %d %.4f, final %.4f (%.2f / %.2f bits)", setting.rule, setting.lag,
                 setting.codec, setting.downstream, setting.unsent, mid_step, row.mid, row.final, row.up_bits,
                 row.down_bits)
        rows.append(row)
    return TakesResult(args.task, rows, mid_step)
