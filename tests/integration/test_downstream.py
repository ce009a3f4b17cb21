"""Versions downstream in the run's codec (invariant 10), against the real Redis and S3 servers.

Learners one version behind take each new version as its update object (int8 + zstd here) rather
than the fp32 params, and land on the committed params bit for bit; the run still replays bit-exact
from S3 alone (the residual is part of the outer state); an update object damaged in the bucket
costs the learner a download of the params, nothing else.
"""

from __future__ import annotations

import pytest

import dataclasses
import math
import struct

import msgpack
import torch
import zstandard

from diloco.infra.history.replay import replay_run
from diloco.storage.history import read_layout, read_manifest, read_params
from diloco.storage.keys import RunKeys
from diloco.storage.objects import ObjectStore
from diloco.workers.transfer import Fetched, Fetcher, TransferStats
from diloco.workers.learner import Learner
from harness import TINY_RUN, join, make_coordinator, start_beside, train, wait_for

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


# --no-hold-state in `make test-slow`: `make test` stays under 8 minutes.
@pytest.mark.parametrize("hold_state", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["held", "read-back"])
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


def _one_code_changed(blob: bytes) -> bytes:
    """An int8 or int4 object (zstd) with its first code moved by one, still a valid code, and the
    header as it was: its payload no longer matches the header's sha256."""
    (header_len,) = struct.unpack_from(">I", blob, 5)
    header = msgpack.unpackb(blob[9:9 + header_len])
    assert header["codec"] in ("int8", "int4") and header["compression"] == "zstd", header
    payload = bytearray(zstandard.ZstdDecompressor().decompress(blob[9 + header_len:]))
    first = header["tensors"][0]
    at = first["offset"] + 4 * -(-math.prod(first["shape"]) // header["block_size"])  # past its scales
    code = payload[at]
    if header["codec"] == "int8":  # a signed byte in [-127, 127]
        payload[at] = 0x7E if code == 0x7F else (code + 1) & 0xFF
    else:  # the low nibble, a code in [1, 15]
        payload[at] = (code & 0xF0) | (1 + (code & 0x0F) % 15)
    return blob[:9 + header_len] + zstandard.ZstdCompressor().compress(bytes(payload))


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
        # Its CPU by phase: the update's GET, its decode added to the params held, their sha256.
        assert {"get", "apply", "verify"} <= set(stats.cpu_phases) and "params" not in stats.cpu_phases
        assert 0 < sum(stats.cpu_phases.values()) <= stats.cpu_s + 1e-3

        # The params a take makes are checked against the manifest's BLAKE3; in a manifest from
        # before BLAKE3 was recorded, against its sha256.
        m = read_manifest(store, keys, 0, head)
        assert len(m.params_blake3) == 64
        for recorded, taken in (("", True), ("0" * 64, False)):
            store.put(keys.manifest(0, head), dataclasses.replace(m, params_blake3=recorded).to_wire(),
                      create_only=False)
            fetched, stats = fetch_from(head - 1)
            assert fetched.version == head and (stats.fetched_updates, stats.update_failed) == \
                ((1, 0) if taken else (0, 1))
        store.put(keys.manifest(0, head), m.to_wire(), create_only=False)

        # A code of the update changed in its payload, the header's sha256 left: the params it gives
        # fail their own sha256 (a take does not hash the update's payload apart), so they are read.
        update = store.get(m.update_key, max_bytes=1 << 30)
        store.put(m.update_key, _one_code_changed(update), create_only=False)
        fetched, stats = fetch_from(head - 1)
        assert fetched.version == head and (stats.update_failed, stats.fetched_params, stats.fetch_failed) == (1, 1, 0)
        assert all(torch.equal(fetched.params[n], committed[n]) for n in committed)

        store.put(m.update_key, b"damaged in the bucket", create_only=False)
        fetched, stats = fetch_from(head - 1)
        assert fetched.version == head and (stats.update_failed, stats.fetched_params, stats.fetch_failed) == (1, 1, 0)
        assert stats.cpu_phases["params"] > 0
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


class Wide(torch.nn.Module):
    """Two 64 x 64 layers: a fragment's int4 update is a fraction of its params, so a chain of a few pays."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))


def wide_learner(endpoints, run_id, name: str, seed: int) -> tuple[Learner, torch.optim.Optimizer]:  # noqa: ANN001
    torch.manual_seed(seed)
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Learner(model, opt, run=run_id, endpoints=endpoints, learner_id=name, tokens_per_step=10), opt


def test_a_learner_built_like_the_proposer_downloads_no_params_at_join(endpoints, run_id):
    """A learner whose initial values are version 0 bit for bit (built from the proposer's seed)
    downloads no params: at version 0 it starts from its own values, later from them and the update
    objects since; one built otherwise downloads them. Each ends on the committed params to the bit."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(INT8_RUN, codec="int4"))
    store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, run_id)
    learners: list[Learner] = []

    def joined(name: str, seed: int) -> tuple[Learner, torch.optim.Optimizer]:
        learner, opt = wide_learner(endpoints, run_id, name, seed)
        learners.append(learner)
        start_beside(coord, learner)
        layout = read_layout(store, keys)
        for f in range(len(layout.fragments)):  # what it holds is the committed version, to the bit
            held = learner.fetcher.held(f)
            committed = read_params(store, layout, read_manifest(store, keys, f, held.version))
            assert all(torch.equal(held.params[n], committed[n]) for n in committed)
            assert all(torch.equal(p.detach(), committed[n]) for n, p in learner.model.named_parameters()
                       if n in committed)
        return learner, opt

    try:
        proposer, opt = joined("l0", seed=0)
        same, _ = joined("l1", seed=0)
        other, _ = joined("l2", seed=1)
        for learner in (proposer, same):
            assert (learner.stats.joined_own, learner.stats.fetched_params) == (2, 0), learner.stats
        assert other.stats.joined_own == 0
        assert same.stats.bytes_joined < other.stats.bytes_joined / 4, (same.stats, other.stats)

        for _ in range(8):  # a few versions of each fragment past version 0
            train(proposer, opt, 4)
            for _ in range(4):
                coord.step(block_ms=50)
            if all(v >= 2 for v in coord.bus.heads().values()):
                break
        heads = coord.bus.heads()
        assert all(2 <= v <= 4 for v in heads.values()), heads  # int4: a chain of 4 is half the params
        late, _ = joined("l3", seed=0)
        assert late.stats.joined_own == 2 and late.stats.fetched_updates == sum(heads.values()), late.stats
        assert late.stats.bytes_joined < other.stats.bytes_joined, (late.stats, other.stats)
    finally:
        for learner in learners:
            learner.close()
        coord.close()


class Reads(ObjectStore):
    """The real store, remembering the keys read through it."""

    def __init__(self, endpoints) -> None:  # noqa: ANN001
        super().__init__(endpoints)
        self.read: list[str] = []

    def get(self, key: str, *, max_bytes: int) -> bytes:
        self.read.append(key)
        return super().get(key, max_bytes=max_bytes)

    def get_buffer(self, key: str, *, max_bytes: int) -> bytearray:
        self.read.append(key)
        return super().get_buffer(key, max_bytes=max_bytes)


@pytest.mark.slow  # 8 s; `make test` keeps learners taking updates bit for bit
def test_a_fetcher_following_the_stream_takes_versions_without_their_manifests(endpoints, run_id):
    """A fetcher one version behind, following the versions stream, takes each new version as the
    update beside its params (the event names the params' key and sha256): after its first
    version it reads no manifest, and holds the committed params bit for bit."""
    coord = make_coordinator(endpoints, run_id, settings=dataclasses.replace(INT8_RUN, codec="int4"))
    learner, opt = wide_learner(endpoints, run_id, "l0", seed=0)
    start_beside(coord, learner)
    store, keys = Reads(endpoints), RunKeys(endpoints.prefix, run_id)
    layout = read_layout(store, keys)
    fetcher = Fetcher(store, coord.bus, layout, stats := TransferStats())
    held = coord.bus.heads()[0]
    fetcher.hold(0, held, read_params(store, layout, read_manifest(store, keys, 0, held)))
    fetcher.start()
    wait_for("the fetcher to follow the stream", lambda: fetcher._last_id != "$")
    store.read.clear()
    try:
        for _ in range(4):
            train(learner, opt, 4)
            for _ in range(4):
                coord.step(block_ms=50)
            head = coord.bus.heads()[0]
            assert head > held
            fetcher.want(0, held)
            got: list[Fetched | None] = []
            wait_for(f"version {head}", lambda: bool(got.append(fetcher.take(0)) or (got[-1] and got[-1].version == head)))
            held = head
        plain = ObjectStore(endpoints)
        committed = read_params(plain, layout, read_manifest(plain, keys, 0, held))
        assert all(torch.equal(got[-1].params[n], committed[n]) for n in committed)
        manifests = [k for k in store.read if k.endswith("/manifest")]
        assert len(manifests) == 1, manifests  # the first version's: does this run publish updates?
        assert (stats.fetched_params, stats.update_failed, stats.fetch_failed) == (0, 0, 0), stats
        assert stats.fetched_updates >= 4, stats

        # An update damaged in the bucket costs one download of the params; it is not read twice.
        train(learner, opt, 4)
        for _ in range(4):
            coord.step(block_ms=50)
        head = coord.bus.heads()[0]
        damaged = read_manifest(plain, keys, 0, head).update_key
        plain.put(damaged, b"damaged in the bucket", create_only=False)
        store.read.clear()
        fetcher.want(0, held)
        wait_for(f"version {head}", lambda: bool(got.append(fetcher.take(0)) or (got[-1] and got[-1].version == head)))
        assert (stats.update_failed, stats.fetched_params, stats.fetch_failed) == (1, 1, 0), stats
        assert store.read.count(damaged) == 1, store.read
        committed = read_params(plain, layout, read_manifest(plain, keys, 0, head))
        assert all(torch.equal(got[-1].params[n], committed[n]) for n in committed)
    finally:
        fetcher.close()
        fetcher.join(5)
        learner.close()
        coord.close()
