"""A learner's fetcher against versions it cannot take: it moves on to the next one.

The coordinator writes every version, but a bucket is shared: an object can be damaged or deleted
under a committed manifest. A fetcher that retried such a head version forever never read the
versions stream again, so it never learnt of the next version: the learner stayed on its old base
and its deltas went stale and were refused.
"""

from __future__ import annotations

import time

from diloco.storage.history import read_layout, read_manifest
from diloco.storage.objects import ObjectStore
from diloco.workers.transfer import Fetcher, TransferStats
from harness import join, make_coordinator, train, wait_for


def test_a_fetcher_skips_an_unreadable_version_and_takes_the_next(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id)
    learner, opt = join(endpoints, run_id, coord, "l0")
    store, keys = ObjectStore(endpoints), coord.keys
    train(learner, opt, 4)  # fragment 0 is due at step 4 (H = 4, two fragments)
    while coord.bus.heads()[0] < 1:
        coord.step(block_ms=50)
    bad = coord.bus.heads()[0]
    manifest = read_manifest(store, keys, 0, bad)
    store.put(manifest.params_key, b"damaged in the bucket", create_only=False)
    fetcher = Fetcher(store, coord.bus, read_layout(store, keys), stats := TransferStats())
    fetcher.start()
    try:
        fetcher.want(0, bad - 1)
        wait_for("the fetcher to refuse the damaged version", lambda: stats.fetch_failed >= 1)
        assert fetcher.take(0) is None
        train(learner, opt, 8)  # more deltas: the coordinator commits newer versions of fragment 0
        while coord.bus.heads()[0] <= bad:
            coord.step(block_ms=50)
        fetched = []
        wait_for("the fetcher to take the version after it",
                 lambda: bool(fetched.append(fetcher.take(0)) or fetched[-1]))
        assert fetched[-1].version > bad and stats.fetch_failed == 1
    finally:
        fetcher.close()
        fetcher.join(5)
        learner.close()
        coord.close()


def test_a_fetcher_done_taking_releases_what_waits_and_downloads_nothing_more(endpoints, run_id):
    coord = make_coordinator(endpoints, run_id)
    learner, opt = join(endpoints, run_id, coord, "l0")
    store, keys = ObjectStore(endpoints), coord.keys
    train(learner, opt, 4)
    while coord.bus.heads()[0] < 1:
        coord.step(block_ms=50)
    fetcher = Fetcher(store, coord.bus, read_layout(store, keys), stats := TransferStats())
    fetcher.start()
    try:
        fetcher.want(0, 0)
        wait_for("the fetcher to download version 1", lambda: fetcher.ready(0) is not None)
        waiting = fetcher._at(0).ready
        fetcher.done_taking()  # the learner leaves: it takes nothing again
        assert fetcher.ready(0) is None and waiting.slot.ask() is None  # released: closed to the stager
        fetched = stats.fetched
        fetcher.want(0, 0)  # ignored from now on
        train(learner, opt, 8)
        head = coord.bus.heads()[0]
        while coord.bus.heads()[0] <= head:
            coord.step(block_ms=50)
        wait_for("the fetcher to see the new head", lambda: fetcher._at(0).head > head)
        time.sleep(1.5)  # three more rounds of its loop (a read blocks 0.5 s): any download would start
        assert fetcher.ready(0) is None and stats.fetched == fetched
    finally:
        fetcher.close()
        fetcher.join(5)
        learner.close()
        coord.close()
