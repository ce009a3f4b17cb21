"""The coordinator lease: one active coordinator per shard of a run, fenced by an epoch.

Three Redis keys per shard (see `RunKeys.lease_of`, `RunKeys.epoch_of`, `RunKeys.shards`):
- `lease`: the holder's name, with a TTL (`PX`). Whoever holds it coordinates the shard's fragments.
- `epoch`: an integer that grows at every takeover. Every commit carries the epoch of its
  coordinator and the commit script refuses any other (`CommitResult.FENCED`), so a deposed
  coordinator that wakes up late cannot commit anything, whatever it believes about its lease.
- `shards`: how many shards coordinate the run, one value for all of them. A lease is taken only by a
  shard of that count. The count changes only while no lease of the old count is held (a shard of
  another count that is still alive: `Holder.shards`); the change retires the old shards' epochs
  (set to 0, which no commit carries), so that one of them waking up late is fenced too.

Contracts:
- `acquire` is one script: it succeeds only if nobody else holds the lease, and then takes a new
  epoch, at least `floor + 1` (the highest epoch seen in S3 manifests: after Redis lost its data,
  epochs still never go backwards). Idempotent for the same holder only in the sense that a retry
  takes yet another epoch, which fences nobody but the holder's own older one.
- `renew` extends the TTL while the epoch is still ours. If the TTL lapsed but nobody took over
  (epoch unchanged), the lease is simply taken back: a pause longer than the TTL is harmless
  when nobody else stepped in. It returns LOST when someone else took over and WIPED when the
  epoch key is gone (Redis restarted empty): the holder must then re-acquire and rebuild.
Transient errors are retried by the caller's Bus retry policy (the scripts are safe to repeat).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from diloco.storage.bus import Bus, redis_retry
from diloco.storage.keys import Shard

_ACQUIRE_LUA = """
-- KEYS: lease, epoch, shards; ARGV: holder, ttl_ms, floor, shards, the shards read before ('' for none)
if (redis.call('GET', KEYS[3]) or '') ~= ARGV[5] then return {-1} end
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return {0, redis.call('PTTL', KEYS[1]), cur} end
local e = tonumber(redis.call('GET', KEYS[2]) or '0')
if e < tonumber(ARGV[3]) then e = tonumber(ARGV[3]) end
e = e + 1
redis.call('SET', KEYS[2], e)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[3], ARGV[4])
return {1, e}
"""

_RELAYOUT_LUA = """
-- KEYS: shards, then the old count's leases, then their epochs; ARGV: shards, the old count
-- A live shard of the old count keeps it: {0, pttl, holder, index}. Otherwise their epochs are
-- retired (0: no commit carries it) and the count is ours.
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return {-1} end
local n = (#KEYS - 1) / 2
for i = 1, n do
  local cur = redis.call('GET', KEYS[1 + i])
  if cur then return {0, redis.call('PTTL', KEYS[1 + i]), cur, i - 1} end
end
for i = 1, n do
  if redis.call('EXISTS', KEYS[1 + n + i]) == 1 then redis.call('SET', KEYS[1 + n + i], '0') end
end
redis.call('SET', KEYS[1], ARGV[1])
return {1}
"""

_RENEW_LUA = """
-- KEYS: lease, epoch; ARGV: holder, epoch, ttl_ms
local e = redis.call('GET', KEYS[2])
if not e then return -1 end
if e ~= ARGV[2] then return 0 end
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""

_RELEASE_LUA = """
-- KEYS: lease; ARGV: holder
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Renewal(enum.Enum):
    HELD = 1
    LOST = 0
    """Another coordinator took over (the epoch moved on): stop."""
    WIPED = -1
    """The epoch key is gone: Redis lost its data. Re-acquire, then rebuild Redis from S3."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds the lease right now, as seen by someone who could not take it."""

    name: str
    expires_in_s: float
    shards: Shard | None = None
    """The shard it holds, when that is a shard of another count than the one asked for."""


class Lease:
    def __init__(self, bus: Bus, holder: str, ttl_s: float) -> None:
        self.bus, self.holder, self.ttl_ms = bus, holder, max(1, int(ttl_s * 1000))
        self.url = bus.url  # for redis_retry's messages (no password)
        self.shard = bus.shard
        self._keys = [bus.keys.lease_of(bus.shard), bus.keys.epoch_of(bus.shard)]
        self._acquire = bus.r.register_script(_ACQUIRE_LUA)
        self._relayout = bus.r.register_script(_RELAYOUT_LUA)
        self._renew = bus.r.register_script(_RENEW_LUA)
        self._release = bus.r.register_script(_RELEASE_LUA)

    @redis_retry
    def acquire(self, floor: int = 0) -> int | Holder:
        """Our new epoch, or who holds the lease now: our shard's, or a shard's of another count
        (`Holder.shards`) while one of them is alive."""
        while True:
            raw = self.bus.r.get(self.bus.keys.shards)
            stored = None if raw is None else int(raw)
            if stored is not None and stored != self.shard.count:
                old = Shard(0, stored).layout()
                reply = self._relayout(keys=[self.bus.keys.shards, *(self.bus.keys.lease_of(s) for s in old),
                                             *(self.bus.keys.epoch_of(s) for s in old)],
                                       args=[self.shard.count, stored])
                if int(reply[0]) == 0:
                    return Holder(name=reply[2].decode(), expires_in_s=max(0, int(reply[1])) / 1000,
                                  shards=Shard(int(reply[3]), stored))
                continue  # the count is ours now, or it changed meanwhile: read it again
            reply = self._acquire(keys=[*self._keys, self.bus.keys.shards],
                                  args=[self.holder, self.ttl_ms, floor, self.shard.count,
                                        "" if stored is None else stored])
            if int(reply[0]) == 1:
                return int(reply[1])
            if int(reply[0]) == 0:
                return Holder(name=reply[2].decode(), expires_in_s=max(0, int(reply[1])) / 1000)

    @redis_retry
    def held_by_other(self) -> Holder | None:
        """Who else holds the lease now, if anyone (a read: `acquire` decides)."""
        pipe = self.bus.r.pipeline(transaction=False)
        pipe.get(self._keys[0])
        pipe.pttl(self._keys[0])
        name, ttl_ms = pipe.execute()
        if name is None or name.decode() == self.holder:
            return None
        return Holder(name=name.decode(), expires_in_s=max(0, int(ttl_ms)) / 1000)

    @redis_retry
    def renew(self, epoch: int) -> Renewal:
        return Renewal(int(self._renew(keys=self._keys, args=[self.holder, epoch, self.ttl_ms])))

    @redis_retry
    def release(self) -> None:
        """Let a standby take over at once instead of after the TTL (a clean shutdown)."""
        self._release(keys=self._keys[:1], args=[self.holder])
