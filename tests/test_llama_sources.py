"""tests/llama_sources.py fetches the llama-cpp-python sdist into ggufcarve's cache when it is not
there, the way the tool build does, so a first run on a fresh machine reads it instead of skipping."""

from __future__ import annotations

import shutil

import llama_sources

from ggufcarve.llama import build
from ggufcarve.llama.tools import llama_cpp_version


def test_a_missing_sdist_is_fetched_into_the_cache(tmp_path, monkeypatch):
    cached = llama_sources.sdist()  # the one the tool build keeps; copied below instead of downloaded
    monkeypatch.delenv(llama_sources.SDIST_ENV, raising=False)
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    expected = tmp_path / "cache" / "sdist" / build.sdist_name(llama_cpp_version())
    assert not expected.exists()
    calls = []

    def fetch(version, on_event=build.ignore):
        calls.append(version)
        target = build.sdist_path(version)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cached, target)
        return target

    monkeypatch.setattr(build, "fetch_sdist", fetch)
    assert llama_sources.sdist() == expected
    assert calls == [llama_cpp_version()]
    assert "llama-arch.cpp" in llama_sources.sources()
    assert llama_sources.sdist() == expected
    assert calls == [llama_cpp_version()]  # present now: not fetched again
