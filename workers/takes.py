"""Which version a learner takes, and when: pure decisions, made by the step hook each step for
each fragment that awaits a version (`Learner._ready`).

After a send a learner trains on and takes a newer version of the fragment once `overlap_steps`
have passed, preferably the version that merged that send (its next delta is then fresh, see
`LearnerConfig.own_version_wait`), and preferably once the stager has made it ready off the
training thread (`STAGE_WAIT_STEPS`). A learner that waits for each merge (`wait_for_merge`)
takes the first newer version as soon as it is due, blocking for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

STAGE_WAIT_STEPS = 4
"""A version due to be taken while the stager is still making it ready (downloaded just now, or
asked again after a send changed the anchor) waits up to this many steps for it; then the step hook
computes it itself (a stall on a GPU)."""

Wait = Literal["not_due", "own_round", "staging"]
"""Why no version is taken this step: the overlap since the send has not passed; the round of the
send has not committed yet (and the learner may still wait for it); the version is being made ready."""


@dataclass(frozen=True, slots=True)
class Awaiting:
    """What the step hook knows of one fragment this step."""

    step: int
    due: int | None
    """The earliest step to take a newer version at (the send's step + overlap_steps); None: nothing awaited."""
    patience: float
    """Steps past `due` to wait for the version that merged the send (own_version_wait * H); 0 to not wait."""
    merged_in: int | None
    """The version that merged the send, once the versions stream said (None: not yet, or no send)."""
    staging: bool
    """The version parked for it is still being made ready."""
    stage_waits: int
    """Steps already waited for that."""
    blocking: bool = False
    """The learner waits for each merge (`wait_for_merge`): nothing to be patient about."""

    @property
    def patient(self) -> bool:
        """Still within the wait for its own round's version."""
        return not self.blocking and self.due is not None and self.step < self.due + self.patience


def wait_reason(a: Awaiting) -> Wait | None:
    """Why not to take a version of the fragment this step, or None to take the one parked (if any)."""
    if a.due is None or a.step < a.due:
        return "not_due"
    if a.merged_in is None and a.patient:
        return "own_round"
    if not a.blocking and a.staging and a.stage_waits < STAGE_WAIT_STEPS:
        return "staging"
    return None


def refetch_after(a: Awaiting, version: int, base_version: int) -> int | None:
    """The parked `version` is not the one to take: fetch one newer than the version returned
    instead (no older than the fragment's base, no older than the version of its own round while
    patient); None: take it."""
    if version <= base_version:
        return base_version
    if a.merged_in is not None and version < a.merged_in and a.patient:
        return a.merged_in - 1
    return None
