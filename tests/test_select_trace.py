"""Calibration criteria traced through llama.cpp: frequency, ean, reap, razor (llama.cpp is the judge)."""

from __future__ import annotations

import json
import random
import subprocess

import factory
import numpy as np
import pytest
from clirun import ggufcarve
from conftest import CALIBRATION_WORDS
from gguf import GGUFReader

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.llama.devices import Compute
from ggufcarve.llama.trace import trace_routing
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.select.experts import ExpertEvaluator
from ggufcarve.select.from_trace import TraceStatistics
from ggufcarve.select.methods import score_model
from ggufcarve.select.scores import ExpertScores, ModelFacts


@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("calibration") / "calibration.txt"
    path.write_text(" ".join(rng.choice(CALIBRATION_WORDS) for _ in range(700)))
    return path


class FixedEvaluator:
    """f_r of the refill expert, given by hand."""

    def __init__(self, refill_output):
        self.refill_output = np.asarray(refill_output, dtype=np.float32)

    def outputs(self, block, expert, x):
        return np.tile(self.refill_output, (len(x), 1))

    def outputs_many(self, block, work):
        return [self.outputs(block, expert, x) for expert, x in work]

    def down_bias(self, block):
        return None


def test_reap_and_razor_equal_a_hand_computation():
    # One token routed to experts 0 and 1 (f0 = [1, 0], f1 = [0, 1]) with renormalised weights
    # 0.75 / 0.25 and probs 0.6 / 0.2 / 0.2; the router's rank-2 expert is 2 with f2 = [1, 1].
    nodes = {
        "ffn_moe_topk": np.array([[0, 1]], np.int32),
        "ffn_moe_down": np.array([[[1.0, 0.0], [0.0, 1.0]]], np.float32),
        "ffn_moe_weights": np.array([[0.6, 0.2]], np.float32),
        "ffn_moe_weights_norm": np.array([[0.75, 0.25]], np.float32),
        "ffn_moe_probs": np.array([[0.6, 0.2, 0.2]], np.float32),
        "ffn_moe_argsort": np.array([[0, 1, 2]], np.int32),
        "ffn_moe_input": np.zeros((1, 2), np.float32),
    }
    reap = TraceStatistics("reap", 3)
    reap.add(0, nodes)
    np.testing.assert_allclose(reap.blocks()[0].score(), [0.75, 0.25, 0.0])
    razor = TraceStatistics("razor", 3, FixedEvaluator([1.0, 1.0]))
    razor.add(0, nodes)
    # c = [0.75, 0.25]; r0 = [0.25, -0.25]; r1 = [-0.75, 0.75]; r2 = [0.25, 0.75]; w_r = 0.2 / 0.8
    # δ0 = ||0.75 r0 - 0.25 r2|| / (1 - 0.75 + 0.25) = ||[0.125, -0.375]|| / 0.5 = sqrt(0.15625) / 0.5
    # δ1 = ||0.25 r1 - 0.25 r2|| / (1 - 0.25 + 0.25) = ||[-0.25, 0]|| = 0.25
    np.testing.assert_allclose(razor.blocks()[0].score(), [np.sqrt(0.15625) / 0.5, 0.25, 0.0], rtol=1e-6)
    assert razor.blocks()[0].counts.tolist() == [1, 1, 0]


def test_largest_magnitudes_equal_numpys_abs_max():
    """The sign-bit-cleared integer maximum gives numpy's max |x| bit for bit: signed zeros,
    subnormals, infinities and the largest finite floats included; a NaN row stays NaN."""
    from ggufcarve.select.from_trace import largest_magnitudes

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 3, 40)) * np.exp(rng.uniform(-100, 80, size=(64, 3, 40)))).astype(np.float32)
    specials = np.array(
        [0.0, -0.0, 1e-45, -1e-45, 1e-38, -3.4028235e38, 3.4028235e38, np.inf, -np.inf], dtype=np.float32
    )
    x[:9, 0, :9] = specials
    x[9:18, 1, 0] = specials
    x[20, 2] = -0.0
    got = largest_magnitudes(x)
    assert got.dtype == np.float32 and got.shape == (64, 3)
    np.testing.assert_array_equal(got, np.abs(x).max(axis=-1))
    x[30, 1, 7] = np.nan
    x[31, 0, 2] = -np.nan
    got = largest_magnitudes(x)
    assert np.isnan(got[30, 1]) and np.isnan(got[31, 0]) and np.isnan(got).sum() == 2
    # a strided (token-major transposed) view, as a capture may hand over
    np.testing.assert_array_equal(largest_magnitudes(x[:, :, ::2]), np.abs(x[:, :, ::2]).max(axis=-1))


