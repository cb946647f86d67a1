"""Quantization ladders: the TOML spec of rungs, the quantizer backends, and the rung-by-rung runner."""
