"""`plan_gc`: what a gc pass deletes and keeps, decided from a listing and the manifests alone."""

from diloco.infra.history.gc import Listed, committed_versions, manifests_to_read, plan_gc
from diloco.storage.keys import RunKeys
from diloco.storage.protocol import Contribution, Manifest, Refusal, VersionSettings

K = RunKeys("p", "r")
HEAD = 5
MAX_STALENESS = 2
OLD = 10_000.0  # seconds: older than any min age used here


def contribution(key: str, base: int) -> Contribution:
    return Contribution(contribution_id=f"{abs(hash(key)) % 16**32:032x}", learner="l0", seq=1, object_key=key,
                        sha256="0" * 64, base_version=base, staleness=0, tokens=1, steps=1, weight=1.0, stream_id="")


def manifest(v: int, epoch: int = 1, refused: tuple[Refusal, ...] = ()) -> Manifest:
    inputs = (contribution(K.genesis_params("l0", 0), -1),) if v == 0 else (contribution(K.delta(0, "l0", v), v - 1),)
    return Manifest(run="r", fragment=0, version=v, parent_version=v - 1, params_key=K.params(0, v, epoch),
                    params_sha256="0" * 64, outer_state_key=K.outer_state(0, v, epoch), outer_state_sha256="0" * 64,
                    inputs=inputs, settings=VersionSettings(kind="delta", outer_lr=0.7, outer_momentum=0.9, max_staleness=MAX_STALENESS), refused=refused, committed_at=0.0,
                    epoch=epoch, update_key=K.update(0, v, epoch) if v else "", update_sha256="0" * 64 if v else "")


REFUSED = K.delta(0, "mallory", 99)
MANIFESTS = {(0, v): manifest(v, refused=(Refusal("", "mallory", "stale", "r", REFUSED),) if v == 4 else ())
             for v in range(HEAD + 1)}
BASES = {K.delta(0, "l2", 7): 1,  # unmerged, too stale: 1 < 5 - 2 - 1 (one version of margin)
         K.delta(0, "l2", 8): 2,  # unmerged, may still be merged (or be, by a coordinator one version behind)
         K.delta(0, "l2", 9): None}  # header is not a delta's


def listing(young: set[str] = frozenset()) -> list[Listed]:
    keys = [K.run_spec(), K.layout(), K.epoch_claim(1), K.epoch_claim(2), K.genesis_layout("l0"),
            K.genesis_params("l0", 0), K.genesis_params("l1", 0), K.genesis_params("l1", 1), REFUSED, *BASES,
            K.learner_state("l0", 3), K.learner_state("l0", 4), K.learner_state("l1", 1)]
    for v in range(HEAD + 1):
        keys += [K.manifest(0, v), K.params(0, v, 1), K.outer_state(0, v, 1)]
        keys += [K.delta(0, "l0", v), K.update(0, v, 1)] if v else []
    keys += [K.params(0, 1, 2), K.params(0, 5, 2), K.params(0, 6, 2)]  # other epochs; version 6 is being written
    return [Listed(key, 100, 0.0 if key in young else OLD) for key in sorted(keys)]


def plan(listed: list[Listed], previous: dict[int, int] | None = None, keep_last: int = 2, min_age_s: float = 60.0):
    asked: list[str] = []

    def base_version_of(key: str) -> int | None:
        asked.append(key)
        return BASES[key]

    p = plan_gc(K, listed, committed_versions(K, listed), MANIFESTS, previous or {}, keep_last=keep_last,
                min_age_s=min_age_s, base_version_of=base_version_of)
    return p, asked


def kinds(p) -> dict[str, set[str]]:
    return {kind: {d.key for d in items} for kind, items in p.by_kind().items()}


