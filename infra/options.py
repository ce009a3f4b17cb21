"""Command-line options generated from config dataclasses: one flag per field, its docstring as help.

A config field `grace_gamma: float = 0.5` with a docstring under it becomes `--grace-gamma`
(type float, default 0.5, help = the docstring). Booleans become `--flag / --no-flag`. Nested
dataclasses and other unsupported types are skipped (the caller handles them).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (attribute docstrings), by field name."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def add_options(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                flags: dict[str, str] | None = None) -> None:
    """One option per scalar field of `cls`; `flags` renames some (field name -> flag)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name in skip or tp not in (int, float, str, bool):
            continue
        flag = (flags or {}).get(f.name) or "--" + f.name.replace("_", "-")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            group.add_argument(flag, dest=f.name, type=tp, required=True, help=f"{docs.get(f.name, '')} (required)")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"{docs.get(f.name, '')} (default: {default})"
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=tp, default=default, help=help_text)


def build(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """An instance of `cls` from parsed options (fields without an option keep their default)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
