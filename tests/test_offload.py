"""How to run a rung on a GPU: the --n-cpu-moe / -ot rule judged by llama.cpp's own regex (read
from the sdist's common/common.h, compiled with Python's re, applied with search as the loader's
std::regex_search does) and by the tensor sizes gguf-py reads from rung files llama-quantize wrote."""

from __future__ import annotations

import json
import re

import pytest
from clirun import ggufcarve
from llama_sources import ffn_exps_regexes, offload_oracle

from ggufcarve.gguf.container import read_model
from ggufcarve.llama import launch
from ggufcarve.placement.kvcache import ContextSettings, context_memory
from ggufcarve.placement.offload import (
    block_range_regex,
    file_offload,
    override_regex,
    placement_of,
    plan_offload,
    weight_placement,
)
from ggufcarve.placement.search import ALL_LAYERS


def test_block_ranges_match_exactly_the_first_n_numbers():
    for n in range(1, 1100):
        pattern = re.compile(f"(?:{block_range_regex(n)})")
        assert [i for i in range(2100) if pattern.fullmatch(str(i))] == list(range(n)), n


def test_placement_without_output_loads_the_embedding_on_the_gpu():
    tensors = [
        ("token_embd.weight", 100),
        ("output_norm.weight", 1),
        ("blk.0.ffn_up_exps.weight", 10),
        ("blk.0.ffn_gate_inp.weight", 2),
        ("blk.1.ffn_down_exps.weight", 20),
        ("blk.1.ffn_up_shexp.weight", 3),
        ("blk.2.ffn_up_exps.weight", 1000),
    ]
    placement = placement_of(tensors, block_count=3, nextn_layers=1)
    assert placement.output_from_embedding and placement.gpu_other == 100 + 1 + 2 + 3
    assert placement.expert_bytes == (10, 20) and placement.skipped_bytes == 1000 and placement.input_bytes == 100
    assert plan_offload(placement, gpu_memory=136, cache_bytes=0, margin=0).n_cpu_moe == 0
    assert plan_offload(placement, gpu_memory=135, cache_bytes=0, margin=0).n_cpu_moe == 1
    assert plan_offload(placement, gpu_memory=100 + 106 + 1 + 5, cache_bytes=100, margin=5).n_cpu_moe == 2
    assert plan_offload(placement, gpu_memory=105, cache_bytes=0, margin=0).n_cpu_moe is None


def _quantize(bin_dir, source, out, ftype):
    finished = launch.run([bin_dir / "llama-quantize", source, out, ftype, "2"], timeout=300)
    assert finished.ok, "\n".join(finished.tail)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, n_layer, ftype",
    [
        ("fused", 3, "Q4_K_M"),  # qwen35moe: ffn_gate_up_exps, shared experts, one MTP block
        ("gpt-oss", 3, "Q2_K"),  # per-expert biases
        ("deepseek2", 4, "Q4_K_M"),  # a dense lead block (no experts), shared expert, exp_probs_b
    ],
)
def test_rule_against_real_rung_files(make_model, llama_tools, tmp_path, arch, n_layer, ftype):
    exps, block_format = ffn_exps_regexes()
    rung = _quantize(llama_tools, make_model(arch, n_layer=n_layer), tmp_path / f"{arch}-{ftype}.gguf", ftype)
    main, sizes, gpu, moved = offload_oracle(rung, exps, block_format)
    placement = weight_placement(read_model(rung))
    assert len(placement.expert_bytes) == main
    assert [placement.gpu_weights(n) for n in range(main + 1)] == gpu
    assert all(gpu[n] > gpu[n + 1] for n in range(main) if moved[n + 1] - moved[n])  # every MoE block moves something
    assert any(n.endswith(("gate_up_exps.weight", "exps.bias")) for n in moved[main]) or arch == "deepseek2"
    cache, margin = 4096, 1000
    for n in range(main + 1):
        expected = min(m for m in range(main + 1) if gpu[m] <= gpu[n])
        answer = plan_offload(placement, gpu_memory=gpu[n] + cache + margin, cache_bytes=cache, margin=margin)
        assert answer.n_cpu_moe == expected and answer.gpu_bytes == gpu[expected] + cache + margin
        assert answer.fits_whole == (expected == 0)
        assert answer.cpu_expert_bytes == sum(sizes[t] for t in moved[expected])
        if expected:
            one = re.compile(answer.override.removesuffix("=CPU"))
            assert {t for t in sizes if one.search(t) and t in moved[main]} == moved[expected]
            assert answer.flags == f"--n-cpu-moe {expected}"
        below = plan_offload(placement, gpu_memory=gpu[n] + cache + margin - 1, cache_bytes=cache, margin=margin)
        smaller = [m for m in range(main + 1) if gpu[m] < gpu[n]]
        assert below.n_cpu_moe == (min(smaller) if smaller else None)
    # -ot for N: llama.cpp's N patterns, one by one, match the same tensors as the single pattern
    for n in range(1, main + 1):
        assert {t for t in sizes if re.search(override_regex(n), t)} - {
            t for t in sizes if re.match(r"blk\.(\d+)\.", t) and int(t.split(".")[1]) >= main
        } == moved[n]


