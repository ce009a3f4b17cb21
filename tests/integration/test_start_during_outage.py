"""Processes started while S3 is down wait for it instead of exiting (found by the chaos suite).

A learner restarted during an S3 outage used to exit 1 when its first read of the run gave up,
and a standby coordinator polling for the lease died the same way (S3 listings were not even
mapped to StorageUnavailable). Both must ride the outage out: the learner joins and trains once S3
is back, the standby takes over when the active coordinator dies.
"""

from __future__ import annotations

import pytest

from diloco.storage.bus import Bus
from harness import announcements, merged_ids, spawn_coordinator, spawn_learner, wait_for

pytestmark = pytest.mark.slow  # a minute of S3 outage and lease takeovers: `make test-all`

RUN = "outage"


def holder_pid(bus: Bus) -> int | None:
    """The pid in the coordinator lease holder's name (host-pid-suffix), if anyone holds it."""
    raw = bus.r.get(bus.keys.lease)
    return None if raw is None else int(raw.decode().rsplit("-", 2)[1])


def test_standbys_and_a_learner_ride_out_an_s3_outage_and_take_over_after_it(own_stack, tmp_path):
    stack, env, procs = own_stack
    lease = ("--lease-s", "2")
    active = spawn_coordinator(RUN, env, tmp_path / "active", *lease)
    first = spawn_learner(RUN, env, tmp_path, "first", steps=100_000, slowdown=3.0)
    procs.extend([active, first])
    bus = Bus(stack.endpoints, RUN)
    wait_for("two versions", lambda: bus.heads() and min(bus.heads().values()) >= 2, procs)
    waiting = spawn_coordinator(RUN, env, tmp_path / "waiting", *lease, "--standby")
    procs.append(waiting)
    wait_for("the standby to stand by", lambda: "standing by" in waiting.tail(100), procs)

    stack.stop_s3()
    # Started during the outage, they wait for S3 up to --reach-timeout-s (10 s by default, then they
    # exit naming the setting to check): the outage lasts longer than that.
    patient = env | {"DILOCO_REACH_TIMEOUT_S": "600"}
    started = spawn_coordinator(RUN, patient, tmp_path / "started", *lease, "--standby")  # its start-up reads S3
    late = spawn_learner(RUN, patient, tmp_path, "late", steps=100_000, slowdown=3.0, seed=1)
    procs.extend([started, late])
    # Both start-ups find S3 unreachable and stay alive. The waiting standby only reads the lease in
    # Redis while it is held, and stays alive too.
    wait_for("both start-ups to find S3 unreachable",
             lambda: all("storage unreachable" in p.tail(100) for p in (started, late)), procs)
    stack.start_s3()
    wait_for("the late learner to join", lambda: "joined run" in late.tail(100), procs)

    active.kill()
    survivors = [first, waiting, started, late]
    wait_for("a standby to take over", lambda: holder_pid(bus) in (waiting.pid, started.pid), survivors)
    heads = bus.heads()
    wait_for("versions from the new coordinator", lambda: min(bus.heads().values()) >= min(heads.values()) + 2,
             survivors)
    wait_for("a contribution of the late learner to be merged",
             lambda: {a.contribution_id for _, a in announcements(bus) if a.learner == "late" and a.kind == "delta"}
             & set(merged_ids(stack.endpoints, RUN)), survivors)
    for p in survivors:  # each leaves on SIGTERM with 143 ("run me again"): the run has not ended
        assert p.terminate() == 143, p.tail()
