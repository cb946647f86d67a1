"""The eval-callback tracer (ggufcarve.llama.trace): what llama.cpp computed, node by node.

The captured nodes are checked against each other with build_moe_ffn's formulas, so a node read
with the wrong layout or from the wrong tensor fails; routing.py's description of each fixture is
checked against the nodes llama.cpp actually built.
"""

from __future__ import annotations

import ctypes
import json

import factory
import gguf
import numpy as np
import pytest

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.gguf.container import read_model
from ggufcarve.llama.calibration import Batching, Document
from ggufcarve.llama.decode import ConsumerSpec, DecodeRequest, decode
from ggufcarve.llama.devices import Compute
from ggufcarve.llama.ggml import GgmlTensor
from ggufcarve.llama.trace import (
    NODES,
    GraphTracer,
    parse_node_name,
    token_major,
    trace_routing,
)
from ggufcarve.moe.layout import inspect_layout

TOKENS = [factory.BOS_ID] + [int(t) for t in np.random.default_rng(7).integers(3, factory.N_VOCAB, 23)]


def test_node_names_are_matched_by_their_suffix():
    assert parse_node_name("ffn_moe_topk-3") == ("ffn_moe_topk", 3)
    assert parse_node_name("CUDA0#ffn_moe_weights_norm-12") == ("ffn_moe_weights_norm", 12)
    assert parse_node_name("result_output") is None


def test_token_major_puts_tokens_first():
    weights = np.arange(2 * 5, dtype=np.float32).reshape(1, 5, 2, 1)  # ggml [1, k=2, T=5]
    assert token_major(weights, 2, (1,)).tolist() == weights.reshape(5, 2).tolist()
    down = np.arange(5 * 2 * 3).reshape(1, 5, 2, 3)  # ggml [n_embd=3, k=2, T=5]
    assert token_major(down, 2, (1, 0)).shape == (5, 2, 3)
    with pytest.raises(ValueError):
        token_major(np.zeros((2, 1, 5, 3)), 1, (0,))


def test_callback_never_raises_and_always_continues_the_graph():
    tracer = GraphTracer(frozenset({"ffn_moe_topk"}))
    other, topk = GgmlTensor(), GgmlTensor()
    other.name, topk.name = b"attn_norm-0", b"ffn_moe_topk-0"
    topk.type = 12  # Q4_K: not a plain number type, so reading it fails inside the callback
    assert tracer(ctypes.addressof(other), True, None) is False  # not observed
    assert tracer(ctypes.addressof(other), False, None) is True
    assert tracer(ctypes.addressof(topk), True, None) is True
    assert tracer(ctypes.addressof(topk), False, None) is True  # failed to read, still continues
    assert tracer.errors and "TypeError" in tracer.errors[0]
    with pytest.raises(BadInput, match="cannot capture"):
        GraphTracer(frozenset({"ffn_moe_everything"}))


@pytest.fixture(scope="module")
def qwen3moe_trace(make_model):
    path = make_model("qwen3moe", "F32")
    return path, trace_routing(path, TOKENS, nodes=NODES)


