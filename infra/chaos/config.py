"""The settings of a chaos run (`diloco chaos`): each field is an option, its docstring the help."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diloco.infra.chaos.faults import KINDS
from diloco.infra.options import chosen
from diloco.storage.errors import ConfigError


@dataclass
class ChaosConfig:
    out: Path
    """Output directory: the stack's data (replaced at start), every process's log, report.json."""
    seconds: float = 60.0
    """Seconds of fault injection once the fleet is up (start-up and the final drain come on top)."""
    seed: int = 1
    """Seed of the fault schedule."""
    learners: int = 3
    """Learner processes (each restarted after a kill or a preemption)."""
    slowdown: float = 3.0
    """Step-time multiplier of every learner: keeps the fleet from saturating a small machine."""
    shards: int = 1
    """Coordinator shards (`diloco coordinator --shards`), each with its standbys; coordinator kills go to
    the shards in turn. At most 2 (the chaos run has two fragments)."""
    lease_s: float = 2.0
    """Coordinator lease: a killed coordinator's standby takes over after this long."""
    restart_delay_s: float = 1.0
    """A killed or preempted learner is restarted (same id, new data seed) after this long."""
    drain_s: float = 60.0
    """At the end: how long the coordinator may take to merge or refuse what is still pending."""
    run: str = "chaos"
    """Run id."""
    kinds: str = ""
    """The kinds of fault to inject, comma-separated (blank: every kind; a kind it does not know is
    refused with the list). A run with some kinds left out says what they cost the model: the same
    seed with and without them."""

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= 2:
            raise ConfigError(f"shards must be 1 or 2 (the chaos run has two fragments), got {self.shards}")
        if self.kinds.strip():
            chosen(self.kinds, "--kinds", KINDS)

    def fault_kinds(self) -> tuple[str, ...]:
        """The kinds of fault this run injects, in FAULT_KINDS' order."""
        picked = set(chosen(self.kinds, "--kinds", KINDS)) if self.kinds.strip() else set(KINDS)
        return tuple(k for k in KINDS if k in picked)
