"""storage is the lowest layer; workers and coordinator never import each other; infra composes.

The layers are the folders storage/, workers/, coordinator/ and infra/, installed as `diloco.storage`
and so on; diloco/ is the public API (`from diloco import Learner`), which exposes the learner's side
only. Every import of the project is under `diloco.`: a top-level `storage` is a user's own package.
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


def imported_layers(source: str, package: str) -> set[str]:
    """The layers (as `layer_of` names them) that a module of `package` imports."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            # `from diloco import storage` imports a layer; `from diloco import Learner` the API.
            names.update(f"{base}.{alias.name}" for alias in node.names)
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


def test_the_scan_names_each_kind_of_import():
    # The rules must not pass because the scan stopped seeing imports.
    source = "\n".join(["import diloco.storage.bus", "from diloco.workers.learner import Learner",
                        "from diloco import coordinator", "from diloco import Learner", "from ..infra import cli",
                        "from . import policy", "from storage.settings import Endpoints", "import torch"])
    assert imported_layers(source, "diloco.coordinator") == {
        "storage", "workers", "coordinator", "diloco", "infra", "top-level storage"}
