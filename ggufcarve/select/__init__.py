"""Expert selection: per-expert statistics (`ExpertScores`), the criteria that fill them, and the
keep-set chosen from them."""