def test_keeps_the_last_n_versions_their_parent_and_every_manifest_and_deletes_the_rest():
    p, asked = plan(listing())
    assert p.heads == {0: HEAD} and p.first_replayable == {0: 4}
    assert kinds(p) == {
        "old_params": {K.params(0, v, 1) for v in (0, 1, 2)} | {K.params(0, 1, 2)},
        "old_outer_state": {K.outer_state(0, v, 1) for v in (0, 1, 2)},
        "old_updates": {K.update(0, v, 1) for v in (1, 2)},
        "other_epoch_objects": {K.params(0, 5, 2)},
        "old_inputs": {K.delta(0, "l0", v) for v in (1, 2, 3)} | {K.genesis_params("l0", 0)},
        "unchosen_genesis": {K.genesis_params("l1", 0)},
        "stale_contributions": {K.delta(0, "l2", 7)},
        "unreadable_contributions": {K.delta(0, "l2", 9)},
        "old_learner_states": {K.learner_state("l0", 3)},  # each learner's newest stays: what a restart resumes from
        "withdrawn_versions": set(), "unmerged_at_end": set(),  # the run is not finished
    }
    assert p.kept == {"may_merge": [K.delta(0, "l2", 8)], "young": [], "uncommitted_version": [K.params(0, 6, 2)]}
    gone = {d.key for d in p.deletions}
    must_stay = {K.run_spec(), K.layout(), K.epoch_claim(1), K.genesis_layout("l0"), REFUSED,
                 K.genesis_params("l1", 1)}  # fragment 1 has no version 0 yet: its proposal may still be taken
    must_stay |= {K.manifest(0, v) for v in range(HEAD + 1)}
    must_stay |= {key for v in (3, 4, 5) for key in (K.params(0, v, 1), K.outer_state(0, v, 1), K.update(0, v, 1))}
    must_stay |= {K.delta(0, "l0", v) for v in (4, 5)}
    must_stay |= {K.learner_state("l0", 4), K.learner_state("l1", 1)}
    assert not gone & must_stay
    assert sorted(asked) == sorted(BASES)  # headers read only for unmerged contributions


def test_once_the_run_is_finished_no_learner_state_is_kept():
    p, _ = plan(listing() + [Listed(K.finished_record(), 100, OLD)])
    assert kinds(p)["old_learner_states"] == {K.learner_state("l0", s) for s in (3, 4)} | {K.learner_state("l1", 1)}


def test_a_version_above_the_runs_end_goes_whole_and_nothing_unmerged_waits_once_it_is_finished():
    """The run ended at version 4 while version 5 was written (withdrawn, its delete failed): version 5
    is not part of the run, manifest and all; the kept range ends at 4; no contribution can merge."""
    listed = listing() + [Listed(K.finished_record(), 100, OLD)]
    p = plan_gc(K, listed, committed_versions(K, listed), MANIFESTS, {}, keep_last=2, min_age_s=60.0,
                base_version_of=BASES.__getitem__, end={0: 4})
    got = kinds(p)
    assert got["withdrawn_versions"] == {K.manifest(0, 5), K.params(0, 5, 1), K.outer_state(0, 5, 1),
                                         K.update(0, 5, 1), K.params(0, 5, 2), K.params(0, 6, 2)}
    assert got["unmerged_at_end"] == {K.delta(0, "l0", 5)} | set(BASES)
    assert p.heads == {0: 4} and p.first_replayable == {0: 3}
    assert got["old_params"] == {K.params(0, v, 1) for v in (0, 1)} | {K.params(0, 1, 2)}
    gone = {d.key for d in p.deletions}
    assert not gone & {K.manifest(0, v) for v in range(5)}
    assert not gone & {key for v in (2, 3, 4) for key in (K.params(0, v, 1), K.outer_state(0, v, 1))}
    assert K.delta(0, "l0", 4) not in gone and REFUSED not in gone
    assert p.kept["may_merge"] == []


def test_young_objects_are_kept_and_the_versions_they_leave_replayable_are_recorded_as_such():
    everything = listing()
    p, asked = plan(listing(young={item.key for item in everything}))
    assert p.deletions == [] and asked == []
    assert p.first_replayable == {0: 0}  # nothing deleted: every version still replays
    unmerged_recent = K.delta(0, "l2", 8)  # a young unmerged contribution's header is not even read
    assert set(p.kept["young"]) == {d.key for d in plan(everything)[0].deletions} | {unmerged_recent}

    # Only version 3's input is old enough: versions 3..5 remain replayable, 0..2 are not.
    young = {item.key for item in everything} - {K.delta(0, "l0", v) for v in (1, 2)}
    p, _ = plan(listing(young=young))
    assert {d.key for d in p.deletions} == {K.delta(0, "l0", 1), K.delta(0, "l0", 2)}
    assert p.first_replayable == {0: 3}


def test_an_earlier_pass_is_never_undone_and_only_its_later_manifests_are_read():
    p, _ = plan(listing(), previous={0: 4}, keep_last=HEAD + 1)
    assert p.first_replayable == {0: 4}
    committed = committed_versions(K, listing())
    assert manifests_to_read(committed, {0: 4}) == [(0, v) for v in (3, 4, 5)]
    assert manifests_to_read(committed, {}) == [(0, v) for v in range(HEAD + 1)]


def test_keep_everything_when_n_covers_the_history():
    p, _ = plan(listing(), keep_last=HEAD + 1)
    assert p.first_replayable == {0: 0}
    assert set(kinds(p)["old_inputs"]) == set() and set(kinds(p)["old_params"]) == set()
    assert kinds(p)["other_epoch_objects"] == {K.params(0, 1, 2), K.params(0, 5, 2)}
