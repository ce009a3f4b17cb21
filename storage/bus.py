"""Redis adapter: the fast index of a run (announcements, versions, heads, learners, counters).

Redis is the index, S3 the durable truth. Each stream entry carries one field, `m`, holding a
msgpack record from `storage.protocol`; entries that do not decode are returned as `Refused`
so that the reader can acknowledge and count them instead of choking.

Contracts:
- `announce` may land twice if a reply is lost and the adapter retries (the XADD was already
  applied): the coordinator deduplicates by `contribution_id`.
- `commit_version` is one Lua script: it checks the fencing epoch, compares-and-sets the head,
  refuses contribution ids already applied, then writes head, commit record, versions entry,
  XACKs and the applied set. Retrying it after a lost reply returns `ALREADY` instead of
  committing twice. Scripts have no rollback, so every check happens before the first write.
- Blocking reads use a `block_ms` well below the socket timeout, so a blocked read never times
  out on the client side while entries are delivered to it; `block_ms=0` does not block.
Transient errors (connection refused/reset, timeouts, a server still loading its AOF) are
retried here with bounded exponential backoff and jitter. A refused identity (wrong user or
password, an ACL without the right) or a server certificate the client does not trust is not
transient: it raises `ConfigError` at once, naming the URL without its password.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import math
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import MovedError, RedisClusterException
from redis.retry import Retry
from tenacity import retry, retry_if_exception, stop_after_delay, wait_random_exponential

from diloco.storage.errors import ConfigError, DilocoError, Refused
from diloco.storage.keys import RunKeys, Shard
from diloco.storage.protocol import (Announcement, Cadence, FinishRequest, LearnerFinished, LearnerLeft, LearnerStats,
                                     Refusal, RunEnd, VersionEvent)
from diloco.storage.settings import ENV_REDIS_URL, Endpoints, redact_url

log = logging.getLogger(__name__)

FIELD = b"m"
SOCKET_TIMEOUT_S = 10.0
MAX_BLOCK_MS = 2000
VERSIONS_MAXLEN = 10_000
"""The versions and refusals streams keep about this many entries (XADD MAXLEN ~): a learner that
missed more takes the heads instead, and manifests in S3 keep every refusal of a version."""
COMMITS_KEPT = 1000
"""The commits hash keeps each fragment's last this many versions (a re-sent commit of one of them is
ALREADY; an older one is refused by the head check anyway)."""
LEARNERS_FORGOTTEN_S = 3600.0
"""A learner whose heartbeat lapsed this long ago leaves the live set's key, the joined set and its stats
are dropped: it is gone (`gone_after_s` is at most this long), and the sets every fleet read returns stay
as large as the ids of the last hour, not of the run's life."""
MAX_LEASE_S = 600.0
"""A heartbeat keeps a learner live for at most this long (its ttl is capped in the script): a made-up
id heartbeated once with a ttl of 1e9 s would otherwise stay live, and be read every loop, for good."""
MAX_STATS_BYTES = 16 * 1024
"""The most a heartbeat's stats record may be (LearnerStats is a few hundred bytes); the script
writes nothing larger, so that no reader holds megabytes of one learner's junk."""
MAX_LIVE_LEARNERS = 4096
"""The most learner ids one run counts live at once: past it, a new id's heartbeat is refused
(`fleet_full`) until leases lapse. The coordinator reads the live set, a large one about once a second
(`coordinator.influence.fleet_read_due`)."""
ANNOUNCEMENTS_KEPT = 10_000
"""`trim_announcements` keeps at least the last this many announcements (for people and tools that
read the stream), beside every entry still pending or not yet delivered (what recovery needs)."""

QUICK_TIMEOUT_S = 2.0
"""A `quick` Bus's socket timeout (`Bus(..., quick=True)`)."""

_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def access_refused(exc: BaseException) -> str | None:
    """What went wrong and what to fix when the server refused this client or the client refused
    the server's certificate; None for anything else."""
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return f"refused the user or password ({exc}): check them in {ENV_REDIS_URL}"
    if isinstance(exc, (redis.exceptions.AuthorizationError, redis.exceptions.NoPermissionError)):
        return f"refused a command to this user ({exc}): give its ACL the commands and keys it needs"
    if isinstance(exc.__context__, ssl.SSLCertVerificationError):
        return (f"presented a TLS certificate this client does not trust ({exc.__context__}): add "
                f"ssl_ca_certs=<CA file>&ssl_cert_reqs=required to the rediss:// URL in {ENV_REDIS_URL}")
    return None


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, _TRANSIENT) and access_refused(exc) is None


_retry_transient = retry(
    retry=retry_if_exception(_transient),
    wait=wait_random_exponential(multiplier=0.1, max=2.0),
    stop=stop_after_delay(30.0),
    reraise=True,
)

F = TypeVar("F", bound=Callable[..., Any])


def redis_retry(method: F) -> F:
    """A method of an object whose `url` is its Redis URL without the password (`Bus`, `Lease`), with
    transient errors retried and a refused identity or certificate turned into `ConfigError`."""
    retried = _retry_transient(method)

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return (method if getattr(self, "quick", False) else retried)(self, *args, **kwargs)
        except redis.RedisError as exc:
            if (what := access_refused(exc)) is not None:
                raise ConfigError(f"Redis at {self.url} {what}") from exc
            if isinstance(exc, MovedError):
                raise ConfigError(f"Redis at {self.url} is a node of a Redis Cluster: use redis+cluster:// "
                                  f"(rediss+cluster://) in {ENV_REDIS_URL}") from exc
            if (isinstance(exc.__context__, ConnectionResetError) and self.url.startswith("redis://")
                    and not getattr(exc, "__notes__", None)):
                exc.add_note(f"{self.url}: a Redis that speaks TLS only resets plaintext connections; "
                             "if it does, use rediss://")
            raise

    return call  # type: ignore[return-value]


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> tuple[int, int]:
    """The smallest stream id after `entry_id`."""
    ms, seq = _stream_id(entry_id)
    return ms, seq + 1


