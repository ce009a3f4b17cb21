"""`diloco plot`: PNGs of a run's history, from S3 (or an export) alone.

What a run's durable history holds, and so what can be plotted after the fact:
- every version's manifest: when it was committed (`committed_at`, the coordinator's clock), by which
  coordinator epoch, its inputs (learner, seq, base version, staleness, tokens, object key) and the
  refusals since its parent;
- the contribution objects themselves, whose sizes one listing gives (until `diloco gc` deletes them);
- every version's params, from which the global model at any moment is assembled and evaluated.

- the learners' reported losses (`losses/{learner}/...`, `workers/losses.py`): what each learner gave
  `Learner.report(loss=...)`, sampled with its step, tokens and time, for any model.

The loss plots draw those per learner, against time (`loss.png`) and against steps and tokens
(`loss_by_step.png`); with a task (`--task`) `loss.png` also shows the global model's eval loss.

Failures are read from the same history: a coordinator takeover is a change of manifest epoch; a
learner's restart is a new run of sequence numbers (each process numbers its objects from its start
time in milliseconds x 1000, `workers/transfer.py`), so each incarnation of a learner is marked from
its start to its last merged contribution (learners there from the start are not marked as joining,
only restarts and late joiners); refusals are marked at the commit of the manifest that
lists them (they happened before it, after its parent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.storage.errors import ConfigError, Refused
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectMissing, Store
from diloco.storage.protocol import Contribution, Refusal, RunSpec
from diloco.workers.losses import LossSeries

log = logging.getLogger(__name__)

MAX_EVALS = 40
"""At most this many global models are evaluated for the loss plot (evenly spread over the run)."""
SEQ_RESTART_GAP = 1_000_000
"""A jump in a learner's sequence numbers larger than this is a new process: a process numbers its
objects from int(time_ms) * 1000 on, one up per object, so two processes a second apart differ by 1e6."""
INSTALL = "pip install 'diloco[plot]'"


@dataclass(frozen=True)
class Commit:
    """One committed version, as its manifest records it."""

    fragment: int
    version: int
    t: float
    """committed_at (coordinator clock, unix seconds)."""
    epoch: int
    inputs: tuple[Contribution, ...]
    refused: tuple[Refusal, ...]


@dataclass
class History:
    run: str
    spec: RunSpec
    commits: list[Commit]
    """Every readable manifest, in commit-time order."""
    sizes: dict[str, int]
    """Object key -> size in bytes, for the contribution objects still in the bucket."""
    problems: list[str] = field(default_factory=list)
    """Manifests that could not be read (skipped), for a person."""

    @property
    def t0(self) -> float:
        """The first commit (version 0 of some fragment): the plots' time origin."""
        return self.commits[0].t if self.commits else 0.0


@dataclass(frozen=True)
class Incarnation:
    """One process of a learner, as its merged contributions show it."""

    learner: str
    started: float
    """When the process began numbering its objects (the learner's clock, unix seconds)."""
    first_merge: float
    last_merge: float
    merged: int


def read_history(store: Store, keys: RunKeys, *, threads: int = 8) -> History:
    """Every manifest of the run (verified against its key) and the sizes of the contribution objects."""
    from diloco.storage.history import list_versions, read_manifest, require_run_spec

    spec = require_run_spec(store, keys)
    wanted = [(f, v) for f in range(spec.num_fragments) for v in list_versions(store, keys, f)]
    problems: list[str] = []

    def read(fv: tuple[int, int]) -> Commit | None:
        f, v = fv
        try:
            m = read_manifest(store, keys, f, v)
        except (ObjectMissing, Refused) as exc:
            problems.append(f"fragment {f} version {v}: manifest unreadable ({exc})")
            return None
        return Commit(f, v, m.committed_at, m.epoch, tuple(m.inputs), tuple(m.refused))

    with ThreadPoolExecutor(threads, thread_name_prefix="manifest") as pool:
        commits = [c for c in pool.map(read, wanted) if c is not None]
    commits.sort(key=lambda c: (c.t, c.fragment, c.version))
    sizes = dict(store.list_sizes(keys.deltas_prefix()))
    return History(keys.run, spec, commits, sizes, problems)


