"""Being the one coordinator of a run: taking the lease, keeping it, noticing when it is gone.

`Leadership.take` waits for the lease (storage.lease) and returns a fresh fencing epoch. Each
epoch is also claimed in S3 (`epochs/{epoch}`, create-only), so that epochs stay unique even
across a Redis that lost its data: a new epoch is always above every claimed one. A thread then
renews the lease every third of its TTL. The loop asks `check()` each iteration:
- deposed (another coordinator holds a newer epoch) -> `Fenced`: stop; the commit script would
  refuse our commits anyway, this only stops us sooner;
- wiped (Redis restarted empty) -> True: the caller re-takes the lease and rebuilds Redis from S3.
If Redis is unreachable the thread keeps trying; a lease that lapsed meanwhile is taken back as
long as nobody else took over. Waiting for the lease outlives Redis and S3 outages the same way.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

import redis

from diloco.storage.bus import Bus
from diloco.storage.errors import ConfigError, Conflict, DilocoError, StorageUnavailable
from diloco.storage.lease import Holder, Lease, Renewal
from diloco.storage.objects import ObjectStore

log = logging.getLogger(__name__)


class Fenced(DilocoError):
    """Another coordinator took over this run (newer epoch); this one must stop."""


class Stopped(DilocoError):
    """Asked to stop while waiting for the lease."""


def holder_name() -> str:
    return f"{socket.gethostname().split('.')[0][:40]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Leadership:
    def __init__(self, bus: Bus, store: ObjectStore, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.store = store
        self.lease = Lease(bus, holder_name(), ttl_s)
        self.epoch = 0
        self._deposed = threading.Event()
        self._wiped = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the epoch and the flags change together
        self._thread: threading.Thread | None = None

    @property
    def holder(self) -> str:
        return self.lease.holder

    def take(self, *, standby: bool, stop: threading.Event) -> int:
        """Our epoch once we hold the lease. Without `standby`, a lease that is still renewed
        after its current TTL has run out means another coordinator is alive: DilocoError."""
        waited_for: str | None = None
        lapses_at = 0.0  # when the lease we saw should lapse if its holder is dead (monotonic)
        while True:
            try:
                got = self._try()
            except (StorageUnavailable, redis.RedisError) as exc:
                # A standby outlives outages: it may be the one the run needs once they end.
                log.warning("waiting for the coordinator lease: storage unreachable, retrying in 1s: %s", exc)
                if stop.wait(1.0):
                    raise Stopped("stopped while waiting for the coordinator lease") from None
                continue
            if not isinstance(got, Holder):
                return got
            if got.shards is not None and not standby:
                raise ConfigError(f"run {self.lease.bus.run!r} is coordinated by {got.shards.count} shard(s) and "
                                  f"{got.name} holds {got.shards}; this coordinator is {self.lease.shard}: start it "
                                  f"with --shards {got.shards.count}, or stop every shard of the run before "
                                  f"changing their number")
            now = time.monotonic()
            if waited_for == got.name and not standby and now >= lapses_at:
                raise DilocoError(f"run {self.lease.bus.run!r} is coordinated by {got.name}, which keeps renewing "
                                  f"its lease: stop it first, or start this one with --standby")
            if waited_for != got.name:
                log.info("%s of run %s is coordinated by %s; %s until its lease lapses (in %.1fs)",
                         got.shards or self.lease.shard, self.lease.bus.run, got.name,
                         "standing by" if standby else "waiting", got.expires_in_s)
                lapses_at = now + got.expires_in_s
            waited_for = got.name
            # A standby polls a few times per TTL; a plain start waits exactly until the lease we
            # saw would lapse: if the same holder still has it then, it renewed it.
            wait_s = min(got.expires_in_s, self.ttl_s / 3) if standby else max(0.0, lapses_at - now)
            if stop.wait(wait_s + 0.05):
                raise Stopped("stopped while waiting for the coordinator lease")

    def retake(self) -> int:
        """After Redis lost its data: the lease again at once, or Fenced if someone else has it."""
        got = self._try()
        if isinstance(got, Holder):
            raise Fenced(f"{got.name} took run {self.lease.bus.run!r} over while Redis was being rebuilt")
        return got

    def _try(self) -> int | Holder:
        held = self.lease.held_by_other()
        if held is not None:
            return held  # cheap check first: a standby polls this for as long as another holds the run
        keys = self.lease.bus.keys
        names = (key.rsplit("/", 1)[1] for key in self.store.list(keys.epochs_prefix()))
        floor = max([self.epoch, *(int(n) for n in names if n.isdigit())])
        while True:
            got = self.lease.acquire(floor=floor)
            if isinstance(got, Holder):
                return got
            try:
                self.store.put(keys.epoch_claim(got), self.holder.encode(), create_only=True)
            except Conflict:
                floor = got  # claimed before Redis lost it: take a higher one
                continue
            with self._lock:
                self.epoch = got
                self._deposed.clear()
                self._wiped.clear()
            return got

    def start_renewing(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew_loop, name="lease", daemon=True)
            self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if self._deposed.is_set() or self._wiped.is_set():
                continue
            epoch = self.epoch
            try:
                renewal = self.lease.renew(epoch)
            except redis.RedisError as exc:
                log.warning("could not renew the coordinator lease: %s", exc)
                continue
            with self._lock:
                if epoch != self.epoch:
                    continue  # the lease was taken again meanwhile (after a wipe): the answer is about the old epoch
                if renewal is Renewal.LOST:
                    log.error("lost the coordinator lease: another coordinator took over (our epoch %d)", epoch)
                    self._deposed.set()
                elif renewal is Renewal.WIPED:
                    log.error("Redis lost the run's keys (restarted empty?): taking the lease again and rebuilding")
                    self._wiped.set()

    def check(self) -> bool:
        """Raise Fenced if deposed; True if Redis was wiped and must be rebuilt."""
        if self._deposed.is_set():
            raise Fenced(f"another coordinator took over run {self.lease.bus.run!r} (this one had epoch {self.epoch})")
        return self._wiped.is_set()

    def deposed(self) -> None:
        """The commit script said another epoch is current."""
        self._deposed.set()

    def close(self, *, release: bool) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if release and not self._deposed.is_set():
            try:
                self.lease.release()
            except redis.RedisError as exc:
                log.warning("could not release the coordinator lease (it lapses in %.0fs): %s", self.ttl_s, exc)

