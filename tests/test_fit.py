"""ggufcarve fit: rung sizes judged by the files the ladder writes, cache sizes judged by what
llama.cpp allocates when it loads the model, K lists by the pruner's own rules."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import factory
import pytest
from clirun import ggufcarve

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.llama import launch
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.placement.kvcache import ContextSettings, context_memory
from ggufcarve.quant.fit import listed_kept_counts, parse_kept_counts, plan_fit
from ggufcarve.quant.quantizer import BinaryQuantizer
from ggufcarve.quant.spec import DEFAULT_LADDER, load_spec
from ggufcarve.settings import parse_memory

# ---------------------------------------------------------------------------------------------
# memory sizes and K lists


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * 2**30),
        ("24GB", 24 * 10**9),
        ("24000MiB", 24000 * 2**20),
        ("24 gib", 24 * 2**30),
        ("23.5G", int(23.5 * 2**30)),
        ("1073741824B", 2**30),
        ("512MB", 512 * 10**6),
        ("2TiB", 2 * 2**40),
    ],
)
def test_memory_sizes_parse(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "24GiBs", "-3GB", "24 XB", "GiB", "1e9"])
def test_nonsense_memory_is_refused(text):
    with pytest.raises(BadInput, match="is not a memory size"):
        parse_memory(text)


@pytest.mark.parametrize("text", ["0GiB", "0", "0.0MB"])
def test_a_zero_budget_is_refused_with_a_positive_example(text):
    with pytest.raises(BadInput, match="a budget of nothing") as refused:
        parse_memory(text)
    assert "24GiB" in refused.value.hint and "0GiB" not in refused.value.hint
    if text != "0":  # a bare number has no unit, zero or not
        assert parse_memory(text, allow_zero=True) == 0


@pytest.mark.parametrize("text", ["24", "1073741824", "23.5"])
def test_a_memory_size_without_a_unit_is_refused_with_a_hint(text):
    with pytest.raises(BadInput, match="has no unit") as refused:
        parse_memory(text)
    assert f"{text}GiB" in refused.value.hint


def test_kept_counts_follow_the_pruners_rules(tmp_path, make_model):
    replica = read_model(factory.write_qwen35moe_replica(tmp_path / "replica.gguf"))
    assert listed_kept_counts(inspect_layout(replica)) == [8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    # 8 experts, top-2: every count from top-k up
    assert listed_kept_counts(inspect_layout(read_model(make_model("qwen3moe")))) == [2, 3, 4, 5, 6, 7, 8]
    # 16 experts in 4 groups, 2 groups used, top-4: multiples of 4, >= 2 per group, 2 x per group >= 4
    grouped = inspect_layout(read_model(make_model("deepseek2")))
    assert listed_kept_counts(grouped) == [8, 12, 16]
    assert parse_kept_counts("8,16", grouped) == [8, 16]
    with pytest.raises(BadInput, match="not a multiple of the 4 expert groups"):
        parse_kept_counts("10", grouped)
    with pytest.raises(BadInput, match="per group"):
        parse_kept_counts("4", grouped)
    layout = inspect_layout(replica)
    assert parse_kept_counts("96-128/16,200", layout) == [96, 112, 128, 200]
    with pytest.raises(BadInput, match="below the 8 experts"):
        parse_kept_counts("4", layout)


# ---------------------------------------------------------------------------------------------
# the cache, against llama.cpp's own allocation

CONTEXT_CHILD = """
import sys
import llama_cpp
from ggufcarve.llama.libllama import forward_warnings, load_model
path, n_ctx, cache_type, flash_attn, swa_full, n_seq = sys.argv[1:7]
forward_warnings(llama_cpp, verbose=True)
model = load_model(llama_cpp, path)
params = llama_cpp.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = int(n_ctx), 512, 512, int(n_seq)
params.type_k = params.type_v = {"F16": llama_cpp.GGML_TYPE_F16, "Q8_0": llama_cpp.GGML_TYPE_Q8_0}[cache_type]
params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn == "1" else \
llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
params.swa_full = swa_full == "1"
sys.exit(0 if llama_cpp.llama_init_from_model(model, params) else 3)
"""
# llama_kv_cache / llama_memory_recurrent: "size = %7.2f MiB (...)", one line per cache
CACHE_SIZE = re.compile(r"^(?P<cache>llama_kv_cache|llama_memory_recurrent): size =\s*(?P<mib>[\d.]+) MiB")


def llama_cache_mib(path: Path, settings: ContextSettings) -> list[tuple[str, float]]:
    lines: list[str] = []
    argv = [
        sys.executable,
        "-c",
        CONTEXT_CHILD,
        path,
        *map(str, (settings.n_ctx, settings.type_k, int(settings.flash_attn), int(settings.swa_full), settings.n_seq)),
    ]
    finished = launch.run(argv, on_line=lines.append, timeout=120)
    assert finished.ok, "\n".join(finished.tail)
    return [(m["cache"], float(m["mib"])) for line in lines if (m := CACHE_SIZE.match(line))]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, settings, caches",
    [
        ("qwen3moe", ContextSettings(4096), ["llama_kv_cache"]),
        ("qwen3moe", ContextSettings(3000, "Q8_0", "Q8_0", n_seq=2), ["llama_kv_cache"]),
        # hybrid with an MTP block: KV on the full-attention block only, recurrent state per sequence
        ("qwen35moe", ContextSettings(2048, "Q8_0", "Q8_0", n_seq=16), ["llama_kv_cache", "llama_memory_recurrent"]),
        ("qwen35moe", ContextSettings(8192, flash_attn=False), ["llama_kv_cache", "llama_memory_recurrent"]),
        ("deepseek2", ContextSettings(4096), ["llama_kv_cache"]),  # MLA: K only
        ("deepseek2", ContextSettings(5000, "Q8_0", "Q8_0"), ["llama_kv_cache"]),
        ("gpt-oss", ContextSettings(4096), ["llama_kv_cache", "llama_kv_cache"]),  # iSWA: full cache, then the window's
        ("gpt-oss", ContextSettings(4096, n_seq=4, swa_full=True), ["llama_kv_cache", "llama_kv_cache"]),
    ],
)
def test_cache_matches_what_llama_cpp_allocates(make_model, arch, settings, caches):
    model = make_model(arch)
    reported = llama_cache_mib(model, settings)
    assert [name for name, _ in reported] == caches
    llama_mib = sum(mib for _, mib in reported)
    estimate = context_memory(read_model(model).get, settings)
    ours = estimate.total_bytes / 2**20
    assert estimate.exact
    # llama.cpp prints MiB with two decimals: allow that rounding on top of 2%
    assert abs(ours - llama_mib) <= 0.02 * llama_mib + 0.005 * len(reported), (ours, reported)
    assert llama_mib > 0.3  # large enough for the printed digits to judge


def test_cache_layers_of_the_replica(tmp_path):
    """Qwen3.6-35B-A3B: 10 full-attention blocks of 2 KV heads x 256, 30 gated-delta-net blocks,
    the MTP block without cache."""
    memory = context_memory(
        read_model(factory.write_qwen35moe_replica(tmp_path / "r.gguf")).get, ContextSettings(16384)
    )
    kinds = [layer.kind for layer in memory.layers]
    assert kinds.count("attention") == 10 and kinds.count("recurrent") == 30 and len(kinds) == 40
    assert memory.kv_bytes == 10 * 2 * (2 * 256 * 2) * 16384  # layers x (K + V) x f16 row x cells
    # conv (4 - 1) x (4096 + 2 x 16 x 128) + state 128 x 4096 floats per block
    assert memory.recurrent_bytes == 30 * 4 * (3 * (4096 + 2 * 16 * 128) + 128 * 4096)
    assert any("MTP" in note for note in memory.notes)


# ---------------------------------------------------------------------------------------------
# rung sizes, against the ladder's files


def _ladder_sizes(source: Path, imatrix: Path, out: Path, bin_dir: Path, rungs: str) -> dict[str, int]:
    result = ggufcarve(
        "ladder",
        "run",
        DEFAULT_LADDER,
        "--source",
        source,
        "--imatrix",
        imatrix,
        "-o",
        out,
        "--only",
        rungs,
        "--quantizer",
        bin_dir / "llama-quantize",
        "-t",
        "2",
        "-q",
    )
    assert result.code == 0, result.stderr[-3000:]
    manifest = json.loads((out / "quant-manifest.json").read_text())
    return {r["name"]: r["bytes"] for r in manifest["rungs"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, kept, rungs",
    [
        ("qwen3moe", 4, "Q8_0,Q6_K,Q4_K_M,Q2_K,IQ1_S"),
        ("qwen35moe", 4, "Q5_K_M,Q3_K_M,IQ2_XS,IQ1_M"),  # with an MTP block
    ],
)
def test_predicted_sizes_match_the_ladders_files(make_model, llama_tools, tmp_path, arch, kept, rungs):
    """Prune for real, collect the pruned model's imatrix with llama-imatrix, run the default
    ladder's rungs (all nine between the two cases): every rung's file is within 1% of fit's
    prediction, in practice within the few bytes of the quantize.imatrix.* keys (qwen35moe: the
    MTP block gets the fallback type in the IQ rungs, in both)."""
    from conftest import make_imatrix

    source = make_model(arch, dtype="Q8_0", n_embd=256, n_ff_exp=256)
    pruned = tmp_path / f"{arch}-pruned-Q8_0.gguf"
    assert ggufcarve("prune", source, "--keep-first", kept, "-o", pruned, "-q").code == 0
    imatrix = make_imatrix(llama_tools, pruned, tmp_path)
    built = _ladder_sizes(pruned, imatrix, tmp_path / "release", llama_tools, rungs)

    model = read_model(source)
    report = plan_fit(
        model,
        inspect_layout(model),
        load_spec(DEFAULT_LADDER),
        memory=parse_memory("1GiB"),
        context=ContextSettings(4096),
        quantizer=BinaryQuantizer(llama_tools / "llama-quantize"),
        kept_counts=[kept],
        only=[rungs],
    )
    assert list(built) == rungs.split(",")
    for name, size in built.items():
        predicted = report.row(kept, name).rung.bytes
        assert abs(predicted - size) <= 0.01 * size, (name, predicted, size)
        assert abs(predicted - size) < 512, (name, predicted, size)  # the imatrix keys' bytes at most
    fallback = {r.rung.rung for r in report.rows if r.rung.fallback}
    assert fallback == ({"IQ2_XS", "IQ1_M"} if arch == "qwen35moe" else set())


@pytest.mark.slow
def test_reference_release_q8_0_sizes(tmp_path, llama_tools):
    """The reference release: Qwen3.6-35B-A3B Q8_0, 34.369 GiB with 256 experts, 18.392 GiB with
    128. A header-only replica of that layout (without the MTP block, which those sizes leave out)
    gives the Q8_0 row within 0.1%."""
    model = read_model(factory.write_qwen35moe_replica(tmp_path / "replica.gguf", mtp=False))
    report = plan_fit(
        model,
        inspect_layout(model),
        load_spec(DEFAULT_LADDER),
        memory=parse_memory("24GiB"),
        context=ContextSettings(16384),
        quantizer=BinaryQuantizer(llama_tools / "llama-quantize"),
        kept_counts=[128, 256],
        only=["Q8_0"],
    )
    for kept, gib in ((256, 34.369), (128, 18.392)):
        assert abs(report.row(kept, "Q8_0").rung.bytes / 2**30 - gib) <= 0.001 * gib
    assert not report.row(256, "Q8_0").fits and report.row(128, "Q8_0").fits


# ---------------------------------------------------------------------------------------------
# command line


@pytest.mark.slow
def test_cli_json_and_table(make_model, llama_tools):
    model = make_model("qwen35moe", dtype="Q8_0", n_embd=256, n_ff_exp=256)
    quantizer = llama_tools / "llama-quantize"
    result = ggufcarve(
        "fit",
        model,
        "--memory",
        "8MiB",
        "--ctx",
        "4096",
        "--kv-type",
        "q8_0",
        "--k",
        "4,8",
        "--only",
        "Q8_0,Q4_K_M",
        "--quantizer",
        quantizer,
        "--json",
    )
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["kind"] == "fit" and doc["schema_version"] == 2 and doc["inputs"][0]["name"] == model.name
    assert doc["parameters"]["memory_bytes"] == 8 * 2**20 and doc["parameters"]["kv_type"] == "q8_0"
    assert [(r["kept"], r["rung"]) for r in doc["rows"]] == [(4, "Q8_0"), (4, "Q4_K_M"), (8, "Q8_0"), (8, "Q4_K_M")]
    for row in doc["rows"]:  # llama.cpp's dry load: the rung's weights, the K's cache, compute and output buffers
        memory = row["memory"][0]
        assert (
            row["total_bytes"]
            == memory["total"]
            == memory["weights"] + memory["cache"] + memory["compute"] + memory["output"]
        )
        # llama.cpp logs the KV and the recurrent state in MiB to two decimals: equal to the exact cache within that
        assert (
            memory["weights"] <= row["file_bytes"]
            and abs(memory["cache"] - row["cache_bytes"]) <= 0.01 * 2**20
            and memory["compute"] > 0
        )
        assert row["fits"] == (row["total_bytes"] <= 8 * 2**20)
    assert doc["cache"]["recurrent_blocks"] == [0] and doc["cache"]["attention_blocks"] == [1]
    assert doc["sizes_from"]["quantizer"]["backend"] == "binary"
    assert str(Path(model).parent) not in result.stdout  # no local directories
    # at the default 16k context llama.cpp's compute buffers alone take 26 MiB of this model's total
    table = ggufcarve(
        "fit", model, "--memory", "40MiB", "--k", "4,8", "--only", "Q8_0,Q4_K_M", "--quantizer", quantizer, "-q"
    )
    assert table.code == 0, table.stderr
    assert (
        "Q4_K_M" in table.stdout
        and "most experts that fit" in table.stdout
        and "binary quantizer dry run" in table.stdout
    )
    # a model of a few MiB is sized in MiB, every cell with three significant digits (none reads 0.00)
    assert (
        "MiB of the rung file" in " ".join(table.stdout.split()) and "GiB" not in table.stdout
    )  # the caption wraps at the table's width
    for row in doc["rows"]:
        assert f"{row['file_bytes'] / 2**20:.2f}" in table.stdout and row["file_bytes"] >= 2**20 / 100


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory", "plenty"], "is not a memory size"),
        (["--memory", "24GiB", "--kv-type", "q4_k"], "--kv-type must be one of f16, q8_0"),
        (["--memory", "24GiB", "--k", "1"], "below the 2 experts"),
        (["--memory", "24GiB", "--k", "x"], "must be a count (8), a list of counts"),
        (["--memory", "24GiB", "--keep", "8-4"], "is an empty range"),
        (["--memory", "24GiB", "--keep", "8", "--k", "8"], "--keep and --k name the same thing"),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line(make_model, args, message):
    result = ggufcarve("fit", make_model("qwen3moe"), *args)
    assert result.code == 1 and message in result.error_line and "hint:" in result.error_line, result.stderr
    assert "Traceback" not in result.stderr


def test_keep_takes_a_keep_set_file_and_sizes_its_count(make_model, tmp_path):
    """--keep FILE sizes the K the file keeps (its ids per block), as --keep K does."""
    model = make_model("qwen3moe")
    keepset = tmp_path / "kept_expert_indices.json"
    from gguf import GGUFReader

    reader = GGUFReader(model)
    blocks = int(next(f.parts[f.data[0]][0] for name, f in reader.fields.items() if name.endswith(".block_count")))
    keepset.write_text(json.dumps({str(b): [0, 2, 4, 6] for b in range(blocks)}))
    by_file = ggufcarve(
        "fit", model, "--memory", "1GiB", "--keep", keepset, "--only", "Q8_0", "--quantizer", "libllama", "--json"
    )
    by_count = ggufcarve(
        "fit", model, "--memory", "1GiB", "--keep", "4", "--only", "Q8_0", "--quantizer", "libllama", "--json"
    )
    assert by_file.code == 0 and by_count.code == 0, by_file.stderr + by_count.stderr
    assert [r["kept"] for r in json.loads(by_file.stdout)["rows"]] == [4]
    assert json.loads(by_file.stdout)["rows"][0]["file_bytes"] == json.loads(by_count.stdout)["rows"][0]["file_bytes"]


@pytest.mark.slow
def test_measure_speed_times_each_fitting_row_in_its_placement_on_the_rungs_types(
    make_model, llama_tools, rpc_servers, tmp_path
):
    """fit --measure-speed: every row that fits gets llama-bench's decode and prompt tok/s, on the CPU for a
    RAM budget and with every layer on the RPC device for a GPU budget; the file timed has the tensor names,
    types and shapes of the rung llama-quantize really writes (the oracle), and its size."""
    from ggufcarve.quant.fit import sparse_rung_file

    model = make_model("qwen3moe", dtype="Q8_0", n_embd=256, n_ff_exp=256)
    quantizer = llama_tools / "llama-quantize"
    common = ("fit", model, "--k", "4", "--only", "Q8_0,Q4_K_M", "--quantizer", quantizer, "--measure-speed", "--json")
    on_cpu = ggufcarve(*common, "--memory", "8GiB", "-t", "2", "--llama-cpp", llama_tools)
    assert on_cpu.code == 0, on_cpu.stderr
    rows = json.loads(on_cpu.stdout)["rows"]
    assert all(r["fits"] and r["decode_tok_s"] > 0 and r["prompt_tok_s"] > 0 for r in rows)
    assert {r["speed_placement"]["label"] for r in rows} == {"CPU"}
    on_gpu = ggufcarve(
        *common, "--memory", "8GiB", "--gpu-memory", "2GiB", "--rpc", rpc_servers[0], "--llama-cpp", llama_tools
    )
    assert on_gpu.code == 0, on_gpu.stderr
    for row in json.loads(on_gpu.stdout)["rows"]:
        assert row["tier"] == "gpu" and row["decode_tok_s"] > 0
        assert row["speed_placement"]["gpu_layers"] == 999 and row["speed_placement"]["label"] == "whole"

    pruned = tmp_path / "pruned.gguf"
    assert ggufcarve("prune", model, "--keep-first", 4, "-o", pruned, "-q").code == 0
    real = factory.quantize_with_llama(pruned, tmp_path / "real-Q4_K_M.gguf", "Q4_K_M", allow_requantize=True)
    source = read_model(model)
    report = plan_fit(
        source,
        inspect_layout(source),
        load_spec(DEFAULT_LADDER),
        memory=parse_memory("8GiB"),
        context=ContextSettings(4096),
        quantizer=BinaryQuantizer(quantizer),
        kept_counts=[4],
        only=["Q4_K_M"],
    )
    timed = sparse_rung_file(source, inspect_layout(source), report.row(4, "Q4_K_M"), tmp_path)
    shape = {t.name: (t.type_id, tuple(t.shape)) for t in read_model(real).tensors}
    assert {t.name: (t.type_id, tuple(t.shape)) for t in read_model(timed).tensors} == shape
    assert abs(timed.stat().st_size - real.stat().st_size) < 512  # llama-quantize's own keys at most


def _demo_q8_report(llama_tools, gpu_memory: int, measure):
    """fit's report for the demo model's Q8_0 (K=16, every expert) at ctx 512 and 8 GiB of system
    memory on a GPU of `gpu_memory` bytes, measured with `measure` (llama.memory.MemorySettings)."""
    from ggufcarve.demo import DEMO_MODEL

    source = read_model(DEMO_MODEL)
    return plan_fit(
        source,
        inspect_layout(source),
        load_spec(DEFAULT_LADDER),
        memory=parse_memory("8GiB"),
        context=ContextSettings(512),
        quantizer=BinaryQuantizer(llama_tools / "llama-quantize"),
        kept_counts=[16],
        only=["Q8_0"],
        gpu_memory=gpu_memory,
        measure=measure,
    )


def _bench_with_last_runs(last_runs, asked=None):
    """A stand-in for llama-bench: decode runs of 10, 11, 12 tok/s, `last_runs` for the last-N -ot
    variant; each call's flags appended to `asked`."""
    from ggufcarve.evaluate.speed import Speed

    def bench(path, placed, flags):
        if asked is not None:
            asked.append(flags)
        runs = list(last_runs) if "-ot" in flags else [10.0, 11.0, 12.0]
        return Speed(512, 64, 2, 100.0, float(sorted(runs)[1]), [100.0] * 3, runs, "llama-bench")

    return bench