@pytest.mark.slow
def test_fit_column_equals_the_rule_on_the_built_file(make_model, llama_tools, tmp_path):
    source = make_model("qwen3moe", n_layer=4)
    rung = _quantize(llama_tools, source, tmp_path / "qwen3moe-Q4_K_M.gguf", "Q4_K_M")
    placement = weight_placement(read_model(rung))
    cache = context_memory(read_model(source).get, ContextSettings(512)).total_bytes
    margin = 2**18
    budget = placement.gpu_weights(2) + cache + margin  # two blocks' experts on the CPU
    result = ggufcarve(
        "fit",
        source,
        "--memory",
        "1GiB",
        "--gpu-memory",
        f"{budget}B",
        "--gpu-margin",
        f"{margin}B",
        "--ctx",
        512,
        "--k",
        8,
        "--only",
        "Q4_K_M",
        "--quantizer",
        llama_tools / "llama-quantize",
        "--json",
        "--file-and-cache",
    )
    assert result.code == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    expected = file_offload(read_model(rung), gpu_memory=budget, context=ContextSettings(512), margin=margin)
    assert expected.n_cpu_moe == 2
    assert row["gpu"] == expected.to_json() and row["cache_bytes"] == cache
    assert (
        0 <= row["file_bytes"] - rung.stat().st_size < 1024
    )  # fit sizes the pruned plan's header, with its provenance keys
    measured = ggufcarve(
        "fit",
        source,
        "--memory",
        "1GiB",
        "--gpu-memory",
        f"{budget}B",
        "--gpu-margin",
        f"{margin}B",
        "--ctx",
        512,
        "--k",
        8,
        "--only",
        "Q4_K_M",
        "--quantizer",
        llama_tools / "llama-quantize",
        "--json",
    )
    counted = json.loads(measured.stdout)["rows"][0]["gpu"]
    assert counted["compute_bytes"] > 0 and (
        counted["n_cpu_moe"] is None or counted["n_cpu_moe"] > 2
    )  # the compute buffers take room too
    table = ggufcarve(
        "fit",
        source,
        "--memory",
        "1GiB",
        "--gpu-memory",
        f"{budget}B",
        "--gpu-margin",
        f"{margin}B",
        "--ctx",
        512,
        "--k",
        8,
        "--only",
        "Q4_K_M",
        "--quantizer",
        llama_tools / "llama-quantize",
        "--file-and-cache",
    )
    assert table.code == 0, table.stderr
    assert "--n-cpu-moe 2 (or -ot 'blk\\.[0-1]\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU')" in table.stdout


def test_a_gpu_backends_buffers_are_the_devices_own():
    """The log lines a llama.cpp with a CUDA backend prints (the format strings of
    src/llama-context.cpp and src/llama-kv-cache.cpp): the GPU's compute buffer is its own figure,
    the pinned host buffers are system memory, nothing is marked estimated."""
    from ggufcarve.llama.memory import DryLoad, parse_log
    from ggufcarve.placement.offload import WeightPlacement, plan_offload, split_devices

    lines = [
        "llama_context:  CUDA_Host  output buffer size =     0.58 MiB",
        "llama_kv_cache: size =  384.00 MiB (  4096 cells,  48 layers, "
        " 1/1 seqs), K (f16):  192.00 MiB, V (f16):  192.00 MiB",
        "sched_reserve:      CUDA0 compute buffer size =  1180.03 MiB",
        "sched_reserve:  CUDA_Host compute buffer size =    24.02 MiB",
    ]
    figures = parse_log(lines)
    mib = 2**20
    load = DryLoad(
        round(figures["cache"] * mib),
        {k: round(v * mib) for k, v in figures["compute"].items()},
        {k: round(v * mib) for k, v in figures["output"].items()},
        ("CUDA0",),
        {},
    )
    assert load.devices == ["host", "CUDA0"]
    placement = WeightPlacement(4 * 2**30, (2**30,) * 4, 2**28, 0, False)
    offload = plan_offload(
        placement, gpu_memory=10 * 2**30, cache_bytes=load.cache, margin=2**30, compute=lambda n: 1180 * mib
    )
    gpu, host = split_devices(placement, offload, load)
    assert (gpu.device, gpu.compute, gpu.cache, gpu.estimated) == ("CUDA0", round(1180.03 * mib), 384 * mib, ())
    assert (host.device, host.compute, host.output, host.estimated) == (
        "host",
        round(24.02 * mib),
        round(0.58 * mib),
        (),
    )
    assert gpu.weights == placement.gpu_weights(offload.n_cpu_moe) and host.weights == placement.input_bytes + sum(
        placement.expert_bytes[: offload.n_cpu_moe]
    )


