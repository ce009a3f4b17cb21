"""Command-line options generated from config dataclasses: one flag per field, its docstring as help.

A config field `grace_gamma: float = 0.5` with a docstring under it becomes `--grace-gamma`
(type float, default 0.5, help = the docstring). Booleans become `--flag / --no-flag`; a field
with `choices` (given to `add_options`) takes only those. Nested dataclasses and other unsupported
types are skipped (the caller handles them).

Every such setting can also come from the environment or a TOML file, for deployments where a
command line is awkward (a Kubernetes manifest, a SkyPilot task). Precedence, highest first: the
flag on the command line, `DILOCO_<FLAG>` in the environment (`--grace-gamma` is
DILOCO_GRACE_GAMMA; a flag that renames its field, `--fragments` for num_fragments, still reads the
field's name, with a line saying it is the old one), the file given as `--config FILE` (or
DILOCO_CONFIG), the field's default. The file holds `field = value` pairs (flag or field spelling)
at its top, for any command that has the setting, and in a table per command (`[coordinator]`),
which wins for that command. A key of the command's own table that is not one of its settings, and
a DILOCO_* variable, a top-level key or a table that no command has, are errors naming the closest
valid name (`check_sources`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import logging
import math
import os
import textwrap
import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from diloco.infra.output import human_bytes, parse_bytes
from diloco.storage.errors import ConfigError

log = logging.getLogger(__name__)

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
    """Keys of the file an option took."""
    asked: set[str] = dataclasses.field(default_factory=set)
    """Setting names (field and flag spellings) the declared options looked up."""
    top: set[str] = dataclasses.field(default_factory=set)
    """The file's top-level keys: each must be a setting of some command."""
    tables: set[str] = dataclasses.field(default_factory=set)
    """The file's tables: each must be a command's."""

    def value(self, name: str, tp: type, choices: Sequence[str] | None,
              old: str | None = None) -> tuple[Any, str] | None:
        """The setting `name` (its flag's spelling) from the environment or the file, converted, and
        where it came from. `old`: the field's name where the flag renames it, still read (a line
        says it is the old name) when `name` is not set."""
        self.asked.update({name} | ({old} if old else set()))
        for key in (name, old) if old else (name,):
            env_name = ENV_PREFIX + key.upper()
            if env_name in self.env:
                if key == old:
                    log.warning("%s is the old name of %s%s: use that", env_name, ENV_PREFIX, name.upper())
                return convert(self.env[env_name], tp, choices, env_name, key), env_name
        for key in (name, old) if old else (name,):
            if key in self.file:
                self.used.add(key)
                where = f"{self.path}: {key}"
                return convert(self.file[key], tp, choices, where, key), where
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
    top: set[str] = set()
    tables: set[str] = set()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read the config file {path}: {exc}") from None
        values = {_field(k): v for k, v in data.items() if not isinstance(v, dict)}
        top = set(values)
        tables = {k for k, v in data.items() if isinstance(v, dict)}
        section = data.get(command or "", {})
        if isinstance(section, dict):
            own = {_field(k) for k in section}
            values.update({_field(k): v for k, v in section.items()})
    _sources = Sources(env=env, file=values, path=Path(path) if path else None, own=own, top=top, tables=tables)
    return _sources


def check_sources(commands: Sequence[str]) -> None:
    """After the chosen command declared its options: a key of its own table in the config file
    that none of them took, a DILOCO_* variable, a top-level key or a table that no command has
    (KNOWN_SETTINGS; `commands`: their names) is a mistake. Raises ConfigError naming it and the
    closest valid name."""
    unknown = _sources.unknown()
    if unknown:
        raise ConfigError(f"{_sources.path}: unknown setting(s) {', '.join(unknown)} for this command "
                          f"(see its --help){_closest(unknown[0], _sources.asked)}")
    env = [k for k in _sources.env if k.startswith(ENV_PREFIX) and k not in ENV_OTHERS
           and k[len(ENV_PREFIX):].lower() not in _sources.asked]
    top = [k for k in _sources.top if k not in _sources.asked]
    tables = [t for t in _sources.tables if t not in commands]
    if tables:
        raise ConfigError(f"{_sources.path}: [{tables[0]}] is not a diloco command{_closest(tables[0], commands)}")
    if not env and not top:
        return
    known = KNOWN_SETTINGS
    for name in env:
        if name[len(ENV_PREFIX):].lower() not in known:
            raise ConfigError(f"{name} is not a setting of any diloco command"
                              f"{_closest(name, {ENV_PREFIX + k.upper() for k in known} | ENV_OTHERS)}")
    for key in top:
        if key not in known:
            raise ConfigError(f"{_sources.path}: {key} is not a setting of any diloco command{_closest(key, known)}")


