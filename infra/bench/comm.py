"""`diloco bench comm`: bytes a learner moves per token, both ways, per codec, against a data-parallel all-reduce.

One short run per codec and H (M learners, P fragments, the run's default clock cadence, real processes and
servers). Up: the sizes of the run's contribution objects in S3 (`fragments/`: every outer
gradient the learners sent) over the tokens the objects cover (each header says how many tokens
its delta covers; every fragment covers them once), so progress a learner had not sent when the
run ended counts on neither side; genesis proposals are not counted (once per run). Down: every
byte the learners read from S3 (versions' params and manifests, the run's records at join: their
`bytes_downloaded`, last heartbeat) over the tokens they trained: since versions travel as updates
in the run's codec (`storage/updates.py`), down is about up. A data-parallel ring all-reduce of the
same model over the same M workers sends 2 (M - 1) / M x the parameter bytes (fp32) per step per
worker (reduce-scatter + all-gather), i.e. 2 (M - 1) / M x 4 x params / tokens_per_step bytes per
token, and receives as many; each reduction factor is data-parallel's bytes over ours, up, down and
both ways together. Beside the bytes, each configuration's final eval loss, and its ratio to the
fp32 run at the same H (short runs: a rough view; `diloco bench quality --codec C` is the measure).

Reconstruction error: the fp32 run's real outer gradients (its contribution objects in S3) are
encoded and decoded with every codec; the table gives the relative L2 error ||d - d'|| / ||d||.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from diloco.infra.output import figures_table
from diloco.infra.bench.trial import (LearnerPlan, Trial, TrialResult, add_out_arguments, bench_stack, run_args,
                                      run_trial)
from diloco.storage import codecs
from diloco.storage.history import read_layout, read_manifest, read_input, list_versions, read_run_spec
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import CADENCES, ObjectMeta
from diloco.workers.tasks.demo import DemoTask

log = logging.getLogger(__name__)

NAME = "comm"
HELP = "bytes per learner per token, up and down, for each codec vs a data-parallel all-reduce, and each codec's error"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_arguments(parser, "comm")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="inner steps per learner (default: %(default)s)")
    parser.add_argument("--sync-every", default="30,50,100", help="values of H, comma-separated (default: %(default)s)")
    parser.add_argument("--fragments", type=int, default=4, help="P (default: %(default)s, the run default)")
    parser.add_argument("--overlap-steps", type=int, default=2, help="tau (default: %(default)s, the run default)")
    parser.add_argument("--cadence", default="clock", choices=CADENCES,
                        help="when learners send (default: %(default)s, the run default; steps makes rounds of one or "
                             "two learners on a busy machine, each version downloaded by every learner)")
    parser.add_argument("--codecs", default=",".join(codecs.CODECS), help="codecs to run (default: %(default)s)")
    parser.add_argument("--compress", action=argparse.BooleanOptionalAction, default=True,
                        help="zstd on top of the codec, as in a run's default (default: %(default)s)")


@dataclass(frozen=True, slots=True)
class Arm:
    codec: str
    sync_every: int
    delta_bytes: int
    """Bytes of every contribution object the run's learners stored."""
    tokens: int
    """Tokens those objects cover."""
    down_bytes: int
    """Bytes the learners read from S3."""
    trained_tokens: int
    """Tokens the learners trained."""
    joined_bytes: int
    """Of `down_bytes`, what joining read (the run's records, every fragment's params): once per learner."""
    trial: TrialResult

    @property
    def bytes_per_token(self) -> float:
        """Up: bytes sent per learner per token."""
        return self.delta_bytes / max(1, self.tokens)

    @property
    def down_per_token(self) -> float:
        """Down: bytes read per learner per token, joining included (a short run pays it over few tokens)."""
        return self.down_bytes / max(1, self.trained_tokens)

    @property
    def steady_down_per_token(self) -> float:
        """Down after joining: what a run of any length pays per token."""
        return (self.down_bytes - self.joined_bytes) / max(1, self.trained_tokens)


