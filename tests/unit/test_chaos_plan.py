"""The chaos suite's pure parts: the fault schedule, the corrupt objects, the accounting."""

from __future__ import annotations

import pytest
import torch

from diloco.infra.chaos.faults import CORRUPTIONS, HEAVY, KINDS, forge, labels, schedule
from diloco.infra.chaos.ledger import Evidence, account
from diloco.storage import codecs
from diloco.storage.errors import Refused
from diloco.storage.history import sha256_hex
from diloco.storage.protocol import Contribution, Manifest, Refusal


@pytest.mark.parametrize("seconds", [10, 30, 45, 120, 600])
@pytest.mark.parametrize("seed", range(8))
def test_every_fault_label_is_scheduled_within_the_run(seconds, seed):
    faults = schedule(seed, seconds)
    assert {f.label for f in faults} == set(labels())
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert all(0 < f.at_s < seconds for f in faults)
    assert all(f.target in ("l0", "l1", "l2") for f in faults if f.kind.startswith("learner"))
    assert all(f.down_s > 0 for f in faults if f.kind in ("redis_restart", "redis_rollback", "s3_restart"))


def test_heavy_faults_leave_the_end_of_the_run_quiet_and_come_one_after_the_other():
    faults = [f for f in schedule(3, 300) if f.kind in HEAVY]
    assert len(faults) > len(labels(HEAVY))  # long runs draw more than the mandatory ones
    assert max(f.at_s for f in faults) <= 300 * 0.85
    servers = [f.at_s for f in faults if f.kind != "coordinator_kill"]
    assert all(b - a >= 4.0 for a, b in zip(servers, servers[1:]))


def test_the_schedule_is_a_function_of_its_arguments():
    assert schedule(7, 60) == schedule(7, 60)
    assert schedule(7, 60) != schedule(8, 60)
    only = schedule(7, 60, ("learner_kill", "redis_restart"))
    assert {f.kind for f in only} == {"learner_kill", "redis_restart"}
    with pytest.raises(ValueError, match="unknown fault kinds"):
        schedule(7, 60, ("meteor",))
    assert set(labels()) >= {f"coordinator_kill:{p}" for p in ("fetched", "params_written", "manifest_written",
                                                                 "committed")}
    assert len(KINDS) == 7


SHAPES = {"blocks.0.weight": (4, 3), "blocks.0.bias": (4,)}


@pytest.mark.parametrize("codec,compress", [("int8", True), ("fp32", False), ("int4", True), ("bf16", False)])
@pytest.mark.parametrize("variant", sorted(CORRUPTIONS))
def test_each_corrupt_object_passes_the_checks_before_the_one_that_catches_it(variant, codec, compress):
    blob, size, sha = forge(variant, SHAPES, codec=codec, compress=compress, meta={"run": "r", "learner": "x"},
                            seed=1)
    assert size == len(blob)  # the size check passes
    if variant == "flipped":
        assert sha != sha256_hex(blob)  # caught by the announcement's sha256
        return
    assert sha == sha256_hex(blob)
    if variant != "truncated":  # (a cut uncompressed payload fails the framing check already)
        assert codecs.read_header(blob, max_bytes=1 << 20).codec == codec  # the run's codec, as a learner's
    with pytest.raises(Refused) as refused:
        codecs.decode(blob, max_bytes=1 << 20, expect=SHAPES)
    assert refused.value.code in CORRUPTIONS[variant], refused.value


def test_a_well_formed_forgery_would_decode():
    """The forger's base object is sound: what is refused is the corruption, not the forging."""
    good = codecs.encode({n: torch.zeros(s) for n, s in SHAPES.items()}, "int8", compress=True, meta={"run": "r"})
    tensors, _ = codecs.decode(good, max_bytes=1 << 20, expect=SHAPES)
    assert set(tensors) == set(SHAPES)


# ---- accounting --------------------------------------------------------------------------------

def _manifest(fragment: int, version: int, ids: list[str], refused: tuple[Refusal, ...] = ()) -> Manifest:
    inputs = tuple(Contribution(contribution_id=i, learner="l0", seq=1, object_key="k", sha256="0" * 64,
                                base_version=max(0, version - 1), staleness=0, tokens=1, steps=1, weight=1.0,
                                stream_id="1-0") for i in ids)
    return Manifest(run="r", fragment=fragment, version=version, parent_version=version - 1, params_key="p",
                    params_sha256="0" * 64, outer_state_key="o", outer_state_sha256="0" * 64, inputs=inputs,
                    settings={}, refused=refused, committed_at=0.0, epoch=1)


def _refusal(cid: str, code: str) -> Refusal:
    return Refusal(contribution_id=cid, learner="l0", code=code, reason="because")


def _evidence(**changes) -> Evidence:
    base = dict(announced={"a", "b", "c", "d", "e"},
                manifests={0: [_manifest(0, 0, ["g0"]), _manifest(0, 1, ["a"]),
                               _manifest(0, 2, ["b"], (_refusal("c", "sha256_mismatch"),))]},
                s3_versions={0: [0, 1, 2]}, redis_heads={0: 2},
                refusals=[_refusal("a", "duplicate"), _refusal("d", "stale")], pending={"e"})
    return Evidence(**{**base, **changes})


def test_every_announced_contribution_gets_exactly_one_outcome():
    led = account(_evidence())
    assert (led.applied, led.refused, led.dropped, led.pending) == ({"a", "b"}, {"c"}, {"d"}, {"e"})
    assert not led.lost and not led.duplicated and not led.unannounced and not led.problems
    assert led.refusal_codes == {"c": "sha256_mismatch", "d": "stale"}
    assert led.figures() == {"versions_committed": 3, "applied": 2, "refused": 1, "dropped": 1, "pending": 1,
                             "announced": 5, "lost": 0, "duplicated": 0}


def test_a_duplicate_refusal_alone_accounts_for_nothing_and_an_unseen_id_is_lost():
    led = account(_evidence(announced={"a", "b", "c", "d", "e", "x", "y"},
                            refusals=[_refusal("x", "duplicate"), _refusal("d", "stale")]))
    assert led.lost == {"x", "y"}


def test_an_id_in_two_manifests_is_duplicated_and_a_stale_verdict_wins_over_other_refusals():
    manifests = _evidence().manifests
    manifests[0].append(_manifest(0, 3, ["a", "z"]))
    led = account(_evidence(manifests=manifests, s3_versions={0: [0, 1, 2, 3]}, redis_heads={0: 3},
                            refusals=[_refusal("d", "stale"), _refusal("d", "bad_payload")]))
    assert led.duplicated == {"a"}
    assert led.unannounced == {"z"}
    assert led.dropped == {"d"}


def test_gaps_in_the_version_chain_and_heads_that_disagree_are_problems():
    led = account(_evidence(s3_versions={0: [0, 2], 1: [0]}, redis_heads={0: 2}))
    assert led.problems == ["fragment 0: versions [1] missing in S3", "fragment 1: Redis head None, S3 head 0"]
