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
from ggufcarve.llama.devices import Compute
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
    finished = launch.run(
        [sys.executable, "-c", ALLOCATING_CHILD, str(path), str(n_ctx), kv], on_line=lines.append, timeout=300
    )
    assert finished.ok, "\n".join(finished.tail)
    text = "\n".join(lines)

    def figure(pattern: str) -> float:
        found = [float(m) for m in re.findall(pattern, text)]
        assert len(found) == 1, (pattern, lines[-30:])
        return found[0]

    return {
        "weights": figure(r"CPU_Mapped model buffer size = +([\d.]+) MiB"),
        "cache": figure(r"llama_kv_cache: size = +([\d.]+) MiB"),
        "compute": figure(r"CPU compute buffer size = +([\d.]+) MiB"),
        "output": figure(r"CPU +output buffer size = +([\d.]+) MiB"),
    }


def fit_params(tools: Path, path: Path, n_ctx: int, kv: str) -> tuple[int, int, int]:
    """llama-fit-params --fit-print on: the host's model, context and compute MiB (whole MiB, rounded down)."""
    proc = subprocess.run(
        [
            str(tools / "llama-fit-params"),
            "-m",
            str(path),
            "-c",
            str(n_ctx),
            "-ctk",
            kv,
            "-ctv",
            kv,
            "--fit-print",
            "on",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=launch.child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    host = [line.split() for line in proc.stdout.splitlines() if line.startswith("Host ")]
    assert len(host) == 1, proc.stdout
    return int(host[0][1]), int(host[0][2]), int(host[0][3])


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory) -> Path:
    import factory

    return factory.write_model(
        tmp_path_factory.mktemp("memory") / "qwen3moe-256x8.gguf",
        "qwen3moe",
        dtype="Q8_0",
        n_expert=256,
        n_expert_used=8,
        n_layer=2,
        n_embd=256,
        n_ff_exp=64,
    )


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
    args = [
        "fit",
        DEMO_MODEL,
        "--memory",
        "100MiB",
        "--ctx",
        "32768",
        "--keep",
        "16",
        "--only",
        "Q8_0",
        "--quantizer",
        "libllama",
        "--json",
    ]
    measured = ggufcarve(*args)
    assert measured.code == 0, measured.stderr
    row = json.loads(measured.stdout)["rows"][0]
    assert row["file_bytes"] + row["cache_bytes"] <= 100 * MIB < row["total_bytes"] and not row["fits"]
    memory = row["memory"][0]
    assert memory["compute"] > row["file_bytes"] and memory["total"] == row["total_bytes"]
    plain = json.loads(ggufcarve(*args, "--file-and-cache").stdout)["rows"][0]
    assert plain["fits"] and "memory" not in plain


@pytest.fixture(scope="module")
def twelve_blocks(tmp_path_factory) -> Path:
    import factory

    return factory.write_model(
        tmp_path_factory.mktemp("memory") / "qwen3moe-16x12.gguf",
        "qwen3moe",
        dtype="Q8_0",
        n_expert=16,
        n_expert_used=4,
        n_layer=12,
        n_embd=64,
        n_ff_exp=32,
    )


@pytest.mark.parametrize("n_cpu_moe", [1, 2, 11, 12])
def test_the_n_cpu_moe_pattern_moves_what_llama_cpp_moves(twelve_blocks, n_cpu_moe):
    """The -ot pattern of --n-cpu-moe N, handed to llama.cpp's loader, moves exactly the routed
    experts of blocks 0..N-1 (the loader logs each tensor an override places)."""
    from gguf import GGUFReader

    from ggufcarve.llama.memory import dry_load
    from ggufcarve.placement.offload import override_regex, weight_placement

    load = dry_load(
        twelve_blocks, MemorySettings(512, compute=Compute(gpu_layers=99), cpu_tensors=(override_regex(n_cpu_moe),))
    )
    reader = GGUFReader(twelve_blocks)
    expected = {}
    for t in reader.tensors:
        match = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", t.name)
        if match and int(match[1]) < n_cpu_moe:
            expected[t.name] = int(t.n_bytes)
    assert load.overridden == dict.fromkeys(expected, "CPU")
    from ggufcarve.gguf.container import read_model

    assert sum(weight_placement(read_model(twelve_blocks)).expert_bytes[:n_cpu_moe]) == sum(expected.values())


def test_on_a_cpu_llama_cpp_the_gpu_split_is_marked_estimated():
    """No GPU backend here: fit's two devices carry llama.cpp's measured cache and CPU graph, the
    compute figures marked estimated; the weights of the two add up to the loaded tensors."""
    from gguf import GGUFReader

    result = ggufcarve(
        "fit",
        DEMO_MODEL,
        "--memory",
        "1GiB",
        "--ctx",
        "4096",
        "--keep",
        "16",
        "--only",
        "Q8_0",
        "--quantizer",
        "libllama",
        "--gpu-memory",
        "2GiB",
        "--json",
    )
    assert result.code == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert row["tier"] == "gpu" and row["tiers"] == ["gpu", "gpu+cpu", "ram", "disk"]
    gpu, host = row["memory"]
    assert (gpu["device"], host["device"]) == ("gpu", "host")
    assert gpu["estimated"] == host["estimated"] == ["compute"]
    cpu_run = measure_memory(Path(DEMO_MODEL), MemorySettings(4096))
    assert gpu["cache"] == cpu_run.cache and host["cache"] == 0
    assert gpu["compute"] == host["compute"] == cpu_run.compute  # whole: nothing copied from system memory
    assert host["output"] == cpu_run.output and gpu["output"] == 0
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(DEMO_MODEL).tensors}
    # a file without output.weight has its output read from token_embd, loaded again on the output layer's device
    loaded = sum(tensors.values()) + (tensors["token_embd.weight"] if "output.weight" not in tensors else 0)
    assert abs(gpu["weights"] + host["weights"] - loaded) <= 32 * len(tensors)  # each tensor padded to the alignment
    assert row["gpu"]["compute_bytes"] == gpu["compute"] and row["fits"]


