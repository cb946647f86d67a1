"""Shared pytest fixtures: tiny GGUF models generated once per session."""

from __future__ import annotations

import pathlib
import sys

import pytest

# tests/ holds helper modules (factory, llama_probe) imported by plain name.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import factory  # noqa: E402


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> pathlib.Path:
    """Session-wide directory for generated model files."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def make_model(models_dir):
    """``make_model(arch, dtype="F16", **write_model_kwargs) -> Path``, written once per session."""
    cache: dict[tuple, pathlib.Path] = {}

    def make(arch: str, dtype: str = "F16", **kwargs) -> pathlib.Path:
        key = (arch, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            suffix = "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
            cache[key] = factory.write_model(models_dir / f"{arch}-{dtype}{suffix}.gguf", arch,
                                             dtype=dtype, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def dense_model(models_dir) -> pathlib.Path:
    return factory.write_dense_model(models_dir / "dense-llama-F16.gguf")
