"""`diloco bench wan`: decoupled DiLoCo, synchronous DiLoCo and data-parallel over rate-limited links.

The network. A hub namespace (`dlw-hub-<pid>`) holds Redis, the S3 server, the coordinator and this
process's own reads; every learner runs in a namespace of its own (`dlw-<pid>-<i>`), joined to the
hub by a veth pair whose ends are both inside those namespaces (10.251.<i>.1/30 on the hub's side,
.2 on the learner's). Each end has a `tc tbf` qdisc: the learner's end limits what it sends (up),
the hub's end what it receives (down). The hub forwards between learners, so the data-parallel arm's
gloo ring crosses two links: the sender's up and the receiver's down. Nothing leaves these
namespaces but their loopbacks; this process joins the hub with setns(2) for the run and leaves it
afterwards. Every process in our namespaces is stopped by its pid and every namespace deleted on
the way out (Ctrl-C and SIGTERM included); namespaces carry the pid of the process that made them,
and those of a process that no longer runs are removed at the next start. `netem` is not in every
kernel (not in this project's), so the links have a rate and no added propagation delay. A tbf
drops what overflows its queue (`--latency-ms` at the link's rate: 100 ms is 1.3 packets at 0.156
Mbit/s), and TCP sends it again; the mixed arm's table gives each link's share of dropped packets.
The namespaces' TCP congestion control is the host's unless `--congestion-control` names one.

The scaling. What decides whether data-parallel is usable on a link is R, the time one all-reduce
of the gradients takes over the link against the time one step takes to compute. A ring
all-reduce moves 2 (M-1)/M x the gradient bytes per learner per step each way. For a 12B model
with bf16 gradients, M = 4 and a 2 s step (`--ref-*`: about 0.5M tokens per learner step on 128
accelerators at 50% of their peak), R is 72 on 2 Gbps and 29 on 5 Gbps. The demo model (108k
parameters, fp32 gradients, 0.65 MB per all-reduce per learner) paced at `--step-time-s` 0.1 s per
step on `--rate-mbit` 1.25 Mbit/s has R = 42, that 12B model on 3.5 Gbps. Every byte the DiLoCo arms
move scales with the parameters too, so the same ratio holds for them: the table prints both sides.

Arms, on the same links and the same token budget (`--steps` inner steps per learner, M learners,
learner i on data stream i, every step paced to at least `--step-time-s`):

- decoupled: the coordinator's defaults (P, H, tau, clock cadence, the run's codec or `--codec`);
- sync: synchronous DiLoCo through our coordinator (`trial.sync_trial`: one fragment, quorum = all,
  learners wait for every merge), H = the default run's;
- dp: data-parallel. M processes, one per learner namespace, each trains the demo model on its own
  stream and sums its gradients with the others' in a real `torch.distributed` gloo all_reduce every
  step, across the shaped links (rendezvous in the hub), then clips and takes the AdamW step. The
  real run is bounded by `--dp-budget-s`; at R ~ 40 it does about a dozen of the budget's steps. Its
  loss per step does not depend on the link, so the loss curve over the whole token budget comes
  from the same update computed in this process (the mean loss of the M shards' batches is the mean
  of their gradients), checked against the real run's model after its last step. Its time to the
  target is then the real run's time at that step if it got there, else the real run's time plus
  the remaining steps at its measured mean step time (marked `extrapolated`).
- mixed: decoupled, the learners on links of `--mixed-rates` x the rate (default 1, 1/2, 1/8, 1/8).
- mixed_without: the mixed arm without its learners on the thinnest links (default: the 1 and 1/2
  links' learners, on their own data streams): the fleet the thin links are added to, at equal wall
  time. Adding them must never leave the model worse.

Per arm: wall time to the target loss (`--target-loss`; default the higher of the decoupled and sync
arms' final eval losses, a loss both reached), tokens per second while training (all
learners' tokens over the time from the first step to the last), the final eval loss, and the
bytes each learner moved on its link (veth counters, every packet) as well as what learners report
(their heartbeats: contribution objects up, S3 reads down).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

from diloco.coordinator.config import RunSettings
from diloco.infra.bench.dataparallel import DpRun, _dp_worker, dp_equivalent_curve, ring_bytes, run_dp
from diloco.infra.bench.netns import (Rates, WanNet, _sigterm_interrupts, entered, feasibility, netns_exec,
                                      remove_leftovers)
from diloco.infra.bench.trial import (LearnerPlan, Placement, Trial, TrialResult, add_out_arguments,
                                      add_repeats_argument, bench_stack, run_dir, run_trial, sync_trial, time_to,
                                      turns)
from diloco.infra.local.stack import LocalStack
from diloco.infra.output import figures_table
from diloco.workers.tasks.demo import DemoTask
from diloco.workers.tasks.base import Task

log = logging.getLogger(__name__)

NAME = "wan"
HELP = ("decoupled vs synchronous DiLoCo vs data-parallel (real gloo) with learners behind rate-limited links "
        "(network namespaces, tc tbf; needs root)")
ARMS = ("decoupled", "sync", "dp", "mixed", "mixed_without")


# ---------------------------------------------------------------------------------------------
# The scaling.



@dataclass(frozen=True, slots=True)
class Scaling:
    params: int
    learners: int
    step_time_s: float
    rate_mbit: float
    ref_params: float
    ref_bytes_per_param: float
    ref_step_s: float
    ref_gbps: tuple[float, float]

    @property
    def allreduce_bytes(self) -> float:
        """Per learner per step, each way: the demo's fp32 gradients in a ring."""
        return ring_bytes(self.params, self.learners, 4)

    @property
    def allreduce_s(self) -> float:
        return self.allreduce_bytes * 8 / (self.rate_mbit * 1e6)

    @property
    def ratio(self) -> float:
        """R: all-reduce time over compute time per step, on the demo's links."""
        return self.allreduce_s / self.step_time_s

    def ref_ratio(self, gbps: float) -> float:
        return ring_bytes(self.ref_params, self.learners, self.ref_bytes_per_param) * 8 / (gbps * 1e9) / self.ref_step_s

    @property
    def equivalent_gbps(self) -> float:
        """The link on which the reference model has the demo's R."""
        return ring_bytes(self.ref_params, self.learners, self.ref_bytes_per_param) * 8 / (
            self.ratio * self.ref_step_s) / 1e9

    def statement(self) -> str:
        lo, hi = self.ref_gbps
        ref = f"{self.ref_params / 1e9:g}B"
        in_range = self.ref_ratio(hi) <= self.ratio <= self.ref_ratio(lo)
        return (f"scaling: the demo model ({self.params} params, fp32 ring all-reduce "
                f"{self.allreduce_bytes / 1e6:.2f} MB per learner per step each way, M={self.learners}) at "
                f"{self.step_time_s:g} s per step on {self.rate_mbit:g} Mbit/s: all-reduce {self.allreduce_s:.2f} s = "
                f"R {self.ratio:.1f} x compute. "
                f"A {ref} model ({self.ref_bytes_per_param:g}-byte gradients, {self.ref_step_s:g} s per step) has "
                f"R {self.ref_ratio(lo):.0f} on {lo:g} Gbps and {self.ref_ratio(hi):.0f} on {hi:g} Gbps: the demo's "
                f"R is the {ref} model's on {self.equivalent_gbps:.2f} Gbps "
                f"({'inside' if in_range else 'OUTSIDE'} {lo:g}-{hi:g} Gbps)")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "allreduce_bytes": self.allreduce_bytes, "allreduce_s": self.allreduce_s,
                "ratio": self.ratio, "ref_ratio": {str(g): self.ref_ratio(g) for g in self.ref_gbps},
                "equivalent_gbps": self.equivalent_gbps}


# ---------------------------------------------------------------------------------------------
# DiLoCo arms: `trial.run_trial`, with the coordinator in the hub and each learner in its namespace.


@dataclass
class LinkedTrial:
    trial: TrialResult
    rates: list[Rates]
    wire: list[tuple[int, int]]
    """(bytes up, bytes down) on each learner's link during the arm."""
    dropped: list[tuple[float, float]] = field(default_factory=list)
    """(up, down): the share of each learner's link's packets its tbf dropped during the arm."""

    @property
    def learners_done_s(self) -> float:
        """When the last learner exited, since the arm started."""
        return self.trial.learners_done_s

    @property
    def per_learner(self) -> dict[str, dict]:
        """Merged contributions and their mean staleness, per learner (from the manifests)."""
        return self.trial.rounds.per_learner if self.trial.rounds else {}


def run_linked_trial(stack: LocalStack, net: WanNet, trial: Trial, task: Task, out: Path, rates: Sequence[Rates], *,
                     curve_points: int | None) -> LinkedTrial:
    """`trial.run_trial` on the links: the coordinator in the hub (at 127.0.0.1 there) and learner i
    in its namespace behind link i, shaped to `rates[i]`."""
    for i, r in enumerate(rates):
        net.shape(i, r)
    before, drops_before = net.counters(), net.drops()
    placement = Placement(coordinator=tuple(netns_exec(net.hub)), learner=lambda i: netns_exec(net.links[i].ns),
                          learner_env=lambda i: net.endpoints_env(i, stack))
    result = run_trial(stack, trial, task, out, curve_points=curve_points, placement=placement)
    after = net.counters()
    wire = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)][:len(rates)]
    dropped = [tuple(_share(a, b) for a, b in zip(ways, ways_before, strict=True))
               for ways, ways_before in zip(net.drops(), drops_before)][:len(rates)]
    return LinkedTrial(result, list(rates), wire, dropped)