def _previous_id(entry_id: tuple[int, int]) -> str:
    """The largest stream id before `entry_id`, as a string (XGROUP CREATE reads the entries after it)."""
    ms, seq = entry_id
    if seq > 0:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-18446744073709551615" if ms > 0 else "0"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


BACKLOG_COUNTED = 10_000
"""Redis < 7 does not say how many entries a group has not read: `backlog` counts up to this many."""


@dataclass(frozen=True, slots=True)
class Backlog:
    """The announcements stream's entries not dealt with yet (`Bus.backlog`)."""

    stream_length: int
    pending: int
    """Delivered to a consumer, not acknowledged (merged, refused or dropped) yet."""
    undelivered: int
    """Not read by the group yet (counted up to BACKLOG_COUNTED on Redis < 7)."""
    oldest_pending_at: float | None
    """Redis time (unix seconds) the oldest pending entry was added at."""
    oldest_undelivered_at: float | None
    group: bool = True
    """The coordinator's consumer group exists (a coordinator has read the stream)."""

    @property
    def waiting(self) -> int:
        return self.pending + self.undelivered

    def lag_s(self, now: float) -> float | None:
        """Age of the oldest entry not dealt with: how far behind the coordinator is."""
        times = [t for t in (self.oldest_pending_at, self.oldest_undelivered_at) if t is not None]
        return max(0.0, now - min(times)) if times else None


class GroupGone(DilocoError):
    """This shard's consumer group is not on the announcements stream: dropped when the run's number of
    shards changed (this coordinator is then fenced), or deleted by hand."""


class CommitResult(enum.Enum):
    COMMITTED = 1
    ALREADY = 2
    """This exact version was committed before (our own retried commit)."""
    FENCED = -1
    """Another coordinator holds a newer epoch: this one must stop."""
    HEAD_MOVED = -2
    """The head is not the parent we merged onto."""
    VERSION_TAKEN = -3
    """A different version with the same number exists."""
    ALREADY_APPLIED = -4
    """One of the contributions was applied in an earlier version."""
    WIPED = -5
    """The epoch key is gone: Redis lost its data (restarted empty). Rebuild from S3, then retry."""
    ENDED = -6
    """The run ended at an earlier version of this fragment (`Bus.end_at_heads`): nothing more is committed."""


_COMMIT_LUA = """
-- KEYS: heads, commits, applied, epoch, versions, announcements, counters, applied_log (this fragment's),
--       final_heads
-- ARGV: fragment, expected_head, version, params_sha, epoch, event, group, maxlen, check_applied (1/0),
--       keep_applied, keep_commits, n_ids, ids..., n_acks, acks...
local frag, expected, version, sha = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if ARGV[5] ~= '' then
  local e = redis.call('GET', KEYS[4])
  if not e then return -5 end
  if e ~= ARGV[5] then return -1 end
end
local final = redis.call('HGET', KEYS[9], frag)
if final and tonumber(version) > tonumber(final) then return -6 end
local ck = frag .. ':' .. version
local done = redis.call('HGET', KEYS[2], ck)
if done then
  if done == sha then return 2 end
  return -3
end
local cur = redis.call('HGET', KEYS[1], frag)
if (cur or '') ~= expected then return -2 end
local n = tonumber(ARGV[12])
if ARGV[9] == '1' then
  for i = 1, n do
    if redis.call('SISMEMBER', KEYS[3], ARGV[12 + i]) == 1 then return -4 end
  end
end
redis.call('HSET', KEYS[1], frag, version)
redis.call('HSET', KEYS[2], ck, sha)
redis.call('HDEL', KEYS[2], frag .. ':' .. (tonumber(version) - tonumber(ARGV[11])))
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[8], '*', 'm', ARGV[6])
local ids = {}
for i = 1, n do
  redis.call('SADD', KEYS[3], ARGV[12 + i])
  ids[i] = ARGV[12 + i]
end
-- the applied set keeps the ids of this fragment's last keep_applied versions: older ones are refused as stale
redis.call('RPUSH', KEYS[8], table.concat(ids, ','))
local keep = tonumber(ARGV[10])
while keep > 0 and redis.call('LLEN', KEYS[8]) > keep do
  for id in string.gmatch(redis.call('LPOP', KEYS[8]), '[^,]+') do redis.call('SREM', KEYS[3], id) end
end
local na = tonumber(ARGV[13 + n])
for i = 1, na do
  redis.call('XACK', KEYS[6], ARGV[7], ARGV[13 + n + i])
end
redis.call('HINCRBY', KEYS[7], 'versions_committed', 1)
redis.call('HINCRBY', KEYS[7], 'contributions_applied', n)
return 1
"""

_MARK_APPLIED_LUA = """
-- KEYS: applied, applied_log (one fragment's); ARGV: keep_applied, ids...
local ids = {}
for i = 2, #ARGV do
  redis.call('SADD', KEYS[1], ARGV[i])
  ids[#ids + 1] = ARGV[i]
end
redis.call('RPUSH', KEYS[2], table.concat(ids, ','))
local keep = tonumber(ARGV[1])
while keep > 0 and redis.call('LLEN', KEYS[2]) > keep do
  for id in string.gmatch(redis.call('LPOP', KEYS[2]), '[^,]+') do redis.call('SREM', KEYS[1], id) end
end
return 1
"""

_HEARTBEAT_LUA = """
-- KEYS: learners, learner_stats, joined, cadence, finished
-- ARGV: learner, ttl_s, joined (1/0), forget_s, max_ttl_s, max_stats_bytes, max_live, [stats]
-- Returns {1, TIME's seconds, TIME's microseconds, the cadence, the run's end} (the last two false
-- where unset): what a learner reads with each heartbeat, in the same round trip. {0} with nothing
-- written if the stats are over max_stats_bytes, {-1} if max_live other learners are live already.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
if ARGV[8] and #ARGV[8] > tonumber(ARGV[6]) then return {0} end
-- learners whose heartbeat lapsed more than forget_s ago are forgotten, a few per call (their stats
-- and their membership of the joined set too: they are long gone)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[4]), 'LIMIT', 0, 16)) do
  redis.call('ZREM', KEYS[1], gone)
  redis.call('HDEL', KEYS[2], gone)
  redis.call('SREM', KEYS[3], gone)
end
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not (mine and tonumber(mine) >= now) and redis.call('ZCOUNT', KEYS[1], now, '+inf') >= tonumber(ARGV[7]) then
  return {-1}
end
redis.call('ZADD', KEYS[1], now + math.min(tonumber(ARGV[2]), tonumber(ARGV[5])), ARGV[1])
if ARGV[3] == '1' then redis.call('SADD', KEYS[3], ARGV[1]) end
if ARGV[8] then redis.call('HSET', KEYS[2], ARGV[1], ARGV[8]) end
return {1, t[1], t[2], redis.call('GET', KEYS[4]), redis.call('GET', KEYS[5])}
"""