# ---- what the plots show, as numbers (pure) ---------------------------------------------------------

def epoch_changes(history: History) -> list[tuple[float, int]]:
    """(time, new epoch) at each commit whose epoch differs from the commit before it."""
    out, last = [], None
    for c in history.commits:
        if last is not None and c.epoch != last:
            out.append((c.t, c.epoch))
        last = c.epoch
    return out


def refusal_marks(history: History) -> list[tuple[float, str, str]]:
    """(time of the manifest listing it, code, learner) per refusal a manifest records."""
    return [(c.t, r.code, r.learner) for c in history.commits for r in c.refused]


def incarnations(history: History) -> list[Incarnation]:
    """Each learner's processes, told apart by jumps in their sequence numbers (SEQ_RESTART_GAP)."""
    merged: dict[str, list[tuple[int, float]]] = {}
    for c in history.commits:
        for i in c.inputs:
            merged.setdefault(i.learner, []).append((i.seq, c.t))
    out = []
    for learner, items in sorted(merged.items()):
        items.sort()
        group: list[tuple[int, float]] = []
        for seq, t in items:
            if group and seq - group[-1][0] > SEQ_RESTART_GAP:
                out.append(_incarnation(learner, group))
                group = []
            group.append((seq, t))
        out.append(_incarnation(learner, group))
    return out


def _incarnation(learner: str, group: list[tuple[int, float]]) -> Incarnation:
    times = [t for _, t in group]
    return Incarnation(learner, group[0][0] / 1e6, min(times), max(times), len(group))


def staleness_points(history: History) -> list[tuple[float, int, int]]:
    """(commit time, fragment, staleness) per merged delta: the head at merge minus its base version."""
    return [(c.t, c.fragment, i.staleness) for c in history.commits if c.version > 0 for i in c.inputs]


def bytes_per_token_points(history: History) -> tuple[list[tuple[float, int, float]], int]:
    """(commit time, fragment, object bytes / tokens) per merged delta whose object is still in the
    bucket and that counted tokens; and how many merged deltas were left out (object deleted, or 0 tokens)."""
    points, missing = [], 0
    for c in history.commits:
        if c.version == 0:
            continue  # version 0 merges the genesis proposal (fp32 parameters, no tokens)
        for i in c.inputs:
            n = history.sizes.get(i.object_key)
            if n is None or i.tokens <= 0:
                missing += 1
                continue
            points.append((c.t, c.fragment, n / i.tokens))
    return points, missing


def heads_over_time(history: History) -> list[tuple[float, dict[int, int]]]:
    """After each commit from the moment every fragment has a version 0: (time, each fragment's head)."""
    heads: dict[int, int] = {}
    out = []
    for c in history.commits:
        heads[c.fragment] = max(c.version, heads.get(c.fragment, -1))
        if len(heads) == history.spec.num_fragments:
            out.append((c.t, dict(heads)))
    return out


def sample(items: Sequence[Any], n: int) -> list[Any]:
    """At most `n` of `items`, evenly spread, the first and the last included."""
    if n <= 0 or not items:
        return []
    if len(items) <= n:
        return list(items)
    if n == 1:
        return [items[-1]]
    picks = sorted({round(i * (len(items) - 1) / (n - 1)) for i in range(n)})
    return [items[i] for i in picks]


@dataclass(frozen=True)
class LossPoint:
    t: float
    heads: dict[int, int]
    loss: float


