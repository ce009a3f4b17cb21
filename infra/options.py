"""Command-line options generated from config dataclasses: one flag per field, its docstring as help.

A config field `grace_gamma: float = 0.5` with a docstring under it becomes `--grace-gamma`
(type float, default 0.5, help = the docstring). Booleans become `--flag / --no-flag`; a field
with `choices` (given to `add_options`) takes only those. Nested dataclasses and other unsupported
types are skipped (the caller handles them).

Every such setting can also come from the environment or a TOML file, for deployments where a
command line is awkward (a Kubernetes manifest, a SkyPilot task). Precedence, highest first: the
flag on the command line, `DILOCO_<FIELD>` in the environment (`--grace-gamma` is
DILOCO_GRACE_GAMMA), the file given as `--config FILE` (or DILOCO_CONFIG), the field's default.
The file holds `field = value` pairs (flag or field spelling) at its top, for any command that has
the setting, and in a table per command (`[coordinator]`), which wins for that command. A key of
the command's own table that is not one of its settings is an error naming it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import os
import textwrap
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from diloco.infra.output import human_bytes, parse_bytes
from diloco.storage.errors import ConfigError

T = TypeVar("T")

ENV_PREFIX = "DILOCO_"
ENV_CONFIG = "DILOCO_CONFIG"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


@dataclasses.dataclass
class Sources:
    """Where settings come from besides the command line: the environment and a config file's values
    for the chosen command. `used` collects what an option took, to catch unknown keys."""

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    file: dict[str, Any] = dataclasses.field(default_factory=dict)
    path: Path | None = None
    own: set[str] = dataclasses.field(default_factory=set)
    """Keys of the command's own table: each must be one of its settings."""
    used: set[str] = dataclasses.field(default_factory=set)

    def value(self, name: str, tp: type, choices: Sequence[str] | None) -> tuple[Any, str] | None:
        """The setting for field `name` from the environment or the file, converted, and where it came from."""
        env_name = ENV_PREFIX + name.upper()
        if env_name in self.env:
            return convert(self.env[env_name], tp, choices, env_name, name), env_name
        if name in self.file:
            self.used.add(name)
            where = f"{self.path}: {name}"
            return convert(self.file[name], tp, choices, where, name), where
        return None

    def unknown(self) -> list[str]:
        return sorted(self.own - self.used)


_sources = Sources()


def load_sources(command: str | None, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Sources:
    """Read the environment and the config file (`--config FILE` in `argv`, else DILOCO_CONFIG) for
    `command`; the options added afterwards take their defaults from them. Raises ConfigError for a
    file that cannot be read or parsed."""
    global _sources
    _origins.clear()
    env = dict(os.environ if env is None else env)
    path = _config_path(argv) or env.get(ENV_CONFIG) or None
    values: dict[str, Any] = {}
    own: set[str] = set()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read the config file {path}: {exc}") from None
        values = {_field(k): v for k, v in data.items() if not isinstance(v, dict)}
        section = data.get(command or "", {})
        if isinstance(section, dict):
            own = {_field(k) for k in section}
            values.update({_field(k): v for k, v in section.items()})
    _sources = Sources(env=env, file=values, path=Path(path) if path else None, own=own)
    return _sources


def check_sources() -> None:
    """After the chosen command declared its options: a key of its own table in the config file
    that none of them took is a mistake. Raises ConfigError naming it."""
    unknown = _sources.unknown()
    if unknown:
        raise ConfigError(f"{_sources.path}: unknown setting(s) {', '.join(unknown)} for this command "
                          "(see its --help)")


def reset_sources() -> None:
    """Forget the environment and file read by `load_sources` (the options are built; later parsers
    built directly with `add_options` take the fields' defaults)."""
    global _sources
    _sources = Sources()


def _config_path(argv: Sequence[str]) -> str | None:
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--config="):
            return word.split("=", 1)[1]
    return None


def _field(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def convert(raw: Any, tp: type, choices: Sequence[str] | None, where: str, name: str = "") -> Any:
    """A setting's value from an environment string or a TOML value, as the field's type. Raises
    ConfigError naming where it came from."""
    try:
        if tp is bool:
            if isinstance(raw, bool):
                value: Any = raw
            elif str(raw).strip().lower() in _TRUE | _FALSE:
                value = str(raw).strip().lower() in _TRUE
            else:
                raise ValueError("expected true or false")
        elif tp is int and name.endswith("_bytes") and isinstance(raw, str):
            value = parse_bytes(raw)
        elif isinstance(raw, bool) or (tp is int and isinstance(raw, float)):
            raise ValueError(f"expected {'an integer' if tp is int else 'a ' + tp.__name__}")
        else:
            value = tp(raw)
            if tp is float and not math.isfinite(value):
                raise ValueError("expected a finite number")
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {raw!r} is not a valid {tp.__name__}: {exc}") from None
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    return value


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
                flags: dict[str, str] | None = None, choices: dict[str, Sequence[str]] | None = None,
                title: str | None = None) -> None:
    """One option per scalar field of `cls`; `flags` renames some (field name -> flag), `choices`
    limits some to the values given; `title` heads the group in --help. Defaults come from the
    environment and the config file when they set the field (module docstring)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(title or _title(cls))
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name in skip or tp not in (int, float, str, bool):
            continue
        flag = (flags or {}).get(f.name) or "--" + f.name.replace("_", "-")
        allowed = (choices or {}).get(f.name)
        extra: dict[str, Any] = {"choices": list(allowed)} if allowed is not None else {}
        doc = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        given = _sources.value(f.name, tp, allowed)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and given is None:
            group.add_argument(flag, dest=f.name, type=tp, required=True, help=f"{doc} (required)", **extra)
            continue
        if given is not None:
            default, origin = given[0], f"from {given[1]}"
            _origins[f.name] = given[1]
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            origin = f"{ENV_PREFIX}{f.name.upper()}"
        kind: Any = _finite if tp is float else tp
        shown = default
        if tp is int and f.name.endswith("_bytes"):  # sizes: read 512MB or 2GiB, shown readable
            kind, shown = parse_bytes, f"{human_bytes(default)}" if isinstance(default, int) else default
        help_text = f"{doc} (default: {shown}; {origin})"
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text, **extra)


def _title(cls: type) -> str:
    """A group title for --help from a config class's name: RoundConfig -> "round settings"."""
    words = "".join(f" {c.lower()}" if c.isupper() else c for c in cls.__name__).split()
    words = [w for w in words if w not in ("config", "settings", "args")]
    return " ".join(words + ["settings"])


def _finite(raw: str) -> float:
    """argparse's type for a float option: a finite number (nan and inf are refused)."""
    value = float(raw)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a finite number")
    return value


_origins: dict[str, str] = {}
"""Field name -> where its default came from (a DILOCO_* variable or the config file), for errors."""


def build(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """An instance of `cls` from parsed options (fields without an option keep their default).
    Raises ConfigError for a value the class refuses, naming where the value came from when it was
    not the command line."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    try:
        return cls(**values)
    except ConfigError as exc:
        named = [n for n in values if str(exc).startswith(n) and n in _origins]
        if named:
            raise ConfigError(f"{_origins[named[0]]}: {exc}") from None
        raise
