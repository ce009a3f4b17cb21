"""The image's install, run: the deployment files' commands in a fresh venv, against real servers.

A venv is installed the way infra/deploy/Dockerfile installs the image: its RUN lines' `pip install`s,
from a copy of its build context (what Dockerfile.dockerignore lets through), with its ENV. The one
change: torch comes from this machine's pip configuration instead of the CPU wheel index.
Then, on the session's real Redis + S3 stack, each platform's coordinator and two learners run as the
files run them (the Kubernetes commands and env, the SkyPilot `run` scripts under bash with the venv as
~/diloco-venv): the coordinator serves /metrics where the file asks for it, the learners train until a
round is merged and leave on SIGTERM with exit 143 within the grace their platform gives, the
coordinator stops on SIGTERM with exit 0. The tool commands of the deployment docs (`finish`, `plot`,
`model export`) run against the Kubernetes run. Without Docker, a cluster or a cloud, that is as far
as the files can be run here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.infra.local.fleet import Proc
from diloco.infra.local.stack import LocalStack, free_ports
from diloco.storage.settings import Endpoints
from harness import fresh_endpoints, merged_ids, wait_for
from test_deploy_files import (GCP_SPOT_NOTICE_S, K8S, SKYPILOT, build_context, container_argv, doc_invocations,
                               dockerfile_instructions, dockerignore_rules, k8s_env, option, pip_installs,
                               pod_spec, workload, yaml)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(yaml is None, reason="pyyaml is not installed"),
              pytest.mark.timeout(1500)]

RUN_SIDE_COMMANDS = {"coordinator", "learner"}  # the files run these; every other doc command is a tool
MERGE_TIMEOUT_S = 180.0


# -- the image as a venv -----------------------------------------------------------------------------

def dockerfile_env() -> dict[str, str]:
    env = {}
    for instruction, arguments in dockerfile_instructions():
        if instruction == "ENV":
            env |= dict(word.split("=", 1) for word in shlex.split(arguments))
    return env


def without_index(words: list[str]) -> list[str]:
    """A `pip install`'s words less `--index-url URL`: this machine's pip configuration finds torch."""
    if "--index-url" not in words:
        return words
    i = words.index("--index-url")
    return words[:i] + words[i + 2:]


def clean_env() -> dict[str, str]:
    """Ours less what would let the venv import this checkout or read this test run's settings."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("DILOCO_")}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv installed as the Dockerfile installs the image; its bin/ holds `diloco`."""
    root = tmp_path_factory.mktemp("image")
    context, venv = root / "src", root / "venv"
    for f in build_context(dockerignore_rules()):
        (context / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(__file__).resolve().parents[2] / f, context / f)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = clean_env() | dockerfile_env()
    for words in pip_installs():
        out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", *without_index(words)],
                             cwd=context, env=env, capture_output=True, text=True, timeout=1200)
        assert out.returncode == 0, f"pip install {shlex.join(words)}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return venv


@pytest.fixture
def on_stack(image: Path, stack: LocalStack, monkeypatch: pytest.MonkeyPatch,
             tmp_path: Path) -> Iterator[tuple[dict[str, str], Endpoints, list[Proc]]]:
    """The environment of a process of the image on this test's bucket (the venv first on PATH, a HOME
    whose ~/diloco-venv is the venv, as SkyPilot's setup leaves it), the bucket's endpoints, and a list
    of processes killed at the end whatever happened."""
    endpoints = fresh_endpoints(stack, monkeypatch)
    home = tmp_path / "home"
    home.mkdir()
    (home / "diloco-venv").symlink_to(image)
    env = clean_env() | endpoints.to_env() | {k: v for k, v in stack.env().items() if k.startswith("AWS_")} | {
        "PATH": f"{image / 'bin'}:{os.environ['PATH']}", "HOME": str(home), "OMP_NUM_THREADS": "1"}
    procs: list[Proc] = []
    yield env, endpoints, procs
    for p in procs:
        p.kill()


# -- the platforms' launches --------------------------------------------------------------------------

def k8s_launches(metrics_port: int) -> tuple[list[str], dict[str, str], int, Any]:
    """(coordinator argv, its env, the learners' grace s, learner i -> (argv, env)) from infra/k8s. The
    coordinator's --metrics-port becomes a free port (two runs may share this machine)."""
    job = workload("diloco-learners")
    coordinator = pod_spec(workload("diloco-coordinator"))["containers"][0]
    argv = container_argv(coordinator)
    if "--metrics-port" in argv:
        argv[argv.index("--metrics-port") + 1] = str(metrics_port)
    learner = pod_spec(job)["containers"][0]
    grace = pod_spec(job).get("terminationGracePeriodSeconds", 30)
    coordinator_env = {e["name"]: str(e["value"]) for e in coordinator.get("env", []) if "value" in e}
    return argv, coordinator_env, grace, lambda i: (container_argv(learner), k8s_env(learner, i))


