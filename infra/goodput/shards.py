"""How many coordinator shards a model needs, projected from one shard's measured throughput.

`diloco bench coordinator` measures what one coordinator process takes in and merges (MB/s of
contribution objects) on a given machine. A run of `params` parameters in `fragments` fragments,
with `learners` learners each sending every fragment once per round period (H steps), must take
in every fragment's round within the period; shard k of K merges the fragments f with f % K == k,
so the busiest shard holds ceil(P / K) of them. Pure arithmetic: each shard is assumed to run on a
machine of its own at the measured rate (what `bench coordinator --shards` approaches on one
machine, where the shards share its cores), with the servers not the limit.

A round of one fragment then takes `round_mb / shard_mb_s` from its first piece to its version:
the goodput simulator's `merge_s`, so that `simulate` can say what the shards' latency costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.storage import codecs
from diloco.storage.errors import ConfigError

MB = 1e6


@dataclass(frozen=True, slots=True)
class ShardLoad:
    """One shard count's load on its busiest shard."""

    shards: int
    fragments_per_shard: int
    """Fragments the busiest shard merges (ceil(P / K))."""
    piece_mb: float
    """One learner's piece of one fragment, in the codec's bytes (before zstd)."""
    need_mb_s: float
    """What the busiest shard must take in to keep up: its fragments' rounds, every period."""
    merge_s: float
    """A fragment's round (every learner's piece) at the shard's rate: from its first piece to its version."""
    utilization: float
    """need_mb_s / the shard's rate: at or above 1 the shard falls behind, rounds queue and go stale."""

    @property
    def keeps_up(self) -> bool:
        return self.utilization < 1.0


def shard_loads(*, params: int, fragments: int, learners: int, period_s: float, codec: str, shard_mb_s: float,
                shards: list[int]) -> list[ShardLoad]:
    """The busiest shard's load for each shard count in `shards` (at most `fragments` each)."""
    if params < fragments or fragments < 1 or learners < 1 or not period_s > 0 or not shard_mb_s > 0:
        raise ConfigError(f"need params >= fragments >= 1, learners >= 1 and a positive period and shard rate, got "
                          f"{params} params, {fragments} fragments, {learners} learners, period {period_s}s, "
                          f"{shard_mb_s} MB/s")
    bad = [k for k in shards if not 1 <= k <= fragments]
    if bad:
        raise ConfigError(f"shard counts must be in 1..{fragments} (the fragments): {bad}")
    found = codecs.get(codec)
    piece_mb = found.nbytes(math.ceil(params / fragments), found.default_block) / MB
    round_mb = learners * piece_mb
    loads = []
    for k in shards:
        per_shard = math.ceil(fragments / k)
        need = per_shard * round_mb / period_s
        loads.append(ShardLoad(shards=k, fragments_per_shard=per_shard, piece_mb=piece_mb, need_mb_s=need,
                               merge_s=round_mb / shard_mb_s, utilization=need / shard_mb_s))
    return loads


def shards_needed(loads: list[ShardLoad]) -> int | None:
    """The fewest shards of `loads` that keep up, None if none does."""
    return min((load.shards for load in loads if load.keeps_up), default=None)