_FLEET_LUA = """
-- KEYS: learners, joined, finished_learners, finish_request; ARGV: gone_after_s
-- Returns live, joined, finished, the finish request and the joined learners whose heartbeat lapsed
-- more than gone_after_s ago (or so long ago that it is forgotten).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local joined = redis.call('SMEMBERS', KEYS[2])
local gone = {}
for _, name in ipairs(joined) do
  local expires = redis.call('ZSCORE', KEYS[1], name)
  if not expires or tonumber(expires) < now - tonumber(ARGV[1]) then gone[#gone + 1] = name end
end
return {redis.call('ZRANGEBYSCORE', KEYS[1], string.format('%.6f', now), '+inf'), joined,
        redis.call('HKEYS', KEYS[3]), redis.call('GET', KEYS[4]) or '', gone}
"""

_SET_FINISHED_LUA = """
-- KEYS: epoch, finished, final_heads, heads
-- ARGV: epoch, record, at_heads (1/0), n, fragment, version, fragment, version, ...
-- Returns 1, 0 (nothing written) if the epoch is not ours, -2 (nothing written) if at_heads and a
-- head is not the record's version of its fragment (a shard committed meanwhile).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[4])
if ARGV[3] == '1' then
  for i = 0, n - 1 do
    if (redis.call('HGET', KEYS[4], ARGV[5 + 2 * i]) or '-1') ~= ARGV[6 + 2 * i] then return -2 end
  end
end
redis.call('SET', KEYS[2], ARGV[2])
for i = 0, n - 1 do redis.call('HSET', KEYS[3], ARGV[5 + 2 * i], ARGV[6 + 2 * i]) end
return 1
"""

_ACK_LUA = """
-- KEYS: announcements; ARGV: group, ids...
if #ARGV > 1 then return redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2)) end
return 0
"""


def _block(block_ms: int) -> int | None:
    """The BLOCK argument of a stream read: at most MAX_BLOCK_MS, and none at all for 0 (which
    Redis would take as "block until an entry arrives", i.e. until the socket times out)."""
    return min(block_ms, MAX_BLOCK_MS) if block_ms > 0 else None


def connect(url: str, timeout_s: float = SOCKET_TIMEOUT_S) -> redis.Redis:
    """A client that does not retry by itself (we retry, bounded, in one place). Over TLS
    (`rediss://`) it checks the server certificate's hostname, whatever the installed redis-py's
    default (older releases did not); the URL's own `ssl_check_hostname=` query still decides.
    `redis+cluster://` (`rediss+cluster://`) is a Redis Cluster, found through the node the URL names:
    the client follows the cluster's slots (its own redirections), and a run's keys share one slot."""
    given, cluster = url, url.startswith(("redis+cluster://", "rediss+cluster://"))
    url = url.replace("+cluster://", "://", 1) if cluster else url
    tls = {"ssl_check_hostname": True} if url.startswith("rediss://") else {}
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": min(timeout_s, 5.0)}
    if cluster:
        try:  # it reads the cluster's map at once
            return RedisCluster.from_url(url, **timeouts, health_check_interval=30, **tls)  # type: ignore[return-value]
        except RedisClusterException as exc:
            if "not enabled" in str(exc):
                raise ConfigError(f"Redis at {redact_url(given)} is not a Redis Cluster node: use redis:// (rediss://) "
                                  f"in {ENV_REDIS_URL}, not +cluster") from None
            raise redis.ConnectionError(f"Redis Cluster at {redact_url(given)}: {exc}") from exc
    return redis.Redis.from_url(url, **timeouts, retry=Retry(NoBackoff(), 0), health_check_interval=30, **tls)


Entry = tuple[str, "Announcement | Refused"]


@dataclass(frozen=True, slots=True)
class Beat:
    """What a learner reads with each heartbeat (`Bus.heartbeat`), in its round trip."""

    server_time: float
    """Redis server time as the heartbeat was written, unix seconds (`Bus.server_time`)."""
    cadence: Cadence | None
    """The round clock (`Bus.cadence`), None before the coordinator sets it."""
    run_end: RunEnd | None
    """The run's end (`Bus.run_end`), None while it goes on."""


@dataclass(frozen=True, slots=True)
class Fleet:
    """The learners of a run as one read sees them (`Bus.fleet`)."""

    live: frozenset[str]
    """Heartbeat not expired, on the Redis server's clock."""
    joined: frozenset[str]
    """Joined the run at some point (`Bus.join`)."""
    finished: frozenset[str]
    """Finished (`Bus.finish`) and not joined again since."""
    finish_request: FinishRequest | None
    """An operator's `diloco finish`, if one asked (None also if the request does not decode)."""
    gone: frozenset[str] = frozenset()
    """Joined, and no heartbeat for longer than the read's `gone_after_s`: a learner that is not coming
    back under this id (a preempted machine replaced under another id, a slot scaled away)."""


