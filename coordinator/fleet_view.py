"""The coordinator's view of its learners: who is live, who sends, who finished, whom rounds wait for.

Redis holds the fleet (`storage.bus.Fleet`: live, joined, finished, gone, a finish request); the
coordinator's loop reads it (a large one only once in a while: `influence.fleet_read_due`) and
adds what only it knows: when it first saw each learner live and when each one's last piece
arrived. From those `FleetView.see` works out the learners the rounds wait for
(`influence.waited_learners`), and `clock_sample` the learners whose step times set the round clock.
"""

from __future__ import annotations

import math
import time
from diloco.coordinator.influence import fleet_read_due, waited_learners
from diloco.storage.bus import Bus, Fleet
from diloco.storage.protocol import FinishRequest


class FleetView:
    """The learners as the loop last saw them. Not thread-safe: the loop's own."""

    def __init__(self, bus: Bus, gone_after_s: float) -> None:
        self.bus = bus
        self.gone_after_s = gone_after_s
        self.first_seen: dict[str, float] = {}
        """When this process first saw each learner live (coordinator clock): the live learners of the last read."""
        self.last_piece: dict[str, float] = {}
        """When each learner's last piece arrived (or was committed, for what the manifests tell)."""
        self.finished: frozenset[str] = frozenset()
        """Learners that have finished, as of the last read that took in every announcement before it."""
        self.waited: frozenset[str] = frozenset()
        """Live learners that have not finished and that rounds wait for (`see`)."""
        self.finish_asked: FinishRequest | None = None
        """An operator's `diloco finish`, as the last read saw it."""
        self._read_at, self._names = -math.inf, 0  # the last read: when (monotonic), how many names

    def read(self) -> Fleet:
        """The fleet as Redis has it now."""
        fleet = self.bus.fleet(self.gone_after_s)
        self._read_at = time.monotonic()
        self._names = len(fleet.live) + len(fleet.joined) + len(fleet.finished) + len(fleet.gone)
        return fleet

    def read_if_due(self) -> Fleet | None:
        """`read()` every step while the fleet is small, once in a while when it is large
        (`influence.fleet_read_due`); None when not now."""
        return self.read() if fleet_read_due(self._names, time.monotonic() - self._read_at) else None

    def see(self, fleet: Fleet, complete: bool, now: Fleet, *, at: float, known: frozenset[str],
            patience_s: float) -> None:
        """Take in a read. A learner counts as finished only once a `complete` read (every
        announcement made before `fleet` was read is in) has taken in its final pieces; until then
        it counts as live, so that no round merges without them. Who is live is read again after
        the read (`now`): a read may block, and learners that joined meanwhile count. `known`: the
        learners of the fragments' recent rounds; `patience_s`: how long a live learner may stay
        silent and still be waited for (0: unknown, every live learner is)."""
        if complete:
            self.finished = fleet.finished
        self.first_seen = {name: self.first_seen.get(name, at) for name in now.live}  # one back is new again
        waited = waited_learners(now.live, first_seen=self.first_seen, last_piece=self.last_piece,
                                 known=known, now=at, patience_s=patience_s)
        self.waited = (waited | now.finished) - self.finished
        keep = now.live | known
        if len(self.last_piece) > 2 * len(keep) + 64:  # forget the senders long gone
            self.last_piece = {n: v for n, v in self.last_piece.items() if n in keep}
        self.finish_asked = fleet.finish_request

    def sent(self, learner: str, at: float) -> None:
        """A piece of `learner`'s arrived, or was committed, at `at` (coordinator clock)."""
        self.last_piece[learner] = max(self.last_piece.get(learner, -math.inf), at)

    def clock_sample(self, most: int) -> list[str]:
        """The learners whose stats set the round clock: the live ones that send pieces (every live
        one until some do, at a run's start), at most `most`, the earliest seen. Ids that only
        heartbeat do not set the clock, and a flood of them costs no more than `most` stats records."""
        live = self.first_seen.keys()
        names = (live & self.last_piece.keys()) or live
        return sorted(names, key=lambda n: (self.first_seen[n], n))[:most]
