"""The roles of a run as processes on the command line: `diloco coordinator`, `diloco learner` and
`diloco finish` (`cli`). What they run lives in coordinator/ and workers/."""