class Bus:
    """The Redis side of one run, as one coordinator `shard` of it sees it (its consumer group, its
    lease and fencing epoch; learners and tools use the default). Thread-safe (redis-py pools connections)."""

    def __init__(self, endpoints: Endpoints, run: str, shard: Shard = Shard(), *, quick: bool = False) -> None:
        """`quick`: each call answers within QUICK_TIMEOUT_S or raises, with no retries (for a
        supervisor's decisions taken every tick while Redis may be down)."""
        if not endpoints.redis_url:
            raise ConfigError(f"no Redis configured: set {ENV_REDIS_URL}")
        self.keys = RunKeys(endpoints.prefix, run)
        self.run = run
        self.shard = shard
        self.group = RunKeys.group_of(shard)
        """The consumer group this shard reads the announcements through."""
        self.epoch_key = self.keys.epoch_of(shard)
        self.url = redact_url(endpoints.redis_url)
        """The Redis URL without its password: the only form of it that goes into messages."""
        self.quick = quick
        self.r = connect(endpoints.redis_url, QUICK_TIMEOUT_S if quick else SOCKET_TIMEOUT_S)
        self._commit = self.r.register_script(_COMMIT_LUA)
        self._ack = self.r.register_script(_ACK_LUA)
        self._warned: set[bytes] = set()
        self._heartbeat = self.r.register_script(_HEARTBEAT_LUA)
        self._mark_applied = self.r.register_script(_MARK_APPLIED_LUA)
        self._fleet = self.r.register_script(_FLEET_LUA)
        self._set_finished = self.r.register_script(_SET_FINISHED_LUA)

    @redis_retry
    def ping(self) -> bool:
        return bool(self.r.ping())

    # ---- announcements (learner -> coordinator) -----------------------------------------
    @redis_retry
    def announce(self, a: Announcement) -> str:
        return self.r.xadd(self.keys.announcements, {FIELD: a.to_wire()}).decode()

    @redis_retry
    def ensure_group(self) -> None:
        """Create the consumer group of every shard of this one's layout (and the stream) if missing,
        then drop the groups of another layout. Idempotent.

        A run's first groups read the stream from its start. Groups made when the number of shards
        changed start at the oldest announcement the old groups had not dealt with (pending or not
        delivered yet): nothing is skipped, and whatever of the later ones was applied is refused as a
        duplicate. Only then are the old groups dropped; the leases let the number change only once
        no shard of the old one is alive (`storage.lease`)."""
        ours = [RunKeys.group_of(s) for s in self.shard.layout()]
        groups = self._groups()
        missing = [g for g in ours if g not in groups]
        if missing:
            oldest = self._oldest_unfinished()
            start = "0" if oldest is None or oldest == (0, 0) else _previous_id(oldest)
            for name in missing:
                try:
                    self.r.xgroup_create(self.keys.announcements, name, id=start, mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        for name in groups:
            if name not in ours and (name == RunKeys.GROUP or name.startswith(RunKeys.GROUP + ":")):
                self.r.xgroup_destroy(self.keys.announcements, name)
                log.warning("dropped the consumer group %s: the run is coordinated by %s now", name,
                            f"{self.shard.count} shard(s)")

    def _groups(self) -> dict[str, dict]:
        """The announcements stream's consumer groups by name (none without a stream)."""
        try:
            return {_text(g["name"]): g for g in self.r.xinfo_groups(self.keys.announcements)}
        except redis.ResponseError:  # no stream yet
            return {}

    @staticmethod
    def _parse(entry_id: bytes, fields: dict | None) -> Entry:
        eid = entry_id.decode()
        if not fields or FIELD not in fields:
            return eid, Refused("bad_message", f"stream entry {eid} has no '{FIELD.decode()}' field")
        try:
            return eid, Announcement.from_wire(fields[FIELD])
        except Refused as exc:
            # Nothing in the entry can be trusted (not even its learner): name the entry, XRANGE finds it.
            return eid, Refused(exc.code, f"stream entry {eid}: {exc.reason}")

    @redis_retry
    def read_announcements(self, consumer: str, *, count: int = 64, block_ms: int = 1000,
                           pending: bool = False) -> list[Entry]:
        """New entries for this consumer (`pending=True`: the ones delivered before but not acked).

        Waits up to `block_ms` for new entries; `block_ms <= 0` returns at once (Redis itself reads
        BLOCK 0 as "wait forever")."""
        block = None if pending else _block(block_ms)
        try:
            reply = self.r.xreadgroup(self.group, consumer, {self.keys.announcements: "0" if pending else ">"},
                                      count=count, block=block)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                raise GroupGone(f"the consumer group {self.group} is gone from {self.keys.announcements}") from None
            raise
        out: list[Entry] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                if pending and not fields:
                    # Trimmed or deleted while pending: nothing to process, acknowledge it.
                    self.ack([entry_id.decode()])
                    continue
                out.append(self._parse(entry_id, fields))
        return out

    @redis_retry
    def announcement_entries(self) -> list[Entry]:
        """Every entry of the announcements stream, in order, parsed as the coordinator parses them
        (a malformed one is a Refused): for the tools that audit or measure a run afterwards. Reads
        the whole stream at once."""
        return [self._parse(entry_id, fields) for entry_id, fields in self.r.xrange(self.keys.announcements)]

    @redis_retry
    def autoclaim(self, consumer: str, *, min_idle_ms: int, count: int = 64) -> list[Entry]:
        """Take over entries left pending by other consumers for longer than min_idle_ms."""
        try:
            reply = self.r.xautoclaim(self.keys.announcements, self.group, consumer, min_idle_ms,
                                      start_id="0-0", count=count)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                raise GroupGone(f"the consumer group {self.group} is gone from {self.keys.announcements}") from None
            raise
        # Redis 6.2 answers [next, entries]; 7.0 adds a list of deleted ids.
        entries = reply[1] if len(reply) > 1 else []
        out: list[Entry] = []
        for item in entries:
            if item is None:
                continue
            entry_id, fields = item
            if not fields:
                self.ack([entry_id.decode()])
                continue
            out.append(self._parse(entry_id, fields))
        return out

    @redis_retry
    def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        return int(self._ack(keys=[self.keys.announcements], args=[self.group, *entry_ids]))

    @redis_retry
    def refuse(self, entry_id: str | None, refusal: Refusal) -> None:
        """Record a refusal (stream + counters) and acknowledge its entry, in one transaction."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.refusals, {FIELD: refusal.to_wire()}, maxlen=VERSIONS_MAXLEN, approximate=True)
        pipe.hincrby(self.keys.counters, "contributions_refused", 1)
        pipe.hincrby(self.keys.counters, f"refused:{refusal.code}", 1)
        if entry_id:
            pipe.xack(self.keys.announcements, self.group, entry_id)
        pipe.execute()

    @redis_retry
    def newest(self, stream: str, count: int) -> list[tuple[str, bytes]]:
        """The newest `count` entries of one of the run's streams (`keys.versions`, `announcements`,
        `refusals`), newest first: (entry id, the record's bytes, b"" when the entry has none). The
        reader decodes them."""
        return [(eid.decode(), fields.get(FIELD, b"")) for eid, fields in self.r.xrevrange(stream, count=count)]

    @redis_retry
    def leadership(self, shard: Shard | None = None) -> tuple[int | None, str | None, float | None]:
        """The fencing epoch of `shard` (this bus's by default), its lease's holder and the seconds until
        its lease expires (None: unset)."""
        shard = shard or self.shard
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.keys.epoch_of(shard))
        pipe.get(self.keys.lease_of(shard))
        pipe.pttl(self.keys.lease_of(shard))
        raw_epoch, holder, ttl_ms = pipe.execute()
        return (None if raw_epoch is None else int(raw_epoch), None if holder is None else holder.decode(errors="replace"),
                None if holder is None or int(ttl_ms) < 0 else int(ttl_ms) / 1000.0)

    @redis_retry
    def shard_count(self) -> int | None:
        """How many shards coordinate the run (`RunKeys.shards`); None before a coordinator took a lease."""
        raw = self.r.get(self.keys.shards)
        return None if raw is None else int(raw)

    @redis_retry
    def consumers(self) -> list[tuple[str, int, float]]:
        """The consumers of the announcements' groups: (name, entries pending, seconds idle), a shard's
        consumers named `group/consumer` where the run has several; none before a group exists."""
        out = []
        for group in self._groups():
            try:
                found = self.r.xinfo_consumers(self.keys.announcements, group)
            except redis.ResponseError:  # dropped meanwhile
                continue
            prefix = "" if group == RunKeys.GROUP else f"{group}/"
            out += [(prefix + _text(c["name"]), int(c["pending"]), int(c["idle"]) / 1000.0) for c in found]
        return out

    @redis_retry
    def refusals(self, count: int = 1000) -> list[Refusal]:
        out = []
        for _eid, fields in self.r.xrange(self.keys.refusals, count=count):
            out.append(Refusal.from_wire(fields[FIELD]))
        return out

    @redis_retry
    def backlog(self) -> Backlog:
        """The announcements not dealt with yet: pending in a group (delivered to a consumer, not
        acknowledged) and not delivered yet, with the Redis time of the oldest of each (a stream id
        starts with the time it was added at). A run of several shards has a group per shard: their
        pending entries add up, and what waits is what the group furthest behind has not read. A few
        small reads per group, whatever the stream's length."""
        length = self.r.xlen(self.keys.announcements)
        groups = self._groups()
        if not groups:  # nobody has read the stream yet: every entry waits
            first = self.r.xrange(self.keys.announcements, count=1) if length else []
            return Backlog(length, 0, length, None, _stream_id(_text(first[0][0]))[0] / 1000 if first else None,
                           group=False)
        pending, undelivered = 0, 0
        oldest_pending: float | None = None
        oldest_new: float | None = None
        for name, group in groups.items():
            summary = self.r.xpending(self.keys.announcements, name)
            pending += int(summary["pending"])
            if summary["pending"]:
                at = _stream_id(_text(summary["min"]))[0] / 1000
                oldest_pending = at if oldest_pending is None else min(oldest_pending, at)
            after = "(" + _text(group["last-delivered-id"])
            first_new = self.r.xrange(self.keys.announcements, min=after, count=1)
            lag = group.get("lag")  # Redis >= 7 (None where it cannot tell, entries deleted)
            if lag is None:
                lag = len(self.r.xrange(self.keys.announcements, min=after, count=BACKLOG_COUNTED)) if first_new else 0
            undelivered = max(undelivered, int(lag))
            if first_new:
                at = _stream_id(_text(first_new[0][0]))[0] / 1000
                oldest_new = at if oldest_new is None else min(oldest_new, at)
        return Backlog(length, pending, undelivered, oldest_pending, oldest_new, group=True)

    def _oldest_unfinished(self) -> tuple[int, int] | None:
        """The id of the oldest announcement not dealt with yet: pending in a group (on any consumer)
        or not yet delivered to it, over every group; (0, 0) if no group exists, None without a stream."""
        try:
            groups = self.r.xinfo_groups(self.keys.announcements)
        except redis.ResponseError:  # no stream
            return None
        if not groups:
            return (0, 0)
        oldest: tuple[int, int] | None = None
        for group in groups:
            start = _next_id(_text(group["last-delivered-id"]))
            if int(group["pending"]):
                pending = self.r.xpending(self.keys.announcements, _text(group["name"]))
                if pending["pending"]:
                    start = min(start, _stream_id(_text(pending["min"])))
            oldest = start if oldest is None else min(oldest, start)
        return oldest

    @redis_retry
    def trim_announcements(self, keep: int = ANNOUNCEMENTS_KEPT) -> int:
        """Drop the announcements that are done with: older than the oldest entry still pending in
        the group (on any consumer) or not yet delivered to it, and than the last `keep` entries.
        What recovery reads is never dropped: pending entries are re-read after a restart or claimed,
        undelivered ones read, and an announcement lost with Redis's data is made again from S3.
        Returns the number of entries removed (XTRIM MINID, Redis >= 6.2)."""
        oldest = self._oldest_unfinished()
        if oldest is None or oldest == (0, 0):
            return 0
        bounds = [oldest]
        if keep > 0:
            newest = self.r.xrevrange(self.keys.announcements, count=keep)
            if len(newest) < keep:
                return 0  # fewer than `keep` entries in all
            bounds.append(_stream_id(newest[-1][0].decode()))
        ms, seq = min(bounds)
        return int(self.r.xtrim(self.keys.announcements, minid=f"{ms}-{seq}", approximate=False))

    @redis_retry
    def unfinished_object_keys(self, limit: int = 100_000) -> set[str]:
        """The object keys of the announcements not dealt with yet (`_oldest_unfinished` and after;
        at most `limit` entries, the oldest first)."""
        start = self._oldest_unfinished()
        if start is None:
            return set()
        out = set()
        for _eid, fields in self.r.xrange(self.keys.announcements, min=f"{start[0]}-{start[1]}", count=limit):
            try:
                out.add(Announcement.from_wire(fields.get(FIELD, b"")).object_key)
            except Refused:
                continue
        return out

    @redis_retry
    def unfinished_entries(self, entry_ids: Sequence[str]) -> set[str]:
        """Those of `entry_ids` not dealt with yet: pending in a group, or not yet delivered to every
        group (all of them while no group exists). For the tools that audit a run afterwards."""
        groups = self._groups()
        if not groups:
            return set(entry_ids)
        pending: set[str] = set()
        for name, group in groups.items():
            if not int(group["pending"]):
                continue
            try:
                rows = self.r.xpending_range(self.keys.announcements, name, min="-", max="+",
                                            count=int(group["pending"]))
            except redis.ResponseError:  # dropped meanwhile
                continue
            pending |= {_text(row["message_id"]) for row in rows}
        read = min(_stream_id(_text(g["last-delivered-id"])) for g in groups.values())
        return {e for e in entry_ids if e in pending or _stream_id(e) > read}

    @redis_retry
    def announcements_after(self, last_id: str, *, count: int = 1000, block_ms: int | None = None) -> list[Entry]:
        """The entries after `last_id` ("0": from the start), outside any group (a tool watching the
        stream); waits up to `block_ms` for one (None: returns at once)."""
        reply = self.r.xread({self.keys.announcements: last_id}, count=count, block=block_ms)
        return [self._parse(eid, fields) for _stream, entries in reply or [] for eid, fields in entries]

    @redis_retry
    def refused_object_keys(self, count: int = 10_000) -> set[str]:
        """The object keys of the last `count` refusals."""
        out = set()
        for _eid, fields in self.r.xrevrange(self.keys.refusals, count=count):
            try:
                out.add(Refusal.from_wire(fields.get(FIELD, b"")).object_key)
            except Refused:
                continue
        return out - {""}

    @redis_retry
    def pending_count(self) -> int:
        """The announcements not dealt with yet, up to where this shard has read: pending in any group
        (delivered, not acknowledged), and 1 for each other shard's group that has not read as far as
        this one's (a run of one shard: its pending entries). What was announced after this shard's
        last read is not counted: the caller's read tells it. 0 without a stream or a group."""
        groups = self._groups()
        waiting = sum(int(g["pending"]) for g in groups.values())
        if (mine := groups.get(self.group)) is not None:
            ours = _stream_id(_text(mine["last-delivered-id"]))
            waiting += sum(1 for name, g in groups.items()
                           if name != self.group and _stream_id(_text(g["last-delivered-id"])) < ours)
        return waiting

    # ---- versions (coordinator -> learners) ---------------------------------------------
    @redis_retry
    def heads(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.r.hgetall(self.keys.heads).items()}

    @redis_retry
    def commit_version(self, event: VersionEvent, *, expected_head: int | None, epoch: int | None,
                       ack_ids: Sequence[str], keep_applied: int, check_applied: bool = True) -> CommitResult:
        """Make `event` the head of its fragment, fenced and atomic (see module docstring).
        `keep_applied`: the applied set keeps the contribution ids of the fragment's last this many
        versions (older contributions are refused as stale anyway; 0 keeps them all).
        `check_applied` False: commit it even if Redis has one of its contributions applied (the
        version's manifest is in S3 already, so it is committed whatever Redis says)."""
        keys = [self.keys.heads, self.keys.commits, self.keys.applied, self.epoch_key, self.keys.versions,
                self.keys.announcements, self.keys.counters, self.keys.applied_log(event.fragment),
                self.keys.final_heads]
        args: list[Any] = [event.fragment, "" if expected_head is None else expected_head, event.version,
                           event.params_sha256, "" if epoch is None else epoch, event.to_wire(),
                           self.group, VERSIONS_MAXLEN, int(check_applied), keep_applied, COMMITS_KEPT,
                           len(event.contributions), *event.contributions, len(ack_ids), *ack_ids]
        result = CommitResult(int(self._commit(keys=keys, args=args)))
        if result is CommitResult.ALREADY:
            self.ack(ack_ids)  # the first attempt acked them; acking again is harmless
        return result

    @redis_retry
    def read_versions(self, after_id: str = "0", *, block_ms: int | None = None,
                      count: int = 256) -> list[tuple[str, VersionEvent | Refused]]:
        block = None if block_ms is None else _block(block_ms)
        reply = self.r.xread({self.keys.versions: after_id}, count=count, block=block)
        out: list[tuple[str, VersionEvent | Refused]] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                try:
                    out.append((entry_id.decode(), VersionEvent.from_wire(fields.get(FIELD, b""))))
                except Refused as exc:
                    out.append((entry_id.decode(), exc))
        return out

    @redis_retry
    def mark_applied(self, fragment: int, contribution_ids: Sequence[str], *, keep_applied: int) -> None:
        """Record the contributions of one version of `fragment` as applied (rebuilding Redis from the
        manifests in S3), keeping the ids of its last `keep_applied` versions as a commit does."""
        self._mark_applied(keys=[self.keys.applied, self.keys.applied_log(fragment)],
                           args=[keep_applied, *contribution_ids])

    @redis_retry
    def is_applied(self, contribution_id: str) -> bool:
        return bool(self.r.sismember(self.keys.applied, contribution_id))

    @redis_retry
    def applied_among(self, contribution_ids: Sequence[str]) -> set[str]:
        """The ones of `contribution_ids` that are applied: one round trip (SMISMEMBER) for a batch."""
        if not contribution_ids:
            return set()
        found = self.r.smismember(self.keys.applied, list(contribution_ids))
        return {cid for cid, hit in zip(contribution_ids, found, strict=True) if hit}

    # ---- the round clock ---------------------------------------------------------------
    @redis_retry
    def epoch(self) -> int | None:
        """The current fencing epoch of this bus's shard; None if Redis lost it."""
        raw = self.r.get(self.epoch_key)
        return None if raw is None else int(raw)

    @redis_retry
    def wiped(self) -> bool:
        """Redis has lost the run's keys: this shard's fencing epoch key is gone (restarted empty, or flushed)."""
        return not self.r.exists(self.epoch_key)

    def _run_node(self) -> dict[str, Any]:
        """In a Redis Cluster, a command that names no key goes to the node that holds the run's keys."""
        if isinstance(self.r, RedisCluster):
            return {"target_nodes": self.r.get_node_from_key(self.keys.heads)}
        return {}

    @redis_retry
    def server_run_id(self) -> str:
        """The Redis server's run id (of the run's node in a cluster): a new one after every restart."""
        return str(self.r.info("server", **self._run_node()).get("run_id", ""))

    @redis_retry
    def server_time(self) -> float:
        """Redis server time, unix seconds: the one clock every process agrees on (the run's node's in a cluster)."""
        sec, usec = self.r.time(**self._run_node())
        return sec + usec / 1e6

    @redis_retry
    def claim_genesis(self, learner: str, fragment: int, ttl_s: float) -> bool:
        """Whether `learner` proposes version 0 of `fragment` (`workers/genesis.py`): the first
        learner to ask does, for `ttl_s` seconds, and asking again (its claim still held) extends it.
        When the claim lapses (its holder left, or stopped extending it) the next to ask takes it over."""
        key, ttl_ms = self.keys.genesis_claim(fragment), max(1, int(ttl_s * 1000))
        if self.r.set(key, learner, nx=True, px=ttl_ms):
            return True
        holder = self.r.get(key)
        if holder is None or holder.decode() != learner:
            return False
        self.r.pexpire(key, ttl_ms)  # ours (or our own reply lost): held on
        return True

    @redis_retry
    def release_genesis(self, learner: str, fragments: Sequence[int]) -> None:
        """`learner` will not propose version 0 of `fragments` after all (it leaves, or its upload
        failed): the next to ask may, at once."""
        for fragment in fragments:
            key = self.keys.genesis_claim(fragment)
            if self.r.get(key) == learner.encode():
                self.r.delete(key)

    @redis_retry
    def set_cadence(self, cadence: Cadence) -> None:
        self.r.set(self.keys.cadence, cadence.to_wire())

    @redis_retry
    def cadence(self) -> Cadence | None:
        raw = self.r.get(self.keys.cadence)
        return None if raw is None else Cadence.from_wire(raw)

    # ---- learners ----------------------------------------------------------------------
    @redis_retry
    def heartbeat(self, learner: str, ttl_s: float, stats: LearnerStats | None = None, *,
                  joined: bool = False) -> Beat:
        """Live until `ttl_s` from now on the Redis server's clock (machines' clocks may disagree).
        `joined`: also (again, should Redis have lost it) a member of the joined set. Returns what a
        learner reads with each heartbeat, read in the same round trip (on a thin link, a learner's
        Redis traffic is mostly round trips this small: four of them a second cost it more than
        their bytes). A cadence or run end that does not decode raises Refused, the heartbeat
        written."""
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"a heartbeat's ttl must be a finite number of seconds > 0, got {ttl_s!r}")
        wire = None if stats is None else stats.to_wire()
        done = self.heartbeat_script(learner, ttl_s, wire, joined=joined)
        if done[0] == 0:
            raise Refused("too_large", f"learner {learner}'s stats are {len(wire or b'')} bytes, over the "
                          f"{MAX_STATS_BYTES} a heartbeat may carry: not written")
        if done[0] == -1:
            raise Refused("fleet_full", f"run {self.keys.run!r} has {MAX_LIVE_LEARNERS} live learners, the most "
                          f"one run takes: learner {learner} is not counted live (start fewer learners, or "
                          "wait for leases to lapse)")
        _, sec, usec, cadence, end = done
        return Beat(server_time=int(sec) + int(usec) / 1e6,
                    cadence=None if cadence is None else Cadence.from_wire(cadence),
                    run_end=None if end is None else RunEnd.from_wire(end))

    def heartbeat_script(self, learner: str, ttl_s: float, stats: bytes | None, *, joined: bool = False) -> list:
        """The heartbeat script's reply to `stats` as bytes (`heartbeat`'s one call of it; a caller
        that writes bytes no learner would, as a hostile learner's may, reads the status itself): see
        _HEARTBEAT_LUA."""
        args: list[Any] = [learner, ttl_s, int(joined), LEARNERS_FORGOTTEN_S, MAX_LEASE_S, MAX_STATS_BYTES,
                           MAX_LIVE_LEARNERS] + ([] if stats is None else [stats])
        return self._heartbeat(keys=[self.keys.learners, self.keys.learner_stats, self.keys.joined,
                                     self.keys.cadence, self.keys.finished], args=args)

    @redis_retry
    def leave(self, learner: str, record: LearnerLeft | None = None) -> None:
        """`learner` is no longer live from now on (its lease ends now, on the Redis server's clock;
        it stays in the live set's history: how long ago it left says when it is gone, `fleet`);
        with `record`, noted as having left without finishing (`diloco status` shows it preempted or
        failed rather than unknown), in the same transaction."""
        now = self.server_time()
        pipe = self.r.pipeline(transaction=True)
        pipe.zadd(self.keys.learners, {learner: now}, xx=True)
        if record is not None:
            pipe.hset(self.keys.left, learner, record.to_wire())
        pipe.execute()

    @redis_retry
    def left_learners(self) -> dict[str, LearnerLeft]:
        """Learners that left without finishing and have not joined since; one that does not decode is skipped."""
        out = {}
        for name, raw in self.r.hgetall(self.keys.left).items():
            try:
                out[name.decode()] = LearnerLeft.from_wire(raw)
            except Refused as exc:
                self._warn_once(("left", name, raw), "skipping the leaving record of %r: %s", name, exc.reason)
        return out

    @redis_retry
    def join(self, learner: str) -> None:
        """`learner` has joined: the run counts on it until it finishes (again, if it had finished before)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(self.keys.joined, learner)
        pipe.hdel(self.keys.finished_learners, learner)
        pipe.hdel(self.keys.left, learner)
        pipe.execute()

    @redis_retry
    def finish(self, record: LearnerFinished) -> None:
        """Record that a learner finished and take it out of the live set, in one transaction: a
        reader never sees it gone from both."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.finished_learners, record.learner, record.to_wire())
        pipe.zrem(self.keys.learners, record.learner)
        pipe.hdel(self.keys.left, record.learner)
        pipe.execute()

    @redis_retry
    def finished_learners(self) -> dict[str, LearnerFinished | Refused]:
        """Learners that finished: their records, or why one does not decode."""
        out: dict[str, LearnerFinished | Refused] = {}
        for name, raw in self.r.hgetall(self.keys.finished_learners).items():
            try:
                out[name.decode(errors="replace")] = LearnerFinished.from_wire(raw)
            except Refused as exc:
                out[name.decode(errors="replace")] = exc
        return out

    @redis_retry
    def heartbeat_expiry(self) -> dict[str, float]:
        """Each live-set member's heartbeat expiry (Redis time, unix seconds)."""
        return {m.decode(): float(s) for m, s in self.r.zrange(self.keys.learners, 0, -1, withscores=True)}

    @redis_retry
    def fleet(self, gone_after_s: float = LEARNERS_FORGOTTEN_S) -> Fleet:
        """Live, joined, finished and gone learners and the finish request, in one consistent read."""
        live, joined, finished, request, gone = self._fleet(
            keys=[self.keys.learners, self.keys.joined, self.keys.finished_learners, self.keys.finish_request],
            args=[gone_after_s])
        try:
            asked = FinishRequest.from_wire(request) if request else None
        except Refused as exc:
            log.warning("ignoring an unreadable finish request: %s", exc.reason)
            asked = None
        return Fleet(live=frozenset(m.decode() for m in live), joined=frozenset(m.decode() for m in joined),
                     finished=frozenset(m.decode() for m in finished), finish_request=asked,
                     gone=frozenset(m.decode() for m in gone))

    # ---- the end of a run ----------------------------------------------------------------
    @redis_retry
    def ask_finish(self, request: FinishRequest) -> None:
        self.r.set(self.keys.finish_request, request.to_wire())

    @redis_retry
    def set_run_end(self, end: RunEnd, epoch: int) -> bool:
        """Publish the run's end (the record in S3 already), fenced: False (nothing written) if `epoch`
        is not the current one. From then on no fragment commits a version above the end's."""
        return self._write_end(end, epoch, at_heads=False) == 1

    @redis_retry
    def end_at_heads(self, end: RunEnd, epoch: int) -> bool | None:
        """End the run at `end.versions` if they are still the heads, atomically: a shard's commit
        either came before (it is a head, in the end) or is refused after (`CommitResult.ENDED`).
        True: ended; None: a head moved (nothing written: end at the new heads); False: fenced."""
        result = self._write_end(end, epoch, at_heads=True)
        return None if result == -2 else result == 1

    def _write_end(self, end: RunEnd, epoch: int, *, at_heads: bool) -> int:
        pairs = [x for f, v in enumerate(end.versions) for x in (f, v)]
        return int(self._set_finished(keys=[self.epoch_key, self.keys.finished, self.keys.final_heads, self.keys.heads],
                                      args=[epoch, end.to_wire(), int(at_heads), len(end.versions), *pairs]))

    @redis_retry
    def run_end(self) -> RunEnd | None:
        """The run's end, if it is finished (S3's `finished.msgpack` is the truth; this is its copy)."""
        raw = self.r.get(self.keys.finished)
        return None if raw is None else RunEnd.from_wire(raw)

    @redis_retry
    def live_learners(self) -> list[str]:
        """Learners whose last heartbeat has not expired, on the Redis server's clock."""
        return [m.decode() for m in self.r.zrangebyscore(self.keys.learners, self.server_time(), "+inf")]

    @redis_retry
    def learner_stats(self, names: Sequence[str] | None = None) -> dict[str, LearnerStats]:
        """Each learner's last reported stats (of `names` only, when given); a record that does not
        decode, or that names another learner than its key, is skipped with a warning (a learner's
        heartbeat cannot break its reader)."""
        out = {}
        if names is None:
            records = self.r.hgetall(self.keys.learner_stats).items()
        else:
            names = list(names)
            records = [(n.encode(), v) for n, v in zip(names, self.r.hmget(self.keys.learner_stats, names) if names
                                                       else [], strict=True) if v is not None]
        for k, v in records:
            name = k.decode(errors="replace")
            try:
                stats = LearnerStats.from_wire(v)
            except Refused as exc:
                self._warn_once(("stats", name, v), "skipping the stats of learner %r: %s", name, exc.reason)
                continue
            if stats.learner != name:
                self._warn_once(("stats", name, v), "skipping the stats under %r: they name learner %r", name,
                                stats.learner)
                continue
            out[name] = stats
        return out

    def _warn_once(self, what: tuple, message: str, *args: object) -> None:
        """Log a warning about `what` (e.g. one bad record) the first time only: the record stays in
        Redis, and is read again every second. At most 1000 are remembered, each by a 16-byte digest
        (a learner rewriting its stats with megabytes of junk must not grow this process)."""
        digest = hashlib.blake2b(digest_size=16)
        for part in what:
            digest.update(part if isinstance(part, bytes) else repr(part).encode())
            digest.update(b"\0")
        key = digest.digest()
        if key in self._warned:
            return
        if len(self._warned) >= 1000:
            self._warned.clear()
        self._warned.add(key)
        log.warning(message, *args)

    # ---- counters ----------------------------------------------------------------------
    @redis_retry
    def incr(self, name: str, amount: int = 1) -> None:
        self.r.hincrby(self.keys.counters, name, amount)

    @redis_retry
    def counters(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.counters).items()}

    def close(self) -> None:
        self.r.close()

