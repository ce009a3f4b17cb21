"""A learner takes the version that merged its own contribution, not an older one committed meanwhile.

If learner A's delta is still in flight when another learner's round commits version v1, and A
merged v1 at its overlap point, A's next delta would be computed against v1, which lacks A's
previous contribution: every later contribution of A would arrive one version stale and weigh
half (staleness discount). With `own_version_wait` A trains on until the version holding its
contribution (v2) is committed and merges that one; its next delta is fresh.
"""

from __future__ import annotations

import pytest

import dataclasses
import time

from diloco.storage.history import read_manifest
from diloco.workers.learner import LearnerConfig
from harness import TINY_RUN, join, make_coordinator, train


def parked_version(learner, fragment: int) -> int | None:  # noqa: ANN001
    return learner.fetcher.ready(fragment)


def wait(what: str, condition, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def run(endpoints, run_id, own_version_wait: float) -> tuple[int, int]:  # noqa: ANN001
    """(the version a takes after its first send of fragment 0, the staleness of its second one)."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(TINY_RUN, cadence="steps"))
    a, opt_a = join(endpoints, run_id, coord, "a")
    b, opt_b = join(endpoints, run_id, coord, "b")
    a.config = dataclasses.replace(a.config, own_version_wait=own_version_wait)
    try:
        train(b, opt_b, 4)  # b sends fragment 0 (H = 4)
        while coord.bus.heads()[0] < 1:
            coord.step(block_ms=50)  # v1 = b's delta alone
        train(a, opt_a, 4)  # a sends fragment 0 against v0; its fetcher parks v1, which lacks it
        wait("a's fetcher to park v1", lambda: parked_version(a, 0) == 1)
        wait("v1 to be made ready off the loop", lambda: not a.fetcher.staging(0))
        train(a, opt_a, 1)  # step 5, tau = 1: a's overlap point; its delta is not merged yet
        for _ in range(20):
            coord.step(block_ms=50)
        assert coord.bus.heads()[0] == 2  # v2 = a's delta
        if own_version_wait:
            assert a.versions[0] == 0  # it did not take v1
            wait("a to learn that v2 merged its delta", lambda: a.fetcher.merged_in(a.fragments[0].sent_id) == 2)
            train(a, opt_a, 1)  # step 6: the parked v1 is dropped, v2 wanted
            wait("a's fetcher to park v2", lambda: parked_version(a, 0) == 2)
            wait("v2 to be made ready off the loop", lambda: not a.fetcher.staging(0))  # or the take waits a step
            train(a, opt_a, 1)  # step 7: v2 merged
        taken = a.versions[0]
        train(a, opt_a, 8 - a.step)  # a's second send of fragment 0, at step 8
        for _ in range(20):
            coord.step(block_ms=50)
        head = coord.bus.heads()[0]
        second = [c for c in read_manifest(coord.store, coord.keys, 0, head).inputs if c.learner == "a"]
        assert second, f"a's second delta is not in v{head}"
        return taken, second[0].staleness
    finally:
        a.close()
        b.close()
        coord.close()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_learner_waits_for_the_version_with_its_own_contribution(endpoints, run_id):
    assert LearnerConfig().own_version_wait > 0
    assert run(endpoints, run_id, LearnerConfig().own_version_wait) == (2, 0)


@pytest.mark.slow  # the counterpart of the waiting test, which stays in `make test`
def test_without_waiting_it_takes_the_older_version_and_its_next_delta_is_stale(endpoints, run_id):
    assert run(endpoints, run_id, 0.0) == (1, 1)
