"""`storage.keys.Shard`: which fragments a coordinator shard merges, and the Redis names it uses."""

from __future__ import annotations

import pytest

from diloco.storage.keys import MAX_SHARDS, RunKeys, Shard


def test_shards_of_a_run_split_its_fragments_between_them_round_robin():
    layout = Shard(0, 3).layout()
    assert [s.fragments(8) for s in layout] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    owned = [f for s in layout for f in s.fragments(8)]
    assert sorted(owned) == list(range(8))  # each fragment has exactly one shard
    assert all(s.owns(f) for s in layout for f in s.fragments(8))
    assert [s.leads for s in layout] == [True, False, False]


def test_a_run_of_one_shard_keeps_the_names_it_always_had():
    keys = RunKeys("p", "r")
    assert keys.lease_of(Shard()) == keys.lease == "diloco:{p/r}:lease"
    assert keys.epoch_of(Shard()) == keys.epoch == "diloco:{p/r}:epoch"
    assert RunKeys.group_of(Shard()) == RunKeys.GROUP == "coordinator"
    two = Shard(1, 2)
    assert (keys.lease_of(two), keys.epoch_of(two), RunKeys.group_of(two)) == (
        "diloco:{p/r}:lease:1of2", "diloco:{p/r}:epoch:1of2", "coordinator:1of2")
    assert len({keys.epoch_of(s) for n in (1, 2, 3) for s in Shard(0, n).layout()}) == 6  # no two counts share one


@pytest.mark.parametrize("index, count", [(0, 0), (2, 2), (-1, 2), (0, MAX_SHARDS + 1)])
def test_a_shard_outside_its_count_is_refused(index, count):
    with pytest.raises(ValueError, match="shard"):
        Shard(index, count)
