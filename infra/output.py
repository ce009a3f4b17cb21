"""What the commands print and write: aligned plain-text tables for stdout (pipes and `less` read
them as they are) and the `--json PATH` files."""

from __future__ import annotations

import json
import math
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


def write_json(path: Path | None, data: object) -> None:
    """Write `data` as JSON to `path` (its directory made if needed); nothing when `path` is None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
