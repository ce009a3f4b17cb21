"""Aligned plain-text tables for the history tools' stdout (no dependency: pipes and `less` read them as is)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, align: str = "", indent: str = "  ") -> str:
    """Columns padded to their widest cell. `align` has one letter per column, 'l' (names, text) or
    'r' (numbers); missing letters mean 'l' for the first column and 'r' for the others."""
    align = align.ljust(len(headers), "r") if align else "l".ljust(len(headers), "r")
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True)]
        lines.append((indent + "  ".join(parts)).rstrip())
    return "\n".join(lines)


def num(value: float | None, spec: str = ".4g") -> str:
    """A number for a table cell; '-' for a missing one."""
    return "-" if value is None else format(value, spec)
