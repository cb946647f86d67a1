"""The Mixture-of-Experts layout of a model (which tensors carry the expert axis, MoE and MTP blocks, routing) and
keep-sets with llama.cpp's load rules."""
