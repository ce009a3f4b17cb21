"""The history tools on the command line: `diloco export`, `import`, `model export`, `replay`, `gc`,
`whatif`, `inspect` and `blame`.

Each subcommand is `add_<name>_arguments(parser)` + `run_<name>(args) -> int`, listed in
`infra.cli.COMMANDS`. All but export and import read a live bucket (S3 settings from the
environment, never Redis) or an export (`--dir`), through `open_source`. Results go to stdout,
`--json PATH` gets the same data, and progress and problems go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from diloco.infra.history.archive import dir_keys, export_run, import_keys, import_run
from diloco.infra.history.blame import blame_run
from diloco.infra.history.gc import DEFAULT_MIN_AGE_S, collect
from diloco.infra.history.inspection import inspect_run, inspect_version
from diloco.infra.history.model_export import FORMATS, HF_CLASSES, export_model
from diloco.infra.history.replay import VersionCheck, replay_run
from diloco.infra.history.rounds import Run, open_run
from diloco.infra.history.whatif import SETTINGS, parse_changes, what_if
from diloco.infra.output import Progress, write_json
from diloco.storage.errors import ConfigError
from diloco.storage.global_model import parse_which, read_global
from diloco.storage.keys import RunKeys
from diloco.storage.localdir import DirStore
from diloco.storage.objects import ObjectStore, Store
from diloco.storage.settings import ENV_S3_PREFIX, Endpoints
from diloco.workers.tasks.kinds import load_task

log = logging.getLogger("diloco")


# -- where the history tools read from: a bucket (the environment) or an export (--dir) ----------


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", help="run id (optional with --dir when the export holds one run)")
    parser.add_argument("--dir", type=Path, metavar="DIR",
                        help="read the run from this export directory (`diloco export`) instead of the bucket "
                             "the environment names")
    parser.add_argument("--prefix", help="read the run under this key prefix instead of DILOCO_S3_PREFIX or the "
                        "export's (e.g. a what-if run written by `diloco whatif --into PREFIX`)")


def add_range_arguments(parser: argparse.ArgumentParser, *, verb: str, start_default: int | None,
                        start_help: str, json_help: str) -> None:
    """--fragment, --from, --to and --json, as every history tool takes them."""
    parser.add_argument("--fragment", type=int, help="only this fragment (default: every fragment)")
    parser.add_argument("--from", dest="start", type=int, default=start_default, metavar="V",
                        help=f"first version to {verb} (default: {start_help})")
    parser.add_argument("--to", dest="end", type=int, metavar="W", help=f"last version to {verb} (default: the latest)")
    parser.add_argument("--json", dest="json_path", type=Path, metavar="PATH", help=json_help)


def open_source(args: argparse.Namespace) -> tuple[Store, RunKeys]:
    """The store and keys `--run` / `--dir` / `--prefix` name. The bucket needs only the S3
    settings: the history tools never contact Redis."""
    if args.dir is not None:
        store, keys = DirStore(args.dir), dir_keys(args.dir, args.run)
    elif not args.run:
        raise ConfigError("--run is required (or --dir with an export)")
    else:
        endpoints = Endpoints.from_env(redis=False)
        store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, args.run)
    return store, keys if args.prefix is None else RunKeys(args.prefix, keys.run)


def _open(args: argparse.Namespace) -> Run:
    return open_run(*open_source(args))  # S3 (or an export) is the history: never Redis


# -- export / import -------------------------------------------------------------------------------

def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run id to export")
    parser.add_argument("--dir", type=Path, required=True, metavar="DIR",
                        help="directory to copy the run's history into (created; an earlier export of the "
                             "run there is brought up to date)")


def _progress(verb: str, bar: Progress) -> Callable[[int, int], None]:
    """A bar on a terminal; elsewhere a log line every 500 objects."""
    def progress(done: int, total: int) -> None:
        bar.update(done, total)
        if not bar.shown and (done == total or done % 500 == 0):
            log.info("%s %d/%d objects", verb, done, total)
    return progress


def run_export(args: argparse.Namespace) -> int:
    endpoints = Endpoints.from_env(redis=False)
    keys = RunKeys(endpoints.prefix, args.run)
    with Progress(f"exporting {args.run}", unit="objects") as bar:
        copied = export_run(ObjectStore(endpoints), keys, args.dir, progress=_progress("exported", bar))
    print(copied.line("exported", f"into {args.dir}"))
    return 0


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, required=True, metavar="DIR", help="an export directory")
    parser.add_argument("--run", help="run id to import (optional when the export holds one run)")


def run_import(args: argparse.Namespace) -> int:
    keys = import_keys(args.dir, args.run, os.environ.get(ENV_S3_PREFIX))
    endpoints = replace(Endpoints.from_env(redis=False), prefix=keys.prefix)
    store = ObjectStore(endpoints)
    store.ensure_bucket()
    with Progress(f"importing {keys.run}", unit="objects") as bar:
        copied = import_run(args.dir, store, keys, progress=_progress("imported", bar))
    print(copied.line("imported", f"into {store.url(keys.root)}"))
    return 0


# -- model export ----------------------------------------------------------------------------------

def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="model_action", required=True, metavar="ACTION")
    export = actions.add_parser("export", help="write the run's global model as a checkpoint (safetensors, a torch "
                                "state_dict, or a Hugging Face save_pretrained directory)",
                                description="Write the run's global model (every fragment's params at the chosen "
                                "versions, each checked against its manifest's sha256) into --out.")
    add_source_arguments(export)
    export.add_argument("--version", default="latest", metavar="WHICH",
                        help="latest (each fragment's newest version; a finished run's final model), final (the "
                             "versions the run's end names; refused before it ends), V (every fragment at version V) "
                             "or V0,V1,... (one per fragment) (default: %(default)s)")
    export.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write into (created)")
    export.add_argument("--format", default="safetensors", choices=FORMATS, help="(default: %(default)s)")
    export.add_argument("--hf-config", type=Path, metavar="DIR",
                        help="with --format hf: a directory holding the model's config.json")
    export.add_argument("--hf-class", default="AutoModelForCausalLM", choices=HF_CLASSES, metavar="CLASS",
                        help="with --format hf: the transformers class to build from the config: "
                             f"{', '.join(HF_CLASSES)} (default: %(default)s)")


def run_model(args: argparse.Namespace) -> int:
    try:
        which = parse_which(args.version)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    store, keys = open_source(args)
    model = read_global(store, keys, which)
    log.info("read %s", model.describe())
    try:
        written = export_model(model, args.out, args.format, hf_config=args.hf_config, hf_class=args.hf_class)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for path in written:
        print(path)
    return 0


# -- replay --------------------------------------------------------------------------------------

def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    add_range_arguments(parser, verb="replay", start_default=None,
                        start_help="the genesis, or the first version whose inputs `diloco gc` kept",
                        json_help="also write the results, version by version, to this JSON file")


def run_replay(args: argparse.Namespace) -> int:
    """Exit 0 only if at least one version was checked and every one is bit-exact."""
    store, keys = open_source(args)  # S3 (or an export) is the history: replay never needs Redis

    with Progress(f"replaying {keys.run}", unit="versions") as bar:
        def progress(check: VersionCheck) -> None:
            bar.advance()
            if not check.bit_exact or not bar.shown:  # on a terminal the bar counts; problems are always logged
                (log.info if check.bit_exact else log.error)("%s", check.line())

        report = replay_run(store, keys, fragment=args.fragment, start=args.start, end=args.end, progress=progress)
    print(report.summary())
    write_json(args.json_path, report.to_json())
    if not report.checks:
        log.error("no committed version of run %s in the range asked for", keys.run)
    return 0 if report.ok else 1


# -- gc ------------------------------------------------------------------------------------------

def add_gc_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--keep-last", type=int, required=True, metavar="N",
                        help="keep what replaying the last N versions of each fragment needs (N >= 1)")
    parser.add_argument("--min-age-s", type=float, default=DEFAULT_MIN_AGE_S, metavar="S",
                        help="never delete an object younger than this (default: %(default)g s): a margin for "
                             "readers of a live run")
    parser.add_argument("--dry-run", action="store_true", help="say what would be deleted and delete nothing")
    parser.add_argument("--list-keys", action="store_true",
                        help="also print every key deleted (or that would be) and every key kept for a reason "
                             "(so does -v, which adds debug logging)")
    parser.add_argument("--json", dest="json_path", type=Path, metavar="PATH",
                        help="also write the figures and every key to this JSON file")


def run_gc(args: argparse.Namespace) -> int:
    store, keys = open_source(args)
    with Progress(f"gc {keys.run}: reading manifests", unit="manifests") as bar:
        result = collect(store, keys, keep_last=args.keep_last, min_age_s=args.min_age_s, dry_run=args.dry_run,
                         progress=bar.update)
    print(result.summary(list_keys=args.list_keys or args.verbose))
    write_json(args.json_path, result.to_json())
    return 0


# -- whatif --------------------------------------------------------------------------------------

def add_whatif_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--into", required=True, metavar="PREFIX",
                        help="key prefix of the scratch run to write (`PREFIX/RUN/...` in the same bucket or export "
                             "directory); must be empty and apart from the run's own prefix")
    parser.add_argument("--set", dest="changes", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting to change, repeatable: " + ", ".join(f"{k} ({w})" for k, (w, _) in
                                                                           SETTINGS.items())
                        + "; none: re-derive with the recorded settings (a check)")
    add_range_arguments(parser, verb="re-derive", start_default=None, start_help="1, or the first version gc kept",
                        json_help="also write the results, version by version, to this JSON file")
    parser.add_argument("--task", type=Path, metavar="PATH",
                        help="the demo task JSON the run trained (the demo writes OUT/task.json): also print the eval "
                             "loss of the recorded and the what-if global model at the end of the range")


def run_whatif(args: argparse.Namespace) -> int:
    changes = parse_changes(args.changes)
    task = load_task(args.task) if args.task is not None else None
    store, keys = open_source(args)
    report, _ = what_if(store, keys, args.into, changes, fragment=args.fragment, start=args.start, end=args.end,
                        task=task, progress=lambda step: log.info("%s", step.line()))
    print(report.summary())
    write_json(args.json_path, report.to_json())
    return 0


# -- inspect and blame ---------------------------------------------------------------------------

def _add_look_range(parser: argparse.ArgumentParser) -> None:
    add_range_arguments(parser, verb="look at", start_default=0, start_help="0",
                        json_help="also write the same data as JSON to this file")


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--version", type=int, metavar="V",
                        help="show this version's inputs and refusals (of every fragment that has it, or of "
                             "--fragment); without it, per-learner aggregates over --from..--to")
    _add_look_range(parser)


def run_inspect(args: argparse.Namespace) -> int:
    run = _open(args)
    if args.version is not None:
        views = inspect_version(run, args.version, args.fragment)
        print("\n\n".join(v.render() for v in views))
        write_json(args.json_path, {"run": run.keys.run, "versions": [v.to_json() for v in views]})
    else:
        view = inspect_run(run, args.fragment, args.start, args.end)
        print(view.render())
        write_json(args.json_path, view.to_json())
    return 0


def add_blame_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    _add_look_range(parser)
    parser.add_argument("--task", type=Path, metavar="TASK.json",
                        help="the demo task the run trained (OUT/task.json of `diloco demo`): adds loss evidence, "
                             "each sampled version re-derived without each of its learners and evaluated")
    parser.add_argument("--loss-versions", type=int, default=10, metavar="N",
                        help="with --task: re-derive the last N versions per fragment that merged two or more "
                             "learners (default: %(default)s; each costs one evaluation per learner)")


def run_blame(args: argparse.Namespace) -> int:
    """Exit 0 whatever the verdicts: blame reports evidence, it does not fail a run."""
    if args.loss_versions < 1:
        raise ConfigError(f"--loss-versions must be at least 1, got {args.loss_versions}")
    task = load_task(args.task) if args.task is not None else None
    report = blame_run(_open(args), fragment=args.fragment, start=args.start, end=args.end, task=task,
                       loss_versions=args.loss_versions, progress=lambda line: log.info("%s", line))
    print(report.render())
    write_json(args.json_path, report.to_json())
    return 0
