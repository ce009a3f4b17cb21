"""`diloco demo`: a whole run on an embedded local stack, with a learner killed midway, vs a baseline.

- `runner`: the demo itself (`DemoConfig`, `run_demo`).
- `cli`: `diloco demo`.
"""
