"""`diloco chaos`: a run of real processes on a local stack under a seeded schedule of faults, then an
audit of every contribution (ARCHITECTURE.md, "The chaos suite").

- `config`: `ChaosConfig`, the run's settings.
- `faults`: the seeded fault schedule and the corrupt objects (pure).
- `processes`: `ChaosSupervisor`, the coordinators (armed with crash points) and learners it supervises.
- `ledger`: what became of every announced contribution, from S3 and Redis.
- `suite`: the run (bring up, inject, drain) and its report.
- `cli`: `diloco chaos`.
"""
