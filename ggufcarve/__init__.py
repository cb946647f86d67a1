"""ggufcarve: cut routed experts out of Mixture-of-Experts GGUF files, byte for byte."""

__version__ = "0.1.0"
