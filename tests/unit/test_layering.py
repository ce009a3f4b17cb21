"""storage is the lowest layer; workers and coordinator never import each other; infra composes.

The layers are the folders storage/, workers/, coordinator/ and infra/, installed as `diloco.storage`
and so on; diloco/ is the public API (`from diloco import Learner`), which exposes the learner's side
only. Every import of the project is under `diloco.`: a top-level `storage` is a user's own package.

Inside infra, each folder is a room (ROOMS). A room imports no room beside it, only those ROOMS
lists below it: `local` (servers and processes on this machine) is under demo, chaos and bench, and
so is `history` (they evaluate a run's global model, and the demo exports its history). The modules
at infra's top are the command line: `cli.py` names the rooms' subcommands as strings and imports
none of them; `options.py` and `output.py` are the kit every room (and cli.py) may use, and import
no room. Folders of deployment files (FILES: the image, Kubernetes, SkyPilot, Prometheus) hold no code.
"""

import ast
from importlib.util import resolve_name
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "diloco"
ALLOWED = {
    "storage": {"storage"},
    "workers": {"storage", "workers"},
    "coordinator": {"storage", "coordinator"},
    "infra": {"storage", "workers", "coordinator", "infra"},
    PACKAGE: {"storage", "workers"},
}
LAYERS = set(ALLOWED) - {PACKAGE}


def package_of(path: Path) -> str:
    """The package a module's relative imports start from: `storage/bus.py` -> `diloco.storage`."""
    parts = path.relative_to(ROOT).parent.parts
    return ".".join(parts if parts[0] == PACKAGE else (PACKAGE, *parts))


def layer_of(module: str) -> str:
    """The layer a module belongs to: `diloco.workers.learner` -> workers, `diloco` -> diloco (the
    public API); a top-level `storage.bus` is not the project's, and is named as such."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return f"top-level {parts[0]}"
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else PACKAGE


def imported_names(source: str, package: str) -> set[str]:
    """Every name a module of `package` imports, absolute: `from . import policy` in diloco.coordinator
    is diloco.coordinator.policy; `from diloco import storage` names diloco.storage (a layer) and
    `from diloco import Learner` diloco.Learner (the API)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def imported_layers(source: str, package: str) -> set[str]:
    """The layers (as `layer_of` names them) that a module of `package` imports."""
    names = imported_names(source, package)
    ours = {name for name in names if name.split(".")[0] in LAYERS | {PACKAGE}}
    return {layer_of(name) for name in ours}


def test_layers_only_import_downwards():
    violations = []
    for layer, allowed in ALLOWED.items():
        files = sorted((ROOT / layer).rglob("*.py"))
        assert files, f"layer {layer} has no modules"
        for path in files:
            for imported in imported_layers(path.read_text(), package_of(path)) - allowed:
                violations.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not violations, "layering violated:\n" + "\n".join(violations)


ROOMS = {
    "local": set(),
    "history": set(),
    "roles": set(),
    "goodput": set(),
    "watch": {"history"},
    "demo": {"local", "history"},
    "chaos": {"local", "history"},
    "bench": {"local", "history"},
}
"""Each room of infra and the rooms it may import (besides itself and the kit)."""
KIT = {"options", "output"}
"""infra's top-level modules that every room (and the command line) may import."""
FILES = {"deploy", "k8s", "skypilot", "metrics"}
"""Folders of infra that hold deployment files, no Python: the image, Kubernetes, SkyPilot, Prometheus/Grafana."""
INFRA = f"{PACKAGE}.infra"


def infra_part(module: str) -> str | None:
    """What of infra a module names: `diloco.infra.chaos.ledger` -> chaos (a room), `diloco.infra.output`
    -> output (a top-level module), `diloco.infra` -> the package itself; None outside infra."""
    parts = module.split(".")
    if parts[:2] != [PACKAGE, "infra"]:
        return None
    return parts[2] if len(parts) > 2 else "infra"


def imported_infra_parts(source: str, package: str) -> set[str]:
    """The rooms and top-level modules of infra (as `infra_part` names them) that a module imports."""
    return {part for name in imported_names(source, package) if (part := infra_part(name)) is not None}


def test_infra_is_rooms_and_the_command_line():
    # A new folder must say where it sits (a room nobody listed would import anything), and the top
    # holds only the command line and its kit.
    folders = {p.name for p in (ROOT / "infra").iterdir() if p.is_dir() and p.name != "__pycache__"} - FILES
    assert folders == set(ROOMS), f"rooms of infra not in ROOMS, or gone: {sorted(folders ^ set(ROOMS))}"
    for name in FILES:
        assert not list((ROOT / "infra" / name).rglob("*.py")), f"infra/{name} holds deployment files, not code"
    top = {p.stem for p in (ROOT / "infra").glob("*.py")}
    assert top == {"__init__", "cli"} | KIT, f"infra's top holds {sorted(top)}: a module of a room belongs in it"
    for room in ROOMS:
        assert (ROOT / "infra" / room / "__init__.py").is_file(), f"infra/{room} is not a package"


def test_rooms_import_only_the_rooms_below_them_and_the_kit():
    violations = []
    for path in sorted((ROOT / "infra").rglob("*.py")):
        where = path.relative_to(ROOT / "infra").parts
        if len(where) == 1:  # the top: cli.py imports no room, the kit imports nothing of infra but itself
            allowed = KIT
        else:
            allowed = {where[0], *ROOMS[where[0]], *KIT}
        for part in imported_infra_parts(path.read_text(), package_of(path)) - allowed:
            violations.append(f"{path.relative_to(ROOT)} imports infra.{part}")
    assert not violations, "rooms of infra import sideways:\n" + "\n".join(violations)


def test_every_subcommand_lives_in_its_rooms_cli():
    from diloco.infra.cli import COMMANDS, room_cli

    source = (ROOT / "infra" / "cli.py").read_text()
    for name, room, _ in COMMANDS:
        assert room in ROOMS, f"diloco {name}: no room {room}"
        tree = ast.parse((ROOT / "infra" / room / "cli.py").read_text())
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert {f"add_{name}_arguments", f"run_{name}"} <= functions, f"diloco {name}: not in {room_cli(room)}"
    assert "import_module" in source  # rooms are imported by name, when their subcommand is chosen


def test_the_scan_names_each_kind_of_import():
    # The rules must not pass because the scan stopped seeing imports.
    source = "\n".join(["import diloco.storage.bus", "from diloco.workers.learner import Learner",
                        "from diloco import coordinator", "from diloco import Learner", "from ..infra import cli",
                        "from . import policy", "from storage.settings import Endpoints", "import torch"])
    assert imported_layers(source, "diloco.coordinator") == {
        "storage", "workers", "coordinator", "diloco", "infra", "top-level storage"}


def test_the_room_scan_names_rooms_the_top_and_relative_imports():
    source = "\n".join(["from diloco.infra.local.stack import LocalStack", "import diloco.infra.output",
                        "from diloco.infra import history", "from ..chaos import ledger", "from . import suite",
                        "from diloco.storage.bus import Bus"])
    assert imported_infra_parts(source, "diloco.infra.chaos") == {"local", "output", "history", "chaos"}
