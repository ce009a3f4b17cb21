"""Version 0, proposed fragment by fragment (`workers/genesis.py`), against real Redis and S3: each
fragment goes up once while its proposers keep up, a slow proposer is overtaken, and a claim whose
holder died lapses."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from diloco.storage.bus import Bus
from diloco.storage.history import read_manifest
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.workers import genesis
from diloco.workers.learner import Learner
from harness import Tiny, make_coordinator, start_beside, tiny_learner


def _start_all(coord, learners, *, before=None) -> None:  # noqa: ANN001
    """Start `learners` in threads (`before(i)` first, if given) while the in-process coordinator steps."""
    raised: list[BaseException] = []

    def start(learner) -> None:  # noqa: ANN001
        try:
            learner.start()
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    threads = []
    for i, learner in enumerate(learners):
        if before is not None:
            before(i)
        threads.append(threading.Thread(target=start, args=(learner,)))
        threads[-1].start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        coord.step(block_ms=20)
    assert not raised, raised


def _proposals(endpoints, keys: RunKeys) -> list[tuple[str, int]]:  # noqa: ANN001
    found = (keys.parse_genesis_key(k) for k in ObjectStore(endpoints).list(keys.root + "genesis/"))
    return sorted(p for p in found if p is not None)


def _version_0_from(endpoints, keys: RunKeys, fragment: int) -> str:  # noqa: ANN001
    manifest = read_manifest(ObjectStore(endpoints), keys, fragment, 0)
    assert manifest is not None
    return manifest.inputs[0].learner


def test_learners_that_start_at_once_upload_each_fragment_of_version_0_once_and_all_join(
        endpoints, run_id, monkeypatch):
    monkeypatch.setattr(genesis, "STEAL_MIN_S", 60.0)  # a slow machine must not make a second upload here
    coord = make_coordinator(endpoints, run_id)
    learners = [tiny_learner(endpoints, run_id, f"l{i}")[0] for i in range(3)]
    _start_all(coord, learners)
    assert all(learner.versions == {0: 0, 1: 0} for learner in learners)
    keys = RunKeys(endpoints.prefix, run_id)
    proposed = _proposals(endpoints, keys)
    # Each fragment uploaded by one learner: no second upload while its proposer keeps up. (Which
    # learners upload is a race; that a slow one is overtaken is the next test.)
    assert sorted(f for _, f in proposed) == [0, 1], proposed
    assert [learner.stats.uploaded for learner in learners].count(0) >= 1  # three learners, two fragments
    for learner in learners:
        learner.close()
    coord.close()


def test_a_learner_that_proposed_version_0_lets_go_of_its_initial_copy_of_the_model_once_joined(
        endpoints, run_id, monkeypatch):
    # The initial values it may propose are a full copy of the model, held while joining: 2 GB of a
    # 1B-parameter bf16 model, which used to stay alive for the whole run. (A bf16 model: its fp32
    # version 0 is made from them, so the copy is its own.)
    initial: list[weakref.ref] = []
    made = genesis.GenesisProposer.__init__

    def spy(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        made(self, *args, **kwargs)
        initial.extend(weakref.ref(t) for t in self.initial.values())

    monkeypatch.setattr(genesis.GenesisProposer, "__init__", spy)
    coord = make_coordinator(endpoints, run_id)
    torch.manual_seed(0)
    model = Tiny().to(torch.bfloat16)
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), run=run_id, endpoints=endpoints,
                      learner_id="proposer", tokens_per_step=10)
    start_beside(coord, learner)
    assert learner.stats.joined_own == 2  # its initial values are version 0
    gc.collect()
    assert len(initial) == 4 and all(ref() is None for ref in initial), "the initial copy is still held"
    learner.close()
    coord.close()


@pytest.mark.slow  # 9 s; `make test` keeps genesis at once and a lapsed claim
def test_a_slow_proposer_is_overtaken_and_the_fleet_joins_on_the_others_upload(endpoints, run_id, monkeypatch):
    """Learner "slow" claims fragment 0 first, and its uploads take 6 s (a thin link). Learner "fast"
    claims fragment 1, uploads it, and then fragment 0 too once it has waited twice its own upload:
    both fragments' version 0 are fast's, and slow's proposal, stored later, is superseded."""
    monkeypatch.setattr(genesis, "STEAL_MIN_S", 0.5)
    keys = RunKeys(endpoints.prefix, run_id)
    real_put = ObjectStore.put

    def put(self, key, *args, **kwargs):  # noqa: ANN001, ANN202
        if key.startswith(keys.root + "genesis/slow/") and not key.endswith("layout.msgpack"):
            time.sleep(6.0)
        return real_put(self, key, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "put", put)
    coord = make_coordinator(endpoints, run_id)
    slow, fast = tiny_learner(endpoints, run_id, "slow")[0], tiny_learner(endpoints, run_id, "fast")[0]
    bus = Bus(endpoints, run_id)

    def wait_for_slow_to_claim(i: int) -> None:
        deadline = time.monotonic() + 30
        while i == 1 and bus.r.get(keys.genesis_claim(0)) != b"slow" and time.monotonic() < deadline:
            coord.step(block_ms=20)

    _start_all(coord, [slow, fast], before=wait_for_slow_to_claim)
    assert slow.versions == fast.versions == {0: 0, 1: 0}
    assert [_version_0_from(endpoints, keys, f) for f in (0, 1)] == ["fast", "fast"]
    deadline = time.monotonic() + 30
    while coord.bus.counters().get("genesis_superseded", 0) < 1 and time.monotonic() < deadline:
        coord.step(block_ms=50)
    assert coord.bus.counters().get("genesis_superseded") == 1  # slow's fragment 0, read after fast's
    for learner in (slow, fast):
        learner.close()
    coord.close()


def test_a_claim_whose_holder_stopped_extending_it_lapses_and_the_next_learner_proposes_that_fragment(
        endpoints, run_id, monkeypatch):
    """A claim on fragment 1 held by a learner that is gone: it lapses (here after 1.5 s), and the
    learner that joins, having proposed fragment 0, takes it and proposes it too (stealing is turned
    off here)."""
    monkeypatch.setattr(genesis, "STEAL_MIN_S", 600.0)
    coord = make_coordinator(endpoints, run_id)
    assert coord.bus.claim_genesis("ghost", 1, 1.5)
    second = tiny_learner(endpoints, run_id, "second")[0]
    _start_all(coord, [second])
    keys = RunKeys(endpoints.prefix, run_id)
    assert second.versions == {0: 0, 1: 0}
    assert [_version_0_from(endpoints, keys, f) for f in (0, 1)] == ["second", "second"]
    assert _proposals(endpoints, keys) == [("second", 0), ("second", 1)]
    second.close()
    coord.close()