KNOWN_SETTINGS = frozenset({
    "alpha", "bounded_momentum", "cadence", "checkpoint_every", "chips", "claim_idle_s", "cover_shards", "close_timeout_s", "codec", "compress",
    "consumer", "contributions", "data_seed", "downstream_codec", "drain_s", "dropped", "error_feedback",
    "fetch_threads", "fragment_mb", "fragments", "gone_after_s", "grace_gamma", "heartbeat_s", "hold_state", "hours", "join_timeout_s", "junk_mb", "junk_stats",
    "keep_serving", "kinds", "kill_at", "learner_failure", "learners", "lease_s", "made_up_ids", "max_claim_ratio", "max_norm_ratio", "max_grace_s", "max_object_bytes",
    "max_link_share", "max_refusals_listed", "max_round_bytes", "max_silent_rounds", "max_staleness", "merge_rule", "merge_s",
    "merge_wait_s", "metrics_port", "min_quorum", "min_round_s", "model_seed", "mtbi_years", "num_fragments",
    "outer_lr", "outer_momentum", "overlap_steps", "own_version_wait", "radial_directional", "reach_timeout_s",
    "read_batch_bytes", "repair_s", "repeats", "rescale_s", "restart_delay_s", "restart_s", "reuse_freed_memory", "round_s", "run",
    "save_state", "scale_rounds", "seconds", "send_ahead", "seed", "slice_chips", "slow_factor", "slowdown", "speed_cv",
    "stale_momentum", "staleness_discount", "staleness_relative", "standby", "state_every", "state_link_share", "state_max_age_s", "step_time_s", "steps", "shard", "shards", "sync_every", "tensors", "threads", "timeout_s", "transfer_nice", "transfer_share", "transfer_threads",
    "token_budget", "until", "upload_deadline_s", "upload_s", "wait_for_merge", "window_s"
})
"""Every setting name (field and flag spellings) of every command: `cli.every_setting()` declares
them all to find out, importing every room (seconds); a unit test holds this list to it."""

ENV_OTHERS = frozenset({"DILOCO_CONFIG", "DILOCO_REDIS_URL", "DILOCO_S3_ENDPOINT", "DILOCO_S3_BUCKET",
                        "DILOCO_S3_PREFIX", "DILOCO_S3_REGION", "DILOCO_LEARNER_ID", "DILOCO_CRASH_AT",
                        "DILOCO_TEST_REQUIRE_TLS"})
"""DILOCO_* variables read outside the commands' options (storage.settings, the learner's id, the
test suite's crash points and TLS switch)."""


def _closest(word: str, names: Iterable[str]) -> str:
    near = difflib.get_close_matches(word, sorted(names), n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


def recording_sources() -> Sources:
    """Sources with nothing set, recording the names options ask for (`every_setting`)."""
    global _sources
    _sources = Sources()
    return _sources


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
    limits some to the values given (a `Literal` field to its own); `title` heads the group in --help. Defaults come from the
    environment and the config file when they set the field (module docstring)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(title or _title(cls))
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        allowed = (choices or {}).get(f.name)
        if typing.get_origin(tp) is typing.Literal:  # a choice of strings: the type lists them
            tp, allowed = str, typing.get_args(tp)
        if f.name in skip or tp not in (int, float, str, bool):
            continue
        flag = (flags or {}).get(f.name) or "--" + f.name.replace("_", "-")
        extra: dict[str, Any] = {"choices": list(allowed)} if allowed is not None else {}
        doc = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        named = flag.lstrip("-").replace("-", "_")
        given = _sources.value(named, tp, allowed, old=f.name if named != f.name else None)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and given is None:
            group.add_argument(flag, dest=f.name, type=tp, required=True, help=f"{doc} (required)", **extra)
            continue
        if given is not None:
            default, origin = given[0], f"from {given[1]}"
            _origins[f.name] = given[1]
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            origin = f"{ENV_PREFIX}{named.upper()}"
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


def whole_numbers(text: str, option: str) -> list[int]:
    """A comma-separated list of whole numbers (`--shards 1,2,4`; blank: none); ConfigError naming
    `option` for anything else, an empty item included."""
    if not text.strip():
        return []
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated whole numbers, got {text!r}") from None


_origins: dict[str, str] = {}
"""Field name -> where its default came from (a DILOCO_* variable or the config file), for errors."""


def chosen(text: str, option: str, choices: Sequence[str]) -> list[str]:
    """A comma-separated list of some of `choices` (`--codecs int4,sign8`), at least one; ConfigError
    naming `option` and the choices otherwise."""
    picked = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in picked if c not in choices]
    if unknown or not picked:
        named = f" ({', '.join(unknown)}: not one of them)" if unknown else ""
        raise ConfigError(f"{option} takes a comma-separated subset of {','.join(choices)}, got {text!r}{named}")
    return picked


def require_at_least(config: object, **least: int) -> None:
    """ConfigError naming the option (`--made-up-ids`) of the first field of `config` below its least value."""
    for name, bound in least.items():
        if getattr(config, name) < bound:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {bound}, got {getattr(config, name)}")


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
