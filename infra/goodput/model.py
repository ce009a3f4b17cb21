"""The simulated fleet: every parameter of the goodput model, its default and where it comes from.

The defaults reproduce the Decoupled DiLoCo paper's setting (per-chip mean time between
interruptions of one year). Three of them are calibrated against the paper's figures at 1.2M
chips rather than known; `docs/benchmarks.md` shows the arithmetic:

- `restart_s` (69 s): a failure every 26.3 s at 1.2M chips and 27% data-parallel goodput mean
  26.3 / (26.3 + 70) = 0.27; with a checkpoint every step, the restart itself is the ~70 s.
- `rescale_s` (17.3 s) and `repair_s` (4900 s, which with 256-chip slices keeps 4% of the chips
  in repair at any time): a least-squares fit of (1 - b) / (1 + lambda_m * rescale) to elastic
  data-parallel (58%) and decoupled M = 2/4/8/16 (70/82/88/93%), lambda_m the failure rate of
  one job, b the share of chips in repair.
Everything else is an assumption, named as such in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from diloco.coordinator.policy import RoundConfig
from diloco.storage.errors import ConfigError
from diloco.storage.protocol import CadenceKind, check_choices

YEAR_S = 365.25 * 86400.0

STRATEGIES = ("dp", "elastic", "decoupled")
"""Synchronous data-parallel, elastic data-parallel, decoupled DiLoCo."""

CATEGORIES = ("useful", "lost", "refused", "paused", "repair", "idle", "pending")
"""Where chip time goes. useful: compute whose result reaches the global model. lost: compute
thrown away (since the last checkpoint, unsent progress of a restarted learner, the step in flight
at a failure). refused: contributions the coordinator refused (too stale). paused: chips of a job
that is restarting or rescaling. repair: chips of failed slices, out of every job until repaired.
idle: chips waiting at a barrier for a slower group. pending: compute whose fate is still open
when the simulation ends (since the last checkpoint or send, in flight, in an open round); at
most a round's worth, so a few hundredths of a percent of a day."""


