"""A short seeded chaos run: every kind of fault against real processes and servers, then the audit.

`diloco chaos` in-process, on a stack of its own under tmp_path: three learners and a coordinator
with a standby train the demo task while the schedule SIGKILLs and SIGTERMs learners, kills the
coordinator at each commit step, restarts Redis and the S3 server, rolls Redis back to a snapshot
a few seconds old, plants corrupt objects and lets a hostile learner with valid credentials lie,
flood and send what cannot be read.
About 70 s on a loaded 2-core machine. `diloco chaos --seconds 300` is the same run, longer.
"""

from __future__ import annotations

import math

import pytest

from diloco.infra.chaos.config import ChaosConfig
from diloco.infra.chaos.faults import CORRUPTIONS, HOSTILE, labels
from diloco.infra.chaos.suite import run_chaos

SECONDS = 45.0
SEED = 5


@pytest.mark.slow  # make test-slow (CI runs it after make test)
@pytest.mark.parametrize("shards", [1, 2], ids=["one-coordinator", "two-shards"])
def test_every_contribution_is_accounted_for_under_every_kind_of_fault(tmp_path, shards):
    """With two shards, the coordinator kills go to each shard in turn: each is replaced by its standby."""
    report = run_chaos(ChaosConfig(out=tmp_path, seconds=SECONDS, seed=SEED, shards=shards))
    print(report.line())
    led, figures = report.ledger, report.figures()
    assert not report.failures, "\n\n".join(report.failures)  # every process exited as it was told to

    # Every kind of fault really happened, the coordinator died at every commit step.
    assert all(figures["faults"][label] > 0 for label in labels()), figures["faults"]
    # Each heavy fault played out before the next one came, and the heads advanced after it.
    assert all(n > 0 for n in figures["recovered"].values()), figures["recovered"]

    # Nothing lost, nothing applied twice: every announcement has exactly one outcome.
    assert figures["lost"] == 0, sorted(led.lost)
    assert figures["duplicated"] == 0, sorted(led.duplicated)
    assert not led.unannounced
    assert figures["applied"] + figures["refused"] + figures["dropped"] + figures["pending"] == figures["announced"]
    assert figures["pending"] == 0  # the coordinator drained before it stopped
    assert figures["applied"] > 0 and figures["versions_committed"] > 4

    # Every corrupt object was refused with the code of the check meant to catch it (or dropped as
    # stale before it was read, had it waited out an outage), and nothing a learner sent was
    # refused other than as stale.
    for cid, variant in report.forged.items():
        caught = cid in led.refused and led.refusal_codes[cid] in CORRUPTIONS[variant]
        assert caught or cid in led.dropped, (variant, cid)
    hostile = {v.input.contribution_id for v in report.hostile}
    assert {cid for cid in led.refused if cid not in report.forged and cid not in hostile} == set()

    # Every hostile input was refused with the reason meant for it, or taken in and bounded. The
    # coordinator survived all of it (no unscheduled exit: `failures` above) and every fragment's
    # head advanced after each hostile fault; a lying piece weighed at most its bound.
    assert {v.input.variant for v in report.hostile} == set(HOSTILE)
    for v in report.hostile:
        if v.input.variant != "flood" or v.problem:
            print(f"hostile {v.input.variant}: {v.input.what}: {v.outcome}" + (f" ({v.problem})" if v.problem else ""))
    assert [v for v in report.hostile if v.problem] == []

    # Versions are contiguous per fragment and Redis agrees with S3; the model learnt.
    assert not led.problems, led.problems
    assert math.isfinite(report.loss_end) and report.loss_end < report.loss_start - 0.2, report.line()
    assert report.problems() == []
