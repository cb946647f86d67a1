"""`ggufcarve imatrix collect` against llama-imatrix on the same text and --ctx (llama.cpp is the judge).

Counts must be equal. in_sum2 is compared with rtol 1e-6 (a few float32 ulps): both add the same
float32 squares in the same order, so the only freedom left is in the activations themselves,
which come from two builds of ggml (llama-imatrix's, llama-cpp-python's) that may take different
SIMD paths; on one machine with one source they agree bit for bit.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from clirun import ggufcarve, tensor_bytes
from conftest import CALIBRATION_WORDS
from gguf import GGUFReader

from ggufcarve.gguf.container import read_model
from ggufcarve.imatrix.collect import collect_imatrix, squares_in_order
from ggufcarve.llama import launch
from ggufcarve.llama.calibration import Batching
from ggufcarve.llama.devices import Compute
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.quant.quantizer import BinaryQuantizer, QuantizeJob
from ggufcarve.select.calibrate import calibrate


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """~5,400 tokens of the fixtures' byte-level vocabulary, ending in a newline (llama.cpp's -f drops it)."""
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("calibration") / "calibration.txt"
    path.write_text(" ".join(rng.choice(CALIBRATION_WORDS) for _ in range(700)) + "\n")
    return path


def llama_imatrix(bin_dir, model, text, out, *args):
    """llama-imatrix run from the text's directory, so imatrix.datasets holds its bare name as ours does."""
    finished = launch.run(
        [
            bin_dir / "llama-imatrix",
            "-m",
            model,
            "-f",
            text.name,
            "-o",
            out,
            "-t",
            "2",
            "--no-repack",
            "--no-ppl",
            *map(str, args),
        ],
        cwd=text.parent,
        timeout=300,
        tail_lines=40,
    )
    assert finished.ok and out.exists(), "\n".join(finished.tail)
    return out


def tensors(path):
    reader = GGUFReader(path)
    keys = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    return keys, [(t.name, t.tensor_type, tuple(int(n) for n in t.shape), np.array(t.data)) for t in reader.tensors]


def assert_same_imatrix(ours, theirs):
    our_keys, our_tensors = tensors(ours)
    their_keys, their_tensors = tensors(theirs)
    assert our_keys == their_keys
    assert [t[:3] for t in our_tensors] == [t[:3] for t in their_tensors]
    for (name, _, _, mine), (_, _, _, reference) in zip(our_tensors, their_tensors):
        if name.endswith(".counts"):
            np.testing.assert_array_equal(mine, reference, err_msg=name)
        else:
            np.testing.assert_allclose(mine, reference, rtol=1e-6, atol=0, err_msg=name)


def test_squares_are_added_one_row_at_a_time():
    rng = np.random.default_rng(0)
    for width in (1, 2, 15, 16, 17, 64):
        for rows in (1, 9, 17, 300):
            x = (rng.standard_normal((rows, width)) * 10).astype(np.float32)
            start = rng.random(width).astype(np.float32)
            expected = start.copy()
            for row in x:
                expected += row * row
            assert np.array_equal(squares_in_order(x, start), expected), (width, rows)


def test_batching_is_llama_imatrix_defaults():
    # imatrix.cpp main(): n_seq = max(1, n_batch / n_ctx), n_kv = n_seq * n_ctx, n_batch = min(n_batch, n_kv);
    # -b 2048 -ub 512
    assert Batching.of(128) == Batching(128, 16, 2048, 512)
    assert Batching.of(512) == Batching(512, 4, 2048, 512)
    assert Batching.of(300) == Batching(300, 6, 1800, 512)
    assert Batching.of(4096) == Batching(4096, 1, 2048, 512)
    work = [list(range(i * 4096, (i + 1) * 4096)) for i in range(2)]
    calls = list(Batching.of(4096).batches(work))
    assert [(clear, len(entries)) for clear, entries in calls] == [
        (True, 2048),
        (False, 2048),
        (True, 2048),
        (False, 2048),
    ]
    assert calls[1][1][0] == (2048, 2048, 0) and calls[2][1][0] == (4096, 0, 0)
    groups = list(Batching.of(128).batches([[c] * 128 for c in range(17)]))
    assert [(clear, len(e), e[-1]) for clear, e in groups] == [
        (True, 16 * 128, (15, 127, 15)),
        (True, 128, (16, 127, 0)),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "args"),
    [
        ("qwen3moe", ("-c", 128)),
        ("qwen3moe", ("-c", 128, "--chunks", 5)),
        ("qwen3moe", ("-c", 2560)),
        ("qwen35moe", ("-c", 128)),
        ("gpt-oss", ("-c", 256)),
        ("deepseek2", ("-c", 512)),
    ],
)
def test_collect_equals_llama_imatrix(arch, args, make_model, llama_tools, text, tmp_path):
    model = make_model(arch, "F16")
    theirs = llama_imatrix(llama_tools, model, text, tmp_path / "theirs.gguf", *args)
    ours = tmp_path / "ours.gguf"
    result = ggufcarve(
        "imatrix",
        "collect",
        model,
        "--calibration",
        text,
        *(("--ctx" if a == "-c" else a) for a in args),
        "-t",
        2,
        "-o",
        ours,
        "-q",
    )
    assert result.code == 0, result.stderr
    assert_same_imatrix(ours, theirs)
    keys, written = tensors(ours)
    assert keys["imatrix.datasets"] == ["calibration.txt"] and keys["general.type"] == "imatrix"
    layout = inspect_layout(read_model(model))
    experts = [(name, shape) for name, _, shape, _ in written if name.endswith("_exps.weight.counts")]
    assert experts and all(shape == (1, layout.expert_count) for _, shape in experts)
    assert not any(name.startswith("output.weight") for name, *_ in written)


