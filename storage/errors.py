"""One small error hierarchy shared by every layer.

`Refused` is the one that matters in operation: it is raised when input from the network
(an object, a stream entry, a header) fails a check. It carries a short machine-readable
`code` (used as a counter label) and a `reason` a person can act on. Refusals are logged and
counted by whoever catches them; the run goes on.
"""

from __future__ import annotations


class DilocoError(Exception):
    """Base class of every error this project raises on purpose."""


class Refused(DilocoError):
    """Input refused by a check. `code` is a stable slug, `reason` a sentence for a person."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class ConfigError(DilocoError):
    """A setting is missing or invalid; the message says which and what to do."""


class StorageUnavailable(DilocoError):
    """S3 did not answer after the adapter's bounded retries (the Redis adapter re-raises redis-py's own errors)."""


class Conflict(DilocoError):
    """A compare-and-set lost: someone else wrote first (object exists, head moved, epoch changed)."""


class RunFinished(DilocoError):
    """The run is finished (`RunEnd`): nothing joins or is merged any more; start a new run to train on."""
