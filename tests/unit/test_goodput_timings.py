"""Timings from a run's records, their projection, and `diloco simulate` on the command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from diloco.infra.cli import build_parser
from diloco.infra.goodput.model import YEAR_S, Model
from diloco.infra.goodput.timings import Failure, Timings, project, timings_from_run
from diloco.storage.errors import ConfigError
from diloco.storage.protocol import Announcement, Contribution, Manifest, RunSpec, VersionSettings

RUN = "timed"
SPEC = RunSpec(run=RUN, num_fragments=1, sync_every=10, overlap_steps=2, merge_rule="rebase", alpha=0.5,
               codec="int8", compress=True, max_object_bytes=1 << 20, created_at=0.0, cadence="clock")
PERIOD_S = 10.0
STEP_S = {"learner-a": 0.5, "learner-b": 1.0}


def announcement(learner: str, n: int) -> Announcement:
    deadline = 1000.0 + n * PERIOD_S
    return Announcement(kind="delta", run=RUN, fragment=0, learner=learner, seq=n,
                        contribution_id=f"{ord(learner[-1]) * 1000 + n:032x}", base_version=0, tokens=10,
                        steps=10, step_time_s=STEP_S[learner], object_key=f"k/{learner}/{n}", size_bytes=1,
                        sha256="0" * 64, sent_at=deadline - STEP_S[learner] / 2 + 0.2, deadline=deadline)


def records() -> tuple[list[tuple[str, Announcement]], list[Manifest]]:
    """learner-a sends every round; learner-b misses rounds 6..10 (down ~40 s). Every announcement
    lands 0.5 s after its learner's mean send time; every round commits 0.3 s after its last one."""
    entries, manifests = [], []
    for n in range(1, 16):
        rnd = []
        for learner in STEP_S:
            if learner == "learner-b" and 6 <= n <= 10:
                continue
            a = announcement(learner, n)
            arrived_ms = round((a.deadline - STEP_S[learner] / 2 + 0.5) * 1000)
            rnd.append((f"{arrived_ms}-0", a))
        entries += rnd
        last = max(int(eid.split("-")[0]) for eid, _ in rnd) / 1000
        inputs = tuple(Contribution(contribution_id=a.contribution_id, learner=a.learner, seq=a.seq,
                                    object_key=a.object_key, sha256=a.sha256, base_version=0, staleness=0,
                                    tokens=a.tokens, steps=a.steps, weight=0.5, stream_id=eid) for eid, a in rnd)
        manifests.append(Manifest(run=RUN, fragment=0, version=n, parent_version=n - 1, params_key="p",
                                  params_sha256="0" * 64, outer_state_key="o", outer_state_sha256="0" * 64,
                                  inputs=inputs, settings=VersionSettings(kind="delta", outer_lr=0.7, outer_momentum=0.9), refused=(), committed_at=last + 0.3, epoch=1))
    return entries, manifests


def test_timings_from_a_runs_records() -> None:
    t = timings_from_run(SPEC, *records())
    assert (t.run, t.sync_every, t.overlap_steps, t.cadence) == (RUN, 10, 2, "clock")
    assert t.step_time_s == STEP_S
    assert t.upload_s == pytest.approx(0.5)
    assert t.merge_s == pytest.approx(0.3)
    assert t.duration_s == pytest.approx(14 * PERIOD_S, abs=0.5)
    assert t.failures == (Failure("learner-b", at_s=pytest.approx(4 * PERIOD_S, abs=0.5),
                                  down_s=pytest.approx(5 * PERIOD_S)),)


def test_timing_file_round_trip_and_refusal(tmp_path) -> None:
    t = timings_from_run(SPEC, *records())
    t.save(tmp_path / "t.json")
    assert Timings.load(tmp_path / "t.json") == t
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="format"):
        Timings.load(tmp_path / "bad.json")


