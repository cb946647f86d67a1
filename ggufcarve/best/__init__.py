"""`ggufcarve best`: the best model for a memory budget, pruned or unpruned, decided by measurement."""
