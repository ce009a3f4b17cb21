"""The synchronous baselines: the whole fleet is one job that steps in lockstep.

- Data-parallel (`data_parallel`): any failure stops the job. It restarts after restart_s on a
  spare slice at full size, from its last checkpoint (every checkpoint_every steps): the work
  since then is lost. Failures during the restart are repaired by the same restart.
- Elastic data-parallel (`elastic`): a failure takes its slice out until it is repaired
  (repair_s) and pauses the job for rescale_s while it re-forms without it; the step in flight
  is lost, nothing else. A failure during a rescale is handled by that rescale; a repaired slice
  rejoins without a pause.

Both run at the pace of the slowest hardware group; faster groups wait at every step's barrier
(chip time `idle`).
"""

from __future__ import annotations

import time

from diloco.infra.goodput.engine import Engine, ChipPool, Job, book_result, new_book, speed_multipliers
from diloco.infra.goodput.model import Model, Result


def _barrier(book: dict[str, float], speeds: list[float]) -> None:
    """Running chips of groups faster than the slowest wait for it at every step: that share of
    every running chip-second (whatever became of it) is idle."""
    efficiency = sum(speeds) / len(speeds) / max(speeds)
    for category in ("useful", "lost", "pending"):
        book["idle"] += book[category] * (1.0 - efficiency)
        book[category] *= efficiency


def data_parallel(model: Model) -> Result:
    started = time.perf_counter()
    speeds = speed_multipliers(model)
    engine = Engine(model.horizon_s)
    book = new_book()
    job = Job(model.chips, model.step_time_s * max(speeds), book)
    restarts = 0

    def checkpointed(after: str) -> None:
        """Keep the steps since the restart (which started from a checkpoint) up to the last
        checkpoint; the rest goes to `after`."""
        chip_s, steps = job.take()
        kept = chip_s * (steps - steps % model.checkpoint_every) / steps if steps else 0.0
        book["useful"] += kept
        book[after] += chip_s - kept

    def on_failure(_job: int, _slice: int) -> None:
        nonlocal restarts
        if not job.running:
            return  # repaired by the restart under way
        job.advance(engine.now)
        checkpointed("lost")
        job.stop(engine.now, lose_settled=False)
        restarts += 1
        engine.at(engine.now + model.restart_s, job.resume, engine.now + model.restart_s)

    fleet = ChipPool(engine, model, 1, on_failure)
    fleet.start()
    engine.run()
    job.finish(model.horizon_s)
    checkpointed("pending")
    _barrier(book, speeds)
    return book_result("dp", model, book, {"failures": fleet.failures, "restarts": restarts}, started)


def elastic(model: Model) -> Result:
    started = time.perf_counter()
    speeds = speed_multipliers(model)
    engine = Engine(model.horizon_s)
    book = new_book()
    job = Job(model.chips, model.step_time_s * max(speeds), book)
    rescales = 0

    def repaired(slice_: int) -> None:
        fleet.in_repair.discard(slice_)
        job.resize(engine.now, fleet.chips_per_slice)

    def on_failure(_job: int, slice_: int) -> None:
        nonlocal rescales
        fleet.in_repair.add(slice_)
        engine.at(engine.now + model.repair_s, repaired, slice_)
        if job.running:
            job.stop(engine.now, lose_settled=False)  # the survivors keep every step done
            rescales += 1
            engine.at(engine.now + model.rescale_s, job.resume, engine.now + model.rescale_s)
        job.resize(engine.now, -fleet.chips_per_slice)

    fleet = ChipPool(engine, model, 1, on_failure)
    fleet.start()
    engine.run()
    job.finish(model.horizon_s)
    book["useful"] += job.take()[0]
    _barrier(book, speeds)
    return book_result("elastic", model, book, {"failures": fleet.failures, "rescales": rescales}, started)