def eval_losses(history: History, store: Store, keys: RunKeys, task: Any, *, evals: int = MAX_EVALS,
                progress: Callable[[str], None] = lambda _: None) -> tuple[list[LossPoint], list[str]]:
    """The task's eval loss of the global model at up to `evals` moments, evenly spread over the
    commits: each fragment at the version current then. Versions whose params are gone (`diloco gc`)
    are skipped and named in the second list."""
    from diloco.infra.history.task_model import check_task_fits, load_version
    from diloco.storage.history import read_layout, read_manifest

    layout = read_layout(store, keys)
    if layout is None:
        raise Refused("missing_object", f"run {keys.run!r} has no layout: no version 0 to evaluate")
    check_task_fits(task, layout, keys.run)
    model = task.make_model(0)
    loaded: dict[int, int] = {}
    points, skipped = [], []
    chosen = sample(heads_over_time(history), evals)
    for n, (t, heads) in enumerate(chosen, 1):
        try:
            for fragment, version in sorted(heads.items()):
                if loaded.get(fragment) != version:
                    load_version(model, store, layout, read_manifest(store, keys, fragment, version))
                    loaded[fragment] = version
        except ObjectMissing as exc:
            skipped.append(f"heads {heads}: params missing ({exc})")
            loaded.clear()
            continue
        loss = float(task.eval_loss(model))
        points.append(LossPoint(t, heads, loss))
        progress(f"eval {n}/{len(chosen)}: heads {heads}: loss {loss:.4f}")
    return points, skipped


# ---- drawing -----------------------------------------------------------------------------------------

def _figure_class() -> Any:
    """A maker of matplotlib Figures on the Agg canvas (no display, no pyplot state); a ConfigError
    naming the extra to install if matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(f"diloco plot needs matplotlib, which is not installed: {INSTALL}") from None

    def figure(**kwargs: Any) -> Any:
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)  # the Agg canvas: PNGs without a display
        return fig

    return figure


def check_matplotlib() -> None:
    _figure_class()


@dataclass(frozen=True)
class TimeAxis:
    t0: float
    scale: float
    unit: str

    @classmethod
    def of(cls, history: History) -> TimeAxis:
        span = history.commits[-1].t - history.t0 if history.commits else 0.0
        scale, unit = (1.0, "s") if span <= 600 else (60.0, "min") if span <= 36000 else (3600.0, "h")
        return cls(history.t0, scale, unit)

    def __call__(self, t: float) -> float:
        return (t - self.t0) / self.scale

    @property
    def label(self) -> str:
        return f"time since the first version 0 ({self.unit}, coordinator clock)"


def mark_failures(ax: Any, history: History, x: TimeAxis) -> None:
    """Coordinator takeovers, learners joining and leaving, and refusals on `ax`."""
    trans = ax.get_xaxis_transform()  # x in data, y in axes fraction
    labelled: set[str] = set()

    def once(kind: str) -> str | None:
        if kind in labelled:
            return None
        labelled.add(kind)
        return kind

    end = history.commits[-1].t if history.commits else history.t0
    for t, epoch in epoch_changes(history):
        ax.axvline(x(t), color="tab:red", lw=1.5, label=once("coordinator takeover (new epoch)"))
        ax.text(x(t), 0.98, f" epoch {epoch}", transform=trans, color="tab:red", fontsize=7, va="top")
    deltas = [c.t for c in history.commits if c.version > 0]
    first_delta = min(deltas) if deltas else end
    seen: set[str] = set()
    for inc in incarnations(history):
        # A restart is always marked; a learner's first process only if it joined late (after the
        # first delta was merged), not the ones there from the start.
        restart, late = inc.learner in seen, inc.started > first_delta
        seen.add(inc.learner)
        if restart or late:
            ax.axvline(x(inc.started), color="tab:green", ls="--", lw=1, label=once("learner (re)started"))
            ax.text(x(inc.started), 0.02, f" {inc.learner}", transform=trans, color="tab:green", fontsize=7,
                    rotation=90, va="bottom")
        if inc.last_merge < end:
            ax.axvline(x(inc.last_merge), color="tab:gray", ls=":", lw=1,
                       label=once("learner's last merged piece (left or finished)"))
            ax.text(x(inc.last_merge), 0.45, f" {inc.learner}", transform=trans, color="tab:gray", fontsize=7,
                    rotation=90, va="bottom")  # above the joins' labels: a leave and a join often coincide
    refusals = refusal_marks(history)
    if refusals:
        ax.plot([x(t) for t, _, _ in refusals], [0.94] * len(refusals), "x", color="tab:red", ms=5,
                transform=trans, label=f"refusal ({len(refusals)}, at the commit listing it)")


def _frame(ax: Any, history: History, x: TimeAxis) -> None:
    """The same time range and label on every plot: the first to the last commit."""
    span = x(history.commits[-1].t) if history.commits else 0.0
    if span > 0:
        ax.set_xlim(-0.01 * span, span * 1.02)
    ax.set_xlabel(x.label)


def _legend(ax: Any) -> None:
    """The legend beside the axes, where it hides neither the data nor the markers' labels."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _colours(series: list[LossSeries]) -> dict[str, Any]:
    """One colour per learner (its incarnations share it)."""
    names = sorted({s.learner for s in series})
    palette = [f"C{i % 10}" for i in range(len(names))]
    return dict(zip(names, palette, strict=True))


