"""Importance matrices in llama.cpp's GGUF and legacy .dat formats: reading and writing, conversion, the check
against a model, and the remap to kept experts."""
