"""Crash points: named places where a process can be made to die on the spot, for fault tests.

`DILOCO_CRASH_AT=manifest_written:2` makes the process SIGKILL itself the second time it reaches
`crash_point("manifest_written")`; several points may be given, comma-separated, and `:N`
defaults to 1. SIGKILL, not an exception: nothing is flushed, no `finally` runs, exactly like a
machine that lost power at that line. Without the variable (always, in production) a crash point
is one dictionary lookup.

The coordinator's points, in commit order (coordinator/publish.py):
- `fetched`: a round's contributions are read and verified, nothing written yet;
- `params_written`: the version's params and outer state are in S3, its manifest is not;
- `manifest_written`: the manifest is in S3 (the version is committed), Redis does not know yet;
- `committed`: the Redis commit is done, the coordinator's memory not yet updated.

And at the run's end (coordinator/service.py), reached once a run: `end_in_redis`, the end is in
Redis (no commit passes it), not yet in S3.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

from diloco.storage.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "DILOCO_CRASH_AT"
POINTS = ("fetched", "params_written", "manifest_written", "committed")
"""The commit's points, reached every round."""
END_POINTS = ("end_in_redis",)


def parse(spec: str) -> dict[str, int]:
    """'point[:n],...' -> {point: n}."""
    targets: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition(":")
        if name not in POINTS + END_POINTS:
            raise ConfigError(f"{ENV}: unknown crash point {name!r}; known: {', '.join(POINTS + END_POINTS)}")
        if count and not (count.isdigit() and int(count) >= 1):
            raise ConfigError(f"{ENV}: {item!r}: the count after ':' must be a positive integer")
        targets[name] = int(count or 1)
    return targets


_targets = parse(os.environ.get(ENV, ""))
_hits: Counter[str] = Counter()


def crash_point(name: str) -> None:
    if name not in _targets:
        return
    _hits[name] += 1
    if _hits[name] == _targets[name]:
        log.critical("crash point %s reached (hit %d): SIGKILL", name, _hits[name])
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
