"""Memory as llama.cpp allocates it: `ggufcarve fit`'s and `best`'s figures against llama.cpp's own.

Two oracles, both llama.cpp's: `llama-fit-params --fit-print on` (built from the same sdist: the
model, context and compute MiB of the host from its no-alloc dry load, common/fit.cpp), and an
allocating load in libllama whose logged buffer sizes are what it really allocated."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import ggufcarve

from ggufcarve.demo import DEMO_MODEL
from ggufcarve.llama import launch
from ggufcarve.llama.memory import MemorySettings, measure_memory

ALLOCATING_CHILD = """
import sys
import llama_cpp
from ggufcarve.llama.libllama import forward_warnings, load_model
forward_warnings(llama_cpp, verbose=True)
model = load_model(llama_cpp, sys.argv[1])
params = llama_cpp.llama_context_default_params()
params.n_ctx = int(sys.argv[2])
params.type_k = params.type_v = {"f16": 1, "q8_0": 8}[sys.argv[3]]
params.flash_attn_type = -1
params.swa_full = False
sys.exit(0 if llama_cpp.llama_init_from_model(model, params) else 3)
"""
MIB = 2**20


def allocated(path: Path, n_ctx: int, kv: str) -> dict[str, float]:
    """The MiB llama.cpp logs when it really allocates the model and a context."""
    lines: list[str] = []
    finished = launch.run([sys.executable, "-c", ALLOCATING_CHILD, str(path), str(n_ctx), kv], on_line=lines.append, timeout=300)
    assert finished.ok, "\n".join(finished.tail)
    text = "\n".join(lines)

    def figure(pattern: str) -> float:
        found = [float(m) for m in re.findall(pattern, text)]
        assert len(found) == 1, (pattern, lines[-30:])
        return found[0]

    return {"weights": figure(r"CPU_Mapped model buffer size = +([\d.]+) MiB"), "cache": figure(r"llama_kv_cache: size = +([\d.]+) MiB"),
            "compute": figure(r"CPU compute buffer size = +([\d.]+) MiB"), "output": figure(r"CPU +output buffer size = +([\d.]+) MiB")}


def fit_params(tools: Path, path: Path, n_ctx: int, kv: str) -> tuple[int, int, int]:
    """llama-fit-params --fit-print on: the host's model, context and compute MiB (whole MiB, rounded down)."""
    proc = subprocess.run([str(tools / "llama-fit-params"), "-m", str(path), "-c", str(n_ctx), "-ctk", kv, "-ctv", kv, "--fit-print", "on"],
                          capture_output=True, text=True, timeout=300, env=launch.child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    host = [line.split() for line in proc.stdout.splitlines() if line.startswith("Host ")]
    assert len(host) == 1, proc.stdout
    return int(host[0][1]), int(host[0][2]), int(host[0][3])


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory) -> Path:
    import factory

    return factory.write_model(tmp_path_factory.mktemp("memory") / "qwen3moe-256x8.gguf", "qwen3moe", dtype="Q8_0", n_expert=256, n_expert_used=8,
                               n_layer=2, n_embd=256, n_ff_exp=64)


@pytest.mark.slow
@pytest.mark.parametrize("n_ctx", [4096, 32768])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("which", ["demo", "256 experts"])
def test_measured_memory_is_what_llama_cpp_allocates(llama_tools, many_experts, which, n_ctx, kv):
    path = DEMO_MODEL if which == "demo" else many_experts
    got = measure_memory(path, MemorySettings(n_ctx, kv.upper()))
    real = allocated(path, n_ctx, kv)
    # every figure is the allocating load's, to its log's 0.01 MiB
    for key in ("weights", "cache", "compute", "output"):
        assert abs(getattr(got, key) / MIB - real[key]) <= 0.006, (key, getattr(got, key) / MIB, real[key])
    model, context, compute = fit_params(llama_tools, path, n_ctx, kv)
    assert int(got.cache / MIB) == context and int(got.compute / MIB) == compute
    fit_total = (model + context + compute) * MIB
    assert abs(got.total - fit_total) <= max(0.01 * fit_total, 16 * MIB)


@pytest.mark.slow
def test_a_compute_dominated_model_does_not_fit_when_file_and_cache_would(tmp_path):
    """At 32k tokens the demo model's compute buffers (40 MiB) outweigh its file (14.5 MiB): file +
    KV cache (78.5 MiB) is within 100 MiB, llama.cpp's total (118 MiB) is not. fit says it does not fit."""
    args = ["fit", DEMO_MODEL, "--memory", "100MiB", "--ctx", "32768", "--k", "16", "--only", "Q8_0", "--quantizer", "libllama", "--json"]
    measured = ggufcarve(*args)
    assert measured.code == 0, measured.stderr
    row = json.loads(measured.stdout)["rows"][0]
    assert row["file_bytes"] + row["cache_bytes"] <= 100 * MIB < row["total_bytes"] and not row["fits"]
    memory = row["memory"][0]
    assert memory["compute"] > row["file_bytes"] and memory["total"] == row["total_bytes"]
    plain = json.loads(ggufcarve(*args, "--file-and-cache").stdout)["rows"][0]
    assert plain["fits"] and "memory" not in plain