def sky_launches() -> tuple[list[str], dict[str, str], int, Any]:
    """The same from infra/skypilot: its `run` scripts under bash, with the task's envs."""
    tasks = {p.name: yaml.safe_load(p.read_text()) for p in sorted(SKYPILOT.glob("*.yaml"))}

    def envs(task: dict[str, Any]) -> dict[str, str]:
        return {k: v for k, v in (task.get("envs") or {}).items() if v is not None}

    coordinator, learner = tasks["coordinator.yaml"], tasks["learner.yaml"]
    return (["bash", "-c", coordinator["run"]], envs(coordinator), GCP_SPOT_NOTICE_S,
            lambda i: (["bash", "-c", learner["run"]], envs(learner) | {
                "LEARNER": str(i), "SKYPILOT_NODE_RANK": "0",
                "SKYPILOT_TASK_ID": f"sky-managed-2026-01-31-12-00-00-123456_diloco-learner-{i}_{i + 1}-0"}))


def run_id_of(argv: list[str], env: dict[str, str]) -> str:
    run = option(argv, "--run")
    if run is not None:
        return run
    script = argv[-1]  # a SkyPilot run script: `--run "$RUN_ID"`
    word = re.search(r"--run\s+(\S+)", script)[1].strip("\"'")
    return re.sub(r"\$\{?([A-Za-z_]+)\}?", lambda m: env[m[1]], word)


def metrics_text(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


# -- the tests --------------------------------------------------------------------------------------

def test_the_image_install_has_what_the_files_need(image: Path, tmp_path: Path):
    # cwd: not the checkout, whose diloco/ `python -c` would import (the image runs in /home/diloco).
    out = subprocess.run([str(image / "bin" / "python"), "-m", "pip", "check"], env=clean_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # --metrics-port, `diloco plot`, `diloco model export --format hf`: what each imports first.
    imports = "import prometheus_client, matplotlib.backends.backend_agg, transformers, diloco; print(diloco.__file__)"
    out = subprocess.run([str(image / "bin" / "python"), "-c", imports], env=clean_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(image) in out.stdout, f"diloco came from {out.stdout}, not from the image's install"
    for argv in (["--help"], ["learner", "--help"], ["coordinator", "--help"]):
        out = subprocess.run([str(image / "bin" / "diloco"), *argv], env=clean_env(), cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"diloco {shlex.join(argv)}:\n{out.stderr}"


@pytest.mark.parametrize("platform", ["k8s", "skypilot"])
def test_the_files_run_a_coordinator_and_learners_that_leave_on_sigterm(
        platform: str, on_stack: tuple[dict[str, str], Endpoints, list[Proc]], tmp_path: Path):
    env, endpoints, procs = on_stack
    (port,) = free_ports(1)
    coordinator_argv, coordinator_env, grace_s, learner = k8s_launches(port) if platform == "k8s" else sky_launches()
    run = run_id_of(coordinator_argv, coordinator_env)
    coordinator = Proc("coordinator", coordinator_argv, tmp_path / "coordinator.log",
                       coordinator_env | env, cwd=tmp_path).start()
    procs.append(coordinator)
    if "--metrics-port" in coordinator_argv:
        wait_for("the coordinator's /metrics", lambda: metrics_text(port) is not None, [coordinator], 120)
    learners = []
    for i in range(2):  # --min-quorum 2: a round merges with two learners' pieces
        argv, learner_env = learner(i)
        learners.append(Proc(f"learner-{i}", argv, tmp_path / f"learner-{i}.log", learner_env | env,
                             cwd=tmp_path).start())
    procs.extend(learners)
    wait_for("a merged round", lambda: bool(merged_ids(endpoints, run)), [coordinator, *learners], MERGE_TIMEOUT_S)
    if "--metrics-port" in coordinator_argv:
        assert "diloco" in (metrics_text(port) or ""), "the coordinator's /metrics has no diloco series"
    for p in learners:
        p.send(signal.SIGTERM)
    for p in learners:
        rc = p.wait(grace_s)
        assert rc == 143, f"{p.name} exited {rc} within {grace_s} s of SIGTERM (143: restart me):\n{p.tail(30)}"
    if platform == "k8s":
        run_the_docs_tools(env, tmp_path)  # `diloco finish` among them: the run ends, its coordinator exits 0
        assert coordinator.wait(60) == 0, coordinator.tail(30)
    else:
        coordinator.send(signal.SIGTERM)  # stopped while the run goes on: 143, relaunch me
        assert coordinator.wait(60) == 143, coordinator.tail(30)


def run_the_docs_tools(env: dict[str, str], cwd: Path) -> None:
    """Every `diloco` tool command of the deployment docs (finish, plot, model export, ...), in their
    order, as the image runs them; each exits 0."""
    tools = [(label, argv) for label, path, argv in doc_invocations()
             if path.parent == K8S or path.name == "deployment.md"]
    tools = [(label, argv) for label, argv in tools if argv[0] not in RUN_SIDE_COMMANDS]
    assert {argv[0] for _l, argv in tools} >= {"finish", "plot", "model"}, tools
    done = set()
    for label, argv in tools:
        if tuple(argv) in done:  # the same command in two docs
            continue
        done.add(tuple(argv))
        out = subprocess.run(["diloco", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{label}: diloco {shlex.join(argv)} exited {out.returncode}:\n{out.stderr[-3000:]}"
        if (target := option(argv, "--out")) is not None:
            assert any((cwd / target).iterdir()), f"{label}: nothing written to {target}"