def _share(after: tuple[int, int], before: tuple[int, int]) -> float:
    """Packets dropped over packets offered (sent and dropped) between two (dropped, sent) counts."""
    dropped, sent = after[0] - before[0], after[1] - before[1]
    return dropped / (dropped + sent) if dropped + sent > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Data-parallel: real gloo workers on the links, and the same update computed here.
# ---------------------------------------------------------------------------------------------
# Figures.


@dataclass
class ArmFigures:
    arm: str
    rates: list[Rates]
    time_to_target_s: float | None
    how: str
    """'measured', 'extrapolated' (dp beyond its real run) or 'not reached'."""
    tokens_per_s: float
    final_eval: float
    steps: list[int]
    """Inner steps per learner (dp: steps of the real run; every rank takes the same)."""
    wire: list[tuple[int, int]]
    """(bytes up, bytes down) per learner on its link."""
    reported: list[tuple[int, int]] | None
    """(bytes up, bytes down) per learner from its heartbeats (DiLoCo arms)."""
    detail: dict = field(default_factory=dict)
    finals: list[float] = field(default_factory=list)
    """Each run's final eval (`--repeats`): `final_eval` is their mean; empty: one run."""

    @property
    def runs(self) -> int:
        return len(self.finals) or 1

    @property
    def spread(self) -> float:
        """(max - min) / mean of the runs' finals: 0 for one run."""
        return (max(self.finals) - min(self.finals)) / self.final_eval if self.finals else 0.0

    def mean_wire(self, way: int) -> float:
        return sum(w[way] for w in self.wire) / max(1, len(self.wire))

    def mean_reported(self, way: int) -> float | None:
        return None if not self.reported else sum(r[way] for r in self.reported) / len(self.reported)

    def to_json(self) -> dict:
        return {"arm": self.arm, "rates_mbit": [[r.up_mbit, r.down_mbit] for r in self.rates],
                "time_to_target_s": self.time_to_target_s, "how": self.how, "tokens_per_s": self.tokens_per_s,
                "final_eval": self.final_eval, "finals": self.finals or [self.final_eval], "spread": self.spread,
                "steps": self.steps, "wire_bytes": self.wire, "reported_bytes": self.reported, **self.detail}