def test_projection_keeps_the_recorded_fleet_unless_given_a_size() -> None:
    t = timings_from_run(SPEC, *records())
    recorded = project(t, Model())
    assert (recorded.learners, recorded.speeds, recorded.step_time_s) == (2, (1.0, 2.0), 0.5)
    assert (recorded.sync_every, recorded.overlap_steps, recorded.upload_s) == (10, 2, pytest.approx(0.5))
    assert recorded.restart_s == recorded.repair_s == pytest.approx(5 * PERIOD_S)
    assert (recorded.chips, recorded.slice_chips, recorded.learner_failure) == (2, 1, "restart")
    assert recorded.mtbi_years * YEAR_S == pytest.approx(2 * t.duration_s)  # one failure in two learners' time
    at_scale = project(t, Model(), chips=1_200_000)
    assert (at_scale.chips, at_scale.slice_chips, at_scale.mtbi_years, at_scale.learner_failure) == (
        1_200_000, Model().slice_chips, 1.0, "rescale")
    assert at_scale.speeds == recorded.speeds
    with pytest.raises(ConfigError, match="no failures"):
        project(replace(t, failures=()), Model())


def simulate(*argv: str) -> int:
    """`diloco simulate ...` without cli.main (which configures logging for the whole session)."""
    args = build_parser(["simulate", *argv]).parse_args(["simulate", *argv])
    return args.handler(args)


def test_simulate_one_fleet_prints_a_table_and_writes_json(tmp_path, capsys) -> None:
    assert simulate("--chips", "600000", "--learners", "4", "--hours", "2", "--json", str(tmp_path / "r.json")) == 0
    out = capsys.readouterr().out
    assert "data-parallel" in out and "elastic data-parallel" in out and "decoupled M=4" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["strategy"] for r in data["results"]] == ["dp", "elastic", "decoupled"]
    assert data["model"]["chips"] == 600_000 and data["model"]["hours"] == 2


def test_simulate_projects_a_timing_file(tmp_path, capsys) -> None:
    timings_from_run(SPEC, *records()).save(tmp_path / "t.json")
    assert simulate("--from-json", str(tmp_path / "t.json"), "--hours", "1", "--json", str(tmp_path / "r.json")) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["model"]["learners"] == 2 and data["model"]["learner_failure"] == "restart"
    assert all(0 < r["goodput"] < 1 for r in data["results"])
    assert "decoupled M=2" in capsys.readouterr().out


def test_simulate_sweep_prints_the_papers_table(tmp_path, capsys) -> None:
    assert simulate("--sweep", "--hours", "0.5", "--json", str(tmp_path / "s.json")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["chips", "DP", "elastic", "M=2", "M=4", "M=8", "M=16"]
    assert [line.split()[0] for line in lines[2:]] == ["150k", "300k", "600k", "1.2M", "2.4M", "paper"]
    assert len(json.loads((tmp_path / "s.json").read_text())["results"]) == 5 * 6


def test_simulate_sweep_draws_the_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    assert simulate("--sweep", "--hours", "0.2", "--plot", str(tmp_path / "g.png")) == 0
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_names_every_parameter(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        simulate("--help")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--chips", "--learners", "--mtbi-years", "--hours", "--seed", "--restart-s", "--rescale-s",
                 "--repair-s", "--learner-failure", "--cadence", "--min-quorum", "--max-staleness", "--sweep",
                 "--from-json", "--record", "--json", "--plot"):
        assert flag in out


def test_plot_needs_the_sweep() -> None:
    with pytest.raises(ConfigError, match="--sweep"):
        simulate("--plot", "g.png")


def test_a_learner_that_only_slows_down_has_not_failed() -> None:
    entries = []
    sent = 1000.0
    for n in range(1, 16):
        sent += PERIOD_S if n < 12 else 3 * PERIOD_S  # three times slower for the last rounds
        a = replace(announcement("learner-a", n), sent_at=sent, deadline=sent + 0.25)
        entries.append((f"{round((sent + 0.3) * 1000)}-0", a))
    assert timings_from_run(SPEC, entries, []).failures == ()
