"""The chaos suite's pure parts: the fault schedule, the corrupt objects, the accounting."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest
import torch

from diloco.coordinator.recovery import announcement_from_object
from diloco.infra.chaos.cli import add_chaos_arguments
from diloco.infra.chaos.config import ChaosConfig
from diloco.infra.chaos.faults import CORRUPTIONS, HEAVY, HOSTILE, KINDS, forge, labels, schedule
from diloco.infra.chaos.hostile import HostileInput, bad_stats, judge_hostile, random_bytes, well_formed
from diloco.infra.chaos.ledger import Evidence, Ledger, account
from diloco.infra.chaos.suite import ChaosReport
from diloco.storage import codecs
from diloco.storage.errors import ConfigError, Refused
from diloco.storage.history import sha256_hex
from diloco.storage.protocol import Contribution, LearnerStats, Manifest, Refusal, VersionSettings


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
    assert set(labels()) >= {f"hostile:{v}" for v in HOSTILE} | {"redis_rollback"}
    assert len(KINDS) == 8


def test_a_run_may_leave_fault_kinds_out_and_a_kind_it_does_not_know_is_refused_by_name(tmp_path):
    cfg = ChaosConfig(out=tmp_path, kinds="redis_rollback, learner_kill")
    assert cfg.fault_kinds() == ("learner_kill", "redis_rollback")  # in the registry's order
    assert ChaosConfig(out=tmp_path).fault_kinds() == KINDS
    with pytest.raises(ConfigError, match=r"--kinds .*learner_kill.* \(meteor: not one of them\)"):
        ChaosConfig(out=tmp_path, kinds="learner_kill,meteor")
    parser = argparse.ArgumentParser()
    add_chaos_arguments(parser)
    assert parser.parse_args(["--kinds", "hostile"]).kinds == "hostile"
    # Only the kinds chosen are drawn, and only their labels must fire.
    assert {f.kind for f in schedule(5, 45, cfg.fault_kinds())} == {"learner_kill", "redis_rollback"}
    report = ChaosReport(seed=5, seconds=45, faults={"learner_kill": 2}, ledger=account(_evidence()), loss_start=3.0,
                         loss_end=2.0, forged={}, hostile=[], failures=[], kinds=cfg.fault_kinds())
    assert report.figures()["faults"] == {"learner_kill": 2, "redis_rollback": 0}
    assert report.figures()["recovered"] == {"redis_rollback": 0}  # heavy kinds only
    fired = [p for p in report.problems() if p.startswith("fault ")]
    assert fired == ["fault redis_rollback never fired"]  # not the kinds left out


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
                    settings=VersionSettings(kind="delta", outer_lr=0.7, outer_momentum=0.9), refused=refused, committed_at=0.0, epoch=1)


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


# ---- the hostile learner -------------------------------------------------------------------------

def test_a_hostile_delta_is_well_formed_and_its_header_cannot_be_announced_again_from_s3():
    """It passes every check of the coordinator; its header names no tokens or steps, so the sweep
    after a Redis outage leaves it alone (each hostile input is announced once, by the hostile learner)."""
    meta = {"run": "r", "fragment": 0, "learner": "hostile", "kind": "delta", "contribution_id": "a" * 32,
            "base_version": 3}
    blob = well_formed(SHAPES, codec="int8", compress=True, meta=meta, seed=1)
    tensors, header = codecs.decode(blob, max_bytes=1 << 20, expect=SHAPES)
    assert set(tensors) == set(SHAPES) and header.meta == meta
    with pytest.raises(Refused) as refused:
        announcement_from_object("p/r/fragments/0000/hostile/0000000000000001", blob, max_bytes=1 << 20)
    assert refused.value.code == "bad_header"


def test_random_bytes_fail_the_framing_check_and_bad_stats_do_not_decode():
    with pytest.raises(Refused) as refused:
        codecs.decode(random_bytes(4096, seed=1), max_bytes=1 << 20, expect=SHAPES)
    assert refused.value.code == "bad_framing"
    for _name, raw in bad_stats("hostile"):
        with pytest.raises(Refused):
            LearnerStats.from_wire(raw)


def _hostile_ledger() -> Ledger:
    honest = _manifest(0, 1, ["h1", "h2"])
    lying = replace(honest, inputs=(*honest.inputs, replace(honest.inputs[0], contribution_id="big", learner="hostile",
                                                            tokens=38, weight=38.0)))
    mixed = replace(_manifest(0, 2, ["small"]), inputs=(
        replace(honest.inputs[0], contribution_id="small", learner="hostile", steps=4, weight=0.25),
        replace(honest.inputs[0], contribution_id="h3", weight=1.0)))
    alone = replace(_manifest(0, 3, ["alone"]), inputs=(
        replace(honest.inputs[0], contribution_id="alone", learner="hostile", weight=1.0),))
    ev = _evidence(announced={"h1", "h2", "big", "small", "h3", "alone", "tl", "fl", "gone"},
                   manifests={0: [_manifest(0, 0, ["g0"]), lying, mixed, alone]}, s3_versions={0: [0, 1, 2, 3]},
                   redis_heads={0: 3}, refusals=[_refusal("tl", "too_large"), _refusal("fl", "stale")], pending=set())
    return account(ev)


def test_the_ledger_knows_each_applied_pieces_share_of_its_round():
    led = _hostile_ledger()
    # big: 38 / (1 + 1 + 38) of its round, learners l0 and hostile; it counted 38 tokens in 1 step, a
    # weight of 38**2 / 1 against l0's round: two pieces of 1 token in 1 step, a weight of 2**2 / 2.
    assert led.round_share["big"][:3] == (0.95, 2, 722.0)
    # 1 token in 4 steps against l0's rounds (weights 2, and 1 in this one): median 1.5.
    assert led.round_share["small"][:3] == (0.2, 2, 0.25 / 1.5)
    assert led.round_share["alone"][:3] == (1.0, 1, 1 / 1.5)  # against l0's rounds of the versions before
    assert math.isnan(led.round_share["big"][3])  # no norms recorded
    two = replace(_manifest(0, 1, ["x"]), inputs=tuple(
        replace(_manifest(0, 1, ["x"]).inputs[0], contribution_id=cid, learner=learner, weight=1.0)
        for cid, learner in (("p1", "hostile"), ("p2", "hostile"), ("h", "l0"))))
    shares = account(_evidence(announced={"p1", "p2", "h"}, manifests={0: [_manifest(0, 0, ["g0"]), two]},
                               s3_versions={0: [0, 1]}, redis_heads={0: 1}, refusals=[], pending=set())).round_share
    # A learner's pieces in one round add up: twice the tokens in twice the steps, twice the weight.
    assert shares["p1"][:3] == shares["p2"][:3] == (2 / 3, 2, 2.0)


def test_each_hostile_input_is_judged_by_what_must_become_of_it():
    led = _hostile_ledger()
    inputs = [HostileInput("lying_tokens", "big", "big"), HostileInput("lying_tokens", "small", "small"),
              HostileInput("lying_deadline", "alone", "alone"),
              HostileInput("oversize", "tl", "tl", frozenset({"too_large"})),
              HostileInput("flood", "fl", "fl", frozenset({"missing_object"})),
              HostileInput("undecodable", "gone", "gone", frozenset({"bad_framing"})),
              HostileInput("sse_c", "h3 applied", "h3", frozenset({"unreadable_object"})),
              HostileInput("made_up_ids", "ghost-1")]
    verdicts = {v.input.what: v for v in judge_hostile(inputs, led)}
    assert verdicts["big"].unbounded and "took 0.95" in verdicts["big"].problem and "722 x" in verdicts["big"].problem
    assert (verdicts["small"].kind, verdicts["small"].problem) == ("applied", "")
    assert verdicts["alone"].problem == ""  # alone in its round: it moves only itself
    assert (verdicts["tl"].kind, verdicts["tl"].problem) == ("refused", "")
    assert (verdicts["fl"].kind, verdicts["fl"].problem) == ("dropped", "")  # stale before it was read: fine
    assert verdicts["gone"].kind == "lost" and not verdicts["gone"].unbounded
    assert verdicts["h3 applied"].problem.startswith("applied; must be refused")
    assert (verdicts["ghost-1"].kind, verdicts["ghost-1"].problem) == ("no_contribution", "")