@dataclass
class WanResult:
    skipped: str | None
    netem: bool = False
    scaling: Scaling | None = None
    target: float | None = None
    target_source: str = ""
    token_budget: int = 0
    """Inner steps per learner."""
    arms: dict[str, ArmFigures] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def verdicts(self) -> list[str]:
        out = []
        t = {a: f.time_to_target_s for a, f in self.arms.items()}
        if t.get("decoupled") and t.get("dp"):
            x = t["dp"] / t["decoupled"]
            out.append(f"decoupled reached the target {x:.1f}x sooner than data-parallel "
                       f"({'met' if x >= 20 else 'NOT met'}: target >= 20x"
                       f"{'; dp extrapolated beyond its real run' if self.arms['dp'].how == 'extrapolated' else ''})")
        elif "decoupled" in t and "dp" in t:
            out.append(f"decoupled vs data-parallel: {self._missed('decoupled', 'dp')}")
        if "decoupled" in t and "sync" in t:
            d, s = t["decoupled"], t["sync"]
            if d is not None and s is not None:
                out.append(f"decoupled {d:.1f}s vs synchronous DiLoCo {s:.1f}s to the target: {s / d:.2f}x "
                           f"({'met' if d <= s else 'NOT met'}: target no slower)")
            else:
                out.append(f"decoupled vs synchronous DiLoCo: {self._missed('decoupled', 'sync')}")
        if "decoupled" in self.arms and "mixed" in self.arms:
            x = self.arms["mixed"].final_eval / self.arms["decoupled"].final_eval
            out.append(f"mixed links end at {x:.4f}x the equal links' final eval "
                       f"({'met' if x <= 1.02 else 'NOT met'}: target within 2%)")
        if "mixed" in self.arms and "mixed_without" in self.arms:
            m, w = self.arms["mixed"].final_eval, self.arms["mixed_without"].final_eval
            out.append(f"the thin-linked learners added: final eval {m:.4f} against {w:.4f} without them "
                       f"({'met' if m <= w else 'NOT met'}: target never worse)")
        return out

    def _missed(self, *arms: str) -> str:
        return "; ".join(f"{a} did not reach the target (final eval {self.arms[a].final_eval:.4f})"
                         for a in arms if self.arms[a].time_to_target_s is None)

    def table(self) -> str:
        if self.skipped:
            return f"wan: skipped: {self.skipped}"
        head = (f"wan: {len(next(iter(self.arms.values())).rates) if self.arms else 0} learners, {self.token_budget} "
                f"steps each (same token budget), target eval loss {self.target:.4f} ({self.target_source})"
                if self.target is not None else "wan: no target")
        rows = []
        for a in ARMS:
            if a not in self.arms:
                continue
            f = self.arms[a]
            rates = sorted({r.up_mbit for r in f.rates}, reverse=True)
            rows.append([a, "/".join(f"{r:g}" for r in rates), f.time_to_target_s, f.how, f.tokens_per_s,
                         f.runs, f.final_eval, 100 * f.spread, round(sum(f.steps) / max(1, len(f.steps))),
                         f.mean_wire(0) / 1e6,
                         f.mean_wire(1) / 1e6,
                         None if f.mean_reported(0) is None else f.mean_reported(0) / 1e6,
                         None if f.mean_reported(1) is None else f.mean_reported(1) / 1e6])
        parts = [head, figures_table(["arm", "Mbit/s", "s to target", "how", "tokens/s", "runs", "final eval",
                                      "spread %", "steps/learner", "wire MB up", "wire MB down", "reported MB up",
                                      "reported MB down"], rows)]
        if "mixed" in self.arms:
            f = self.arms["mixed"]
            merged = f.detail.get("per_learner", {})
            dropped = f.detail.get("tbf_dropped") or [(None, None)] * len(f.rates)
            rows = [[f"learner-{i}", r.up_mbit, f.steps[i], w[0] / 1e6, w[1] / 1e6,
                     None if d[0] is None else 100 * d[0], None if d[1] is None else 100 * d[1],
                     merged.get(f"learner-{i}", {}).get("merged", 0),
                     merged.get(f"learner-{i}", {}).get("mean_staleness")]
                    for i, (r, w, d) in enumerate(zip(f.rates, f.wire, dropped))]
            parts += ["mixed arm, per learner:", figures_table(["learner", "Mbit/s", "steps", "wire MB up",
                                                                "wire MB down", "% dropped up", "% dropped down",
                                                                "pieces merged", "mean staleness"], rows)]
        if self.scaling is not None:
            parts.append(self.scaling.statement())
        parts += self.notes + self.verdicts()
        return "\n".join(parts)

    def to_json(self) -> dict:
        return {"bench": NAME, "skipped": self.skipped, "netem": self.netem,
                "scaling": None if self.scaling is None else self.scaling.to_json(),
                "target": self.target, "target_source": self.target_source, "token_budget_steps": self.token_budget,
                "arms": {a: f.to_json() for a, f in self.arms.items()}, "notes": self.notes,
                "verdicts": self.verdicts()}


