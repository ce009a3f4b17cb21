"""Learning tasks a learner can train: the interface (`base`), the demo's (`demo`, its model
`tinygpt` and languages `language`), `gpt2` and `vision`, reading any of them from its wire form
(`kinds`), and the loop `diloco learner` trains one with (`train`)."""
