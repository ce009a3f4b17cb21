"""`diloco bench NAME`: benchmarks that compose real learners, a real coordinator and real servers.

Each benchmark is a module here with `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> Result`; a `Result` prints as a table (`table()`) and is written as JSON
(`to_json()`). Figures are measured in one run, ratios against a baseline measured in the same
run: nothing here asserts on time.
"""
