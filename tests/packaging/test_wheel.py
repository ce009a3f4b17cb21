"""The package as a user gets it: the built wheel (not the editable install) in a fresh venv, used
from a project of the user's own that has top-level `storage` and `workers` packages.

Nothing is downloaded. The wheel is built from a copy of the sources with the project venv's
setuptools; the fresh venv has no system site-packages and finds the dependencies (torch, redis,
boto3, ...) through a .pth file naming a folder of links to the project venv's site-packages, less
the editable install of diloco (its finder, its .pth and its metadata), which could otherwise stand
in for the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("storage", "workers", "coordinator", "infra")
SOURCES = ("pyproject.toml", "README.md", "diloco", *LAYERS)
USERS_OWN = "the user's project"

USER_SCRIPT = f"""
import json, storage, workers  # the user's own packages, imported first
import diloco
from diloco import Learner, LearnerConfig
from diloco.storage.bus import Bus
import diloco.infra.cli

assert storage.OWNER == workers.OWNER == {USERS_OWN!r}
print(json.dumps({{"diloco": diloco.__file__, "version": diloco.__version__, "Learner": Learner.__module__,
                  "LearnerConfig": LearnerConfig.__name__, "bus": Bus.__module__,
                  "storage": storage.__file__, "workers": workers.__file__}}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
          "--wheel-dir", str(dist), str(src)])
    (built,) = dist.glob("diloco-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, with the project venv's dependencies but not its diloco."""
    home = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(home)])
    python = home / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
          str(wheel)])
    deps = tmp_path_factory.mktemp("deps")
    for site in {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}:
        for entry in Path(site).iterdir():
            if not _is_projects_own(entry.name) and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    site_packages = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    (site_packages / "project-deps.pth").write_text(f"{deps}\n")
    return home


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    """A project of the user's own: its packages `storage` and `workers` hold none of diloco's modules."""
    for name in ("storage", "workers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"OWNER = {USERS_OWN!r}\n")
    return tmp_path


def test_the_wheel_installs_one_package_holding_every_module_and_the_compose_file(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"diloco"}
    expected = {"diloco/__init__.py", "diloco/infra/local/docker-compose.yml"}
    for layer in LAYERS:
        expected |= {f"diloco/{path.relative_to(ROOT).as_posix()}" for path in (ROOT / layer).rglob("*.py")}
    missing = sorted(expected - names)
    assert not missing, "not in the wheel (a package missing from [tool.setuptools] packages?):\n" + "\n".join(missing)


def test_diloco_imports_beside_the_users_own_storage_and_workers(wheel: Path, venv: Path, user_project: Path):
    seen = json.loads(_run([str(venv / "bin" / "python"), "-c", USER_SCRIPT], cwd=user_project))
    installed = Path(seen["diloco"]).parent
    assert installed.is_relative_to(venv), f"diloco came from {installed}, not the wheel in {venv}"
    assert (installed / "infra" / "local" / "docker-compose.yml").is_file()
    assert seen["version"] == wheel.name.split("-")[1]
    assert (seen["Learner"], seen["LearnerConfig"], seen["bus"]) == (
        "diloco.workers.learner", "LearnerConfig", "diloco.storage.bus")
    assert Path(seen["storage"]).parent == user_project / "storage"
    assert Path(seen["workers"]).parent == user_project / "workers"


@pytest.mark.slow  # 6 s; `make test` keeps the import beside the user's own packages
def test_the_command_line_runs_from_the_users_project(venv: Path, user_project: Path):
    assert "usage: diloco" in _run([str(venv / "bin" / "diloco"), "--help"], cwd=user_project)
    # `python -m` puts the working directory, and so the user's packages, first on sys.path.
    learner_help = _run([str(venv / "bin" / "python"), "-m", "diloco.infra.cli", "learner", "--help"],
                        cwd=user_project)
    assert "--run" in learner_help


def _is_projects_own(name: str) -> bool:
    """The editable install of diloco in the project venv: finder module, .pth files, metadata."""
    return name.startswith(("__editable__", "diloco")) or name.endswith(".pth")


def _run(argv: list[str], cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run(argv, cwd=cwd, env=env | {"PYTHONNOUSERSITE": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout
