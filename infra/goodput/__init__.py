"""The goodput simulator: how much of a failing fleet's chip time reaches the global model.

Goodput = useful chip time / total chip time, where total is chips x simulated seconds and
useful is compute whose result reaches the global model: steps kept by a checkpoint
(data-parallel), steps done by the survivors (elastic data-parallel), or steps carried by a
contribution the coordinator merged (decoupled). Not useful: work lost since the last checkpoint
or send, the step in flight at a failure, restarts and rescales, chips out for repair, waiting
at a barrier for slower chips, and contributions refused as too stale; nor is compute whose fate
is still open when the simulation ends (at most a round). `model.CATEGORIES` names where each
chip-second goes; the categories add up to the total.

Modules:
- `model`: every parameter (`Model`), its default and where that comes from; `Result`.
- `engine`: the event engine, the fleet's failures (one Poisson process), a job's chip time.
- `sync`: data-parallel and elastic data-parallel.
- `decoupled`: decoupled DiLoCo, driving `coordinator.policy` and the learners' send schedules.
- `sweep`: the strategies on one fleet or the paper's grid; tables, JSON and the plot.
- `timings`, `record`: timings recorded from a real run, and their projection.
- `cli`: `diloco simulate`.
"""
