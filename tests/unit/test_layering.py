"""storage is the lowest layer; workers and coordinator never import each other; infra composes."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "storage": {"storage"},
    "workers": {"storage", "workers"},
    "coordinator": {"storage", "coordinator"},
    "infra": {"storage", "workers", "coordinator", "infra"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(ALLOWED)


def test_layers_only_import_downwards():
    violations = []
    for layer, allowed in ALLOWED.items():
        files = sorted((ROOT / layer).rglob("*.py"))
        assert files, f"layer {layer} has no modules"
        for path in files:
            for pkg in imported_packages(path) - allowed:
                violations.append(f"{path.relative_to(ROOT)} imports {pkg}")
    assert not violations, "layering violated:\n" + "\n".join(violations)