def _demo_row_with_experts_on_the_cpu(llama_tools):
    """fit's report for the demo model's Q8_0 on a 1045 MiB GPU at ctx 512 (its experts of some blocks,
    not all, in system memory) and that row."""
    from ggufcarve.llama.memory import MemorySettings

    report = _demo_q8_report(llama_tools, parse_memory("1045MiB"), MemorySettings(512))
    row = report.row(16, "Q8_0")
    assert row.tier == "gpu+cpu" and 0 < row.offload.n_cpu_moe < 4
    return report, row


@pytest.mark.parametrize("last_runs, chosen", [((20.0, 21.0, 22.0), "last"), ((10.5, 11.0, 11.5), "first")])
def test_measure_speed_takes_the_other_variant_only_when_it_decodes_faster_beyond_noise(llama_tools, last_runs, chosen):
    """A row with the experts of N blocks in system memory is timed as --n-cpu-moe N and as the last N
    blocks' -ot; the variant takes the row's place (placement, llama-server line, speed) only when its
    decode runs are faster beyond noise (a tie keeps the placement found by bytes)."""
    from ggufcarve.llama.devices import Compute
    from ggufcarve.quant.fit import measure_speeds

    report, row = _demo_row_with_experts_on_the_cpu(llama_tools)
    n = row.offload.n_cpu_moe
    asked = []
    bench = _bench_with_last_runs(last_runs, asked)
    timed = measure_speeds(report, bench, Compute(threads=2), on_device=True)
    assert len(asked) == 2 and "-ot" not in asked[0] and "-ot" in asked[1]
    assert asked[0][asked[0].index("-ncmoe") + 1] == str(n) and "-ncmoe" not in asked[1]
    override = asked[1][asked[1].index("-ot") + 1]
    doc = next(r for r in timed.to_json()["rows"] if r["kept"] == 16 and r["rung"] == "Q8_0")
    labels = [p["label"] for p in doc["speed_placements"]]
    assert labels == [f"n-cpu-moe {n}", f"last {n} blocks' experts on the CPU"]
    if chosen == "last":
        assert doc["placement"]["override_tensor"] == override and doc["placement"]["n_cpu_moe"] is None
        assert doc["placement_chosen_by"].startswith("measured speed") and doc["decode_tok_s"] == 21.0
        assert doc["server"][doc["server"].index("-ot") + 1] == override
    else:
        assert doc["placement"]["n_cpu_moe"] == n and "placement_chosen_by" not in doc and doc["decode_tok_s"] == 11.0
        assert "--n-cpu-moe" in doc["server"]


