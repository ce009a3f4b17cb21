"""The learner: wrap an existing PyTorch training loop in Decoupled DiLoCo.

    learner = Learner(model, optimizer, run="my-run", tokens_per_step=batch * seq_len)
    with learner:                      # joins the run: starts from the latest global versions
        for x, y in data:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()           # the learner hooks this: every H steps per fragment it
            optimizer.zero_grad()      # sends global - local and later takes the new global

Works with any `nn.Module` and any `torch.optim.Optimizer` (it registers a step post-hook; the
inner optimizer's state stays local). Nothing in the loop waits on the network: uploads and
downloads run in background threads; a new global fragment is merged at the first step boundary
at least `overlap_steps` after the send at which it is available.

Islands: if `torch.distributed` is initialized with a world size above 1 (a torchrun job), only
rank 0 talks to Redis and S3. Construct the Learner on every rank. At each step rank 0 decides
which fragments to send and to merge and broadcasts that plan; every rank then takes part in
gathering the fragment (sharded DTensor parameters: FSDP2, tensor parallelism) and in receiving
its new values (`workers.island.Replica`). Replicated parameters (DDP) cost a broadcast per merge
only. Only rank 0 reports tokens: pass the whole island's tokens per step as `tokens_per_step`.

Leaving: `with learner:` ending without an exception is a finish (`finish`): the progress since the
last sends goes out as final pieces, then the learner records that it finished and leaves. An
exception leaves without sending anything (`close`).

Bookkeeping per fragment (`FragmentState`): `anchor` is the point unsent progress is measured from.
Sending: delta = anchor - local, then anchor = local. Taking version G:
'adopt':  local = G, anchor = G (the steps trained since the send are dropped, and not counted);
'rebase': local = local + (G - anchor) (keeps progress made since the send), anchor = G;
'mix':    local = alpha * local + (1 - alpha) * G, anchor = G.
The step hook never waits for the device (`workers.hostcopy`): `local` at a send is a snapshot whose
copy to the host the uploader's thread waits for, and it computes the delta there; a merge computes
`G - anchor` on the host and adds it to the parameters in place on the device.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis
import torch

from diloco.storage import codecs
from diloco.storage.bus import MAX_LEASE_S, Bus
from diloco.storage.errors import ConfigError, DilocoError, RunFinished, StorageUnavailable
from diloco.storage.global_model import Which, read_global
from diloco.storage.history import read_layout, read_manifest, read_params, read_run_end, read_run_spec
from diloco.storage.keys import RunKeys
from diloco.storage.linkuse import LINK_WINDOW_S, LinkLoad
from diloco.storage.names import model_names, run_parameters
from diloco.storage.objects import ObjectStore
from diloco.storage.protocol import Layout, LearnerFinished, LearnerLeft, LearnerStats, RunEnd, check_id
from diloco.storage.reach import check_servers
from diloco.storage.settings import Endpoints
from diloco.workers.fragments import clock_due, due_fragments, layout_mismatch, model_params, plan_layout, send_lead
from diloco.workers.genesis import GenesisProposer
from diloco.workers.hostcopy import Snapshot
from diloco.workers.island import Replica
from diloco.workers.losses import LossRecorder
from diloco.workers.metrics import LearnerMetrics
from diloco.workers.keeper import StateKeeper
from diloco.workers.state import Stateful
from diloco.workers.staging import Stager
from diloco.workers.takes import Awaiting, refetch_after, wait_reason
from diloco.storage.heap import reuse_freed_memory
from diloco.storage.intraop import Pacer, usable_cpus
from diloco.workers.threads import (CHOSEN_NICE, CHOSEN_SHARE, CHOSEN_THREADS, ThreadLimits, abandon,
                                    check_settings as check_transfer_settings)
from diloco.workers.transfer import Fetched, Fetcher, TransferStats, Uploader, UploadJob

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    join_timeout_s: float = 300.0
    """How long to wait for the coordinator to create the run and commit version 0."""
    reach_timeout_s: float = 10.0
    """When joining, how long to wait for Redis and S3 to answer before giving up with a ConfigError that
    names the setting to check (a wrong password, key, secret or bucket gives up at once). Raise it to
    start learners before their servers."""
    heartbeat_s: float = 1.0
    """Seconds between heartbeats (which carry steps, tokens, loss, step time)."""
    lease_s: float = 10.0
    """A learner whose last heartbeat is older than this is not counted as live."""
    close_timeout_s: float = 20.0
    """On leaving (finished, preempted or failed): how long to wait for queued uploads, final pieces
    included, and for the learner's state (`save_state`), before abandoning them and leaving. Leaving
    takes at most about this long: keep it below the grace a preemption really gives (GKE Spot gives
    pods 15 s whatever terminationGracePeriodSeconds asks; a GCP spot VM stops 30 s after its notice)."""
    upload_deadline_s: float = 120.0
    """A contribution that cannot be stored and announced for this long (S3 or Redis down) is dropped and counted."""
    wait_for_merge: bool = False
    """Synchronous DiLoCo: `overlap_steps` after a send, stop training until the round's new version
    of that fragment arrives (at most `merge_wait_s`). Off by default: nothing waits on the network.
    With the coordinator's quorum set to the whole fleet this is the barrier DiLoCo that the
    decoupled mode is measured against."""
    merge_wait_s: float = 300.0
    """With `wait_for_merge`: the longest a step waits for a new version before training on without it."""
    metrics_port: int = 0
    """Serve this learner's Prometheus metrics on this port at /metrics, rank 0 (0: off; docs/metrics.md)."""
    error_feedback: bool = True
    """With a lossy codec (int8, int4, bf16, sparse, sign8): what the codec loses of a fragment's delta
    is added to the fragment's next send, so that no progress is lost to quantization over the run."""
    dropped: str = "auto"
    """With error feedback and the rebase rule, what the codec loses of a piece: 'keep' it in this
    model (the take after the send subtracts it from the rebase) to reach the next piece from there;
    'carry' it beside a model rebased without it, into the next piece; 'auto': keep for codecs that
    drop most of a piece (sign8, sparse: `Codec.drops`), whose dropped progress is otherwise trained
    again and then sent twice (docs/benchmarks.md, "Codecs"), carry for the others. A piece stored
    after its take is carried."""
    save_state: bool = True
    """Save this learner's own state (inner optimizer, LR schedule and the objects passed as `state=`,
    step and tokens) to the bucket under its id, every `state_every` sends of fragment 0 and when it
    leaves on SIGTERM, and restore it when a learner of the same id rejoins (`workers/state.py`). Off:
    a restarted learner starts its optimizer, schedule and data afresh. An island saves one state
    through rank 0: the optimizer's state whole (a sharded one gathered) and every rank's own objects."""
    state_every: int = 10
    """With `save_state`: save every this many sends of fragment 0 (about rounds); 0: only on SIGTERM."""
    state_max_age_s: float = 1800.0
    """With `save_state`: a saved state older than this (the coordinator's default `--gone-after-s`)
    is not restored; the learner starts afresh."""
    state_link_share: float = 0.1
    """With `save_state`: the most of the learner's upload link its saved states may take. A state is
    saved (at its `state_every`) only if uploading it, at the rate this learner's uploads have gone up,
    would take at most this share of the time since the last save, or 2 s (`state.save_fits_link`): a state
    is two to three times the model (AdamW's moments), twice the pieces of ten rounds at int4, and on
    a thin link it delays the pieces it shares the link with until they are refused as stale. 1: no
    limit. The state saved on SIGTERM is always tried."""
    transfer_threads: int = CHOSEN_THREADS
    """CPU threads each of the learner's transfer threads (uploader, fetcher, stager, state saver)
    may use for torch's encoding, decoding and hashing of whole fragments. 0: a quarter of this
    process's CPUs when the model is on a GPU (the thread that launches the kernels keeps its core);
    on the CPU one when their work is paced (`transfer_share`), else torch's own count."""
    transfer_nice: int = CHOSEN_NICE
    """How far below the training loop's priority the transfer threads run (Linux: a nice value of
    their own, the thread only): when they contend for a core, the loop wins. 0: the same priority.
    -1: chosen for the device (`threads.transfer_nice`): 10 when the model is on a GPU (the thread
    that launches its kernels is never kept waiting), 0 on the CPU (where a lowered transfer thread
    waits behind the loop's own work, and every take comes that much later)."""
    transfer_share: float = CHOSEN_SHARE
    """The share of a CPU the transfer threads' heavy work may take between them over any stretch of
    more than 50 ms of it (`storage.intraop.pace_this_thread`, one `Budget`): a burst (encoding a large piece, taking a
    version) is spread out instead of slowing one step of a loop it shares a core with by up to
    twice. 1: not paced. 0: chosen for the device (`threads.transfer_share`): 0.25 on the CPU, not
    paced beside a GPU (where they run on cores of their own, below the loop). Their average load
    should stay below it (a 124M model on 2 CPUs uses 4% of one); where it does not, pieces queue
    and the uploader rushes, unpaced, until its queue is empty (`Uploader._rush`: a 1B model on 2
    CPUs needs 0.42 of one). Version 0's
    proposal and the final pieces of a learner leaving are not paced: no loop trains beside them."""
    reuse_freed_memory: bool = True
    """Tune this process's malloc (glibc) to keep freed fragment-sized buffers for reuse instead of
    handing them back to the OS after every piece (`storage.heap`): the transfer threads' encoding and
    decoding then write into pages already there, not fresh ones the kernel faults in and zeroes
    (a quarter of an int4 encode's time on a CPU). It keeps up to 256 MiB of freed heap. False, or
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set, or another allocator preloaded: the process's
    allocator is left as it is."""
    send_ahead: bool = True
    """On the clock cadence: send each piece ahead of its round's deadline by the time this learner's
    pieces take to go out (`fragments.send_lead`: at most half a round), so that it arrives by the
    deadline, also on a thin link. Off: send at the last step before the deadline."""
    own_version_wait: float = 0.5
    """After `overlap_steps`, keep training up to this fraction of H more steps while the version that
    merged this learner's own contribution is not committed or not downloaded yet, rather than take an
    older one: a delta computed against a version that lacks the learner's previous contribution is
    stale, and weighs less. After that, any newer version is taken (else a learner whose sends come
    faster than their rounds commit would never move its base)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.heartbeat_s) and self.heartbeat_s > 0):
            raise ConfigError(f"heartbeat_s must be a finite number of seconds > 0, got {self.heartbeat_s!r}")
        if not 0 < self.state_link_share <= 1:
            raise ConfigError(f"state_link_share must be in (0, 1], got {self.state_link_share!r}")
        if self.state_every < 0:
            raise ConfigError(f"state_every must be >= 0 sends (0: save the state on SIGTERM only), got "
                              f"{self.state_every}")
        if self.dropped not in ("auto", "keep", "carry"):
            raise ConfigError(f"dropped must be auto, keep or carry, got {self.dropped!r}")
        check_transfer_settings(self.transfer_threads, self.transfer_nice, self.transfer_share)
        if self.lease_s <= self.heartbeat_s or not self.lease_s <= MAX_LEASE_S:
            raise ConfigError(f"lease_s ({self.lease_s}) must exceed heartbeat_s ({self.heartbeat_s}) and be at "
                              f"most {MAX_LEASE_S:g} s")


@dataclass
class FragmentState:
    """What a learner keeps for one fragment of the model. Every rank of an island knows `names`;
    the rest is rank 0's."""

    names: list[str]
    """The fragment's parameter names."""
    anchor: Snapshot = field(default_factory=lambda: Snapshot({}))
    """The point unsent progress is measured from: the local values at the last send, or the global
    version taken since. Never changed in place: the uploader and the fetcher may hold it."""
    base_version: int = -1
    """The global version the anchor descends from: a delta sent now is based on it."""
    tokens: int = 0
    """Tokens trained since the last send (since joining, before the first)."""
    steps: int = 0
    """Inner steps since the last send."""
    awaiting: int | None = None
    """After a send: the earliest step at which to merge a newer version; None: nothing awaited."""
    sent_id: str | None = None
    """Contribution id of the last send."""
    sent_deadline: float | None = None
    """The clock deadline the last send served (clock cadence)."""
    since_step: int = 0
    """The step of the last send or take: the steps since were trained on from the same base."""
    stage_waits: int = 0
    """Steps the next take has waited for the stager to make its version ready (`takes.STAGE_WAIT_STEPS`)."""