@pytest.mark.slow
def test_llama_quantize_takes_the_collected_imatrix_for_iq2_xs(q8_moe, llama_tools, text, tmp_path):
    theirs = llama_imatrix(llama_tools, q8_moe, text, tmp_path / "theirs.imatrix.gguf", "-c", 128)
    (tmp_path / "ours").mkdir()
    ours = collect_imatrix(
        read_model(q8_moe), [text], tmp_path / "ours" / "theirs.imatrix.gguf", ctx=128, compute=Compute(threads=2)
    ).output_path
    quantizer = BinaryQuantizer(llama_tools / "llama-quantize")
    outputs = []
    for imatrix, name in ((ours, "ours.gguf"), (theirs, "theirs.gguf")):
        result = quantizer.run(QuantizeJob(q8_moe, tmp_path / name, "IQ2_XS", imatrix=imatrix, nthreads=2))
        assert result.returncode == 0, result.error
        outputs.append(tmp_path / name)
    quantized = read_model(outputs[0])
    assert {t.type_name for t in quantized.tensors if t.name.endswith("_exps.weight")} == {"IQ2_XS"}
    for t in quantized.tensors:
        assert tensor_bytes(outputs[0], t.name) == tensor_bytes(outputs[1], t.name), t.name


@pytest.mark.slow
def test_one_calibration_pass_scores_and_collects(make_model, text, tmp_path):
    path = make_model("qwen35moe", "F16")
    model = read_model(path)
    layout = inspect_layout(model)
    alone = collect_imatrix(model, [text], tmp_path / "alone.gguf", ctx=128, compute=Compute(threads=2)).output_path
    together = tmp_path / "together.gguf"
    both = calibrate(model, layout, "reap", [text], ctx=128, compute=Compute(threads=2), imatrix_out=together)
    scores = calibrate(model, layout, "reap", [text], ctx=128, compute=Compute(threads=2))
    assert together.read_bytes() == alone.read_bytes()
    assert both.to_json() == scores.to_json()


@pytest.mark.slow
def test_cli_refusals_are_one_line_with_a_hint(make_model, text, tmp_path):
    model = make_model("qwen3moe", "F16")
    out = tmp_path / "out" / "m.imatrix.gguf"
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"x")
    cases = [
        (("--calibration", short), out, "fewer than one --ctx chunk of 512"),
        ((), out, "no calibration input"),
        (("--calibration", tmp_path / "missing.txt"), out, "missing.txt': no such file"),
        (("--calibration", text, "--chunks", 0), out, "--chunks must be an integer >= 1 (got '0')"),
        (("--calibration", text, "--ctx", 1), out, "--ctx must be an integer >= 2 (got '1')"),
        (("--calibration", text), existing, "already exists"),
        (("--calibration", text), model, "is the source file"),
    ]
    for args, target, message in cases:
        result = ggufcarve("imatrix", "collect", model, *args, "-o", target, "-q")
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.code == 1 and len(lines) == 1 and message in lines[0] and "(hint: " in lines[0], result.stderr
        assert not out.exists() and existing.read_bytes() == b"x"
    assert not out.parent.exists() or os.listdir(out.parent) == []