def _learner_lines(ax: Any, series: list[LossSeries], xs: Callable[[LossSeries], list[float]]) -> None:
    """Each incarnation of each learner as a line, a learner's in one colour, labelled once."""
    colours, labelled = _colours(series), set()
    for s in series:
        label = None if s.learner in labelled else f"{s.learner} (reported)"
        labelled.add(s.learner)
        ax.plot(xs(s), s.losses, "-", lw=1, alpha=0.8, color=colours[s.learner], label=label)


def plot_loss(history: History, x: TimeAxis, path: Path, losses: list[LossPoint] | None,
              floor: float | None = None, note: str = "", reported: list[LossSeries] | None = None) -> Path:
    fig = _figure_class()(figsize=(11, 4.5))
    ax = fig.add_subplot()
    if reported:
        _learner_lines(ax, reported, lambda s: [x(t) for t in s.times])
    if losses:
        ax.plot([x(p.t) for p in losses], [p.loss for p in losses], "o-", ms=3, color="black",
                label=f"global model eval loss ({len(losses)} evaluated)")
        if floor is not None:
            ax.axhline(floor, color="black", ls="--", lw=1, label=f"entropy floor {floor:.3f}")
    if losses or reported:
        ax.set_ylabel("loss")
        title = " and ".join(what for what, shown in (("learners' reported loss", reported),
                                                       ("global eval loss", losses)) if shown)
    else:
        ax.text(0.5, 0.8, note or "no loss to plot", transform=ax.transAxes, ha="center", va="center",
                fontsize=9, wrap=True, zorder=5, bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "none"})
        ax.set_yticks([])
        title = "loss: not in the run's history"
    mark_failures(ax, history, x)
    _frame(ax, history, x)
    ax.set_title(f"run {history.run}: {title}, failures marked")
    _legend(ax)
    return _save(fig, path)


def plot_versions(history: History, x: TimeAxis, path: Path) -> Path:
    fig = _figure_class()(figsize=(11, 4.5))
    ax = fig.add_subplot()
    for f in range(history.spec.num_fragments):
        mine = [c for c in history.commits if c.fragment == f]
        if mine:
            ax.step([x(c.t) for c in mine], [c.version for c in mine], where="post", label=f"fragment {f}")
    mark_failures(ax, history, x)
    _frame(ax, history, x)
    ax.set_ylabel("committed version")
    ax.set_title(f"run {history.run}: versions per fragment")
    _legend(ax)
    return _save(fig, path)


def _per_fragment(ax: Any, history: History, x: TimeAxis, points: list[tuple[float, int, float]], *,
                  first: dict[str, Any] | None = None, alpha: float) -> None:
    """(time, fragment, value) points, one series per fragment (fragment 0 drawn with `first`'s style)."""
    for f in range(history.spec.num_fragments):
        mine = [(t, v) for t, g, v in points if g == f]
        if mine:
            style = (first if f == 0 and first else {"marker": ".", "ms": 4})
            ax.plot([x(t) for t, _ in mine], [v for _, v in mine], linestyle="none", alpha=alpha,
                    label=f"fragment {f}", **style)


def _line(ax: Any, x: TimeAxis, points: list[tuple[float, float]], label: str) -> None:
    """A per-version summary drawn over the points, if there is one."""
    if points:
        ax.plot([x(t) for t, _ in points], [v for _, v in points], "-", color="black", lw=0.8, alpha=0.6, label=label)