@dataclass(frozen=True, slots=True)
class Model:
    """One simulated fleet: its size, how it fails, how fast it steps and how it recovers."""

    chips: int = 1_200_000
    """N: chips in the fleet (the paper: 150k to 2.4M)."""
    learners: int = 8
    """M: decoupled learners, each N/M chips; also the number of hardware groups whose speeds differ."""
    mtbi_years: float = 1.0
    """Mean time between interruptions of one chip, in years (the paper: 1). Failures of the fleet
    are a Poisson process of rate chips / MTBI, each hitting a chip drawn uniformly."""
    hours: float = 24.0
    """Simulated duration."""
    seed: int = 0
    """Seed of the failure process (and of the speeds and step offsets); same seed, same results."""
    step_time_s: float = 1.0
    """Inner-step time of the fastest group (assumed; sets how much a failure's step in flight costs)."""
    speed_cv: float = 0.0
    """Spread of step times between hardware groups: each group's step time is step_time_s times a
    lognormal multiplier with this coefficient of variation, the fastest rescaled to 1 (paper: 0)."""
    sync_every: int = 50
    """H: inner steps of the fastest learner per round (the project's default; assumed)."""
    overlap_steps: int = 5
    """tau: steps a learner trains after a send before it takes the new version (the run's default is 2)."""
    upload_s: float = 1.0
    """Decoupled: from a learner's send to the coordinator's intake (assumed)."""
    merge_s: float = 1.0
    """Decoupled: from a round's merge to its version being readable by learners (assumed)."""
    cadence: CadenceKind = "clock"
    """Decoupled: when learners send: 'clock' (at the coordinator's round deadlines, the project's
    default) or 'steps' (every H of their own steps, at offsets that differ by learner)."""
    learner_failure: Literal["rescale", "restart"] = "rescale"
    """Decoupled: a failure inside a learner makes it 'rescale' (pause rescale_s, then go on
    without the failed slice until it is repaired; assumed, as elastic data-parallel does) or
    'restart' (down for restart_s, its unsent progress lost, then it rejoins at the latest global
    version on a spare slice: what a torchrun island of this project does today)."""
    checkpoint_every: int = 1
    """Data-parallel: steps between checkpoints (asynchronous, to peer memory: no pause; assumed).
    A failure loses the work since the last one."""
    restart_s: float = 69.0
    """A restart (data-parallel, or a learner with learner_failure 'restart'): detect the failure,
    reschedule on a spare slice, reload. Calibrated: data-parallel goodput 0.27 at 1.2M chips."""
    rescale_s: float = 17.3
    """A rescale (elastic data-parallel, decoupled learners): the job pauses this long to re-form
    without the failed slice. Calibrated (see module docstring)."""
    slice_chips: int = 256
    """Chips one failure takes out of a job (a host and its model-parallel group; assumed)."""
    repair_s: float = 4900.0
    """A failed slice is out of its job this long (elastic and decoupled; data-parallel restarts on
    a spare). Calibrated with rescale_s: slice_chips * repair_s / MTBI = 0.04 of the chips in repair."""
    lease_s: float = 10.0
    """Decoupled, learner_failure 'restart': the coordinator counts a learner live until its
    heartbeat lease lapses this long after it died (the learner's default)."""
    round: RoundConfig = field(default_factory=RoundConfig)
    """The coordinator's round policy (quorum, grace, staleness); its overlap_steps is replaced by
    this model's, as the coordinator takes tau from the run."""
    speeds: tuple[float, ...] = ()
    """Step-time multiplier of each learner (from a recorded run); overrides speed_cv when given."""

    def __post_init__(self) -> None:
        if self.chips < 1 or self.learners < 1:
            raise ConfigError(f"need at least one chip and one learner, got {self.chips} chips, {self.learners} learners")
        if self.chips < self.learners * self.slice_chips:
            raise ConfigError(f"{self.chips} chips cannot make {self.learners} learners of at least one "
                              f"{self.slice_chips}-chip slice each")
        for name in ("mtbi_years", "hours", "step_time_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("speed_cv", "upload_s", "merge_s", "restart_s", "rescale_s", "repair_s", "lease_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.sync_every < 1 or self.checkpoint_every < 1 or self.slice_chips < 1:
            raise ConfigError("sync_every, checkpoint_every and slice_chips must be at least 1")
        if not 0 <= self.overlap_steps < self.sync_every:
            raise ConfigError(f"overlap_steps must be in [0, sync_every), got {self.overlap_steps}")
        check_choices(self)
        if self.speeds and (len(self.speeds) != self.learners or min(self.speeds) <= 0):
            raise ConfigError(f"speeds must be {self.learners} positive multipliers, got {list(self.speeds)}")

    @property
    def horizon_s(self) -> float:
        return self.hours * 3600.0

    @property
    def failure_rate_per_s(self) -> float:
        """lambda = N / MTBI: failures per second anywhere in the fleet."""
        return self.chips / (self.mtbi_years * YEAR_S)

    @property
    def period_s(self) -> float:
        """The round clock's period: H steps of the fastest learner, as the coordinator sets it."""
        return self.sync_every * self.step_time_s


@dataclass
class Result:
    """What one strategy did with the fleet: goodput and where every chip-second went."""

    strategy: str
    chips: int
    learners: int
    goodput: float
    """Useful chip time / total chip time (chips x simulated seconds)."""
    chip_time: dict[str, float]
    """Share of total chip time per category of CATEGORIES (they sum to 1)."""
    stats: dict[str, float]
    """Counts: failures, restarts, rescales, rounds, refused contributions, ..."""
    wall_s: float = 0.0
    """Seconds the simulation took on this machine."""

    def to_wire(self) -> dict:
        return {"strategy": self.strategy, "chips": self.chips, "learners": self.learners, "goodput": self.goodput,
                "chip_time": self.chip_time, "stats": self.stats, "wall_s": self.wall_s}
