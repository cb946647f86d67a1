"""Placement: where a model's weights, cache and buffers go on the user's devices, and what each
device then holds (measured by llama.cpp's dry load on the devices present, estimated for others)."""
