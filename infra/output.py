"""What the commands print and write: aligned plain-text tables for stdout (pipes and `less` read
them as they are) and the `--json PATH` files."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, align: str = "", indent: str = "  ",
          rule: bool = False) -> str:
    """Columns padded to their widest cell. `align` has one letter per column, 'l' (names, text) or
    'r' (numbers); missing letters mean 'l' for the first column and 'r' for the others. `rule`
    underlines the headers with dashes."""
    align = align.ljust(len(headers), "r") if align else "l".ljust(len(headers), "r")
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if rule:
        cells.insert(1, ["-" * w for w in widths])
    lines = []
    for r in cells:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True)]
        lines.append((indent + "  ".join(parts)).rstrip())
    return "\n".join(lines)


def num(value: float | None, spec: str = ".4g") -> str:
    """A number for a table cell; '-' for a missing one."""
    return "-" if value is None else format(value, spec)


def cell(value: Any) -> str:
    """A figure for a table cell: 4 significant digits, '-' for None or NaN."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return "-" if value is None else str(value)


def figures_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A benchmark's table: values formatted by `cell`, columns of numbers right-aligned, headers underlined."""
    numeric = [bool(rows) and all(isinstance(row[i], (int, float)) or row[i] is None for row in rows)
               for i in range(len(columns))]
    return table(columns, [[cell(v) for v in row] for row in rows], align="".join("r" if n else "l" for n in numeric),
                 indent="", rule=True)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def human_bytes(n: float) -> str:
    """A byte count for a person: 532 B, 52.7 kB, 217.6 MB, 2.1 GB (decimal units, as network rates);
    a whole number of MiB or GiB (a setting such as 1 << 30) in those units: 1 GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n and n % size == 0:
            return f"{int(n) // size} {unit}"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(text: str) -> int:
    """A size from the command line: 1073741824, 512MB, 2GiB, 64k (decimal k/M/G/T, binary KiB/MiB/GiB/TiB).
    Raises ValueError (argparse reports it as an invalid value)."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"not a size: {text!r} (e.g. 1073741824, 512MB, 2GiB)")
    value = float(number) * _UNITS[unit]
    if value < 0 or value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def write_json(path: Path | None, data: object) -> None:
    """Write `data` as JSON to `path` (its directory made if needed); nothing when `path` is None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")


class Progress:
    """A progress bar on stderr for a long command (export, import, replay, gc, bench), drawn by rich
    only when stderr is a terminal; elsewhere (a pipe, a log file, CI) it draws nothing, and `shown`
    tells the caller to log its usual lines instead.

        with Progress("exporting", unit="objects") as bar:
            for ...: bar.update(done, total)
    """

    def __init__(self, description: str, *, unit: str = "", force: bool | None = None) -> None:
        self.description, self.unit = description, unit
        self.shown = sys.stderr.isatty() if force is None else force
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.shown:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn(self.unit), TimeElapsedColumn(), console=Console(stderr=True),
                                     transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=None)
        return self

    def update(self, done: int, total: int | None = None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)

    def advance(self, n: int = 1, total: int | None = None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=n, **({"total": total} if total is not None else {}))

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