@pytest.mark.slow
def test_measure_speed_times_both_variants_on_the_device_and_the_answer_fits(llama_tools, rpc_servers):
    """fit --measure-speed --gpu-memory on an RPC device: the row with experts in system memory is timed
    by llama-bench in both variants, and the llama-server line of the one chosen, loaded by
    llama-fit-params on the same device, fits the budget with llama.cpp's margin."""
    from ggufcarve.demo import DEMO_MODEL
    from tests.fit_params import fit_params

    result = ggufcarve(
        "fit", DEMO_MODEL, "--ctx", 512, "--k", 16, "--only", "Q8_0", "--memory", "8GiB", "--gpu-memory", "1040MiB",
        "--rpc", rpc_servers[0], "--quantizer", llama_tools / "llama-quantize", "--llama-cpp", llama_tools,
        "--measure-speed", "-t", 2, "--json",
    )  # fmt: skip
    assert result.code == 0, result.stderr[-2000:]
    (row,) = json.loads(result.stdout)["rows"]
    assert row["tier"] == "gpu+cpu" and len(row["speed_placements"]) == 2
    assert all(p["decode_tok_s"] > 0 and p["prompt_tok_s"] > 0 for p in row["speed_placements"])
    speeds = {p["label"]: p["decode_tok_s"] for p in row["speed_placements"]}
    assert row["decode_tok_s"] == speeds[row["placement"]["label"]]
    server = row["server"]
    theirs = fit_params(llama_tools / "llama-fit-params", DEMO_MODEL, server[3:])  # its --rpc and -dev included
    assert sum(theirs["RPC0"]) * 2**20 + 2**30 <= 1040 * 2**20, theirs