def test_ean_sum_msan_and_mone_equal_a_hand_computation():
    # Two tokens, top-2: expert 0 outputs [3, 4] then [0, 2]; expert 1 [1, 0]; expert 2 [0, -1].
    nodes = {
        "ffn_moe_topk": np.array([[0, 1], [2, 0]], np.int32),
        "ffn_moe_down": np.array([[[3.0, 4.0], [1.0, 0.0]], [[0.0, -1.0], [0.0, 2.0]]], np.float32),
        "ffn_moe_weights": np.array([[0.5, 0.5], [0.5, 0.5]], np.float32),
    }
    stats = TraceStatistics("msan", 4)
    stats.add(0, nodes)
    assert stats.filled == ("frequency", "ean", "ean-sum", "msan", "mone", "reap", "hope")
    score = {m: stats.blocks(m)[0].score() for m in stats.filled}
    np.testing.assert_allclose(score["ean-sum"], [5.0 + 2.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(score["ean"], [3.5, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(score["msan"], [(25.0 + 4.0) / 2, 1.0, 1.0, 0.0])
    # expert 0: mean [1.5, 3], deviations [1.5, 1] and [-1.5, -1]: E||f - mu||^2 = 3.25, times 2 tokens
    np.testing.assert_allclose(score["mone"], [6.5, 0.0, 0.0, 0.0])
    assert stats.blocks("mone")[0].output_sums.tolist() == [[3.0, 6.0], [1.0, 0.0], [0.0, -1.0], [0.0, 0.0]]
    with pytest.raises(BadInput, match="does not fill razor"):
        stats.blocks("razor")
    # a scores file round trip keeps mone's vectors, and shards add
    scores = ExpertScores("mone", ModelFacts("m", 0, "qwen3moe", 1, 0, 4, 2, 0, 0, (0,)), stats.blocks("mone"))
    again = ExpertScores.from_json(json.loads(scores.dumps()))
    np.testing.assert_allclose(again.merged(again).scores()[0], 2 * score["mone"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen35moe"])
def test_frequency_counts_equal_llama_imatrix_counts(arch, make_model, llama_tools, calibration_text, tmp_path):
    model = make_model(arch, "F16")
    out = tmp_path / "imatrix.gguf"
    proc = subprocess.run(
        [
            str(llama_tools / "llama-imatrix"),
            "-m",
            str(model),
            "-f",
            str(calibration_text),
            "-o",
            str(out),
            "-c",
            "128",
            "-t",
            "2",
            "--no-repack",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = read_model(model)
    scores = score_model(
        loaded, inspect_layout(loaded), "frequency", calibration=[calibration_text], ctx=128, compute=Compute(threads=2)
    )
    written = {
        t.name: np.asarray(t.data).reshape(-1)
        for t in GGUFReader(out).tensors
        if t.name.endswith("ffn_up_exps.weight.counts")
    }
    traced = [b for b, s in scores.blocks.items() if s.rule == "frequency"]
    assert traced and len(traced) == len(written)
    for block in traced:
        np.testing.assert_array_equal(
            scores.blocks[block].counts, np.rint(written[f"blk.{block}.ffn_up_exps.weight.counts"]).astype(np.int64)
        )
    assert scores.tokens == sum(scores.blocks[traced[0]].counts) // inspect_layout(loaded).expert_used_count


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["numpy", "ggml"])
@pytest.mark.parametrize("arch", factory.ARCHES)
def test_expert_outputs_equal_llama_cpps_ffn_moe_down(arch, engine, make_model):
    """Both engines of ExpertEvaluator give llama.cpp's ffn_moe_down of every selected expert (F32
    weights); ggml's through outputs_many, one graph for all of a block's (expert, token) pairs."""
    path = make_model(arch, "F32")
    model = read_model(path)
    layout = inspect_layout(model)
    tokens = [factory.BOS_ID] + [int(t) for t in np.random.default_rng(3).integers(3, factory.N_VOCAB, 15)]
    trace = trace_routing(
        path, tokens, nodes=("ffn_moe_topk", "ffn_moe_down", "ffn_moe_input"), logits=False, compute=Compute(threads=2)
    )
    evaluator = ExpertEvaluator(model, layout, threads=2, engine=engine)
    assert set(trace.topk) == {b for b in layout.blocks if not layout.is_mtp(b)}
    for block, topk in trace.topk.items():
        down, x = trace.nodes["ffn_moe_down"][block], trace.nodes["ffn_moe_input"][block]
        pairs = [(t, j, int(expert)) for t in range(len(tokens)) for j, expert in enumerate(topk[t])]
        if engine == "numpy":
            ours = [evaluator.outputs(block, expert, x[t : t + 1])[0] for t, _, expert in pairs]
        else:
            ours = [out[0] for out in evaluator.outputs_many(block, [(expert, x[t : t + 1]) for t, _, expert in pairs])]
        for (t, j, _), out in zip(pairs, ours):
            np.testing.assert_allclose(out, down[t, j], rtol=2e-3, atol=2e-5 * float(np.abs(down[t, j]).max()))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_ggml_expert_outputs_of_a_q8_0_model_equal_llama_cpps_ffn_moe_down(arch, make_model):
    """On quantized weights ggml's products are llama.cpp's own op (ggml_mul_mat_id, the inputs
    quantized to Q8_0 as it quantizes them): ffn_moe_down bit for bit, whether a block's rows are
    one (token, expert) pair each or each expert's tokens together, where numpy's float32 products
    of the dequantized weights differ by the inputs' quantization (measured: 1.8% and 1.6% of the
    largest element)."""
    path = make_model(arch, "Q8_0")
    model = read_model(path)
    layout = inspect_layout(model)
    tokens = [factory.BOS_ID] + [int(t) for t in np.random.default_rng(4).integers(3, factory.N_VOCAB, 23)]
    trace = trace_routing(
        path, tokens, nodes=("ffn_moe_topk", "ffn_moe_down", "ffn_moe_input"), logits=False, compute=Compute(threads=2)
    )
    ggml = ExpertEvaluator(model, layout, threads=2, engine="ggml")
    exact = ExpertEvaluator(model, layout)
    worst = {"ggml": 0.0, "ggml, grouped": 0.0, "numpy": 0.0}
    for block, topk in trace.topk.items():
        down, x = trace.nodes["ffn_moe_down"][block], trace.nodes["ffn_moe_input"][block]
        pairs = [(t, j, int(expert)) for t in range(len(tokens)) for j, expert in enumerate(topk[t])]
        ours = ggml.outputs_many(block, [(expert, x[t : t + 1]) for t, _, expert in pairs])
        experts = sorted({expert for _, _, expert in pairs})
        rows = {e: [t for t, _, expert in pairs if expert == e] for e in experts}
        grouped = dict(zip(experts, ggml.outputs_many(block, [(e, x[rows[e]]) for e in experts])))
        for (t, j, expert), out in zip(pairs, ours):
            scale = float(np.abs(down[t, j]).max())
            worst["ggml"] = max(worst["ggml"], float(np.abs(out[0] - down[t, j]).max()) / scale)
            together = grouped[expert][rows[expert].index(t)]
            worst["ggml, grouped"] = max(worst["ggml, grouped"], float(np.abs(together - down[t, j]).max()) / scale)
            worst["numpy"] = max(
                worst["numpy"], float(np.abs(exact.outputs(block, expert, x[t : t + 1])[0] - down[t, j]).max()) / scale
            )
    assert worst["ggml"] == 0.0, worst
    assert worst["ggml, grouped"] == 0.0, worst
    assert worst["numpy"] > 1e-3, worst


def copy_experts(src, dst, block, source, copies):
    """`src` with experts `copies` of `block` made byte-identical to `source` (expert slabs and router rows)."""
    dst.write_bytes(src.read_bytes())
    model = read_model(dst)
    layout = inspect_layout(model)
    with open(dst, "r+b") as f:
        for t in next(layer for layer in layout.layers if layer.block == block).tensors:
            if t.role not in ("expert weight", "router"):
                continue
            _, info = model.tensor_index[t.name]
            start, _ = model.shards[0].data_range(info)
            f.seek(start + source * t.bytes_per_expert)
            slab = f.read(t.bytes_per_expert)
            for c in copies:
                f.seek(start + c * t.bytes_per_expert)
                f.write(slab)
    return dst


@pytest.mark.slow
def test_razor_scores_interchangeable_copies_near_zero(make_model, calibration_text, tmp_path):
    # top-2 routing and k + 1 = 3 identical experts: deleting one promotes another copy.
    copies = (3, 5, 6)
    path = copy_experts(make_model("qwen3moe", "F32"), tmp_path / "copies.gguf", 0, copies[0], copies[1:])
    model = read_model(path)
    layout = inspect_layout(model)
    score = {
        m: score_model(model, layout, m, calibration=[calibration_text], ctx=128, compute=Compute(threads=2)).blocks[0]
        for m in ("frequency", "reap", "razor")
    }
    others = [e for e in range(layout.expert_count) if e not in copies]
    # llama.cpp's argsort breaks the tie between equal router scores the same way every time, so
    # two copies share the selections and the third only ever stands in as the refill expert.
    used = [e for e in copies if score["frequency"].counts[e] > 0]
    assert len(used) == 2 and score["frequency"].counts[used].min() > 0.05 * score["frequency"].counts.sum()
    reap, razor = score["reap"].score(), score["razor"].score()
    assert min(reap[used]) > 0.1 * max(reap[others])
    assert max(razor[list(copies)]) < 1e-3 * max(razor[others])


@pytest.mark.slow
def test_calibration_through_the_cli(make_model, calibration_text, tmp_path):
    model = make_model("deepseek2", "F16")
    jsonl = tmp_path / "calibration.jsonl"
    jsonl.write_text(json.dumps({"text": calibration_text.read_text()}) + "\n")
    out = tmp_path / "reap.json"
    result = ggufcarve(
        "select",
        model,
        "--method",
        "reap",
        "--calibration",
        jsonl,
        "--ctx",
        128,
        "--keep",
        8,
        "--protect-super-experts",
        "-t",
        2,
        "-o",
        out,
        "-q",
    )
    assert result.code == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["calibration"][0]["name"] == "calibration.jsonl" and record["calibration"][0]["tokens"] > 128
    assert record["parameters"]["ctx"] == 128 and record["tokens"] == record["parameters"]["chunks"] * 128
    assert all(len(e["routed"]) == 16 for e in record["per_block"].values())
    text_out = tmp_path / "text.json"
    assert (
        ggufcarve(
            "select",
            model,
            "--method",
            "reap",
            "--calibration",
            calibration_text,
            "--ctx",
            128,
            "--keep",
            8,
            "-t",
            2,
            "-o",
            text_out,
            "-q",
        ).code
        == 0
    )
    assert json.loads(text_out.read_text())["per_block"] == {
        b: {k: v for k, v in e.items() if k not in ("protected", "super_experts")}
        for b, e in record["per_block"].items()
    }
    pruned = tmp_path / "pruned" / "model.gguf"
    assert ggufcarve("prune", model, "--keep", out, "-o", pruned, "-q").code == 0


def test_empty_or_short_calibration_is_refused(make_model, tmp_path):
    model = make_model("qwen3moe", "F16")
    out = tmp_path / "sel.json"
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for args, message in (
        (["--calibration", empty], "empty calibration file"),
        ([], "give --calibration FILE"),
    ):
        result = ggufcarve("select", model, "--method", "frequency", "--keep", 4, *args, "-o", out)
        assert result.code == 1 and message in result.error_line and len(result.stderr.strip().splitlines()) == 1, (
            result.stderr
        )
        assert not out.exists()
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    result = ggufcarve("select", model, "--method", "frequency", "--keep", 4, "--calibration", short, "-o", out, "-q")
    assert result.code == 1 and "fewer than one --ctx chunk of 512" in result.error_line, result.stderr
    assert not out.exists()


def with_chat_template(src, dst, template):
    """`src` with a tokenizer.chat_template key added (tensor data copied unchanged)."""
    from gguf.constants import GGUFValueType

    from ggufcarve.gguf.container import TensorHeader, encode_header, make_kv

    f = read_model(src).shards[0]
    tensors = [TensorHeader(t.name, t.shape, t.type_id, t.nbytes) for t in f.tensors]
    header, offsets = encode_header(
        f.version, [*f.kvs, make_kv("tokenizer.chat_template", GGUFValueType.STRING, template)], tensors, f.alignment
    )
    assert offsets == [t.offset for t in f.tensors]
    with open(src, "rb") as source:
        source.seek(f.data_start)
        dst.write_bytes(header + source.read())
    return dst


@pytest.mark.slow
def test_chat_messages_are_rendered_with_the_models_template(make_model, tmp_path):
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    model = with_chat_template(make_model("qwen3moe", "F16"), tmp_path / "chat.gguf", chatml)
    words = " ".join(CALIBRATION_WORDS * 12)
    messages = [{"role": "user", "content": words}, {"role": "assistant", "content": words[::-1]}]
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": rendered}) + "\n")
    loaded = read_model(model)
    layout = inspect_layout(loaded)
    chat, text = (
        score_model(loaded, layout, "frequency", calibration=[tmp_path / n], ctx=128, compute=Compute(threads=2))
        for n in ("chat.jsonl", "text.jsonl")
    )
    assert chat.tokens == text.tokens > 0 and chat.inputs[0]["tokens"] == text.inputs[0]["tokens"]
    for block in (0, 1):
        np.testing.assert_array_equal(chat.blocks[block].counts, text.blocks[block].counts)
    result = ggufcarve(
        "select",
        make_model("qwen3moe", "F16"),
        "--method",
        "frequency",
        "--calibration",
        tmp_path / "chat.jsonl",
        "--keep",
        4,
        "-o",
        tmp_path / "s.json",
    )
    assert result.code == 1 and "has no chat template" in result.error_line


def test_gelu_glu_is_ggmls_f16_tanh_gelu():
    import math

    from ggufcarve.select.experts import activate

    x = np.array([-12.0, -10.0, -3.7, -1.0, -0.25, 0.0, 0.3, 1.0, 2.5, 9.5, 10.0, 15.0], dtype=np.float32)
    up = np.array([1.5, -2.0, 0.5, 3.0, -1.0, 2.0, 1.0, -0.75, 0.25, 1.0, 2.0, -1.0], dtype=np.float32)

    def table(v):  # ggml_table_gelu_f16[f16(v)]: f16 of 0.5 h (1 + tanh(sqrt(2/pi) h (1 + 0.044715 h^2)))
        if v <= -10.0:
            return 0.0
        if v >= 10.0:
            return v
        h = float(np.float16(v))
        return float(np.float16(0.5 * h * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * h * (1.0 + 0.044715 * h * h)))))

    expected = np.array([table(float(v)) for v in x])
    np.testing.assert_allclose(activate("gelu-glu", None, x), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(activate("gelu-glu", x, up), expected * up, rtol=1e-6, atol=1e-7)
    # the tanh approximation, not erf: 0.5 x (1 + erf(x / sqrt 2)) at x = -3.7 is -4.0e-4, the tanh form -6.9e-4
    assert (
        abs(activate("gelu-glu", None, np.float32([-3.7]))[0] - 0.5 * -3.7 * (1 + math.erf(-3.7 / math.sqrt(2)))) > 1e-4
    )
    silu = x / (1.0 + np.exp(-x))
    np.testing.assert_allclose(activate("silu-glu", x, up), silu * up, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(activate("silu-glu", None, x), silu, rtol=1e-6, atol=1e-7)


def llama_cpp_moe_type_ops():
    """{architecture: (type_ops of its build_moe_ffn calls, facts)} read from the llama.cpp sources in the sdist
    (tests/llama_sources.py). facts: "probs_in" when a call passes precomputed router logits,
    "clamp" when the class reads LLM_KV_SWIGLU_CLAMP_EXP."""
    from llama_sources import architectures

    return {
        name: (
            {c.type_op for c in arch.calls},
            ({"probs_in"} if any(c.probs_in for c in arch.calls) else set()) | ({"clamp"} if arch.clamp else set()),
        )
        for name, arch in architectures().items()
        if arch.calls
    }


def test_activations_table_matches_llama_cpps_build_moe_ffn_calls():
    from ggufcarve.select.experts import ACTIVATIONS

    kinds = {"LLM_FFN_SILU": "silu-glu", "LLM_FFN_GELU": "gelu-glu", "LLM_FFN_SWIGLU_OAI_MOE": "swiglu-oai"}
    sources = llama_cpp_moe_type_ops()
    assert {"llama", "qwen3moe", "gpt-oss", "grok"} <= set(sources)
    for arch, kind in ACTIVATIONS.items():
        assert arch in sources, f"{arch}: no build_moe_ffn call in its graph"
        ops, facts = sources[arch]
        assert {kinds.get(op) for op in ops} == {kind}, (arch, ops)
        assert not facts, (arch, facts)  # precomputed router logits or a swiglu clamp: outside ExpertEvaluator
        assert arch not in ("llama4", "grovemoe")  # weights before the experts; chunk experts
    from ggufcarve.select.experts import NOT_EVALUATED

    assert set(NOT_EVALUATED) <= set(sources)
    # every other graph with a build_moe_ffn call belongs to a model whose loader creates no *_exps tensors
    assert set(sources) - set(ACTIVATIONS) - set(NOT_EVALUATED) == {
        "bert",
        "jina-bert-v2",
        "jina-bert-v3",
        "nomic-bert",
        "phi3",
    }


def test_architectures_razor_cannot_evaluate_are_refused_with_their_reason():
    from ggufcarve.errors import UnsupportedModel
    from ggufcarve.select.experts import ACTIVATIONS, NOT_EVALUATED, activation_of

    assert not set(NOT_EVALUATED) & set(ACTIVATIONS)
    with pytest.raises(UnsupportedModel) as refused:
        activation_of("llama4")
    assert "weight_before_ffn" in refused.value.message and "frequency, ean or reap" in refused.value.hint
    with pytest.raises(UnsupportedModel) as unknown:
        activation_of("no-such-arch")
    assert "does not know the expert activation" in unknown.value.message


@pytest.mark.parametrize("method", ["ean", "reap", "razor"])
def test_folding_per_micro_batch_or_held_gives_the_same_statistics(method):
    """BlockFolder folds ean/reap micro-batch by micro-batch and holds razor's micro-batches for
    larger products: both orders give the statistics of one fold of all tokens."""
    from types import SimpleNamespace

    from ggufcarve.select.from_trace import BlockFolder

    rng = np.random.default_rng(5)
    experts, k, width, tokens = 6, 2, 8, 12

    def micro_batch(t):
        logits = rng.normal(size=(t, experts)).astype(np.float32)
        order = np.argsort(-logits, axis=1).astype(np.int32)
        probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        weights = np.take_along_axis(probs, order[:, :k], axis=1)
        return {
            "ffn_moe_topk": order[:, :k],
            "ffn_moe_argsort": order,
            "ffn_moe_probs": probs,
            "ffn_moe_weights": weights,
            "ffn_moe_weights_norm": weights / weights.sum(axis=1, keepdims=True),
            "ffn_moe_input": rng.normal(size=(t, width)).astype(np.float32),
            "ffn_moe_down": rng.normal(size=(t, k, width)).astype(np.float32),
        }

    parts = [micro_batch(tokens // 3) for _ in range(3)]
    evaluator = FixedEvaluator(rng.normal(size=width))
    whole = TraceStatistics(method, experts, evaluator)
    whole.add(0, {node: np.concatenate([p[node] for p in parts]) for node in parts[0]})
    for hold in (0, 1 << 30):
        folded = TraceStatistics(method, experts, evaluator)
        tracer = SimpleNamespace(
            nodes=frozenset(parts[0]), captured={node: {0: [p[node] for p in parts]} for node in parts[0]}
        )
        folder = BlockFolder(tracer, folded, parse=None, hold_bytes=hold)
        folder.flush(keep=1, held=True)  # the graph has moved on to block 1
        still_held = all(blocks for blocks in tracer.captured.values())
        assert still_held == (method == "razor" and hold > 0), (method, hold)
        folder.flush()  # the decode call ended
        assert all(not blocks for blocks in tracer.captured.values())
        for criterion in folded.filled:
            for name, values in folded.blocks(criterion)[0].arrays().items():
                np.testing.assert_allclose(
                    values,
                    whole.blocks(criterion)[0].arrays()[name],
                    rtol=1e-5,
                    err_msg=f"{criterion} {name}, hold {hold}",
                )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_one_pass_criteria_equal_numpy_from_llama_cpps_captured_ffn_moe_down(arch, make_model):
    """The statistics consumer and llama/trace's capture consumer watch the same decode (micro-batches
    of 32 tokens): ean, ean-sum, msan, mone and reap from the pass equal numpy's float64 computation
    from the captured ffn_moe_down, ffn_moe_topk and weights."""
    from ggufcarve.llama.calibration import Batching
    from ggufcarve.llama.decode import ConsumerSpec, DecodeRequest, decode
    from ggufcarve.select.from_trace import WEIGHT_NODES, statistics_consumer

    path = make_model(arch, "F32")
    layout = inspect_layout(read_model(path))
    tokens = tuple([factory.BOS_ID] + [int(t) for t in np.random.default_rng(7).integers(3, factory.N_VOCAB, 95)])
    nodes = ["ffn_moe_topk", "ffn_moe_down", *WEIGHT_NODES]
    request = DecodeRequest(
        str(path),
        (ConsumerSpec("nodes", "ggufcarve.llama.trace:capture", {"nodes": nodes}), statistics_consumer("mone")),
        Batching.single(48, 32),
        tokens=tokens,
        compute=Compute(threads=2),
    )
    run = decode(request, what="test")
    captured, stats = run.outputs["nodes"], TraceStatistics.from_arrays(run.outputs["statistics"], layout.expert_count)
    assert stats.filled == ("frequency", "ean", "ean-sum", "msan", "mone", "reap", "hope")
    blocks = [b for b in layout.blocks if not layout.is_mtp(b)]
    assert blocks and sorted(stats.counts) == blocks
    for block in blocks:
        topk = captured[f"ffn_moe_topk:{block}"]
        down = captured[f"ffn_moe_down:{block}"].astype(np.float64)
        weight = next(captured[f"{n}:{block}"] for n in WEIGHT_NODES if f"{n}:{block}" in captured).astype(np.float64)
        assert topk.shape[0] == len(tokens)
        expected = {m: np.zeros(layout.expert_count) for m in ("ean", "ean-sum", "msan", "mone", "reap")}
        for e in range(layout.expert_count):
            t, j = np.nonzero(topk == e)
            if not len(t):
                continue
            f = down[t, j]
            norms = np.linalg.norm(f, axis=1)
            expected["ean-sum"][e] = norms.sum()
            expected["ean"][e] = norms.mean()
            expected["msan"][e] = (norms**2).mean()
            expected["mone"][e] = len(t) * ((f - f.mean(axis=0)) ** 2).sum(axis=1).mean()
            expected["reap"][e] = (weight[t, j] * norms).mean()
        for method, values in expected.items():
            ours = stats.blocks(method)[block].score()
            assert np.ptp(values) > 0, method
            np.testing.assert_allclose(
                ours, values, rtol=2e-5, atol=1e-6 * values.max(), err_msg=f"blk.{block} {method}"
            )
        # hope: token by token, every ordered pair of its selected experts (i = j included)
        sums = np.zeros((layout.expert_count, layout.expert_count))
        counts = np.zeros_like(sums)
        for t in range(len(tokens)):
            v = weight[t] * np.linalg.norm(down[t], axis=1)
            for a, i in enumerate(topk[t]):
                for c, j in enumerate(topk[t]):
                    sums[i, j] += v[a] * v[c]
                    counts[i, j] += 1
        hope = stats.blocks("hope")[block]
        assert np.array_equal(hope.pair_counts, counts) and counts.trace() == topk.size
        np.testing.assert_allclose(hope.pair_sums, sums, rtol=2e-5, atol=1e-9 * sums.max(), err_msg=f"blk.{block}")


def spearman(a, b):
    """Spearman's rank correlation (the scores here have no ties among routed experts)."""
    ra, rb = (np.argsort(np.argsort(x, kind="stable")).astype(np.float64) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


# measured: the demo model (ctx 256, the first 16 chunks of its calibration text) per-block Spearman
# 0.971, 0.950, 0.929, 0.888 (mean 0.935; all 60 chunks: 0.93, 0.89, 0.89, 0.92, mean 0.91);
# q8_moe (8 random experts, top-2, 4 chunks of 128) 1.0, 0.952 (mean 0.976)
IMATRIX_MSAN_FLOOR = {"demo": 0.85, "q8_moe": 0.8}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["demo", "q8_moe"])
def test_imatrix_msan_is_gguf_pys_formula_and_ranks_like_the_traced_msan(
    case, q8_moe, q8_moe_imatrix, llama_tools, tmp_path, capsys
):
    """imatrix-msan equals sum_c in_sum2/counts x ||W_down[:, c]||^2 computed from gguf-py's reads of
    llama-imatrix's file and the model; its per-block rank correlation with the traced msan (same
    text, same --ctx, same chunks) is printed and held to the floor measured."""
    import gguf

    from ggufcarve.demo import CALIBRATION, DEMO_MODEL

    if case == "demo":
        model, text, ctx, chunks = DEMO_MODEL, CALIBRATION, 256, 16
        imatrix = tmp_path / "demo.imatrix.gguf"
        proc = subprocess.run(
            [
                str(llama_tools / "llama-imatrix"),
                "-m",
                str(model),
                "-f",
                str(text),
                "-o",
                str(imatrix),
                "-c",
                str(ctx),
                "--chunks",
                str(chunks),
                "-t",
                "2",
                "--no-repack",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        model, imatrix, ctx, chunks = q8_moe, q8_moe_imatrix, 128, 4
        text = q8_moe_imatrix.parent / "calibration.txt"  # the text conftest.make_imatrix gave llama-imatrix
    loaded = read_model(model)
    layout = inspect_layout(loaded)
    estimate = score_model(loaded, layout, "imatrix-msan", imatrix=imatrix)
    traced = score_model(
        loaded, layout, "msan", calibration=[text], ctx=ctx, max_tokens=chunks * ctx, compute=Compute(threads=2)
    )
    entries = {t.name: np.asarray(t.data, dtype=np.float64) for t in GGUFReader(imatrix).tensors}
    weights = {t.name: t for t in GGUFReader(model).tensors}
    correlations = []
    for block in layout.blocks:
        if layout.is_mtp(block):
            continue
        down = weights[f"blk.{block}.ffn_down_exps.weight"]
        w = gguf.quants.dequantize(down.data, down.tensor_type).astype(np.float64)  # [expert, n_embd, n_ff]
        in_sum2 = entries[f"blk.{block}.ffn_down_exps.weight.in_sum2"].reshape(layout.expert_count, -1)
        counts = entries[f"blk.{block}.ffn_down_exps.weight.counts"].reshape(-1)
        expected = np.where(counts > 0, (in_sum2 * (w**2).sum(axis=1)).sum(axis=1) / np.maximum(counts, 1), 0.0)
        np.testing.assert_allclose(estimate.blocks[block].score(), expected, rtol=1e-6)
        correlations.append(spearman(estimate.blocks[block].score(), traced.blocks[block].score()))
    with capsys.disabled():
        print(
            f"\nimatrix-msan vs traced msan, {case}: Spearman per block "
            f"{[round(r, 3) for r in correlations]}, mean {np.mean(correlations):.3f}"
        )
    assert np.mean(correlations) >= IMATRIX_MSAN_FLOOR[case]


@pytest.mark.parametrize("arch", ["qwen3moe", "fused"])
def test_per_expert_scales_and_biases_apply_per_row_in_ggmls_batches(arch, make_model, monkeypatch):
    """build_moe_ffn's per-expert scales are one scalar per expert ([n_expert]) and its biases a
    vector per expert: ggml's batches, one expert per row, apply each row's own, as the numpy engine
    does one expert at a time (the fixtures have neither, so the tables are given here)."""
    path = make_model(arch, "F32")
    model = read_model(path)
    layout = inspect_layout(model)
    rng = np.random.default_rng(12)
    n_expert = layout.expert_count
    tables = {}

    def per_expert(self, name):
        if name not in tables:
            base = name.rsplit(".", 1)[0] + ".weight"
            if base not in model.tensor_index:
                tables[name] = None
            elif name.endswith(".scale"):
                tables[name] = rng.uniform(0.5, 2.0, n_expert).astype(np.float32)
            else:
                tables[name] = rng.normal(size=(n_expert, model.tensor_index[base][1].shape[1])).astype(np.float32)
        return tables[name]

    monkeypatch.setattr(ExpertEvaluator, "_per_expert", per_expert)
    width = model.tensor_index["blk.0.ffn_down_exps.weight"][1].shape[1]
    x = rng.standard_normal((12, width)).astype(np.float32)
    work = [(e, x[i : i + 4]) for i, e in zip(range(0, 12, 4), (2, 0, 2))]
    ggml = ExpertEvaluator(model, layout, threads=2, engine="ggml").outputs_many(0, work)
    numpy = ExpertEvaluator(model, layout)
    assert any(t is not None for name, t in tables.items() if name.endswith(".scale"))
    for (expert, rows), ours in zip(work, ggml):
        np.testing.assert_allclose(
            ours, numpy.outputs(0, expert, rows), rtol=2e-3, atol=1e-4 * float(np.abs(ours).max())
        )
