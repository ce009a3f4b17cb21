"""`diloco status` rendering: a made-up RunStatus shown as plain text and as rich tables, sizes and ages readable."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from diloco.infra.watch.render import ago, duration, lease, render_rich, render_text, size, until
from diloco.infra.watch.status import (ConsumerStatus, CoordinatorStatus, EndStatus, FinishedLearner, FragmentStatus,
                                       LearnerStatus, PendingStatus, RecentRefusal, RoundClock, RunStatus)


@pytest.mark.parametrize(("n", "text"), [(None, "-"), (0, "0 B"), (999, "999 B"), (1500, "1.5 kB"),
                                         (3_200_000, "3.2 MB"), (1_100_000_000, "1.1 GB")])
def test_sizes_are_readable(n, text):
    assert size(n) == text


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (0.04, "0.0 s ago"), (3.24, "3.2 s ago"),
                                               (59.9, "59.9 s ago"), (90, "1.5 min ago"), (7200, "2.0 h ago"),
                                               (3 * 86400, "3.0 d ago")])
def test_ages_say_how_long_ago(seconds, text):
    assert ago(seconds) == text


def test_times_to_come_and_leases():
    assert until(0.4) == "in 0.4 s" and until(-1.2) == "1.2 s ago" and until(None) == "-"
    assert lease(7.9) == "7.9 s left" and lease(-3.2) == "expired 3.2 s ago"
    assert duration(125) == "2.1 min"


def learner(name: str, **kw) -> LearnerStatus:
    base = dict(learner=name, state="live", lease_left_s=8.7, step=1234, tokens=2_500_000, loss=2.3456,
                step_time_s=0.05, adopted=40, uploaded=41, upload_failed=0, bytes_up=5_300_000, bytes_down=12_000_000,
                wall_s=70.0, staleness=1, staleness_by_fragment={"0": 1, "1": 0}, last_sent_age_s=0.8,
                incarnation="ab12cd34", pid=4242)
    return LearnerStatus(**(base | kw))


def status(**kw) -> RunStatus:
    base = dict(
        run="r1", prefix="diloco", redis="redis://127.0.0.1:6379/0", read_at=1_800_000_000.0, exists_in_s3=True,
        spec={"num_fragments": 2, "sync_every": 30, "overlap_steps": 3, "codec": "int8", "compress": True,
              "merge_rule": "rebase", "cadence": "clock", "created_at": 1_799_999_000.0},
        heads_from="redis",
        fragments=[FragmentStatus(0, 41, 1.25, 3, 0.4), FragmentStatus(1, 40, 2.5, 2, 1.6)],
        clock=RoundClock("clock", 30, 3, 2.4, 1_799_999_100.0, 0, 0.4),
        coordinator=CoordinatorStatus(3, "host-1-abc123", 8.2, 125.0, [ConsumerStatus("coordinator", 1, 0.3)]),
        learners=[learner("learner-0"), learner("learner-3", state="lapsed", lease_left_s=-12.5, loss=None,
                                                    staleness=None, staleness_by_fragment={})],
        finished_learners=[FinishedLearner("learner-2", 30.0, 1000, 2)],
        refusals=[RecentRefusal(4.0, "stale", "learner-3", "base version 2 is 6 behind the head 8 " + "x" * 300,
                             "c" * 32)],
        refused_total=3, refused_by_code={"stale": 2, "bad_framing": 1},
        pending=PendingStatus(stream_length=120, pending=1, undelivered=0, oldest_pending_age_s=0.3, lag_s=0.3,
                              group=True),
        counters={"versions_committed": 83, "contributions_applied": 160, "contributions_refused": 3},
        finished=None, finish_requested_by=None)
    return RunStatus(**(base | kw))


def test_the_plain_view_shows_every_part_readably():
    text = render_text(status())
    lines = text.splitlines()
    assert lines[0].startswith("run r1 (prefix diloco, Redis redis://127.0.0.1:6379/0) at 2027-01-15 08:00:00 UTC: "
                               "RUNNING")
    assert "settings: 2 fragment(s), H=30, tau=3, int8+zstd, rebase, clock cadence" in text
    row = next(line for line in lines if line.split()[:2] == ["0", "41"])
    assert "1.2 s ago" in row and "in 0.4 s" in row
    assert "a fragment's round every 2.4 s; next deadline: fragment 0 in 0.4 s" in text
    assert "coordinator: epoch 3, lease held by host-1-abc123 (expires in 8.2 s), epoch claimed 2.1 min ago" in text
    assert "consumer coordinator: 1 pending, last read 0.3 s ago" in text
    assert "120 in the stream, 1 pending (read, not acknowledged), 0 not read yet; coordinator lag 0.3 s" in text
    assert "learners: 1 live, 1 lapsed (joined, not finished), 1 finished" in text
    live = next(line for line in lines if line.strip().startswith("learner-0"))
    for cell in ("live", "8.7 s left", "1,234", "2,500,000", "2.3456", "50 ms", "1 (f0:1 f1:0)", "0.8 s ago",
                 "5.3 MB", "12.0 MB"):
        assert cell in live, (cell, live)
    lapsed = next(line for line in lines if line.strip().startswith("learner-3"))
    assert "lapsed" in lapsed and "expired 12.5 s ago" in lapsed
    assert "learner-2" in text and "30.0 s ago" in text  # finished
    assert "refusals: 3 in all (stale 2, bad_framing 1); the last 1" in text
    refusal = next(line for line in lines if " stale " in line)
    assert "4.0 s ago" in refusal and refusal.endswith("...") and len(refusal) < 200  # the reason is cut


def test_a_finished_run_says_so_and_the_json_is_plain_data():
    s = status(finished=EndStatus("learners", "every learner that joined has finished", [83, 82], 5.0),
               learners=[], refusals=[], refused_total=0, refused_by_code={})
    text = render_text(s)
    assert "FINISHED by learners 5.0 s ago: every learner that joined has finished" in text.splitlines()[0]
    assert "refusals: 0 in all" in text
    data = json.loads(json.dumps(s.to_json()))
    assert data["fragments"][0] == {"fragment": 0, "head": 41, "head_age_s": 1.25, "contributions": 3,
                                    "next_deadline_in_s": 0.4}
    assert data["finished"]["versions"] == [83, 82]


def test_step_cadence_missing_pieces_and_the_rich_view():
    s = status(clock=RoundClock("steps", 4, 1, None, None, None, None),
               fragments=[FragmentStatus(0, None, None, None, None)],
               coordinator=CoordinatorStatus(None, None, None, None), heads_from="s3",
               pending=PendingStatus(3, 0, 3, None, 12.0, group=False), notes=["Redis holds no heads"])
    text = render_text(s)
    assert "step cadence, a round every H=4 inner steps" in text
    assert "epoch none (Redis lost it), nobody holds the lease" in text
    assert "no coordinator group yet (never read); oldest 12.0 s ago" in text
    assert "heads (from S3: Redis holds none)" in text and "note: Redis holds no heads" in text
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    console.print(render_rich(status()))
    shown = console.export_text()
    for cell in ("RUNNING", "learner-0", "8.7 s left", "5.3 MB", "expired 12.5 s ago", "stale", "1.2 s ago"):
        assert cell in shown, cell