@pytest.mark.slow
def test_captured_nodes_obey_build_moe_ffn(qwen3moe_trace):
    path, trace = qwen3moe_trace
    layout = inspect_layout(read_model(path))
    k, n = layout.expert_used_count, layout.expert_count
    weights_of = {t.name: np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(path).tensors}
    assert trace.logits.shape == (len(TOKENS), factory.N_VOCAB) and np.isfinite(trace.logits).all()
    for block in layout.blocks:
        node = {name: blocks[block] for name, blocks in trace.nodes.items()}
        router = weights_of[f"blk.{block}.ffn_gate_inp.weight"].reshape(n, -1)
        np.testing.assert_allclose(node["ffn_moe_logits"], node["ffn_moe_input"] @ router.T, rtol=1e-4, atol=1e-4)
        logits = node["ffn_moe_logits"].astype(np.float64)
        softmax = np.exp(logits - logits.max(1, keepdims=True))
        np.testing.assert_allclose(node["ffn_moe_probs"], softmax / softmax.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
        assert node["ffn_moe_topk"].shape == (len(TOKENS), k)  # warm-up (every expert) excluded
        np.testing.assert_array_equal(node["ffn_moe_topk"], node["ffn_moe_argsort"][:, :k])
        weights = np.take_along_axis(node["ffn_moe_probs"], node["ffn_moe_topk"], axis=1)
        np.testing.assert_allclose(node["ffn_moe_weights"], weights, rtol=1e-6)
        np.testing.assert_allclose(node["ffn_moe_weights_norm"], weights / weights.sum(1, keepdims=True), rtol=1e-5)
        mixed = (node["ffn_moe_down"] * node["ffn_moe_weights_norm"][:, :, None]).sum(1)
        np.testing.assert_allclose(node["ffn_moe_out"], mixed, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_micro_batches_trace_the_same_tokens(qwen3moe_trace):
    path, whole = qwen3moe_trace
    events = []
    pieces = trace_routing(path, TOKENS, nodes=("ffn_moe_topk", "ffn_moe_probs"), batch=5, on_event=events.append)
    assert [e.done for e in events] == [5, 10, 15, 20, 24] and {(e.stage, e.total, e.unit) for e in events} == {
        ("trace", 24, "tokens")
    }
    for block, ids in whole.topk.items():
        np.testing.assert_array_equal(pieces.topk[block], ids)
        np.testing.assert_allclose(
            pieces.nodes["ffn_moe_probs"][block], whole.nodes["ffn_moe_probs"][block], rtol=1e-4, atol=1e-6
        )
    np.testing.assert_allclose(pieces.logits, whole.logits, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_context_chunks_are_decoded_independently(qwen3moe_trace):
    """context=12 over 24 tokens: the second chunk is traced as if it were a sequence of its own."""
    path, whole = qwen3moe_trace
    chunked = trace_routing(path, TOKENS, context=12, batch=5)
    alone = trace_routing(path, TOKENS[12:])
    for block, ids in whole.topk.items():
        np.testing.assert_array_equal(chunked.topk[block][:12], ids[:12])
        np.testing.assert_array_equal(chunked.topk[block][12:], alone.topk[block])
    np.testing.assert_allclose(chunked.logits[12:], alone.logits, rtol=1e-3, atol=1e-3)
    assert not np.allclose(chunked.logits[12:], whole.logits[12:], rtol=1e-3, atol=1e-3)  # the history mattered
    with pytest.raises(BadInput, match="at least 1 token"):
        trace_routing(path, TOKENS, context=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "options"),
    [("qwen3moe", {}), ("qwen35moe", {}), ("deepseek2", {}), ("deepseek2", {"v2_routing": True}), ("gpt-oss", {})],
)
def test_routing_description_matches_the_graph_llama_cpp_built(make_model, arch, options):
    """Normalised weights exist iff routing.py says so, scaled ones iff it names a scale, which they
    carry; the probabilities are the gating function routing.py names, of the router logits."""
    path = make_model(arch, **options)
    routing = inspect_layout(read_model(path)).routing
    trace = trace_routing(path, TOKENS[:8], nodes=NODES, logits=False)
    for block, logits in trace.nodes["ffn_moe_logits"].items():
        probs = trace.nodes["ffn_moe_probs"][block]
        if routing.gating_name == "sigmoid":
            np.testing.assert_allclose(probs, 1 / (1 + np.exp(-logits)), rtol=1e-5)
        elif routing.gating_name == "softmax":
            np.testing.assert_allclose(probs.sum(1), 1, rtol=1e-5)
        else:  # softmax_weight: the probabilities are the (router-biased) logits; the softmax comes after selection
            bias = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}[f"blk.{block}.ffn_gate_inp.bias"]
            np.testing.assert_allclose(probs, logits + bias, rtol=1e-6, atol=1e-6)
    assert trace.logits is None and trace.topk
    assert ("ffn_moe_weights_norm" in trace.nodes) == bool(routing.normalised)
    assert ("ffn_moe_weights_scaled" in trace.nodes) == routing.scaled
    assert ("ffn_moe_probs_biased" in trace.nodes) == routing.selection_bias
    assert ("ffn_moe_weights_softmax" in trace.nodes) == (routing.gating_name == "softmax_weight")
    for block, applied in trace.nodes.get("ffn_moe_weights_scaled", {}).items():
        before = trace.nodes["ffn_moe_weights_norm" if routing.normalised else "ffn_moe_weights"][block]
        np.testing.assert_allclose(applied, routing.scale * before, rtol=1e-5)
    if routing.grouped:
        size = read_model(path).get(f"{arch}.expert_count") // routing.group_count
        for ids in trace.topk.values():
            assert max(len(set((row // size).tolist())) for row in ids) <= routing.group_used_count


@pytest.mark.slow
def test_a_model_llama_cpp_cannot_load_is_one_error(models_dir):
    src = factory.write_model(models_dir / "to-cut.gguf", "qwen3moe")
    cut = models_dir / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ToolFailed, match=r"tracing cut\.gguf: the decode child exited 3: .*could not load .*cut\.gguf"):
        trace_routing(cut, TOKENS[:4])
    with pytest.raises(BadInput, match="no tokens"):
        trace_routing(src, [])


def test_a_decode_request_is_the_same_after_its_json():
    request = DecodeRequest(
        "m.gguf",
        (ConsumerSpec("nodes", "ggufcarve.llama.trace:capture", {"nodes": ["ffn_moe_topk"]}),),
        Batching.single(24, 5),
        documents=((Document(text="a"), Document(messages=(("user", "hi"),))),),
        max_tokens=48,
        logits=True,
        compute=Compute(threads=3),
    )
    assert DecodeRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    with pytest.raises(BadInput, match="not a ggufcarve module:attribute"):
        ConsumerSpec("x", "os:system")
    with pytest.raises(BadInput, match="either calibration documents or token ids"):
        DecodeRequest("m.gguf", (), Batching.of(512))


@pytest.mark.slow
def test_a_failing_decode_child_is_named_by_its_own_last_lines(make_model):
    """A child that refuses its input is a BadInput; one that fails is a ToolFailed that quotes the
    child's own last line (here Python's), not a guess about llama.cpp."""
    path = str(make_model("qwen3moe", "F32"))
    refused = DecodeRequest(
        path,
        (ConsumerSpec("nodes", "ggufcarve.llama.trace:capture", {"nodes": ["ffn_moe_everything"]}),),
        Batching.single(8, 8),
        tokens=tuple(TOKENS[:8]),
    )
    with pytest.raises(BadInput, match="cannot capture ffn_moe_everything"):
        decode(refused, what="tracing")
    broken = DecodeRequest(
        path,
        (ConsumerSpec("nodes", "ggufcarve.llama.trace:no_such_factory"),),
        Batching.single(8, 8),
        tokens=tuple(TOKENS[:8]),
    )
    with pytest.raises(ToolFailed) as failed:
        decode(broken, what="tracing")
    assert "the decode child exited 1" in failed.value.message and "no_such_factory" in failed.value.message, (
        failed.value
    )
    assert "llama.cpp" not in str(failed.value), failed.value
