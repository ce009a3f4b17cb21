"""The history tools: what a run's history in S3 (or an export of it) can tell, with S3 alone.

- `archive`: `diloco export` and `diloco import`, and reading an export directory.
- `rounds`: a run's committed versions and their inputs, read back verified (used by the tools below).
- `replay`: `diloco replay`, every version re-derived and checked bit for bit.
- `gc`: `diloco gc`, the objects a run no longer needs deleted, its record kept.
- `whatif`: `diloco whatif`, a range of versions re-derived with other settings into a scratch run.
- `inspection`: `diloco inspect`, what went into a version or a run, per learner.
- `blame`, `verdict`: `diloco blame`, the evidence per learner and the verdicts drawn from it (pure).
- `task_model`: a task's model holding a run's global parameters (the tools and the rooms above that
  evaluate a run: demo, chaos, bench).
- `cli`: the subcommands.
"""