def test_the_gpu_compute_estimate_grows_by_the_largest_expert_block_on_the_cpu():
    from ggufcarve.placement.offload import WeightPlacement, gpu_compute, plan_offload

    placement = WeightPlacement(100, (10, 40, 20, 30), 5, 0, False)
    compute = gpu_compute(placement, 7)
    assert [compute(n) for n in range(5)] == [7, 17, 47, 47, 47]
    # weights(N) = 100 + experts of blocks N..: 200, 190, 150, 130, 100; + cache 3 + compute(N): 210, 210, 200, 180, 150
    assert plan_offload(placement, gpu_memory=185, cache_bytes=3, compute=compute, margin=0).n_cpu_moe == 3
    assert plan_offload(placement, gpu_memory=185, cache_bytes=3, margin=0).n_cpu_moe == 2  # without the buffers: 153


def test_with_a_gpu_backend_fit_reports_the_buffers_llama_cpp_places(monkeypatch):
    """Wiring: when llama.cpp's dry load names a GPU device, fit loads each row on it (every layer
    offloaded, from the estimate's --n-cpu-moe N) and reports that load's layers, cache and buffers,
    not the estimate."""
    from typer.testing import CliRunner

    from ggufcarve.cli import app
    from ggufcarve.demo import DEMO_MODEL
    from ggufcarve.llama import memory

    mib = 2**20
    placed = []

    def fake(path, settings):
        if settings.compute.gpu_layers == 0:
            return memory.DryLoad(8 * mib, {"CPU": 12 * mib}, {"CPU": mib // 64}, ("CUDA0",), {})
        placed.append((settings.compute.gpu_layers, settings.cpu_tensors))
        return memory.DryLoad(
            8 * mib,
            {"CUDA0": 20 * mib, "CUDA_Host": mib},
            {"CUDA_Host": mib // 64},
            ("CUDA0",),
            {},
            layers=dict.fromkeys(range(64), "CUDA0"),  # every block and the output layer
            offload_devices=(("CUDA0", "NVIDIA GeForce RTX 4090"),),
            cache_by_device={"CUDA0": 8 * mib},
        )

    monkeypatch.setattr(memory, "dry_load", fake)
    result = CliRunner().invoke(
        app,
        [
            "fit",
            str(DEMO_MODEL),
            "--memory",
            "1GiB",
            "--ctx",
            "4096",
            "--k",
            "16",
            "--only",
            "Q8_0",
            "--quantizer",
            "libllama",
            "--gpu-memory",
            "2GiB",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["rows"][0]
    assert placed == [(ALL_LAYERS, ())]  # whole: every layer, no override
    gpu, host = row["memory"]
    assert (gpu["device"], gpu["compute"], "estimated" in gpu) == ("CUDA0", 20 * mib, False)
    assert (host["compute"], host["output"]) == (mib, mib // 64)
    assert row["gpu"]["compute_bytes"] == 20 * mib and row["tier"] == "gpu"


def _layered_rows(per_layer: int, names: list[str], layer_count: int):
    """Each device holds `per_layer` bytes per layer llama.cpp's split rule gives it (the oracle of a
    uniform model); the host none."""
    from ggufcarve.llama.memory import HOST, DeviceMemory
    from ggufcarve.placement.search import assign_layers

    def rows_of(placement):
        assigned = assign_layers(layer_count, placement.gpu_layers, placement.tensor_split, names)
        held = [per_layer * sum(1 for d in assigned.values() if d == name) for name in names]
        return [DeviceMemory(name, bytes_, 0, 0, 0) for name, bytes_ in zip(names, held)] + [
            DeviceMemory(HOST, 0, 0, 0, 0)
        ]

    return rows_of


def test_a_split_moves_whole_layers_from_the_device_over_its_budget():
    """10 layers of 100 bytes by -ts 1,1 put 500 on each device; budgets of 700 and 300 leave B over
    by 200: two layers move to A (-ts 7,3, the only split that fits both), and llama.cpp's split rule
    gives exactly those layer counts."""
    from ggufcarve.llama.memory import HOST
    from ggufcarve.placement.search import PlacedMemory, Placement, assign_layers, relieved

    names, layer_count = ["A", "B"], 9  # 9 blocks and the output layer
    rows_of = _layered_rows(100, names, layer_count)
    start = Placement(tensor_split=(1.0, 1.0))
    placed = PlacedMemory(start, rows_of(start), True, {"A": 700, "B": 300, HOST: 10**9}, 0)
    assert placed.over() == ["B"]
    got = relieved(placed, rows_of, layer_count)
    assert got.fits and got.placement.tensor_split == (7.0, 3.0), got.placement
    layers = list(assign_layers(layer_count, got.placement.gpu_layers, got.placement.tensor_split, names).values())
    assert (layers.count("A"), layers.count("B")) == (7, 3)
    assert got.placement.label() == "whole, split 7:3"


def test_a_split_that_cannot_fit_is_left_as_it_was():
    """Budgets of 500 and 300 hold 8 of the 10 layers: no split fits, the placement comes back over."""
    from ggufcarve.llama.memory import HOST
    from ggufcarve.placement.search import PlacedMemory, Placement, relieved

    names, layer_count = ["A", "B"], 9
    rows_of = _layered_rows(100, names, layer_count)
    start = Placement(tensor_split=(1.0, 1.0))
    placed = PlacedMemory(start, rows_of(start), True, {"A": 500, "B": 300, HOST: 10**9}, 0)
    got = relieved(placed, rows_of, layer_count)
    assert got is placed and not got.fits