@pytest.mark.slow
def test_a_faster_variant_on_a_present_device_carries_its_own_measured_memory(llama_tools, rpc_servers):
    """With the device present (an RPC server), the variant timed faster is loaded by llama.cpp in its
    own placement: the row's memory per device is that load's, and the device's row equals
    llama-fit-params' for the row's llama-server line on the same device, within max(1%, 16 MiB)."""
    from ggufcarve.demo import DEMO_MODEL
    from ggufcarve.llama.devices import Compute
    from ggufcarve.llama.memory import MemorySettings
    from ggufcarve.quant.fit import measure_speeds
    from tests.fit_params import fit_params

    on_rpc = MemorySettings(512, compute=Compute(rpc=(rpc_servers[0],)))
    report = _demo_q8_report(llama_tools, parse_memory("1040MiB"), on_rpc)
    bench = _bench_with_last_runs([20.0, 21.0, 22.0])
    timed = measure_speeds(report, bench, Compute(rpc=on_rpc.compute.rpc, threads=2), True, measure=on_rpc)
    (doc,) = timed.to_json()["rows"]
    assert "placement_chosen_by" in doc, (doc.get("placement_kept_because"), doc["memory"], doc["speed_placement"])
    assert doc["placement_chosen_by"].startswith("measured speed") and doc["placement"]["override_tensor"]
    assert doc["placement_measured"] is True and "placement_kept_because" not in doc
    rows = {m["device"]: m for m in doc["memory"]}
    theirs = fit_params(llama_tools / "llama-fit-params", DEMO_MODEL, doc["server"][3:])
    ours = rows["RPC0"]["total"]
    assert abs(ours - sum(theirs["RPC0"]) * 2**20) <= max(0.01 * ours, 16 * 2**20), (rows, theirs)
    assert ours + 2**30 <= parse_memory("1040MiB")