FLAG_RUN_FINISHED = 1
FLAG_LEAVE = 2
FLAG_SAVE_STATE = 4
"""Bits of the flags rank 0 shares with its plan each step."""


WAIT_LOG_S = 5.0
"""While joining, how often a learner says what it is waiting for."""
PREEMPTED_EXIT = 143
"""The exit code of a learner that left on SIGTERM: 128 + 15, as a process SIGTERM killed."""


class Preempted(SystemExit):
    """Raised out of `optimizer.step()` after SIGTERM (`handle_sigterm=True`), once the learner has sent
    its progress and left. A SystemExit (code 143, as a process killed by SIGTERM): uncaught, the
    process exits quietly; `except Exception` in a training loop does not swallow it."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message


ENV_LEARNER_ID = "DILOCO_LEARNER_ID"


def stable_learner_id(env: Mapping[str, str] = os.environ) -> str | None:
    """The id a deployment gives this learner's slot, the same after a preemption, so that the
    replacement resumes as the same learner (its state, its place in the run): DILOCO_LEARNER_ID,
    else a Kubernetes Indexed Job's JOB_COMPLETION_INDEX (`learner-<index>`), else a SkyPilot
    managed job's SKYPILOT_TASK_ID and node rank (`learner-<job id>-<rank>`). None without any."""
    if own := env.get(ENV_LEARNER_ID):
        return own
    if (index := env.get("JOB_COMPLETION_INDEX")) is not None:
        return f"learner-{index}"
    if task := env.get("SKYPILOT_TASK_ID"):  # ends with the managed job's id, kept across recoveries
        job = re.sub(r"[^A-Za-z0-9_.-]", "-", task.rsplit("_", 1)[-1])[:40]
        return f"learner-{job}-{env.get('SKYPILOT_NODE_RANK', '0')}"
    return None


