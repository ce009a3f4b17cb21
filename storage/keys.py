"""Every Redis key and S3 object key, built in one place.

Integers are zero-padded so that lexicographic listing order is numeric order
(fragment: 4 digits, version: 12 digits, seq: 16 digits). Object layout under `{prefix}/{run}/`:

    run.msgpack                                   RunSpec, written once by the coordinator
    layout.msgpack                                Layout, written at genesis
    epochs/{epoch}                                the holder of each coordinator epoch, claimed once
    genesis/{learner}/layout.msgpack              a learner's proposed layout
    genesis/{learner}/{fragment}                  a learner's proposed initial params
    fragments/{fragment}/{learner}/{seq}          one encoded outer gradient
    versions/{fragment}/{version}/params.{epoch}       global params of that version
    versions/{fragment}/{version}/outer_state.{epoch}  outer-optimizer state after that version
    versions/{fragment}/{version}/manifest             the commit record (Manifest): names the two above
    collections/{n}                               a Collection: what a gc pass removed (or where a what-if run starts)
    finished.msgpack                              RunEnd: the run is finished, with each fragment's final version
    losses/{learner}/{seq}                        LossLog: a learner's reported losses (workers/losses.py)
    learners/{learner}/state/{seq}                a learner's own state across preemption (workers/state.py)

Version objects carry the writer's fencing epoch, so a deposed coordinator racing the current one
never overwrites the objects that a committed manifest points to.

Redis keys are `diloco:{<prefix>/<run>}:...` (the same prefix as in S3, so deployments that share a
Redis do not collide); the braces are a Redis Cluster hash tag: a run's keys share one slot. See `RunKeys`.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.storage.protocol import check_id

FRAGMENT_DIGITS = 4
VERSION_DIGITS = 12
SEQ_DIGITS = 16
EPOCH_DIGITS = 10
COLLECTION_DIGITS = 10


def _frag(fragment: int) -> str:
    if not 0 <= fragment < 10**FRAGMENT_DIGITS:
        raise ValueError(f"fragment {fragment} out of range")
    return f"{fragment:0{FRAGMENT_DIGITS}d}"


def _learner_seq(key: str, prefix: str, middle: str) -> tuple[str, int] | None:
    """(learner, seq) of a key `{prefix}{learner}/{middle}{seq}`, or None."""
    learner, _, rest = key.removeprefix(prefix).partition("/")
    seq = rest.removeprefix(middle)
    if not key.startswith(prefix) or not learner or not rest.startswith(middle) or not seq.isdigit():
        return None
    return learner, int(seq)


def _num(value: int, digits: int) -> str:
    if not 0 <= value < 10**digits:
        raise ValueError(f"{value} out of range for {digits} digits")
    return f"{value:0{digits}d}"


MAX_SHARDS = 256
"""The most coordinator shards one run may be split into (each owns at least one fragment)."""


@dataclass(frozen=True, slots=True)
class Shard:
    """One coordinator's part of a run: the fragments f with f % count == index. A run is coordinated
    by `count` shards (1: one coordinator for every fragment), each under a lease and fencing epoch of
    its own and reading the announcements through a consumer group of its own; shard 0 also keeps the
    run's clock and ends the run (`coordinator.service`)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARDS:
            raise ValueError(f"a run is coordinated by 1 to {MAX_SHARDS} shards, not {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} does not exist in a run of {self.count} shard(s): 0 to {self.count - 1}")

    def owns(self, fragment: int) -> bool:
        return fragment % self.count == self.index

    def fragments(self, num_fragments: int) -> list[int]:
        return list(range(self.index, num_fragments, self.count))

    def layout(self) -> list[Shard]:
        """Every shard of this one's run layout."""
        return [Shard(i, self.count) for i in range(self.count)]

    @property
    def leads(self) -> bool:
        """Shard 0 keeps the run-level duties: the round clock, trimming, refusals naming no fragment, the end."""
        return self.index == 0

    @property
    def suffix(self) -> str:
        """What this shard's Redis keys add to the run's (nothing for a run of one shard)."""
        return "" if self.count == 1 else f":{self.index}of{self.count}"

    def __str__(self) -> str:
        return f"shard {self.index} of {self.count}"


