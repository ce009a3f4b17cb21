"""Learning tasks a learner can train: the interface (`base`), the tasks beside the demo's
(`gpt2`, `vision`) and reading any of them from its wire form (`kinds`)."""
