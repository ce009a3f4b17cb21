"""The coordinator lease: one active coordinator per run, fenced by an epoch.

Two Redis keys (see `RunKeys.lease`, `RunKeys.epoch`):
- `lease`: the holder's name, with a TTL (`PX`). Whoever holds it coordinates the run.
- `epoch`: an integer that grows by one at every takeover. Every commit carries the epoch of its
  coordinator and the commit script refuses any other (`CommitResult.FENCED`), so a deposed
  coordinator that wakes up late cannot commit anything, whatever it believes about its lease.

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

_ACQUIRE_LUA = """
-- KEYS: lease, epoch; ARGV: holder, ttl_ms, floor
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return {0, redis.call('PTTL', KEYS[1]), cur} end
local e = tonumber(redis.call('GET', KEYS[2]) or '0')
if e < tonumber(ARGV[3]) then e = tonumber(ARGV[3]) end
e = e + 1
redis.call('SET', KEYS[2], e)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, e}
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


class Lease:
    def __init__(self, bus: Bus, holder: str, ttl_s: float) -> None:
        self.bus, self.holder, self.ttl_ms = bus, holder, max(1, int(ttl_s * 1000))
        self.url = bus.url  # for redis_retry's messages (no password)
        self._keys = [bus.keys.lease, bus.keys.epoch]
        self._acquire = bus.r.register_script(_ACQUIRE_LUA)
        self._renew = bus.r.register_script(_RENEW_LUA)
        self._release = bus.r.register_script(_RELEASE_LUA)

    @redis_retry
    def acquire(self, floor: int = 0) -> int | Holder:
        """Our new epoch, or who holds the lease now."""
        reply = self._acquire(keys=self._keys, args=[self.holder, self.ttl_ms, floor])
        if int(reply[0]) == 1:
            return int(reply[1])
        return Holder(name=reply[2].decode(), expires_in_s=max(0, int(reply[1])) / 1000)

    @redis_retry
    def held_by_other(self) -> Holder | None:
        """Who else holds the lease now, if anyone (a read: `acquire` decides)."""
        pipe = self.bus.r.pipeline(transaction=False)
        pipe.get(self.bus.keys.lease)
        pipe.pttl(self.bus.keys.lease)
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