@pytest.mark.slow
def test_one_present_gpu_gets_the_smallest_n_cpu_moe_llama_fit_params_keeps_within_it(llama_tools, rpc_servers):
    """One --gpu-memory with its device present (an RPC server): fit loads --n-cpu-moe N on it, from
    the estimate's N both ways, and answers with the smallest N whose device total llama-fit-params
    keeps within the budget with llama.cpp's margin, where N - 1 it does not (the estimate without
    the device answers a larger N here, or none: its compute buffers are on the safe side)."""
    from ggufcarve.demo import DEMO_MODEL
    from tests.fit_params import fit_params

    budget = 1038 * 2**20
    common = ("fit", DEMO_MODEL, "--ctx", 512, "--k", 16, "--only", "Q8_0", "--memory", "8GiB")
    tools = ("--gpu-memory", f"{budget}B", "--quantizer", llama_tools / "llama-quantize", "--json")
    present = ggufcarve(*common, *tools, "--rpc", rpc_servers[0], "--llama-cpp", llama_tools)
    absent = ggufcarve(*common, *tools)
    assert present.code == 0 and absent.code == 0, present.stderr[-2000:] + absent.stderr[-2000:]
    (row,) = json.loads(present.stdout)["rows"]
    (estimated,) = json.loads(absent.stdout)["rows"]
    n = row["placement"]["n_cpu_moe"]
    assert row["placement_measured"] is True and not estimated.get("placement_measured")
    assert 0 < n and (estimated["gpu"]["n_cpu_moe"] is None or n < estimated["gpu"]["n_cpu_moe"]), estimated["gpu"]
    assert row["gpu"]["n_cpu_moe"] == n and row["server"][row["server"].index("--n-cpu-moe") + 1] == str(n)

    def device_mib(k: int) -> int:
        args = ["--rpc", rpc_servers[0], "-c", "512", "-ngl", "999", "--n-cpu-moe", str(k)]
        return sum(fit_params(llama_tools / "llama-fit-params", DEMO_MODEL, args)["RPC0"])

    assert device_mib(n) * 2**20 + 2**30 <= budget < (device_mib(n - 1) + 1) * 2**20 + 2**30
    rows = {m["device"]: m for m in row["memory"]}
    assert abs(rows["RPC0"]["total"] - device_mib(n) * 2**20) <= 16 * 2**20


