"""The one measurement layer: candidates (a model file and an optional keep-set) scored against the
unpruned model's log-probs, by successive halving decided with paired statistics.

`tune` (which criterion and K), `best` (which model for a memory budget) and the demo's budget
answer are its front ends. `statistics` holds the paired comparison and the decision rules (pure
functions); `protocol` and `child` the one llama.cpp child that scores every candidate on one file
with routing masks switched between them; `tournament` the rounds.
"""
