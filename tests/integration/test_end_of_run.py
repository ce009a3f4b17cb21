"""The end of a run does not damage the model: learners that end at staggered times leave a final
version no worse than the one that stood before the first of them left.

When learners finish one after the other, the last rounds hold fewer learners and shorter pieces
(each learner's last progress, sent as it leaves). Each such round moves the model only as far as
the progress it carries (`policy.round_step`, a fractional outer step), so the last version is the
model to take. Real `diloco` processes on the demo task, real Redis and S3.
"""

from __future__ import annotations

import pytest

from diloco.storage.bus import Bus
from harness import global_eval, spawn_coordinator, spawn_learner, wait_all, wait_for

pytestmark = pytest.mark.slow  # four trained learners ending at staggered times: `make test-all`


def test_learners_ending_at_staggered_times_leave_a_final_version_no_worse_than_before_they_left(
        endpoints, run_id, tmp_path, fleet_env):
    env, procs = fleet_env
    procs.append(spawn_coordinator(run_id, env, tmp_path))
    # Slowed down so that the run spans many rounds of the clock (whose period is at least 1 s); each
    # learner ends about a round after the previous one.
    learners = [spawn_learner(run_id, env, tmp_path, f"l{i}", steps=240 + 30 * i, seed=i, slowdown=3.0)
                for i in range(4)]
    procs.extend(learners)
    bus = Bus(endpoints, run_id)
    wait_for("the first learner to end", lambda: any(not p.alive() for p in learners), timeout_s=240)
    before = bus.heads()
    wait_all(learners)
    wait_for("the last pieces to merge", lambda: bus.pending_count() == 0, timeout_s=30)
    after = bus.heads()
    assert all(after[f] > before[f] for f in before), (before, after)  # the last learners' rounds merged
    at_first_leave, final = global_eval(endpoints, run_id, before), global_eval(endpoints, run_id, after)
    print(f"global eval loss when the first learner left {at_first_leave:.4f}, final {final:.4f}")
    assert final <= at_first_leave * 1.005, f"the end of the run damaged the model: {at_first_leave:.4f} -> {final:.4f}"