@pytest.mark.slow
def test_a_faster_variant_measured_over_the_budget_is_not_taken(llama_tools, rpc_servers):
    """A budget between what llama.cpp allocates on the device for --n-cpu-moe 3 and for the last
    three blocks' -ot (the estimate calls them equal; the -ot's compute buffer is larger): the -ot
    variant timed faster is measured over the budget, so the row keeps --n-cpu-moe 3, its memory and
    its line, and `placement_kept_because` names the device."""
    from dataclasses import replace

    from ggufcarve.demo import DEMO_MODEL
    from ggufcarve.llama.devices import Compute
    from ggufcarve.llama.memory import MemorySettings, dry_load
    from ggufcarve.placement.memory import device_memory
    from ggufcarve.placement.search import Placement
    from ggufcarve.quant.fit import measure_speeds

    on_rpc = MemorySettings(512, compute=Compute(rpc=(rpc_servers[0],)))
    source = read_model(DEMO_MODEL)
    main = inspect_layout(source).main_layer_count

    def on_device(placement: Placement) -> int:
        run = replace(on_rpc, compute=placement.compute(on_rpc.compute.rpc), cpu_tensors=placement.cpu_tensors(main))
        return next(row.total for row in device_memory(source, dry_load(DEMO_MODEL, run)) if row.device == "RPC0")

    first, last = on_device(Placement(n_cpu_moe=3)), on_device(Placement(n_cpu_moe=3, from_last=True))
    assert first < last, (first, last)  # the window this test needs
    budget = 2**30 + (first + last) // 2
    report = _demo_q8_report(llama_tools, budget, on_rpc)

    bench = _bench_with_last_runs([20.0, 21.0, 22.0])
    timed = measure_speeds(report, bench, Compute(rpc=on_rpc.compute.rpc, threads=2), True, measure=on_rpc)
    (doc,) = timed.to_json()["rows"]
    assert doc["placement"]["n_cpu_moe"] == 3 and not doc["placement"]["override_tensor"], doc["placement"]
    assert "placement_chosen_by" not in doc and "RPC0" in doc["placement_kept_because"], doc
    assert doc["server"][doc["server"].index("--n-cpu-moe") + 1] == "3"
    assert [m["total"] for m in doc["memory"] if m["device"] == "RPC0"] == [first]
    assert doc["decode_tok_s"] == 11.0