def test_the_gpu_compute_buffer_moves_the_answer_to_n_cpu_moe():
    """A GPU that holds weights + cache + margin but not the compute buffers too: with the
    buffers counted the rung runs with experts in system memory, not whole."""
    whole = json.loads(
        ggufcarve(
            "fit",
            DEMO_MODEL,
            "--memory",
            "1GiB",
            "--ctx",
            "4096",
            "--keep",
            "16",
            "--only",
            "Q8_0",
            "--quantizer",
            "libllama",
            "--gpu-memory",
            "2GiB",
            "--gpu-margin",
            "0B",
            "--json",
        ).stdout
    )["rows"][0]
    gpu = whole["memory"][0]
    budget = gpu["weights"] + gpu["cache"] + gpu["compute"] // 2
    row = json.loads(
        ggufcarve(
            "fit",
            DEMO_MODEL,
            "--memory",
            "1GiB",
            "--ctx",
            "4096",
            "--keep",
            "16",
            "--only",
            "Q8_0",
            "--quantizer",
            "libllama",
            "--gpu-memory",
            f"{budget}B",
            "--gpu-margin",
            "0B",
            "--json",
        ).stdout
    )["rows"][0]
    assert row["gpu"]["n_cpu_moe"] != 0 and row["tier"] in ("gpu+cpu", "ram")
    plain = json.loads(
        ggufcarve(
            "fit",
            DEMO_MODEL,
            "--memory",
            "1GiB",
            "--ctx",
            "4096",
            "--keep",
            "16",
            "--only",
            "Q8_0",
            "--quantizer",
            "libllama",
            "--gpu-memory",
            f"{budget}B",
            "--gpu-margin",
            "0B",
            "--file-and-cache",
            "--json",
        ).stdout
    )["rows"][0]
    assert plain["gpu"]["fits_whole"]  # file + cache alone would say whole


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tier", "gpu"], "--gpu-memory"),
        (["--tier", "fast"], "not one of gpu, gpu+cpu, ram, disk"),
    ],
)
def test_best_refuses_a_tier_it_cannot_rank_in(tmp_path, args, message):
    from ggufcarve.demo import CALIBRATION, HELDOUT

    result = ggufcarve(
        "best",
        DEMO_MODEL,
        "--memory",
        "1GiB",
        "--heldout",
        HELDOUT,
        "--calibration",
        CALIBRATION,
        "-o",
        str(tmp_path / "best"),
        *args,
    )
    assert result.code != 0 and message in result.stderr, result.stderr
    assert not (tmp_path / "best").exists()


def test_eval_reports_the_memory_llama_cpp_allocates(tmp_path):
    """eval's report: the memory of the model run as it was evaluated, equal to an allocating load's log."""
    from ggufcarve.demo import HELDOUT

    result = ggufcarve(
        "eval",
        DEMO_MODEL,
        "--reference",
        DEMO_MODEL,
        "--heldout",
        HELDOUT,
        "--ctx",
        "512",
        "--chunks",
        "2",
        "--speed-runs",
        "0",
        "-o",
        str(tmp_path / "eval"),
        "--quiet",
    )
    assert result.code == 0, result.stderr
    reports = [
        json.loads(p.read_text()) for p in (tmp_path / "eval").glob("*.json") if json.loads(p.read_text()).get("memory")
    ]
    assert reports, sorted(p.name for p in (tmp_path / "eval").iterdir())
    (memory,) = reports[0]["memory"]
    real = allocated(Path(DEMO_MODEL), 512, "f16")
    for key in ("weights", "cache", "compute", "output"):
        assert abs(memory[key] / MIB - real[key]) <= 0.01, (key, memory, real)
    assert reports[0]["memory_settings"]["n_ctx"] == 512


def test_best_ranks_in_the_fastest_tier_any_candidate_runs_in(tmp_path):
    """With a GPU that holds the demo's small rungs whole, the dry run ranks in tier gpu: every
    candidate runs there, its memory split into the GPU's and the host's; --tier ram ranks in
    system memory."""
    from ggufcarve.demo import CALIBRATION, HELDOUT

    common = [
        DEMO_MODEL,
        "--memory",
        "64MiB",
        "--ctx",
        "256",
        "--heldout",
        HELDOUT,
        "--calibration",
        CALIBRATION,
        "-o",
        str(tmp_path / "best"),
        "--dry-run",
        "--json",
        "--gpu-memory",
        f"{2**30 + 12 * MIB}B",
    ]
    fastest = json.loads(ggufcarve("best", *common).stdout)
    assert fastest["tier"] == "gpu" and fastest["candidates"]
    for c in fastest["candidates"]:
        assert c["tiers"][0] == "gpu" and c["fits"], c
        gpu, host = c["memory"]
        assert gpu["total"] + 2**30 <= 2**30 + 12 * MIB and host["total"] <= 64 * MIB
    ram = json.loads(ggufcarve("best", *common, "--tier", "ram").stdout)
    assert ram["tier"] == "ram"
    assert max(c["file_bytes"] for c in ram["candidates"]) > max(
        c["file_bytes"] for c in fastest["candidates"]
    )  # Q8_0 K=16 runs in ram, not whole on the GPU
    assert all("ram" in c["tiers"] for c in ram["candidates"])