def first_at_or_below(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """When a curve of the global model after every commit first reaches `target`: the commit time of
    the first version at or below it (the model does not change between commits); None if none does."""
    return next((t for t, loss in curve if loss <= target), None)


def diloco_figures(arm: str, lt: LinkedTrial, target: float | None) -> ArmFigures:
    """A DiLoCo arm's figures; time to the target from its curve (after every commit: the first version
    at or below it; evenly spaced evaluations: interpolated between them, `trial.time_to`)."""
    t = lt.trial
    stats = [t.learners.get(f"learner-{i}", {}) for i in range(len(lt.rates))]  # the plans' ids, in link order
    train_s = max((float(s.get("wall_s", 0) or 0) for s in stats), default=0.0)
    reached = None if target is None else (first_at_or_below if t.curve_versions else time_to)(t.curve, target)
    return ArmFigures(arm, lt.rates, reached, "measured" if reached is not None else "not reached",
                      t.total("tokens") / train_s if train_s else 0.0, t.eval_loss,
                      [int(s.get("step", 0)) for s in stats], lt.wire,
                      [(int(s.get("bytes_uploaded", 0)), int(s.get("bytes_downloaded", 0))) for s in stats],
                      {"trial": t.to_json(), "learners_done_s": lt.learners_done_s, "per_learner": lt.per_learner,
                       "tbf_dropped": lt.dropped})


def combined(runs: Sequence[ArmFigures]) -> ArmFigures:
    """An arm's figures over its runs (`--repeats`): the means of its times to the target (None, "not
    reached in K of N runs", if some run did not reach it), tokens per second, final evals, steps,
    bytes per learner, and of the mixed arm's per-learner figures; each run's own figures in
    `detail["runs"]`. One run: itself."""
    if len(runs) == 1:
        return runs[0]
    first, n = runs[0], len(runs)
    times = [f.time_to_target_s for f in runs]
    missed = sum(t is None for t in times)
    time_s = None if missed else fmean(times)
    how = "measured" if not missed else f"not reached in {missed} of {n} runs"
    per_learner = {}
    for name in sorted({k for f in runs for k in f.detail.get("per_learner", {})}):
        theirs = [f.detail["per_learner"].get(name, {}) for f in runs]
        stale = [x["mean_staleness"] for x in theirs if x.get("mean_staleness") is not None]
        per_learner[name] = {"merged": fmean([x.get("merged", 0) for x in theirs]),
                             "mean_staleness": fmean(stale) if stale else math.nan}
    dropped = [f.detail.get("tbf_dropped") for f in runs]
    return ArmFigures(first.arm, first.rates, time_s, how, fmean([f.tokens_per_s for f in runs]),
                      fmean([f.final_eval for f in runs]),
                      [round(fmean(steps)) for steps in zip(*(f.steps for f in runs))],
                      _mean_pairs([f.wire for f in runs]),
                      None if any(f.reported is None for f in runs) else _mean_pairs([f.reported for f in runs]),
                      {"per_learner": per_learner,
                       "tbf_dropped": _mean_pairs(dropped) if all(dropped) else [],
                       "runs": [f.to_json() for f in runs]},
                      finals=[f.final_eval for f in runs])


def _mean_pairs(runs: Sequence[Sequence[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Per learner, the mean (up, down) over the runs."""
    return [(fmean([p[0] for p in pairs]), fmean([p[1] for p in pairs])) for pairs in zip(*runs)]


# ---------------------------------------------------------------------------------------------
# The command.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_arguments(parser, "wan")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of %(default)s")
    add_repeats_argument(parser, "dp, whose loss per step does not depend on the link, runs once")
    parser.add_argument("--learners", type=int, default=4, help="M (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=600,
                        help="inner steps per learner: the token budget of every arm (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="wall-clock cap of each DiLoCo arm's learners (default: %(default)s)")
    parser.add_argument("--dp-budget-s", type=float, default=60.0,
                        help="wall clock of the real data-parallel run; its time to the target beyond it is its "
                             "measured step time x the steps it needs (default: %(default)s)")
    parser.add_argument("--step-time-s", type=float, default=0.1,
                        help="every step paced to at least this (default: %(default)s)")
    parser.add_argument("--rate-mbit", type=float, default=1.25,
                        help="each learner's link, each way, in Mbit/s (default: %(default)s)")
    parser.add_argument("--mixed-rates", default="1,0.5,0.125,0.125",
                        help="the mixed arm's links as factors of --rate-mbit, one per learner (cycled) "
                             "(default: %(default)s)")
    parser.add_argument("--latency-ms", type=float, default=100.0,
                        help="tbf queue of each link, in ms at its rate (default: %(default)s)")
    parser.add_argument("--congestion-control", default=None, metavar="NAME",
                        help="TCP congestion control in every namespace, one of the host's allowed ones "
                             "(net.ipv4.tcp_allowed_congestion_control), e.g. reno or bbr (default: the host's)")
    parser.add_argument("--codec", default=None,
                        help="the decoupled and mixed arms' codec (default: the run's, %s)" % RunSettings().codec)
    parser.add_argument("--sync-every", type=int, default=RunSettings().sync_every,
                        help="H of the sync arm (default: the default run's, %(default)s)")
    parser.add_argument("--target-loss", type=float,
                        help="eval loss to time the arms to (default: the higher of the decoupled and sync arms' "
                             "final eval losses, a loss both reached; with one of them, its own)")
    parser.add_argument("--curve-points", type=int, default=0,
                        help="evaluations per DiLoCo arm, evenly spaced; 0: after every committed version "
                             "(default: %(default)s)")
    parser.add_argument("--dp-eval-every", type=int, default=10,
                        help="steps between evaluations of the data-parallel loss curve (default: %(default)s)")
    parser.add_argument("--ref-params", type=float, default=12e9, help="the scaling's reference model (default: 12e9)")
    parser.add_argument("--ref-step-s", type=float, default=2.0,
                        help="the reference model's compute time per step (default: %(default)s)")
    parser.add_argument("--ref-bytes-per-param", type=float, default=2.0,
                        help="bytes per gradient in the reference all-reduce (default: %(default)s, bf16)")


def _factors(args: argparse.Namespace) -> list[float]:
    """The mixed arm's link of each learner, as a factor of the rate."""
    factors = [float(x) for x in args.mixed_rates.split(",") if x.strip()]
    if not factors or min(factors) <= 0:
        raise SystemExit(f"--mixed-rates {args.mixed_rates!r}: give positive factors")
    return [factors[i % len(factors)] for i in range(args.learners)]


def _learners(args: argparse.Namespace, arm: str) -> list[int]:
    """The learners (as data streams: the mixed arm's positions) an arm runs: all of them, but in
    mixed_without the learners on the mixed arm's thinnest links."""
    if arm != "mixed_without":
        return list(range(args.learners))
    factors = _factors(args)
    kept = [i for i, f in enumerate(factors) if f > min(factors)]
    if not kept:
        raise SystemExit(f"--mixed-rates {args.mixed_rates!r}: mixed_without needs links thicker than the thinnest")
    return kept


def _rates(args: argparse.Namespace, arm: str) -> list[Rates]:
    """The link of each of the arm's learners, in the order of `_learners`."""
    if arm not in ("mixed", "mixed_without"):
        return [Rates(args.rate_mbit, args.rate_mbit)] * args.learners
    factors = _factors(args)
    return [Rates(args.rate_mbit * factors[i], args.rate_mbit * factors[i]) for i in _learners(args, arm)]


def _allowed_congestion_controls() -> list[str]:
    """What a network namespace other than the host's may take as its default (the kernel refuses the
    others there, whatever is loaded)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    except OSError:
        return []


def _host_congestion_control() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip() + " (the host's)"
    except OSError:
        return "the host's"


def _trial(arm: str, args: argparse.Namespace) -> Trial:
    learners = tuple(LearnerPlan(f"learner-{k}", steps=args.steps, data_seed=i)
                     for k, i in enumerate(_learners(args, arm)))
    if arm == "sync":
        return sync_trial("wan-sync", learners, args.budget_s, sync_every=args.sync_every,
                          step_time_s=args.step_time_s)
    extra = () if args.codec is None else ("--codec", args.codec)
    return Trial(f"wan-{arm}", learners, args.budget_s, extra, step_time_s=args.step_time_s)  # the defaults


def run(args: argparse.Namespace) -> WanResult:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}: arms {ARMS}")
    if args.learners < 2:
        raise SystemExit("--learners must be at least 2")
    allowed = _allowed_congestion_controls()
    if args.congestion_control and allowed and args.congestion_control not in allowed:
        raise SystemExit(f"--congestion-control {args.congestion_control}: a namespace may only take one the host "
                         f"allows, {', '.join(allowed)} (net.ipv4.tcp_allowed_congestion_control)")
    feasible = feasibility()
    if feasible.reason:
        log.warning("wan: skipped: %s", feasible.reason)
        return WanResult(feasible.reason)
    remove_leftovers()
    task = DemoTask()
    params = sum(q.numel() for q in task.make_model(0).parameters())
    scaling = Scaling(params, args.learners, args.step_time_s, args.rate_mbit, args.ref_params,
                      args.ref_bytes_per_param, args.ref_step_s, (2.0, 5.0))
    result = WanResult(None, feasible.netem, scaling, token_budget=args.steps)
    if not feasible.netem:
        result.notes.append("links: tbf rate limits only, no added propagation delay (netem is not in this kernel)")
    result.notes.append(f"links: TCP congestion control {args.congestion_control or _host_congestion_control()}, "
                        f"tbf queue {args.latency_ms:g} ms")
    out = args.out.resolve()
    linked: dict[str, list[LinkedTrial]] = {}
    dp: DpRun | None = None
    with _sigterm_interrupts(), WanNet(args.learners, latency_ms=args.latency_ms,
                                              congestion_control=args.congestion_control) as net, entered(net.hub):
        diloco_arms = [a for a in ("decoupled", "sync", "mixed", "mixed_without") if a in arms]
        if diloco_arms:
            with bench_stack(out, keep=args.keep_stack, bind="0.0.0.0") as stack:  # every address of the hub
                for repeat, order in enumerate(turns(diloco_arms, args.repeats)):
                    for arm in order:
                        lt = run_linked_trial(stack, net, _trial(arm, args), task,
                                              run_dir(out / arm, repeat, args.repeats), _rates(args, arm),
                                              curve_points=args.curve_points or None)
                        linked.setdefault(arm, []).append(lt)
                        log.info("wan: %s%s: eval %.4f, %d versions", arm,
                                 f" (run {repeat + 1} of {args.repeats})" if args.repeats > 1 else "",
                                 lt.trial.eval_loss, lt.trial.counters.get("versions_committed", 0))
        if "dp" in arms:
            dp = run_dp(net, task, out / "dp", steps=args.steps, budget_s=args.dp_budget_s,
                        step_time_s=args.step_time_s, rate=_rates(args, "dp")[0])
            log.info("wan: dp: %d steps in %.1fs (all-reduce %.2fs per step), eval %.4f", dp.steps,
                     dp.step_end[-1] if dp.step_end else 0.0, dp.to_json()["mean_allreduce_s"], dp.final_eval)
    compared = [a for a in ("decoupled", "sync") if a in linked] or list(linked)
    if args.target_loss is not None:
        result.target, result.target_source = args.target_loss, "--target-loss"
    elif compared:
        result.target = max(lt.trial.eval_loss for a in compared for lt in linked[a])
        result.target_source = (f"the highest final eval loss of {' and '.join(compared)}"
                                f"{' over their runs' if args.repeats > 1 else ''}: a loss "
                                f"{'both' if len(compared) == 2 else 'it'} reached")
    for arm, runs in linked.items():
        result.arms[arm] = combined([diloco_figures(arm, lt, result.target) for lt in runs])
    if dp is not None:
        result.arms["dp"] = dp_figures(dp, task, args, result)
        if "mixed" in result.arms:
            result.notes.append(dp_on_mixed_links(result.arms["dp"], dp, _rates(args, "mixed")))
    return result


def dp_on_mixed_links(figures: ArmFigures, dp: DpRun, mixed: Sequence[Rates]) -> str:
    """What data-parallel would take on the mixed arm's links (computed, not run): a ring all-reduce
    moves at its slowest link's rate, so every step's all-reduce takes the measured one x the ratio
    of the rates."""
    slowdown = figures.rates[0].up_mbit / min(min(r.up_mbit, r.down_mbit) for r in mixed)
    reduce_s = sum(dp.allreduce_s) / max(1, len(dp.allreduce_s))
    step_s = dp.mean_step_s + reduce_s * (slowdown - 1)
    steps = figures.detail.get("steps_to_target")
    to_target = "-" if steps is None else f"{dp.time_at(1) + (max(steps, 1.0) - 1) * step_s:.0f}s"
    return (f"data-parallel on the mixed arm's links (computed from the measured run, not run): its ring moves "
            f"at the slowest link's rate, {slowdown:g}x slower: {step_s:.1f}s per step, {to_target} to the target")


def dp_figures(dp: DpRun, task: DemoTask, args: argparse.Namespace, result: WanResult) -> ArmFigures:
    curve = dp_equivalent_curve(task, args.learners, args.steps, eval_every=args.dp_eval_every, also=(dp.steps,))
    if result.target is None:
        result.target, result.target_source = curve[-1][1], "data-parallel's eval loss at the token budget"
    at_real = dict(curve).get(dp.steps)
    step = time_to([(float(s), loss) for s, loss in curve], result.target)
    if step is None:
        reached, how = None, "not reached"
    else:
        reached = dp.time_at(max(step, 1.0))
        how = "measured" if step <= dp.steps else "extrapolated"
    mean_reduce = sum(dp.allreduce_s[1:] or dp.allreduce_s) / max(1, len(dp.allreduce_s[1:] or dp.allreduce_s))
    wire_up = sum(w[0] for w in dp.wire) / max(1, len(dp.wire)) / max(1, dp.steps)
    assert result.scaling is not None
    result.notes.append(
        f"dp row: time to target and final eval over the whole token budget (loss per step from the in-process "
        f"equivalent, time per step measured); steps and wire MB of the real run. The real gloo run took "
        f"{dp.steps} steps in {dp.step_end[-1] if dp.step_end else 0:.1f}s "
        f"(all-reduce {mean_reduce:.2f}s per step measured, {result.scaling.allreduce_s:.2f}s computed from "
        f"the bytes and the rate; {wire_up / 1e6:.3f} MB up per learner per step on the wire, "
        f"{result.scaling.allreduce_bytes / 1e6:.3f} MB computed); eval of its model {dp.final_eval:.4f}, "
        f"the in-process equivalent at the same step {at_real if at_real is None else round(at_real, 4)}; "
        f"steps to the target {'-' if step is None else f'{step:.0f}'} of {args.steps}")
    tokens = args.learners * task.tokens_per_step() * dp.steps
    span = dp.step_end[-1] - (dp.step_end[0] - dp.mean_step_s) if dp.step_end else 0.0
    return ArmFigures("dp", [_rates(args, "dp")[0]] * args.learners, reached, how, tokens / span if span else 0.0,
                      curve[-1][1], [dp.steps] * args.learners, dp.wire, None,
                      {"real_run": dp.to_json(), "equivalent_curve": curve, "equivalent_at_real_steps": at_real,
                       "steps_to_target": step})


if __name__ == "__main__":
    if sys.argv[1:2] == ["dp-worker"]:
        logging.basicConfig(level=logging.INFO)
        _dp_worker(sys.argv[2:])
    raise SystemExit("usage: python -m diloco.infra.bench.wan dp-worker ... (run `diloco bench wan` instead)")
