"""The one builder of placement flags (placement.run_line), the placement's JSON round trip, and where
a child computed (llama.computed) as llama.cpp's loader logs it.

Oracles: llama.cpp's own option spellings (common/arg.cpp, tools/llama-bench/llama-bench.cpp, read from
the sources of the llama-cpp-python sdist where they are on this machine) and llama.cpp's loader lines.
"""

from __future__ import annotations

import pytest

from ggufcarve.llama.computed import Computed, layers_of, recording, stage
from ggufcarve.placement.run_line import RunContext, bench_args, server_argv
from ggufcarve.placement.search import Placement

MAIN = 40


@pytest.mark.parametrize(
    "placement",
    [
        Placement(),
        Placement(gpu_layers=0),
        Placement(n_cpu_moe=3),
        Placement(n_cpu_moe=5, from_last=True),
        Placement(n_cpu_moe=2, tensor_split=(8.0, 10.0)),
        Placement(n_cpu_moe=2, from_last=True, tensor_split=(1.0, 1.0)),
    ],
)
def test_a_placement_reads_back_what_it_wrote(placement):
    assert Placement.from_json(placement.to_json(MAIN)) == placement


def test_the_server_line_names_the_devices_the_layers_and_the_context_it_was_timed_with():
    context = RunContext(n_ctx=16384, kv_type="Q8_0")
    argv = server_argv("m.gguf", Placement(n_cpu_moe=3), MAIN, context, rpc=("127.0.0.1:50052",), devices=("RPC0",))
    assert argv == [
        "llama-server", "-m", "m.gguf", "-c", "16384", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on",
        "--rpc", "127.0.0.1:50052", "-dev", "RPC0", "-ngl", "999", "--n-cpu-moe", "3",
    ]  # fmt: skip
    bench = bench_args(Placement(n_cpu_moe=3), MAIN, context, rpc=("127.0.0.1:50052",), devices=("RPC0",))
    assert bench == [
        "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-d", "8192",
        "--rpc", "127.0.0.1:50052", "-dev", "RPC0", "-ngl", "999", "-ncmoe", "3",
    ]  # fmt: skip


def test_a_split_and_the_last_blocks_experts_in_each_tools_spelling():
    placement = Placement(n_cpu_moe=2, from_last=True, tensor_split=(8.0, 10.0))
    context = RunContext(n_ctx=4096, n_ubatch=256, depth=0)
    argv = server_argv("m.gguf", placement, 4, context, devices=("CUDA0", "CUDA1"))
    assert argv[argv.index("-dev") + 1] == "CUDA0,CUDA1" and argv[argv.index("-ts") + 1] == "8,10"
    assert argv[argv.index("-ot") + 1] == r"blk\.(2|3)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
    assert argv[argv.index("-ub") + 1] == "256" and "--n-cpu-moe" not in argv and "-fa" not in argv
    bench = bench_args(placement, 4, context, devices=("CUDA0", "CUDA1"))
    assert bench[bench.index("-dev") + 1] == "CUDA0/CUDA1" and bench[bench.index("-ts") + 1] == "8/10"
    assert bench[bench.index("-fa") + 1] == "auto" and bench[bench.index("-d") + 1] == "0"


def test_on_the_cpu_the_line_says_so_and_names_no_device():
    argv = server_argv("m.gguf", Placement(gpu_layers=0), MAIN, RunContext(512), rpc=(), devices=())
    assert argv == ["llama-server", "-m", "m.gguf", "-c", "512", "-ngl", "0"]


def test_the_spellings_are_llama_cpps():
    """Every flag the builder writes is one the tools parse (their argument tables in the sources)."""
    from tests.llama_sources import source_text

    arg = source_text("common/arg.cpp")
    bench = source_text("tools/llama-bench/llama-bench.cpp")
    for flag in ("--rpc", "-dev", "-ngl", "-ts", "--n-cpu-moe", "-ot", "-c", "-ctk", "-ctv", "-fa", "-b", "-ub"):
        assert f'"{flag}"' in arg, flag
    for flag in ("-dev", "-ngl", "-ts", "-ncmoe", "-ot", "-ctk", "-ctv", "-fa", "-b", "-ub", "-d", "-v"):
        assert f'"{flag}"' in bench, flag


LOADER = [
    "load_tensors: layer   0 assigned to device CPU, is_swa = 0",
    "load_tensors: layer   1 assigned to device RPC0, is_swa = 0",
    "load_tensors: layer   2 assigned to device RPC0, is_swa = 0",
    "load_tensors: layer   3 assigned to device RPC1, is_swa = 0",
    "load_tensors: layer   4 assigned to device RPC1, is_swa = 0",
]


def test_where_a_child_computed_is_read_from_the_loaders_lines():
    assert layers_of(LOADER) == {"CPU": 1, "RPC0": 2, "RPC1": 2}
    assert layers_of([*LOADER, *(line.replace("RPC1", "RPC0") for line in LOADER)]) == {"CPU": 1, "RPC0": 4}
    assert layers_of(["load_tensors: offloading 4 repeating layers to GPU"]) == {}


def test_children_are_recorded_under_the_stage_they_ran_in():
    from ggufcarve.llama import child

    with recording() as outer:
        with stage("tournament"):
            for text in (
                child.line(child.COMPUTED, child.ComputedOn("measure", {"RPC0": 5})),
                child.line(child.COMPUTED, child.ComputedOn("measure", {"RPC0": 5})),
            ):
                child._Watch(lambda event: None, {}, None)(text)
        child._Watch(lambda event: None, {"decode": "calibration"}, None)(
            child.line(child.COMPUTED, child.ComputedOn("decode", {"CPU": 5}))
        )
    assert outer.to_json() == {
        "calibration": [{"layers": {"CPU": 5}, "children": 1}],
        "tournament": [{"layers": {"RPC0": 5}, "children": 2}],
    }
    assert outer.devices("tournament") == {"RPC0"} and Computed().to_json() == {}


def test_a_stages_placement_in_words_counts_its_layers_and_children():
    from ggufcarve.llama.computed import in_words

    assert in_words([{"layers": {"RPC0": 5}, "children": 1}]) == "RPC0 5/5 layers"
    assert (
        in_words([{"layers": {"CPU": 11, "CUDA0": 30}, "children": 2}])
        == "CPU 11/41 layers + CUDA0 30/41 layers (2 children)"
    )
    assert in_words([]) == in_words(None) == "not recorded"