@dataclass(frozen=True, slots=True)
class RunKeys:
    """Keys of one run. `prefix` is the bucket-level prefix (no leading/trailing '/')."""

    prefix: str
    run: str

    def __post_init__(self) -> None:
        check_id("run", self.run)

    # ---- S3 -------------------------------------------------------------------------------
    @property
    def root(self) -> str:
        return f"{self.prefix}/{self.run}/" if self.prefix else f"{self.run}/"

    def run_spec(self) -> str:
        return f"{self.root}run.msgpack"

    def layout(self) -> str:
        return f"{self.root}layout.msgpack"

    def genesis_layout(self, learner: str) -> str:
        return f"{self.root}genesis/{check_id('learner', learner)}/layout.msgpack"

    def genesis_params(self, learner: str, fragment: int) -> str:
        return f"{self.root}genesis/{check_id('learner', learner)}/{_frag(fragment)}"

    def epoch_claim(self, epoch: int) -> str:
        return f"{self.root}epochs/{_num(epoch, EPOCH_DIGITS)}"

    def epochs_prefix(self) -> str:
        return f"{self.root}epochs/"

    def collection(self, n: int) -> str:
        """The n-th Collection record of the run (1, 2, ...), written create-only."""
        return f"{self.root}collections/{_num(n, COLLECTION_DIGITS)}"

    def collections_prefix(self) -> str:
        return f"{self.root}collections/"

    def finished_record(self) -> str:
        """The run's RunEnd, written create-only by the coordinator that finishes the run."""
        return f"{self.root}finished.msgpack"

    def parse_genesis_key(self, key: str) -> tuple[str, int] | None:
        """Inverse of genesis_params: (learner, fragment) or None (also for a proposed layout)."""
        parts = key.removeprefix(f"{self.root}genesis/").split("/")
        if not key.startswith(f"{self.root}genesis/") or len(parts) != 2 or not parts[1].isdigit():
            return None
        return parts[0], int(parts[1])

    def delta(self, fragment: int, learner: str, seq: int) -> str:
        return f"{self.root}fragments/{_frag(fragment)}/{check_id('learner', learner)}/{_num(seq, SEQ_DIGITS)}"

    def deltas_prefix(self, fragment: int | None = None) -> str:
        return f"{self.root}fragments/" + ("" if fragment is None else f"{_frag(fragment)}/")

    def parse_delta_key(self, key: str) -> tuple[int, str, int] | None:
        """Inverse of delta: (fragment, learner, seq) or None."""
        rest = key.removeprefix(self.deltas_prefix())
        parts = rest.split("/")
        if rest == key or len(parts) != 3 or not (parts[0].isdigit() and parts[2].isdigit()):
            return None
        return int(parts[0]), parts[1], int(parts[2])

    def version_dir(self, fragment: int, version: int) -> str:
        return f"{self.root}versions/{_frag(fragment)}/{_num(version, VERSION_DIGITS)}/"

    def params(self, fragment: int, version: int, epoch: int) -> str:
        """Written by the coordinator of `epoch`: two coordinators never write the same object."""
        return self.version_dir(fragment, version) + f"params.{_num(epoch, EPOCH_DIGITS)}"

    def outer_state(self, fragment: int, version: int, epoch: int) -> str:
        return self.version_dir(fragment, version) + f"outer_state.{_num(epoch, EPOCH_DIGITS)}"

    def update(self, fragment: int, version: int, epoch: int) -> str:
        """The version as an update of its parent in the downstream codec (`storage.updates`)."""
        return self.version_dir(fragment, version) + f"update.{_num(epoch, EPOCH_DIGITS)}"

    def update_beside(self, params_key: str, fragment: int, version: int) -> str | None:
        """The key of the update that the coordinator which wrote `params_key` (that version's params)
        wrote with it; None if `params_key` is not a params key of that version."""
        tail = params_key.removeprefix(self.version_dir(fragment, version))
        epoch = tail.removeprefix("params.")
        if tail == params_key or epoch == tail or len(epoch) != EPOCH_DIGITS or not epoch.isdigit():
            return None
        return self.update(fragment, version, int(epoch))

    def manifest(self, fragment: int, version: int) -> str:
        return self.version_dir(fragment, version) + "manifest"

    def versions_prefix(self, fragment: int | None = None) -> str:
        return f"{self.root}versions/" + ("" if fragment is None else f"{_frag(fragment)}/")

    def parse_version_key(self, key: str) -> tuple[int, int, str] | None:
        """Inverse of params/outer_state/update/manifest: (fragment, version, leaf) or None."""
        rest = key.removeprefix(self.versions_prefix())
        parts = rest.split("/")
        if rest == key or len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
            return None
        return int(parts[0]), int(parts[1]), parts[2]

    # ---- Redis ----------------------------------------------------------------------------
    @property
    def _r(self) -> str:
        # One hash tag per run ({...}): in a Redis Cluster every key of a run is in one slot, so that the
        # scripts and transactions, which touch several of them, run there.
        return f"diloco:{{{self.prefix}/{self.run}}}:" if self.prefix else f"diloco:{{{self.run}}}:"

    @property
    def announcements(self) -> str:
        """Stream: learners XADD Announcements; the coordinator reads with a consumer group."""
        return self._r + "announcements"

    @property
    def versions(self) -> str:
        """Stream: the coordinator XADDs a VersionEvent per committed version."""
        return self._r + "versions"

    @property
    def heads(self) -> str:
        """Hash: fragment (decimal) -> latest committed version."""
        return self._r + "heads"

    @property
    def commits(self) -> str:
        """Hash: '{fragment}:{version}' -> params sha256, for idempotent re-commits."""
        return self._r + "commits"

    @property
    def applied(self) -> str:
        """Set: contribution ids merged into one of the last versions of their fragment (the ones
        `applied_log` lists)."""
        return self._r + "applied"

    def applied_log(self, fragment: int) -> str:
        """List: per committed version of `fragment`, oldest first, its contribution ids joined by
        commas; trimmed to the last versions that the `applied` set keeps."""
        return f"{self._r}applied_log:{fragment}"

    @property
    def epoch(self) -> str:
        """String: the current coordinator fencing epoch; commits carrying another epoch fail."""
        return self.epoch_of(Shard())

    def epoch_of(self, shard: Shard) -> str:
        """String: the fencing epoch of the coordinator of `shard` (its fragments' commits carry it)."""
        return self._r + "epoch" + shard.suffix

    @property
    def lease(self) -> str:
        """String with a TTL: the name of the coordinator that holds the run (storage.lease)."""
        return self.lease_of(Shard())

    def lease_of(self, shard: Shard) -> str:
        """String with a TTL: the name of the coordinator that holds `shard` (storage.lease)."""
        return self._r + "lease" + shard.suffix

    @property
    def shards(self) -> str:
        """String: how many shards coordinate the run (`Shard.count`); every shard's lease agrees with it,
        and it changes only while no shard of the old count holds its lease (storage.lease)."""
        return self._r + "shards"

    def genesis_claim(self, fragment: int) -> str:
        """String, expiring: the learner that proposes version 0 of `fragment` (`Bus.claim_genesis`);
        the others propose other fragments instead of uploading the same initial values too."""
        return self._r + f"genesis_claim:{fragment}"

    @property
    def cadence(self) -> str:
        """String: msgpack Cadence, the round clock learners send by (clock cadence runs)."""
        return self._r + "cadence"

    @property
    def learners(self) -> str:
        """Sorted set: learner -> heartbeat expiry (unix seconds)."""
        return self._r + "learners"

    @property
    def learner_stats(self) -> str:
        """Hash: learner -> msgpack of its last reported stats (steps, tokens, loss, step time)."""
        return self._r + "learner_stats"

    @property
    def joined(self) -> str:
        """Set: learners that have joined the run (the run ends by itself once each has finished)."""
        return self._r + "joined"

    @property
    def finished_learners(self) -> str:
        """Hash: learner -> msgpack LearnerFinished, for learners that finished (removed when one joins again)."""
        return self._r + "finished_learners"

    @property
    def finish_request(self) -> str:
        """String: msgpack FinishRequest, an operator's `diloco finish`."""
        return self._r + "finish_request"

    @property
    def finished(self) -> str:
        """String: msgpack RunEnd, the same record as the run's `finished.msgpack` once it is finished."""
        return self._r + "finished"

    @property
    def final_heads(self) -> str:
        """Hash: fragment -> its final version, set with `finished` in one script: a commit of a
        version above it is refused (a shard that had not seen the end yet)."""
        return self._r + "final_heads"

    @property
    def counters(self) -> str:
        """Hash: counter name -> integer (contributions applied, refused:{code}, versions...)."""
        return self._r + "counters"

    @property
    def refusals(self) -> str:
        """Stream: one entry per refused contribution, with its reason."""
        return self._r + "refusals"

    GROUP = "coordinator"
    """Consumer group on the announcements stream (of a run coordinated by one shard)."""

    @staticmethod
    def group_of(shard: Shard) -> str:
        """The consumer group through which `shard` reads the announcements (each shard reads every
        entry and acknowledges the other shards' at once)."""
        return RunKeys.GROUP + shard.suffix

    # ---- a learner's losses (S3) and leaving without finishing (Redis) -----------------------
    def loss_log(self, learner: str, seq: int) -> str:
        """A LossLog: some of a learner's reported losses; seq is unique per learner, rising in time."""
        return f"{self.root}losses/{check_id('learner', learner)}/{_num(seq, SEQ_DIGITS)}"

    def losses_prefix(self, learner: str | None = None) -> str:
        return f"{self.root}losses/" + ("" if learner is None else f"{check_id('learner', learner)}/")

    def parse_loss_key(self, key: str) -> tuple[str, int] | None:
        """Inverse of loss_log: (learner, seq) or None."""
        return _learner_seq(key, self.losses_prefix(), "")

    # ---- a learner's own state across preemption (S3) -----------------------------------------
    def learner_state(self, learner: str, seq: int) -> str:
        """A learner's saved state (optimizer, schedule, step, the user's own); seq rises per learner."""
        return f"{self.learner_states_prefix(learner)}{_num(seq, SEQ_DIGITS)}"

    def learner_states_prefix(self, learner: str | None = None) -> str:
        return f"{self.root}learners/" + ("" if learner is None else f"{check_id('learner', learner)}/state/")

    def parse_learner_state_key(self, key: str) -> tuple[str, int] | None:
        """Inverse of learner_state: (learner, seq) or None."""
        return _learner_seq(key, self.learner_states_prefix(), "state/")

    @property
    def left(self) -> str:
        """Hash: learner -> msgpack LearnerLeft, for learners that left without finishing (preempted or
        failed; removed when one joins again or finishes)."""
        return self._r + "left"
