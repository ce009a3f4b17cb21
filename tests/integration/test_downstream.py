"""Versions downstream in the run's codec (invariant 10), against the real Redis and S3 servers.

Learners one version behind take each new version as its update object (int8 + zstd here) rather
than the fp32 params, and land on the committed params bit for bit; the run still replays bit-exact
from S3 alone (the residual is part of the outer state); an update object damaged in the bucket
costs the learner a download of the params, nothing else.
"""

from __future__ import annotations

import pytest

import dataclasses

import torch

from diloco.infra.history.replay import replay_run
from diloco.storage.history import read_layout, read_manifest, read_params
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.workers.transfer import Fetched, Fetcher, TransferStats
from harness import TINY_RUN, join, make_coordinator, train, wait_for

INT8_RUN = dataclasses.replace(TINY_RUN, codec="int8", compress=True, cadence="steps")


def trained_run(endpoints, run_id, rounds: int = 4, *, between=None, hold_state: bool = True):  # noqa: ANN001, ANN201
    coord = make_coordinator(endpoints, run_id, settings=INT8_RUN, hold_state=hold_state)
    l0, opt0 = join(endpoints, run_id, coord, "l0")
    l1, opt1 = join(endpoints, run_id, coord, "l1")
    try:
        for k in range(rounds):
            for learner, opt in ((l0, opt0), (l1, opt1)):
                train(learner, opt, 4)
            for _ in range(4):
                coord.step(block_ms=50)
            if between is not None:
                between(k, coord)
        train(l0, opt0, 4)  # takes the last versions
        train(l1, opt1, 4)
        return coord, (l0, l1)
    except BaseException:
        for learner in (l0, l1):
            learner.close()
        coord.close()
        raise


@pytest.mark.parametrize("hold_state", [True, False], ids=["held", "read-back"])
def test_learners_take_updates_and_hold_the_committed_params_bit_for_bit(endpoints, run_id, hold_state):
    """Also with --no-hold-state: the coordinator holds no fragment's params or outer state between
    its rounds, and each merge reads them back from S3 (in place, views of one buffer): the same
    versions, to the bit, as the learners' own chains of updates and the replay say."""
    def holds_nothing(_k, coord):  # noqa: ANN001
        assert all(f.params is None and f.state is None for f in coord.fragments.values())

    coord, learners = trained_run(endpoints, run_id, hold_state=hold_state,
                                  between=None if hold_state else holds_nothing)
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    layout = read_layout(store, keys)
    try:
        heads = coord.bus.heads()
        for f, head in heads.items():
            for v in range(1, head + 1):
                m = read_manifest(store, keys, f, v)
                assert m.update_key and m.settings.downstream == "int8"
                assert 0 < m.update_bytes < m.params_bytes, (m.update_bytes, m.params_bytes)
        for learner in learners:
            assert learner.stats.fetched_updates >= 2 and learner.stats.update_failed == 0, learner.stats
            for f in range(len(learner.fragments)):
                held = learner.fetcher.held(f)
                assert held.version >= 2
                committed = read_params(store, layout, read_manifest(store, keys, f, held.version))
                assert held.params.keys() == committed.keys()
                assert all(torch.equal(held.params[n], committed[n]) for n in committed)
    finally:
        for learner in learners:
            learner.close()
        coord.close()

    report = replay_run(store, keys)
    assert report.ok and all(c.bit_exact for c in report.checks), report.summary()


@pytest.mark.slow  # make test stays under 8 minutes: make test-slow runs it
def test_a_damaged_update_costs_a_download_of_the_params(endpoints, run_id):
    coord, learners = trained_run(endpoints, run_id, rounds=3)
    for learner in learners:
        learner.close()
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    layout = read_layout(store, keys)
    head = coord.bus.heads()[0]
    assert head >= 3

    def fetch_from(version: int) -> tuple[Fetched, TransferStats]:
        """A fetcher holding `version` of fragment 0, asked for a newer one."""
        fetcher = Fetcher(store, coord.bus, layout, stats := TransferStats())
        fetcher.hold(0, version, read_params(store, layout, read_manifest(store, keys, 0, version)))
        fetcher.start()
        try:
            fetcher.want(0, version)
            got: list[Fetched | None] = []
            wait_for("the fetcher to take the head", lambda: bool(got.append(fetcher.take(0)) or got[-1]))
            return got[-1], stats
        finally:
            fetcher.close()
            fetcher.join(5)

    try:
        committed = read_params(store, layout, read_manifest(store, keys, 0, head))
        fetched, stats = fetch_from(head - 1)
        assert fetched.version == head and (stats.fetched_updates, stats.fetched_params) == (1, 0)
        assert all(torch.equal(fetched.params[n], committed[n]) for n in committed)

        m = read_manifest(store, keys, 0, head)
        store.put(m.update_key, b"damaged in the bucket", create_only=False)
        fetched, stats = fetch_from(head - 1)
        assert fetched.version == head and (stats.update_failed, stats.fetched_params, stats.fetch_failed) == (1, 1, 0)
        assert all(torch.equal(fetched.params[n], committed[n]) for n in committed)

        # Replay names it: the object learners take instead of the params no longer lands on them.
        report = replay_run(store, keys, fragment=0)
        assert [(c.version, [p.code for p in c.problems]) for c in report.checks if c.problems] == \
            [(head, ["stored_update"])]

        # Two versions behind, two updates of this tiny model are more bytes than its params: params.
        fetched, stats = fetch_from(head - 2)
        assert fetched.version == head and (stats.fetched_updates, stats.fetched_params) == (0, 1)
    finally:
        coord.close()
