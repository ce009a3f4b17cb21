"""No bytes from the network may reach pickle, marshal, torch.load or eval: they run code.

Every payload is msgpack (`storage.protocol`) or a tensor object (`storage.codecs`), both parsed
with bounds and refusals. This test parses every module of the package (diloco/ and the four layers)
and fails, naming file:line, on an import of a module that unpickles or a call that loads or
evaluates code. Nothing is allowlisted: a new use must show here, with a comment saying why its
input is not from the network.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("diloco", "storage", "workers", "coordinator", "infra")

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
"""Each of them turns bytes into objects by running what the bytes say."""
UNSAFE_BUILTINS = {"eval", "exec", "__import__"}
UNSAFE_CALLS = {
    "torch.load", "torch.serialization.load", "torch.jit.load", "numpy.load", "np.load",
    # torch.distributed's *_object collectives pickle what they send and unpickle what other ranks send.
    "torch.distributed.broadcast_object_list", "dist.broadcast_object_list",
    "torch.distributed.all_gather_object", "dist.all_gather_object",
    "torch.distributed.gather_object", "dist.gather_object",
    "torch.distributed.scatter_object_list", "dist.scatter_object_list",
    "torch.distributed.recv_object_list", "dist.recv_object_list",
}
UNSAFE_NAMES = {name.rsplit(".", 1)[1] for name in UNSAFE_CALLS if name.startswith("torch.")}
"""The same functions imported by name: `from torch import load`."""


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def unsafe_uses(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
            what = f"import {', '.join(bad)}" if bad else None
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNSAFE_MODULES:
                what = f"from {node.module} import ..."
            elif node.module.split(".")[0] == "torch":
                bad = [a.name for a in node.names if a.name in UNSAFE_NAMES]
                what = f"from {node.module} import {', '.join(bad)}" if bad else None
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            if isinstance(node.func, ast.Name) and node.func.id in UNSAFE_BUILTINS:
                what = f"{node.func.id}()"
            elif name in UNSAFE_CALLS or name in {f"builtins.{b}" for b in UNSAFE_BUILTINS}:
                what = f"{name}()"
        if what:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {what}")
    return found


def test_no_module_can_unpickle_load_or_eval_bytes():
    files = [path for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py"))]
    assert len(files) > 20, "the layers' modules were not found"
    found = [use for path in files for use in unsafe_uses(path)]
    assert not found, "code that unpickles or evaluates bytes (see this test's docstring):\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_use(tmp_path):
    # The scan itself must not rot into a test that passes because it sees nothing.
    sample = tmp_path / "sample.py"
    lines = ["import pickle", "import marshal as m", "from torch import load", "import torch",
             "from torch.distributed import broadcast_object_list",
             "x = torch.load(b)", "y = eval(s)", "exec(s)", "model.eval()", "z = np.load(f)",
             "torch.distributed.all_gather_object(out, obj)"]
    sample.write_text("\n".join(lines) + "\n")
    found = unsafe_uses(sample, root=tmp_path)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "5", "6", "7", "8", "10", "11"], found