def _learner_id(given: str | None) -> str:
    learner_id = given or stable_learner_id()
    if learner_id is None:
        raise ConfigError(f"no learner id: pass learner_id= to the Learner or set {ENV_LEARNER_ID} (on Kubernetes "
                          "Indexed Jobs and SkyPilot managed jobs it is found by itself). Give each learner slot its "
                          "own id and keep it across restarts: a restarted learner resumes under its id, and a run "
                          "waits for every id that joined to finish")
    return check_id("learner", learner_id)


class Learner:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, run: str,
                 endpoints: Endpoints | None = None, learner_id: str | None = None,
                 tokens_per_step: int | None = None, config: LearnerConfig | None = None,
                 handle_sigterm: bool = False, state: Mapping[str, Stateful] | None = None) -> None:
        if tokens_per_step is not None and (isinstance(tokens_per_step, bool) or int(tokens_per_step) <= 0):
            raise ConfigError(f"tokens_per_step must be a positive number of tokens (or samples) per step, got "
                              f"{tokens_per_step!r}: it weighs this learner's contributions")
        self.model = model
        self.optimizer = optimizer
        user_state = dict(state or {})
        bad = [k for k, v in user_state.items() if not (callable(getattr(v, "state_dict", None))
                                                        and callable(getattr(v, "load_state_dict", None)))]
        if bad:
            raise ConfigError(f"state= objects need state_dict() and load_state_dict(): {bad} lack them")
        self.run = check_id("run", run)
        self.learner_id = _learner_id(learner_id)
        self.tokens_per_step = tokens_per_step
        self.config = config or LearnerConfig()
        self._endpoints = endpoints
        self.step = 0
        self.tokens = 0
        self._loss: float | torch.Tensor | None = None
        self.adopted = 0
        self.steps_through = 0
        """Inner steps trained between a send (or take) and the take after it (LearnerStats.steps_through):
        with the adopt rule, the steps dropped."""
        self.dropped_stale = 0
        """Pieces not sent because the coordinator would have refused them as stale (`_send`)."""
        self.taken_staged = 0
        """Of `adopted`, versions taken with what the stager's thread had made ready (`workers.staging`):
        the others' arithmetic ran in the step hook."""
        self.kept_dropped = 0
        """Takes that left what the codec dropped of the piece in the model (`LearnerConfig.dropped`)."""
        # Rank 0's connections and threads, made as it joins (`_join`); None before, and on other ranks.
        self.store: ObjectStore | None = None
        self.bus: Bus | None = None
        self.uploader: Uploader | None = None
        self.fetcher: Fetcher | None = None
        self._stager: Stager | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._losses: LossRecorder | None = None
        self.stats = TransferStats()
        # Names without the prefixes of DDP, torch.compile and other wrappers: a DDP island, a compiled
        # learner and a plain one train the same run.
        self.replica = Replica(run_parameters(model))
        self.is_leader = self.replica.is_leader
        self.keeper = StateKeeper(self.learner_id, optimizer, self.replica, user_state)
        """The learner's own state (`LearnerConfig.save_state`): the optimizer's, and that of the `state=`
        objects (an LR scheduler, a data position: anything with `state_dict()` and `load_state_dict()`)."""
        self.fragments: list[FragmentState] = []
        """Per fragment (index = fragment), set when joining."""
        self._pending_tokens: int | None = None
        self._step_time_s = 0.0
        self._last_step_at: float | None = None
        self._merge_wait_s = 0.0  # with wait_for_merge: time the last hook waited for versions, not a step's
        self._cadence = None
        self._link_load = LinkLoad()  # how busy its link to S3 is, for its heartbeats (`storage.linkuse`)
        self._clock_offset_s = 0.0  # Redis server time - local time
        self._last_boundary: float | None = None  # the previous step's end, on the cadence clock
        self._hook = None
        self._merges_first = True  # set when joining: a step takes versions before it sends (rebase)
        self._joined = False  # rank 0: joined (heartbeats then keep it in the run's joined set)
        self._genesis: GenesisProposer | None = None  # rank 0, while joining: its part in version 0
        self._run_end: RunEnd | None = None  # rank 0: the run's end, once a heartbeat has seen it
        self._run_finished = False  # every rank: as rank 0 last shared it
        self._stop = threading.Event()
        self.sync_s = 0.0
        """Time the training loop spent in this learner's step hook: snapshots, deltas, merges and,
        with `wait_for_merge`, waiting for versions. Uploads and downloads run beside the loop."""
        self.hook_phases: dict[str, list[float]] = {}
        """Where the step hook's time goes: phase (decide, merge, send, save) -> [total s, longest s]."""
        self.started_at: float | None = None
        """When the first step ended (monotonic): the training loop's wall time is measured from it."""
        self.preempted = False
        """SIGTERM arrived (with `handle_sigterm`): the learner leaves at the end of the step in progress."""
        self._metrics: LearnerMetrics | None = None
        self._saves_state = False  # every rank: rank 0 saves states (the ranks take part in gathering them)
        self._leave_by: float | None = None  # finish(): when sending the last pieces and leaving must be done
        self._sends_of_0 = 0
        self.restored_from: str | None = None
        """The saved state this learner resumed from when it joined (its key), None if it started afresh."""
        self._sigterm_previous = None
        self._joining = False  # rank 0 in `_join`: SIGTERM raises Preempted at once
        if handle_sigterm:
            self._install_sigterm_handler()

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Learner:
        if self._hook is None:  # `learner.start()` before the block is the same join
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    @property
    def run_finished(self) -> bool:
        """The run was finished (every learner finished, or `diloco finish`): nothing this learner
        sends is merged any more, so it sends nothing more, and a training loop may stop. Seen by
        rank 0's heartbeat, and by every rank of an island at its next step."""
        return self._run_finished

    @property
    def versions(self) -> dict[int, int]:
        """Fragment -> the global version its local values descend from (rank 0; the last one taken)."""
        return {f: state.base_version for f, state in enumerate(self.fragments)}

    def global_state_dict(self, version: Which = "latest") -> dict[str, torch.Tensor]:
        """The run's global model as it stands now: each fragment's newest version by default (the
        final model only once the run is finished: `final_state_dict` waits for that; see
        `diloco.storage.global_model.read_global` for `version`), read from S3 and checked against the
        manifests, as a state dict of this learner's trainable parameters (named as the model names
        them: `model.load_state_dict(sd, strict=False)` loads it; buffers are not part of it). Works on
        every rank of an island and after the learner has left; the endpoints are the learner's."""
        endpoints = self._endpoints or Endpoints.from_env(redis=False)
        loaded = read_global(ObjectStore(endpoints), RunKeys(endpoints.prefix, self.run), version)
        names = model_names(self.model)
        unknown = sorted(set(loaded.state) - set(names))
        if unknown:
            raise DilocoError(f"run {self.run!r} has parameters this model lacks: {unknown[:3]}")
        return {names[n]: t for n, t in loaded.state.items()}

    def final_state_dict(self, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
        """The run's final model: wait (up to `timeout_s`) until the run is finished, then return
        its final versions (the ones its end record names) as `global_state_dict` does. A learner
        that finishes before the others gets the model they end with, not the one of the moment it
        left. Raises DilocoError if the run is not finished in time."""
        endpoints = self._endpoints or Endpoints.from_env(redis=False)
        store, keys = ObjectStore(endpoints), RunKeys(endpoints.prefix, self.run)
        deadline = time.monotonic() + timeout_s
        while read_run_end(store, keys) is None:
            if time.monotonic() > deadline:
                raise DilocoError(f"run {self.run!r} is not finished after {timeout_s:.0f}s: its final model does "
                                  "not exist yet (global_state_dict() gives the latest versions)")
            time.sleep(1.0)
        return self.global_state_dict("final")

    def start(self) -> None:
        """Join the run: wait for its spec, propose version 0 if none exists, adopt the latest versions.

        On an island every rank calls this; rank 0 joins and the others receive its parameters.
        If rank 0 fails to join, every rank raises. Joining twice is refused (DilocoError)."""
        if self._hook is not None:
            raise DilocoError(f"learner {self.learner_id} has joined run {self.run!r} already")
        values: dict[str, torch.Tensor] | None = None
        heads: dict[int, int] = {}
        failure: BaseException | None = None
        initial = self.replica.read(self.replica.params)  # collective; rank 0 may propose these as version 0
        if self.is_leader:
            try:
                self._joining = True
                if self.preempted:  # SIGTERM came before start
                    raise Preempted(f"learner {self.learner_id} left run {self.run!r} on SIGTERM before joining it")
                values, heads = self._join(initial)
            except BaseException as exc:  # noqa: BLE001 (re-raised below, after telling the other ranks)
                self._joining = False
                failure = exc
                self._abandon()
            finally:
                self._joining = False
        status = self.replica.share(None if not self.is_leader else
                                    [int(failure is not None), 0 if failure else len(self.layout.fragments),
                                     int(not failure and self.spec.merge_rule == "rebase"),
                                     int(self.keeper.saver is not None)], 4)
        self._merges_first = bool(status[2])  # every rank runs a step's sends and merges in the same order
        self._saves_state = bool(status[3])
        if failure is not None:
            if isinstance(failure, Preempted):
                log.warning("%s", failure)
            raise failure
        if status[0]:
            raise DilocoError(f"rank 0 of learner {self.learner_id} could not join run {self.run!r}: see its log")
        if not self.is_leader:
            layout = plan_layout(model_params(self.model), status[1])  # rank 0 checked it against the run's
        else:
            layout = self.layout
        self.fragments = [FragmentState([s.name for s in specs]) for specs in layout.fragments]
        if values is not None:  # rank 0
            # Pinned memory for two snapshots of every parameter, and for a saved state (AdamW: two
            # moments each) when states are saved: allocated here, not in a step.
            self.replica.copies.reserve(list(self.replica.params.values()),
                                        sets=4 if self.keeper.saver is not None else 2)
            for f, state in enumerate(self.fragments):
                state.anchor = Snapshot({n: values[n] for n in state.names})  # shared with the fetcher
                state.base_version = heads[f]
        self.replica.write(values, [n for state in self.fragments for n in state.names])
        if self._saves_state and (restored := self.keeper.restore()) is not None:
            self.step, self.tokens, self.restored_from = restored
        self._hook = self.optimizer.register_step_post_hook(lambda *_: self._after_step())
        self._pre_hook = self.optimizer.register_step_pre_hook(lambda *_: self.keeper.before_step())
        if self.is_leader and self.config.metrics_port:
            self._metrics = LearnerMetrics.start(self, self.config.metrics_port)

    def finish(self, *, preempted: bool = False) -> None:
        """Leave the run cleanly: send every fragment's progress since its last send as a final piece
        (for the fragment's next round), wait up to `close_timeout_s` for the uploads, record that this
        learner has finished, and leave. `with learner:` calls it when the block ends without an
        exception. The run ends by itself once every learner that joined has finished.

        `preempted=True` (a preemption notice, SIGTERM): the progress is sent all the same, but the
        learner is not recorded as finished, as it may come back: the run does not end without it.
        Once the run is finished (`run_finished`), nothing is sent and the learner just leaves.
        Call it between steps; on an island every rank calls it (they take part in the gathers).
        Does nothing if the learner has not joined or has left already."""
        if self._hook is None:
            return  # never joined (refused, or failed to start), or left already
        self._leave_by = time.monotonic() + self.config.close_timeout_s  # sending and leaving, together
        self._stop_pacing()  # the loop is done: the final pieces go out as fast as they can
        if self.is_leader:
            self.fetcher.done_taking()  # nor does it take a version again: none is downloaded for it
        final = self._send_progress(final=True)
        if preempted and self._saves_state and self.replica.share(
                [int(self._run_end is None)] if self.is_leader else None, 1)[0]:
            self._save_state()  # it may come back: it resumes from here
        self.preempted |= preempted  # recorded as such on leaving (LearnerLeft)
        finished = None if preempted or self._run_end is not None else final
        self._leave_run(finished)

    def close(self) -> None:
        """Leave the run without sending anything: wait up to `close_timeout_s` for queued uploads,
        stop the threads and announce leaving. `with learner:` calls it when the block ends with an
        exception: the progress since the last sends is dropped, and the learner is not finished."""
        if self._hook is not None:
            self._leave_run(None)

    def send_progress(self) -> None:
        """Send every fragment's progress since its last send now, for the round it would have gone to
        next, and go on training (`finish` does the same on leaving). Call it between steps; on an
        island every rank calls it."""
        if self._hook is not None:
            self._send_progress(final=False)

    def _send_progress(self, *, final: bool) -> list[str]:
        """Send each fragment's unsent progress (nothing once the run is finished); rank 0 returns
        the contribution ids it went out under, the other ranks []."""
        due: dict[int, float] | None = None
        if self.is_leader:
            cadence = self._cadence if self.spec.cadence == "clock" else None
            now = time.time() + self._clock_offset_s
            due = {} if self._run_end is not None else {
                f: cadence.next_deadline(f, self.spec.num_fragments, after=now) if cadence else 0.0
                for f, state in enumerate(self.fragments) if state.steps > 0}
        to_send, _, _ = self.replica.share_plan(None if due is None else list(due), None if due is None else [],
                                                len(self.fragments))
        sent = []
        for f in to_send:
            sent.append(self._send(f, due.get(f, 0.0) if due else 0.0, final=final))
            if final and self.is_leader and self._leave_by is not None:  # leaving (`finish`)
                # One fragment's snapshot and delta at a time, not every fragment's at once: leaving
                # must not take more memory than training (a 1B model: docs/benchmarks.md).
                self.uploader.flush(max(0.0, self._leave_by - time.monotonic()))
        if to_send:
            log.info("sent the progress since the last send of fragment(s) %s%s", to_send,
                     " as final pieces" if final else "")
        return [cid for cid in sent if cid is not None]

    def _leave_run(self, finished: list[str] | None) -> None:
        """Wait up to `close_timeout_s` for queued uploads, stop the threads, then (rank 0) record that
        this learner finished with its `finished` final pieces (None: it did not finish) and leave."""
        if self._hook is not None:
            self._hook.remove()
            self._pre_hook.remove()
            self._hook = None
        self._restore_sigterm_handler()
        if not self.is_leader:
            return
        deadline = self._leave_by or time.monotonic() + self.config.close_timeout_s
        self._stop_pacing()
        if not self.uploader.flush(max(0.0, deadline - time.monotonic())):
            log.warning("leaving with %d contribution(s) not uploaded after %.0fs: abandoned", self.uploader.pending(),
                        self.config.close_timeout_s)
        if self.keeper.saver is not None and not self.keeper.saver.flush(max(0.0, deadline - time.monotonic())):
            log.warning("leaving without the learner's state saved after %.0fs: a restart starts afresh",
                        self.config.close_timeout_s)
        self._stop.set()
        self.uploader.close()
        self.fetcher.close()
        if self._stager is not None:
            self._stager.close()
        if self.keeper.saver is not None:
            self.keeper.saver.close()
        # Join before the interpreter tears down: a daemon thread inside a torch op at exit aborts the
        # process. A thread stuck on an unreachable server is abandoned at the deadline.
        saver = self.keeper.saver
        for thread in (self.uploader, self.fetcher, self._stager, self._heartbeat_thread, self._losses, saver):
            if thread is not None:
                thread.join(timeout=max(0.5, deadline - time.monotonic()))
                if thread.is_alive():
                    abandon(thread)
        self.replica.copies.close()
        # Leaving is best effort (the lease expires anyway) and must not outlast the deadline
        # while Redis is unreachable: it runs in a thread that is abandoned then.
        leaving = threading.Thread(target=self._leave, args=(finished,), name="leave", daemon=True)
        leaving.start()
        leaving.join(timeout=max(0.5, deadline - time.monotonic()))
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None

    def _leave(self, finished: list[str] | None) -> None:
        try:
            self._heartbeat()
            if self._genesis is not None and not self._joined:  # gave up joining: another learner proposes at once
                self._genesis.release()
            if finished is None:
                left = LearnerLeft(self.learner_id, time.time() + self._clock_offset_s, self.step, self.preempted)
                self.bus.leave(self.learner_id, left if self._joined else None)
                return
            self.bus.finish(LearnerFinished(learner=self.learner_id, finished_at=time.time() + self._clock_offset_s,
                                            steps=self.step, final=tuple(finished)))
            log.info("learner %s finished run %s after %d steps (final pieces: %d)", self.learner_id, self.run,
                     self.step, len(finished))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not announce leaving: %s", exc)

    def _abandon(self) -> None:
        """Rank 0, joining failed: stop whatever `_join` started and leave the live set (best effort).
        The learner never joined, so it neither sends nor finishes anything."""
        self._stop.set()
        self._restore_sigterm_handler()
        threads = [t for t in (self.uploader, self.fetcher, self._stager, self._heartbeat_thread, self._losses,
                               self.keeper.saver) if t is not None]
        for thread in threads:
            if hasattr(thread, "close"):
                thread.close()
        deadline = time.monotonic() + self.config.close_timeout_s
        for thread in threads:  # nothing of a learner that never joined keeps running
            if thread.is_alive():
                thread.join(timeout=max(0.1, deadline - time.monotonic()))
        self.replica.copies.close()  # the snapshots' lander, started by reading the model at join on a device
        if self.bus is not None:
            leaving = threading.Thread(target=self._leave, args=(None,), name="leave", daemon=True)
            leaving.start()
            leaving.join(timeout=2.0)  # the lease lapses anyway

    def report(self, *, loss: float | torch.Tensor | None = None, tokens: int | None = None) -> None:
        """Optional, before optimizer.step(): the step's loss (for progress) and token count (else
        tokens_per_step). Pass the loss tensor itself rather than `loss.item()`: it is kept detached
        and read on the heartbeat's thread, so the training loop never waits for the device for it."""
        if loss is not None:
            self._loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        if tokens is not None:
            self._pending_tokens = int(tokens)

    @property
    def last_loss(self) -> float | None:
        """The last loss reported (a tensor's value is read here: on a device, this waits for it)."""
        loss = self._loss
        return None if loss is None else float(loss)

    # ---- preemption ---------------------------------------------------------------------------
    def _install_sigterm_handler(self) -> None:
        """SIGTERM (a spot preemption, Kubernetes deleting the pod, SkyPilot recovering a job) only
        marks the learner: at the end of the step in progress it sends its progress, leaves as
        preempted (it may come back) and raises `Preempted` out of `optimizer.step()`."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("handle_sigterm: the Learner is not built on the main thread; Python delivers signals "
                        "there only: no SIGTERM handler installed")
            return

        def on_sigterm(signum: int, _frame: object) -> None:
            first, self.preempted = not self.preempted, True
            if self._joining:  # nothing to send yet: leave now, from wherever joining waits
                raise Preempted(f"learner {self.learner_id} left run {self.run!r} on SIGTERM while joining it")
            if first:
                log.warning("SIGTERM: learner %s leaves at the end of the step in progress", self.learner_id)

        self._sigterm_previous = signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm_handler(self) -> None:
        if self._sigterm_previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_previous)
            self._sigterm_previous = None

    # ---- joining ----------------------------------------------------------------------------
    def _join(self, initial: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
        """Rank 0: join the run; return the latest global values of every parameter and the version
        of each fragment they come from."""
        endpoints = self._endpoints or Endpoints.from_env()
        check_servers(endpoints, timeout_s=self.config.reach_timeout_s)  # a wrong setting ends here, named
        self.store = ObjectStore(endpoints)
        self.bus = Bus(endpoints, self.run)
        keys = self.bus.keys
        deadline = time.monotonic() + self.config.join_timeout_s
        self.spec = self._wait(lambda: read_run_spec(self.store, keys), deadline,
                               f"run {self.run!r} to be created by a coordinator")
        end = self._wait(lambda: read_run_end(self.store, keys), deadline, "the run's state", found=False)
        if end is not None:
            raise RunFinished(f"run {self.run!r} is finished ({end.reason}; final versions "
                              f"{list(end.versions)}): nothing joins it any more; train on in a new run")
        if self.spec.codec not in codecs.CODECS:
            raise ConfigError(f"run {self.run!r} sends {self.spec.codec} pieces, a codec this build does not have "
                              f"({', '.join(codecs.CODECS)}): upgrade diloco to the coordinator's version")
        mine = plan_layout(model_params(self.model), self.spec.num_fragments)
        layout = self._wait(lambda: read_layout(self.store, keys), deadline, "the run's layout", found=False)
        self._limits = ThreadLimits.for_device(self.replica.device.type, usable_cpus(),
                                               threads=self.config.transfer_threads, nice=self.config.transfer_nice,
                                               share=self.config.transfer_share)
        if self.config.reuse_freed_memory:
            log.debug("learner %s: malloc: %s", self.learner_id, reuse_freed_memory())
        self.uploader = Uploader(self.store, self.bus, self.spec, self.learner_id, self.stats,
                                 deadline_s=self.config.upload_deadline_s, error_feedback=self.config.error_feedback,
                                 keep_dropped=self._keeps_dropped(),
                                 limits=self._limits)
        self.uploader.start()
        self._heartbeat()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()
        self._losses = LossRecorder(self.store, keys, self.learner_id, self.progress,  # workers/losses.py
                                    lambda: time.time() + self._clock_offset_s, self._stop,
                                    base_s=self.config.heartbeat_s)
        self._losses.start()
        # Version 0 is proposed fragment by fragment, each by the first learner to claim it, so
        # that learners starting together upload different fragments (`workers/genesis.py`).
        self._genesis = genesis = GenesisProposer(self.bus, self.store, self.uploader, self.learner_id, initial)

        def layout_or_propose() -> Layout | None:
            found = read_layout(self.store, keys)
            if found is None:  # the first proposal the coordinator reads fixes it
                genesis.step(mine, self.bus.heads())
            return found

        if layout is None:
            layout = self._wait(layout_or_propose, deadline, "the run's layout")
        problem = layout_mismatch(layout, mine)
        if problem:
            raise ConfigError(f"this model does not fit run {self.run!r}: {problem}")
        self.layout = layout

        def heads_or_propose() -> dict[int, int] | None:
            heads = self.bus.heads()
            if all(f in heads for f in range(len(layout.fragments))):
                return heads
            genesis.step(layout, heads)
            return None

        heads = self._wait(heads_or_propose, deadline, "version 0 of every fragment")
        self._stager = Stager(self.replica.copies, self._anchor_for, limits=self._limits)
        self._stager.start()
        self.fetcher = Fetcher(self.store, self.bus, layout, self.stats, stager=self._stager, limits=self._limits)
        values: dict[str, torch.Tensor] = {}
        for fragment, version in heads.items():
            what = f"version {version} of fragment {fragment}"
            manifest = self._wait(lambda f=fragment, v=version: read_manifest(self.store, keys, f, v), deadline, what)
            own = {s.name: initial[s.name].float() for s in layout.fragments[fragment]}
            params = self._wait(lambda m=manifest, o=own: self.fetcher.from_own(m, o), deadline, what, found=False)
            if params is None:
                params = self._wait(lambda m=manifest: read_params(self.store, layout, m), deadline, what)
            self.fetcher.note(manifest)
            self.fetcher.hold(fragment, version, params)  # the next versions come as updates of these
            values.update(params)
        self.stats.bytes_joined = self.store.bytes_read
        if self.stats.joined_own:
            log.info("learner %s: its initial values are version 0 of %d of %d fragment(s): their params were "
                     "not downloaded", self.learner_id, self.stats.joined_own, len(heads))
        if self.config.save_state:
            self.keeper.find(self.store, keys, heads, self.bus.server_time, max_age_s=self.config.state_max_age_s,
                             limits=self._limits)
        self.fetcher.start()
        self.bus.join(self.learner_id)
        self._joined = True
        genesis.joined()
        log.info("learner %s joined run %s at versions %s", self.learner_id, self.run,
                 [heads[f] for f in sorted(heads)])
        return values, heads

    def _keeps_dropped(self) -> bool:
        """Whether what the codec loses of a piece stays in the model (`LearnerConfig.dropped`)."""
        if self.spec.merge_rule != "rebase" or self.config.dropped == "carry":
            return False
        return self.config.dropped == "keep" or codecs.get(self.spec.codec).drops

    def _wait(self, probe, deadline: float, what: str, *, found: bool = True):  # noqa: ANN001, ANN202
        """Call `probe` until it returns a value (`found=False`: until it returns at all). S3 or
        Redis being unreachable meanwhile is waited out as well: a learner may start during an
        outage, and joins once it is over (within `join_timeout_s`)."""
        delay, started, said = 0.05, time.monotonic(), 0.0
        while True:
            error = None
            try:
                value = probe()
                if value is not None or not found:
                    return value
            except (StorageUnavailable, redis.RedisError) as exc:
                error = exc
                log.warning("waiting for %s: storage unreachable, retrying: %s", what, exc)
            if error is None and time.monotonic() - started - said >= WAIT_LOG_S:
                said = time.monotonic() - started
                log.info("learner %s waiting for %s (%.0fs of join_timeout_s %.0fs)", self.learner_id, what, said,
                         self.config.join_timeout_s)
            if time.monotonic() > deadline:
                raise DilocoError(f"gave up waiting for {what} after {self.config.join_timeout_s:.0f}s: " +
                                  (f"last error: {error}" if error else "is `diloco coordinator` running against "
                                   "the same Redis, bucket and run?"))
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    # ---- the step hook ------------------------------------------------------------------------
    def _after_step(self) -> None:
        now = time.monotonic()
        try:
            self._step_hook(now)
        finally:
            self.sync_s += time.monotonic() - now

    def _step_hook(self, now: float) -> None:
        if self._last_step_at is None:
            self._last_step_at = self.started_at = now  # the end of the first step: wall time counts from here
        else:
            # The step's own time: a wait for a merge (wait_for_merge) is not, or the round clock, set
            # from step times, would slow down by every wait, and every wait grow with it.
            dt = now - self._last_step_at - self._merge_wait_s
            self._step_time_s = dt if self._step_time_s == 0 else 0.9 * self._step_time_s + 0.1 * dt
        self._last_step_at, self._merge_wait_s = now, 0.0
        self.step += 1
        tokens = self.tokens_per_step if self._pending_tokens is None else self._pending_tokens
        if tokens is None:
            if self.is_leader:  # rank 0 reports the island's tokens; the other ranks' counts are not used
                raise ConfigError("no token count for this step: pass tokens_per_step= to the Learner (the whole "
                                  "island's tokens or samples per optimizer step) or call learner.report(tokens=n) "
                                  "before each optimizer.step(); contributions are weighted by them")
            tokens = 0
        self._pending_tokens = None
        self.tokens += tokens
        due: dict[int, float] = {}
        ready: dict[int, Fetched] = {}
        mark = time.perf_counter()
        if self.is_leader:
            for state in self.fragments:
                state.tokens += tokens
                state.steps += 1
            due, ready = self._due(), self._ready()
        # Rank 0 decides; on an island every rank then takes part in the same gathers and writes.
        flags = (FLAG_RUN_FINISHED if self._run_end is not None else 0) | (FLAG_LEAVE if self.preempted else 0)
        if self.is_leader and 0 in due and self._saves_state and self._state_due():
            flags |= FLAG_SAVE_STATE
        to_send, to_merge, flags = self.replica.share_plan(list(due), list(ready), len(self.fragments), flags)
        self._run_finished = bool(flags & FLAG_RUN_FINISHED)
        if flags & FLAG_LEAVE:  # rank 0 was told to stop: every rank sends its part of the progress and leaves
            self.preempted = True
            self.finish(preempted=True)
            raise Preempted(f"learner {self.learner_id} left run {self.run!r} on SIGTERM after step {self.step}, "
                            "its progress sent")
        # A fragment both due and ready this step: rebasing first uses the anchor of its last send,
        # landed long ago, and the send after it carries the same progress (local - anchor), labelled
        # with the version it was trained from; sending first would make the rebase wait for this
        # step's own snapshot to reach the host. Adopting or mixing first would drop or blend the round's progress
        # before it is sent, and neither reads the anchor: they come after the send.
        based_on = {f: self.fragments[f].base_version for f in to_merge} if self._merges_first else {}
        mark = self._phase("decide", mark)
        for f in to_merge if self._merges_first else ():
            self._merge(f, ready.get(f))
        mark = self._phase("merge", mark) if to_merge and self._merges_first else mark
        for f in to_send:
            self._send(f, due.get(f, 0.0), based_on=based_on.get(f))
        mark = self._phase("send", mark) if to_send else mark
        for f in () if self._merges_first else to_merge:
            self._merge(f, ready.get(f))
        mark = self._phase("merge", mark) if to_merge and not self._merges_first else mark
        if flags & FLAG_SAVE_STATE:
            self._save_state()
            self._phase("save", mark)

    def _state_due(self) -> bool:
        """Rank 0, fragment 0 about to be sent: whether to save the learner's state this step (every
        `state_every` sends of it, when the link allows: `StateKeeper.fits_link`)."""
        self._sends_of_0 += 1
        if not self.config.state_every or self._sends_of_0 % self.config.state_every:
            return False
        return self.keeper.fits_link(self.stats.bytes_uploaded, self.stats.put_s, self.config.state_link_share)

    def _phase(self, name: str, since: float) -> float:
        """Count the time since `since` to the hook's phase `name`; return now."""
        now = time.perf_counter()
        total = self.hook_phases.setdefault(name, [0.0, 0.0])
        total[0] += now - since
        total[1] = max(total[1], now - since)
        return now

    def _due(self) -> dict[int, float]:
        """Rank 0: fragments to send after this step -> the clock deadline they serve (0 on the step
        cadence). None once the run is finished: it merges nothing more."""
        if self._run_end is not None:
            return {}
        cadence = self._cadence
        if self.spec.cadence == "clock" and cadence is not None:
            now = time.time() + self._clock_offset_s
            sent = {f: s.sent_deadline for f, s in enumerate(self.fragments) if s.sent_deadline is not None}
            lead = send_lead(self.stats.send_lag_s, cadence.period_s) if self.config.send_ahead else 0.0
            due = clock_due(now, self._step_time_s, cadence, self.spec.num_fragments, sent, self._last_boundary,
                            lead)
            self._last_boundary = now
            for f, deadline in due:
                self.fragments[f].sent_deadline = deadline
        else:
            due = [(f, 0.0) for f in due_fragments(self.step, self.spec.num_fragments, self.spec.sync_every)]
        # Nothing to send for a fragment with no step since its last send.
        return {f: deadline for f, deadline in due if self.fragments[f].steps > 0}
    def _ready(self) -> dict[int, Fetched]:
        """Rank 0: fetched versions to merge now: at least `overlap_steps` after the send that awaits
        them, and preferably the version that merged that send (see `LearnerConfig.own_version_wait`)."""
        ready = {}
        sync = self.config.wait_for_merge
        patience = self.config.own_version_wait * self.spec.sync_every
        for fragment, state in enumerate(self.fragments):
            if state.awaiting is None or self.step < state.awaiting:
                continue  # not due (`wait_reason` says so too): no fetcher lookups on most steps
            a = Awaiting(step=self.step, due=state.awaiting, patience=patience if state.sent_id is not None else 0.0,
                         merged_in=self.fetcher.merged_in(state.sent_id), staging=self.fetcher.staging(fragment),
                         stage_waits=state.stage_waits, blocking=sync)
            why = wait_reason(a)
            if why == "staging":
                state.stage_waits += 1  # being made ready off this thread: a few steps later costs less
            if why is not None:
                continue  # own_round: that round has not committed yet: train on, take its version later
            waited_from = time.monotonic()
            fetched = self.fetcher.take(fragment, self.config.merge_wait_s if sync else 0.0)
            self._merge_wait_s += time.monotonic() - waited_from
            if fetched is None:
                continue
            newer_than = refetch_after(a, fetched.version, state.base_version)
            if newer_than is not None:
                fetched.release()
                self.fetcher.want(fragment, newer_than)
                continue
            state.awaiting, state.stage_waits = None, 0
            ready[fragment] = fetched
        return ready

    @torch.no_grad()
    def _send(self, fragment: int, deadline: float, *, final: bool = False, based_on: int | None = None
              ) -> str | None:
        """Send the fragment's progress since its last send; rank 0 returns its contribution id.
        `based_on`: the version the progress was trained from, when a take this step moved the base
        (a rebase before the send: the piece is the same progress, and says so)."""
        state = self.fragments[fragment]
        snapshot = self.replica.snapshot(state.names)
        if snapshot is None:
            return None  # not rank 0: the gather was our part
        base = state.base_version if based_on is None else based_on
        if not final and self.fetcher.too_stale(fragment, base):  # it would be refused on arrival
            return self._drop_stale(fragment, snapshot)
        # The uploader computes the delta, once the snapshot has landed on the host.
        job = UploadJob(fragment, {}, base, state.tokens, state.steps, self._step_time_s,
                        deadline=deadline, final=final, pending=[(state.anchor, snapshot)])
        state.anchor, state.tokens, state.steps = snapshot, 0, 0
        if self.spec.merge_rule == "rebase":
            self.fetcher.restage(fragment)  # a version waiting to be taken: ready it against this anchor
        state.sent_id = self.uploader.submit(job)
        state.since_step = self.step
        state.awaiting = self.step + self.spec.overlap_steps
        self.fetcher.want(fragment, state.base_version)
        return state.sent_id

    def _drop_stale(self, fragment: int, snapshot: Snapshot) -> None:
        """Rank 0: a piece based on a version more than max_staleness behind the head would be refused
        on arrival. Drop it here, as the coordinator would (the progress since the last send is left
        out of the global model, the local values keep it), instead of spending the link on it: a
        learner whose link cannot download versions as fast as they come would otherwise upload
        pieces refused on arrival, slowing the very downloads it is behind on. Sending that progress
        later, based on a newer version, would pass it off as fresh: it was computed from the old
        one. The learner asks for the newest version and takes it at once (no own piece to wait for)."""
        state = self.fragments[fragment]
        if self.dropped_stale == 0 or state.sent_id is not None:
            log.info("fragment %d: piece not sent: based on version %d, more than max_staleness behind the head, "
                     "it would be refused; taking the newest version", fragment, state.base_version)
        self.dropped_stale += 1
        state.anchor, state.tokens, state.steps, state.sent_id = snapshot, 0, 0, None
        state.awaiting, state.since_step = self.step, self.step
        self.fetcher.want(fragment, state.base_version)

    @property
    def transfer_cpu_s(self) -> float:
        """CPU seconds of the uploader's, the fetcher's and the stager's own threads (torch's intra-op
        pool threads they use are not counted)."""
        return self.stats.cpu_s + (self._stager.cpu_s if self._stager is not None else 0.0)

    @property
    def transfer_cpu_phases(self) -> dict[str, float]:
        """`transfer_cpu_s` by what the threads did (`TransferStats.cpu_phases`; "stage": the stager's
        thread making versions ready to take)."""
        phases = dict(self.stats.cpu_phases)
        if self._stager is not None:
            phases["stage"] = self._stager.cpu_s
        return phases

    @property
    def transfer_paced_s(self) -> float:
        """Seconds the transfer threads have slept to keep to their CPU share (`transfer_share`)."""
        return sum(pacer.slept_s for pacer in self._pacers())

    def _pacers(self) -> list[Pacer]:
        threads = (self.uploader, self.fetcher, self._stager, self.keeper.saver)
        return [t.pacer for t in threads if t is not None and t.pacer is not None]

    def _stop_pacing(self) -> None:
        """Leaving: the transfer threads' work is no longer paced (the loop they left room for is done)."""
        for pacer in self._pacers():
            pacer.stop()

    def _anchor_for(self, fragment: int, version: int) -> tuple[Snapshot | None, list[str]] | None:
        """The stager's thread, about to make `version` ready: the anchor of the moment to compute it
        against (None for adopt and mix, which blend the values themselves) and the fragment's names;
        None if it will not be taken (`_merge` uses the value only if the anchor is still the same)."""
        if fragment >= len(self.fragments):
            return None  # not joined yet
        state = self.fragments[fragment]
        if version <= state.base_version:
            return None  # not taken
        return (state.anchor if self.spec.merge_rule == "rebase" else None), state.names

    @torch.no_grad()
    def _merge(self, fragment: int, fetched: Fetched | None) -> None:
        """Take version G of the fragment (see the module docstring): the parameters are updated in
        place on the device and never read back. What is added was computed on the fetcher's
        thread (`_stage`) unless the anchor changed since."""
        state = self.fragments[fragment]
        names = state.names
        values, keep, add = None, 1.0, 1.0
        staged = None  # rank 0 only, like `fetched`
        if self.is_leader and fetched is not None:
            rebase = self.spec.merge_rule == "rebase"
            pending = fetched.slot.pending
            staged = fetched.slot.claim()
            if staged is not None and staged.anchor is not (state.anchor if rebase else None):
                staged.release()  # the learner sent again since: computed here instead
                staged = None
            if staged is None:
                log.debug("fragment %d: version %d taken with its value computed here (%s)", fragment,
                          fetched.version, "still being made ready" if pending else "made ready for another anchor")
            g = fetched.params
            if staged is not None:
                values = staged.values
                self.taken_staged += 1
            elif rebase:
                anchor = state.anchor.wait()  # landed long ago: at least overlap_steps since the send
                values = {n: torch.sub(g[n], anchor[n], out=self.replica.host_empty(tuple(g[n].shape)))
                          for n in names}
            else:
                values = g
            if rebase and self.uploader.keep_dropped and (dropped := self.uploader.taken(fragment)) is not None:
                for n, d in dropped.items():  # what the codec dropped of the piece stays in the model
                    values[n].sub_(d if values[n].device == d.device else self.replica.copies.to_device(d))
                self.kept_dropped += 1
            if self.spec.merge_rule == "adopt":
                # Steps computed from a model G replaced: dropped, so the next piece neither carries nor counts them.
                keep, add = 0.0, 1.0
                state.tokens, state.steps = 0, 0
            elif not rebase:
                keep, add = self.spec.alpha, 1.0 - self.spec.alpha
            state.anchor, state.base_version = Snapshot(g), fetched.version
            self.adopted += 1
            self.steps_through += self.step - state.since_step
            state.since_step = self.step
        self.replica.blend(values, names, keep=keep, add=add, staged=staged is not None)
        if staged is not None:
            staged.release()

    # ---- the learner's own state across preemption (workers/keeper.py) ----------------------------
    def _save_state(self) -> None:
        self.keeper.save(self.step, self.tokens, [s.base_version for s in self.fragments],
                         saved_at=time.time() + self._clock_offset_s)

    # ---- heartbeats --------------------------------------------------------------------------
    def progress(self) -> LearnerStats:
        """What the next heartbeat reports."""
        store = self.store
        link = 0.0
        if store is not None:
            self.stats.bytes_downloaded = store.bytes_read
            period = self._cadence.period_s if self._cadence is not None else 0.0
            link = self._link_load.update(time.monotonic(), store.link.busy_s(), period,
                                          max(LINK_WINDOW_S, 2 * period))
        return LearnerStats(learner=self.learner_id, step=self.step, tokens=self.tokens,
                            loss=math.nan if (loss := self.last_loss) is None else loss,
                            step_time_s=self._step_time_s, adopted=self.adopted,
                            steps_through=self.steps_through, uploaded=self.stats.uploaded,
                            upload_failed=self.stats.upload_failed, bytes_uploaded=self.stats.bytes_uploaded,
                            bytes_downloaded=self.stats.bytes_downloaded, bytes_joined=self.stats.bytes_joined,
                            sync_s=self.sync_s, background_cpu_s=self.transfer_cpu_s,
                            wall_s=0.0 if self.started_at is None else time.monotonic() - self.started_at,
                            link_round_s=link, pid=os.getpid(), incarnation=self._incarnation)

    _incarnation = uuid.uuid4().hex[:8]

    def _heartbeat(self) -> None:
        """Report progress, and refresh the round clock, our offset to the Redis clock and whether
        the run is finished: one round trip (`Bus.heartbeat`)."""
        progress = self.progress()
        before = time.time()
        beat = self.bus.heartbeat(self.learner_id, self.config.lease_s, progress, joined=self._joined)
        self._clock_offset_s = beat.server_time - (before + time.time()) / 2
        if self._genesis is not None and not self._joined:  # its proposals still on their way: the others wait on
            self._genesis.extend()
        self._cadence = beat.cadence
        if self._run_end is None and self._joined and (end := beat.run_end) is not None:
            log.info("run %s is finished (%s; final versions %s): learner %s sends nothing more", self.run,
                     end.reason, list(end.versions), self.learner_id)
            self._run_end = end

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self._heartbeat()
            except Exception as exc:  # Redis down: the lease lapses, training goes on
                log.warning("heartbeat failed: %s", exc)
