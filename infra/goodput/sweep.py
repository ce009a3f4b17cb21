"""Running the strategies on one fleet or over the paper's grid, and reporting them (text, JSON, PNG).

`sweep` runs the paper's grid: 150k to 2.4M chips; data-parallel, elastic data-parallel and
decoupled DiLoCo with M = 2, 4, 8 and 16 learners. `PAPER` holds the paper's figures at 1.2M chips
for comparison; they are printed beside the simulation's and never enter it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from diloco.infra.goodput.decoupled import decoupled
from diloco.infra.goodput.model import CATEGORIES, YEAR_S, Model, Result
from diloco.infra.goodput.sync import data_parallel, elastic

log = logging.getLogger(__name__)

RUNNERS: dict[str, Callable[[Model], Result]] = {"dp": data_parallel, "elastic": elastic, "decoupled": decoupled}
LABELS = {"dp": "data-parallel", "elastic": "elastic data-parallel", "decoupled": "decoupled"}

SWEEP_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
SWEEP_LEARNERS = (2, 4, 8, 16)
PAPER_CHIPS = 1_200_000
PAPER = {"dp": 0.27, "elastic": 0.58, "M=2": 0.70, "M=4": 0.82, "M=8": 0.88, "M=16": 0.93}
"""The Decoupled DiLoCo paper's goodput at 1.2M chips, per-chip MTBI one year."""


def column(result: Result) -> str:
    return f"M={result.learners}" if result.strategy == "decoupled" else result.strategy


def simulate(model: Model) -> list[Result]:
    """Each strategy on the same fleet (same seed: the same failures hit the same chips)."""
    return [run(model) for run in RUNNERS.values()]


def sweep(model: Model, chips: tuple[int, ...] = SWEEP_CHIPS,
          learners: tuple[int, ...] = SWEEP_LEARNERS) -> list[Result]:
    """The paper's grid. With speed variance, the synchronous baselines run on as many hardware
    groups as the largest M (they have no learners of their own)."""
    results = []
    for n in chips:
        for strategy in ("dp", "elastic"):
            results.append(RUNNERS[strategy](replace(model, chips=n, learners=max(learners))))
        for m in learners:
            results.append(decoupled(replace(model, chips=n, learners=m)))
        log.info("%s chips done: %s", f"{n:,}", "  ".join(f"{column(r)} {r.goodput:.1%}"
                                                         for r in results if r.chips == n))
    return results


def _chips(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n // 1000}k"


def _span(seconds: float) -> str:
    for unit, length in (("year", YEAR_S), ("day", 86400.0), ("h", 3600.0)):
        if seconds >= 0.5 * length:
            return f"{seconds / length:.3g} {unit}" + ("s" if unit != "h" and seconds != length else "")
    return f"{seconds:.3g} s"


def describe(model: Model) -> str:
    """The fleet's failure regime and the simulation's extent, in one line."""
    return (f"per-chip MTBI {_span(model.mtbi_years * YEAR_S)}: at {model.chips:,} chips a failure every "
            f"{1.0 / model.failure_rate_per_s:.1f} s; {model.hours:g} h simulated, seed {model.seed}")


def sweep_table(results: list[Result], model: Model) -> str:
    """Goodput in %, a row per fleet size, a column per strategy, and the paper's row."""
    columns = list(dict.fromkeys(column(r) for r in results))
    heads = {"dp": "DP", "elastic": "elastic"}
    lines = [f"goodput (%), {describe(replace(model, chips=PAPER_CHIPS))}",
             f"{'chips':<12}" + "".join(f"{heads.get(c, c):>9}" for c in columns)]
    for n in dict.fromkeys(r.chips for r in results):
        row = {column(r): r.goodput for r in results if r.chips == n}
        lines.append(f"{_chips(n):<12}" + "".join(f"{100 * row[c]:>9.1f}" for c in columns))
    lines.append(f"{'paper 1.2M':<12}" + "".join(f"{100 * PAPER[c]:>9.0f}" if c in PAPER else f"{'':>9}"
                                               for c in columns))
    return "\n".join(lines)


def point_table(results: list[Result], model: Model) -> str:
    """One fleet: goodput and where the chip time went, a row per strategy."""
    lines = [describe(model),
             f"{'strategy':<24}{'goodput':>8}" + "".join(f"{c:>9}" for c in CATEGORIES[1:]) + f"{'failures':>10}"]
    for r in results:
        name = f"decoupled M={r.learners}" if r.strategy == "decoupled" else LABELS[r.strategy]
        lines.append(f"{name:<24}{100 * r.goodput:>7.1f}%" + "".join(f"{100 * r.chip_time[c]:>8.1f}%"
                                                                     for c in CATEGORIES[1:])
                     + f"{int(r.stats['failures']):>10}")
    return "\n".join(lines)


def to_json(results: list[Result], model: Model) -> dict:
    return {"model": asdict(model), "paper_at_1_2M": PAPER, "results": [r.to_wire() for r in results]}


def plot(results: list[Result], path: Path) -> bool:
    """Goodput against fleet size per strategy (the paper's points marked), and where chip time
    goes at 1.2M chips. False if matplotlib is not installed (`pip install -e '.[bench]'`)."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(dict.fromkeys(column(r) for r in results))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    for i, c in enumerate(columns):
        points = sorted((r.chips, r.goodput) for r in results if column(r) == c)
        colour = f"C{i}"
        left.plot([p[0] for p in points], [100 * p[1] for p in points], "o-", color=colour,
                  label={"dp": "data-parallel", "elastic": "elastic DP"}.get(c, f"decoupled {c}"))
        if c in PAPER:
            left.plot([PAPER_CHIPS], [100 * PAPER[c]], "x", color=colour, markersize=10, markeredgewidth=2)
    left.set_xscale("log")
    sizes = sorted({r.chips for r in results})
    left.set_xticks(sizes, [_chips(n) for n in sizes])
    left.minorticks_off()
    left.set_xlabel("chips (per-chip MTBI 1 year)")
    left.set_ylabel("goodput (%)")
    left.set_ylim(0, 100)
    left.set_title("simulated goodput (x: the paper at 1.2M)")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8, loc="lower left")
    at = [r for r in results if r.chips == PAPER_CHIPS] or [r for r in results if r.chips == results[-1].chips]
    bottom = [0.0] * len(at)
    for i, category in enumerate(CATEGORIES):
        values = [100 * r.chip_time[category] for r in at]
        right.bar(range(len(at)), values, bottom=bottom, color=f"C{i}", label=category)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(range(len(at)), [{"dp": "DP", "elastic": "elastic"}.get(column(r), column(r)) for r in at])
    right.set_ylabel("share of chip time (%)")
    right.set_title(f"where chip time goes at {at[0].chips:,} chips")
    right.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