def test_gpu_margin_zero_is_accepted_and_counted_on_the_device():
    """--gpu-margin 0 (with or without a unit) leaves nothing free: the demo's Q8_0 (16.2 MB on the GPU
    with its cache) fits 1030 MiB whole, where llama.cpp's 1 GiB margin leaves 6 MiB and sends experts
    to system memory; the margin is in the row's bytes and the report's settings."""
    from ggufcarve.demo import DEMO_MODEL

    rows = {}
    for margin in ("0", "0MiB", "1GiB"):
        result = ggufcarve(
            "fit", DEMO_MODEL, "--memory", "8GiB", "--gpu-memory", "1030MiB", "--gpu-margin", margin, "--ctx", 512,
            "--keep", 16, "--only", "Q8_0", "--file-and-cache", "--json",
        )  # fmt: skip
        assert result.code == 0, result.stderr[-2000:]
        doc = json.loads(result.stdout)
        rows[margin] = (doc["gpu_margin_bytes"], doc["rows"][0]["gpu"])
    for margin, bytes_free in (("0", 0), ("0MiB", 0), ("1GiB", 2**30)):
        recorded, gpu = rows[margin]
        assert recorded == bytes_free == gpu["margin_bytes"]
    assert rows["0"][1]["fits_whole"] and rows["0"][1]["n_cpu_moe"] == 0
    assert not rows["1GiB"][1]["fits_whole"] and rows["1GiB"][1]["n_cpu_moe"] > 0
    assert rows["0"][1]["gpu_bytes"] + 2**30 > 1030 * 2**20 >= rows["0"][1]["gpu_bytes"]
    refused = ggufcarve("fit", DEMO_MODEL, "--memory", "8GiB", "--gpu-memory", "1GiB", "--gpu-margin", "1")
    assert refused.code != 0 and "--gpu-margin '1' has no unit" in refused.stderr, refused.stderr


def test_the_nothing_fits_hint_names_the_flag_fit_takes():
    from ggufcarve.demo import DEMO_MODEL

    result = ggufcarve("fit", DEMO_MODEL, "--memory", "1MiB", "--ctx", 512, "--only", "Q8_0", "--file-and-cache")
    assert result.code == 0, result.stderr[-2000:]
    assert "nothing fits" in result.stdout and "(--keep)" in result.stdout
