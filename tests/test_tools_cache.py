"""The tools cache is keyed by the CPU the tools were compiled for; the build's children are bounded.

The CPU is faked with a /proc/cpuinfo-like file; the cache entries hold fake tools (shell scripts)
except in the rebuild test, which compiles a fake llama.cpp source with the real cmake.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
from test_toolchain import fake_sdist, fake_tool

from ggufcarve.errors import ToolFailed, ToolMissing
from ggufcarve.fileio import cache_root
from ggufcarve.llama import build, tools
from ggufcarve.llama.launch import Finished
from ggufcarve.llama.tools import (
    TOOLS,
    cache_dir,
    cache_state,
    cpu_features,
    locate_tool,
    require_tool,
)

AVX2_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx lm "
    "constant_tsc pni ssse3 fma cx16 sse4_1 sse4_2 popcnt f16c avx avx2 bmi1 bmi2 hypervisor"
)
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512bw avx512vl avx512_vnni amx_tile amx_int8"


def cpuinfo(path: Path, flags: str) -> Path:
    path.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: "
        f"{flags}\nbugs\t\t: spectre_v1\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    )
    return path


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Empty cache, no tools on PATH, and a CPU with AVX2 but no AVX-512."""
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGUFCARVE_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(tools, "CPUINFO", cpuinfo(tmp_path / "cpuinfo-avx2", AVX2_FLAGS))
    return tmp_path


def cache_entry(version: str, build_info: dict | None) -> Path:
    """A cache entry with fake tools and the given build-info.json (None: no file)."""
    entry = cache_dir(version)
    for name in TOOLS:
        fake_tool(entry / "bin", name)
    if build_info is not None:
        (entry / "build-info.json").write_text(json.dumps(build_info))
    return entry


def test_cpu_key_is_the_instruction_set_extensions_only(tmp_path):
    avx2 = cpu_features(cpuinfo(tmp_path / "a", AVX2_FLAGS))
    assert {"avx2", "fma", "f16c", "pni", "sse4_2", "bmi2"} <= set(avx2.flags)
    assert not {"hypervisor", "constant_tsc", "fpu", "ht"} & set(avx2.flags)
    noisy = cpu_features(cpuinfo(tmp_path / "b", " ".join(reversed(AVX2_FLAGS.split())) + " arch_perfmon md_clear"))
    assert noisy.key == avx2.key  # order and non-ISA flags do not matter
    avx512 = cpu_features(cpuinfo(tmp_path / "c", AVX512_FLAGS))
    assert avx512.key != avx2.key and {"avx512f", "amx_int8"} <= set(avx512.flags)
    assert avx2.key.startswith(avx2.machine + "-")


def test_entry_built_for_another_cpu_is_not_used(isolated, monkeypatch):
    version = tools.llama_cpp_version()
    avx512 = cpu_features(cpuinfo(isolated / "cpuinfo-avx512", AVX512_FLAGS))
    entry = cache_entry(version, {"llama_cpp_python": version, "cpu": avx512.to_json()})
    assert cache_state(entry) == "other cpu"
    assert locate_tool("llama-quantize") is None
    with pytest.raises(ToolMissing, match="built for another CPU"):
        require_tool("llama-quantize")
    monkeypatch.setattr(tools, "CPUINFO", isolated / "cpuinfo-avx512")  # the machine that built it
    assert locate_tool("llama-quantize") == (entry / "bin" / "llama-quantize", "cache")


def test_entry_without_a_cpu_record_is_adopted_and_kept(isolated):
    """A cache made before the CPU was recorded is this machine's: the record is added, nothing rebuilt."""
    version = tools.llama_cpp_version()
    entry = cache_entry(version, {"llama_cpp_python": version, "sdist": "x.tar.gz"})
    mtime = (entry / "bin" / "llama-quantize").stat().st_mtime_ns
    assert locate_tool("llama-imatrix") == (entry / "bin" / "llama-imatrix", "cache")
    info = json.loads((entry / "build-info.json").read_text())
    assert (
        info["cpu"]["key"] == cpu_features().key
        and info["cpu_recorded"] == "on first use"
        and info["sdist"] == "x.tar.gz"
    )
    events = []
    assert build.build_tools(events.append, version=version, backend="cpu") == entry / "bin"
    assert [e.stage for e in events] == ["cached"] and (entry / "bin" / "llama-quantize").stat().st_mtime_ns == mtime
    assert [p.name for p in entry.iterdir() if p.name.startswith(".")] == []  # no temp file of the record left


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None, reason="needs cmake and a C compiler")
def test_entry_built_for_another_cpu_is_rebuilt(isolated):
    version = "0.0.3-test"
    avx512 = cpu_features(cpuinfo(isolated / "cpuinfo-avx512", AVX512_FLAGS))
    entry = cache_entry(version, {"llama_cpp_python": version, "cpu": avx512.to_json()})
    (cache_root() / "sdist").mkdir(parents=True)
    fake_sdist(cache_root() / "sdist" / build.sdist_name(version), version)
    events = []
    assert build.build_tools(events.append, version=version, backend="cpu") == entry / "bin"
    rebuild = [e for e in events if e.stage == "rebuild"]
    assert rebuild and avx512.key in rebuild[0].message and cpu_features().key in rebuild[0].message
    assert json.loads((entry / "build-info.json").read_text())["cpu"] == cpu_features().to_json()
    assert cache_state(entry) == "ready"
    assert "version: 9.9" in (entry / "bin" / "llama-quantize").read_bytes().decode(
        "latin-1"
    )  # the compiled one, not the script


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_silent_build_step_is_killed_with_its_children(isolated, monkeypatch):
    """cmake (here a script that starts a child and hangs) is stopped by the idle watchdog; its
    whole process group is killed and the error says so."""
    fake_bin = isolated / "fakebin"
    fake_bin.mkdir()
    pid_file = isolated / "child.pid"
    cmake = fake_bin / "cmake"
    cmake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\necho configuring\nsleep 300\n")
    cmake.chmod(cmake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake_bin}:/usr/bin:/bin")
    monkeypatch.setattr(build, "BUILD_IDLE_TIMEOUT", 1.0)
    started = time.monotonic()
    with pytest.raises(ToolFailed, match="printed nothing for too long") as failure:
        build.compile_tools(isolated / "src", isolated / "build", isolated / "bin")
    assert time.monotonic() - started < 60
    assert "configuring" in str(failure.value)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_sdist_download_runs_with_a_timeout_and_an_idle_watchdog(isolated, monkeypatch):
    seen = {}

    def fake_run(argv, **kwargs):
        seen.update(kwargs)
        return Finished(list(argv), -9, 900.0, ["Collecting llama-cpp-python"], timed_out="timeout")

    monkeypatch.setattr(build, "run", fake_run)
    with pytest.raises(ToolFailed, match="timed out after 900 s"):
        build.fetch_sdist("1.2.4")
    assert seen["timeout"] == build.DOWNLOAD_TIMEOUT and seen["idle_timeout"] == build.DOWNLOAD_IDLE_TIMEOUT
    assert not os.listdir(cache_root() / "sdist")