@dataclass
class CommResult:
    params: int
    tokens_per_step: int
    learners: int
    arms: list[Arm]
    errors: dict[str, float]
    """codec -> relative L2 reconstruction error over the fp32 run's real deltas."""

    def dp_bytes_per_token(self) -> float:
        """What one worker of a ring all-reduce over `learners` workers sends (and receives) per token."""
        return 2 * (self.learners - 1) / self.learners * 4 * self.params / self.tokens_per_step

    def _fp32_loss(self, arm: Arm) -> float | None:
        return next((a.trial.eval_loss for a in self.arms if a.codec == "fp32" and a.sync_every == arm.sync_every),
                    None)

    def table(self) -> str:
        dp = self.dp_bytes_per_token()
        rows = [["data-parallel all-reduce (fp32)", dp, dp, None, 2 * dp, 1.0, 1.0, None, None, None, None]]
        for arm in self.arms:
            both = arm.bytes_per_token + arm.down_per_token
            steady = arm.bytes_per_token + arm.steady_down_per_token
            fp32 = self._fp32_loss(arm)
            rows.append([f"{arm.codec}, H={arm.sync_every}", arm.bytes_per_token, arm.down_per_token,
                         arm.steady_down_per_token, both, dp / arm.bytes_per_token, 2 * dp / both, 2 * dp / steady,
                         self.errors.get(arm.codec), arm.trial.eval_loss, arm.trial.eval_loss / fp32 if fp32 else None])
        best_up = max(dp / arm.bytes_per_token for arm in self.arms)
        best = max(2 * dp / (arm.bytes_per_token + arm.down_per_token) for arm in self.arms)
        best_steady = max(2 * dp / (arm.bytes_per_token + arm.steady_down_per_token) for arm in self.arms)
        head = (f"comm: {self.params} parameters, M = {self.learners} learners, {self.tokens_per_step} tokens per "
                f"learner step; a data-parallel ring all-reduce sends {dp:.1f} and receives {dp:.1f} bytes per token "
                "per worker")
        return (head + "\n" + figures_table(["what", "up B/token", "down B/token", "down after join", "both B/token",
                                             "x less up", "x less both", "x less both after join", "rel. L2 error",
                                             "eval loss", "/ fp32"], rows)
                + f"\nbest reduction up {best_up:.0f}x, both ways {best:.0f}x with the join, {best_steady:.0f}x after "
                f"it (target >= 500x both ways: {'met' if best >= 500 else 'NOT met'} with the join); bytes per token "
                "scale as 1/H; the join is a fixed cost, the shorter the run the more it weighs")

    def to_json(self) -> dict:
        dp = self.dp_bytes_per_token()
        return {"bench": NAME, "params": self.params, "tokens_per_step": self.tokens_per_step,
                "learners": self.learners, "dp_bytes_per_token": dp, "relative_l2_error": self.errors,
                "arms": [{"codec": a.codec, "sync_every": a.sync_every, "delta_bytes": a.delta_bytes, "tokens": a.tokens,
                          "bytes_per_token": a.bytes_per_token, "reduction": dp / a.bytes_per_token,
                          "down_bytes": a.down_bytes, "trained_tokens": a.trained_tokens,
                          "down_per_token": a.down_per_token, "joined_bytes": a.joined_bytes,
                          "steady_down_per_token": a.steady_down_per_token,
                          "reduction_both_ways": 2 * dp / (a.bytes_per_token + a.down_per_token),
                          "eval_loss": a.trial.eval_loss, "trial": a.trial.to_json()} for a in self.arms]}


def sent(store: ObjectStore, keys: RunKeys, fragments: int) -> tuple[int, int]:
    """(bytes of every contribution object, tokens they cover), from the objects and their headers."""
    size = tokens = 0
    for key, n in store.list_sizes(keys.deltas_prefix()):
        size += n
        tokens += ObjectMeta.from_meta(codecs.read_header(store.get(key, max_bytes=n), max_bytes=1 << 30).meta,
                                       key).tokens
    return size, tokens // fragments


def reconstruction_errors(store: ObjectStore, keys: RunKeys, limit: int = 40) -> dict[str, float]:
    """Relative L2 error of every codec over up to `limit` real fp32 deltas of the run."""
    spec, layout = read_run_spec(store, keys), read_layout(store, keys)
    assert spec is not None and layout is not None
    deltas = []
    for f in range(len(layout.fragments)):
        for v in list_versions(store, keys, f)[1:]:
            for c in read_manifest(store, keys, f, v).inputs:
                deltas.append(read_input(store, layout, f, c, max_bytes=spec.max_object_bytes))
    deltas = deltas[:limit]
    errors = {}
    for codec in codecs.CODECS:
        num = den = 0.0
        for d in deltas:
            decoded, _ = codecs.decode(codecs.encode(d, codec), max_bytes=1 << 30)
            for name, x in d.items():
                num += float(torch.sum((decoded[name] - x) ** 2))
                den += float(torch.sum(x ** 2))
        errors[codec] = (num / den) ** 0.5 if den else float("nan")
    return errors


def run(args: argparse.Namespace) -> CommResult:
    task = DemoTask()
    wanted = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if "fp32" not in wanted:
        wanted.insert(0, "fp32")  # the reference deltas for the errors
    periods = [int(h) for h in args.sync_every.split(",") if h.strip()]
    learners = tuple(LearnerPlan(f"learner-{i}", steps=args.steps, data_seed=i) for i in range(args.learners))
    arms: list[Arm] = []
    with bench_stack(args.out, keep=args.keep_stack) as stack:
        store = ObjectStore(stack.endpoints)
        for h in periods:
            for codec in wanted:
                shape = run_args(args.fragments, h, min(args.overlap_steps, h - 1), codec, cadence=args.cadence)
                if not args.compress:
                    shape = (*shape, "--no-compress")
                trial = run_trial(stack, Trial(f"comm-{codec}-h{h}", learners, 3600.0, shape), task, args.out,
                                  curve_points=1)
                size, tokens = sent(store, RunKeys(stack.endpoints.prefix, trial.run), args.fragments)
                arms.append(Arm(codec, h, size, tokens, int(trial.total("bytes_downloaded")),
                                int(trial.total("tokens")), int(trial.total("bytes_joined")), trial))
        reference = next(a for a in arms if a.codec == "fp32")
        errors = reconstruction_errors(store, RunKeys(stack.endpoints.prefix, reference.trial.run))
    params = sum(p.numel() for p in task.make_model(0).parameters())
    return CommResult(params, task.tokens_per_step(), args.learners, arms, errors)