def plot_staleness(history: History, x: TimeAxis, path: Path) -> Path:
    fig = _figure_class()(figsize=(11, 4.5))
    ax = fig.add_subplot()
    points = staleness_points(history)
    _per_fragment(ax, history, x, points, first=dict(marker="o", ms=6, mfc="none"), alpha=0.7)
    _line(ax, x, [(c.t, sum(i.staleness for i in c.inputs) / len(c.inputs)) for c in history.commits
                  if c.version > 0 and c.inputs], "mean per merged version")
    if not points:
        ax.text(0.5, 0.5, "no merged contributions yet", transform=ax.transAxes, ha="center")
    _frame(ax, history, x)
    ax.set_ylabel("staleness (head at merge - base version)")
    ax.set_title(f"run {history.run}: staleness of merged contributions ({len(points)})")
    _legend(ax)
    return _save(fig, path)


def plot_bytes_per_token(history: History, x: TimeAxis, path: Path) -> Path:
    fig = _figure_class()(figsize=(11, 4.5))
    ax = fig.add_subplot()
    points, missing = bytes_per_token_points(history)
    _per_fragment(ax, history, x, points, alpha=0.6)
    per_commit = []
    for c in history.commits:
        known = [(history.sizes[i.object_key], i.tokens) for i in c.inputs
                 if c.version > 0 and i.object_key in history.sizes and i.tokens > 0]
        if known:
            per_commit.append((c.t, sum(n for n, _ in known) / sum(k for _, k in known)))
    _line(ax, x, per_commit, "per merged version (its bytes / its tokens)")
    codec = f"{history.spec.codec}{' + zstd' if history.spec.compress else ''}"
    note = f"; {missing} merged piece(s) not shown (object deleted by gc, or no tokens counted)" if missing else ""
    if not points:
        ax.text(0.5, 0.5, "no contribution object with tokens in the bucket" + note, transform=ax.transAxes,
                ha="center", fontsize=8)
    _frame(ax, history, x)
    ax.set_ylabel("bytes uploaded per token trained")
    ax.set_title(f"run {history.run}: bytes per token ({codec}){note}", fontsize=9)
    _legend(ax)
    return _save(fig, path)


def plot_loss_by_step(history: History, path: Path, reported: list[LossSeries]) -> Path:
    """The learners' reported losses against their steps and their tokens (each incarnation counts from
    its own start, as the learner reported them)."""
    fig = _figure_class()(figsize=(11, 7))
    by_step, by_tokens = fig.subplots(2, 1)
    _learner_lines(by_step, reported, lambda s: s.steps)
    _learner_lines(by_tokens, reported, lambda s: s.tokens)
    by_step.set_xlabel("inner steps (of the learner's process)")
    by_tokens.set_xlabel("tokens (of the learner's process)")
    for ax in (by_step, by_tokens):
        ax.set_ylabel("reported loss")
    by_step.set_title(f"run {history.run}: learners' reported loss")
    _legend(by_step)
    fig.tight_layout()
    return _save(fig, path)


NO_LOSS = ("No loss is recorded in the run's history: no learner gave Learner.report(loss=...) a loss.\n"
           "Pass --task TASK.json (the task the run trained, e.g. OUT/task.json of `diloco demo`) to plot the "
           "global model's eval loss.")


def write_plots(history: History, out: Path, *, losses: list[LossPoint] | None = None, floor: float | None = None,
                note: str = NO_LOSS, reported: list[LossSeries] | None = None) -> list[Path]:
    """loss.png, versions.png, staleness.png and bytes_per_token.png under `out` (made if needed), and
    loss_by_step.png when learners reported losses."""
    check_matplotlib()  # the clear error first
    if not history.commits:
        raise Refused("missing_object", f"run {history.run!r} has no committed version to plot yet")
    out.mkdir(parents=True, exist_ok=True)
    x = TimeAxis.of(history)
    return [plot_loss(history, x, out / "loss.png", losses, floor, note, reported),
            plot_versions(history, x, out / "versions.png"),
            plot_staleness(history, x, out / "staleness.png"),
            plot_bytes_per_token(history, x, out / "bytes_per_token.png")] + \
        ([plot_loss_by_step(history, out / "loss_by_step.png", reported)] if reported else [])
