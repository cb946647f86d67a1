"""greedy: error(S) against a brute-force numpy oracle (gguf-py weights, llama.cpp's captured block
inputs and router logits), the exhaustive optimum beside greedy's keep-set, and the scores' top-K
as the elimination's S on grouped routing."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import numpy as np
import pytest
from clirun import ggufcarve
from conftest import CALIBRATION_WORDS
from gguf import GGUFReader
from gguf.quants import dequantize

from ggufcarve.gguf.container import read_model
from ggufcarve.llama.devices import Compute
from ggufcarve.llama.trace import trace_routing
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.select.experts import ExpertEvaluator
from ggufcarve.select.greedy import NODES, greedy_block, router_of

CTX = 128
pytestmark = pytest.mark.slow  # every test traces a fixture through llama.cpp


@pytest.fixture(scope="module")
def qwen_traced(make_model):
    """An 8-expert top-2 qwen3moe fixture (softmax renormalised over the top-2) and its trace."""
    path = make_model("qwen3moe", "F32")
    return path, _trace(path, _tokens(4 * CTX))


def _tensors(path) -> dict[str, np.ndarray]:
    return {
        t.name: dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        for t in GGUFReader(path).tensors
    }


def _expert_outputs(weights: dict[str, np.ndarray], block: int, x: np.ndarray) -> np.ndarray:
    """[E, T, n_embd]: down (silu(gate x) * up x) of every expert, float64."""
    gate, up, down = (weights[f"blk.{block}.ffn_{n}_exps.weight"].astype(np.float64) for n in ("gate", "up", "down"))
    g, u = np.einsum("efd,td->etf", gate, x), np.einsum("efd,td->etf", up, x)
    return np.einsum("edf,etf->etd", down, g / (1 + np.exp(-g)) * u)


def _tokens(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(CALIBRATION_WORDS) for _ in range(count))
    return [3 + b for b in text.encode()][:count]


def _trace(path, tokens):
    return trace_routing(
        path, tokens, nodes=(*NODES, "ffn_moe_logits"), logits=False, context=CTX, compute=Compute(threads=2)
    )


def _block(path, trace, block):
    model = read_model(path)
    layout = inspect_layout(model)
    nodes = {n: trace.nodes[n][block] for n in NODES}
    return greedy_block(
        router_of(model, layout, block), nodes, ExpertEvaluator(model, layout, engine="ggml"), block
    )  # the engine greedy runs


@pytest.mark.parametrize("block", [0, 1])
def test_greedy_error_equals_brute_force_for_every_subset_of_four(qwen_traced, block):
    path, trace = qwen_traced
    x = trace.nodes["ffn_moe_input"][block].astype(np.float64)
    logits = trace.nodes["ffn_moe_logits"][block].astype(np.float64)
    f = _expert_outputs(_tensors(path), block, x)  # the oracle: every expert on every token
    n_expert, k = logits.shape[1], 2

    def output(keep) -> np.ndarray:
        masked = np.full_like(logits, -np.inf)
        masked[:, list(keep)] = logits[:, list(keep)]
        top = np.argsort(-masked, axis=1)[:, :k]
        w = np.exp(np.take_along_axis(masked, top, axis=1) - masked.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        return np.einsum("tj,tjd->td", w, f[top, np.arange(len(x))[:, None]])

    y = output(range(n_expert))

    def oracle(keep) -> float:
        return float(np.mean(np.sum((y - output(keep)) ** 2, axis=1)))

    greedy = _block(path, trace, block)
    subsets = list(itertools.combinations(range(n_expert), 4))
    assert len(subsets) == 70
    exhaustive = {s: oracle(s) for s in subsets}
    for s in subsets:
        assert greedy.error(s) == pytest.approx(exhaustive[s], rel=1e-4, abs=1e-9), s

    result = greedy.eliminate()
    assert len(result.removed) == n_expert - k and sorted(result.survivors + result.removed) == list(range(n_expert))
    for step, error in enumerate(result.errors):  # the incremental errors of the elimination
        assert error == pytest.approx(
            oracle(sorted(set(range(n_expert)) - set(result.removed[: step + 1]))), rel=1e-4, abs=1e-9
        )
    keep4 = tuple(sorted(set(range(n_expert)) - set(result.removed[:4])))
    score = result.scores(n_expert)
    assert tuple(sorted(np.argsort(-score, kind="stable")[:4])) == keep4
    best = min(exhaustive, key=exhaustive.get)
    rank = sorted(exhaustive.values()).index(exhaustive[keep4]) + 1

    # frequency and reap, computed here from llama.cpp's routing and the oracle's outputs
    top = trace.nodes["ffn_moe_topk"][block].astype(np.intp)
    counts = np.bincount(top.reshape(-1), minlength=n_expert).astype(np.float64)
    full_top = np.argsort(-logits, axis=1)[:, :k]
    w = np.exp(np.take_along_axis(logits, full_top, axis=1))
    w /= w.sum(axis=1, keepdims=True)
    norms = np.linalg.norm(f[full_top, np.arange(len(x))[:, None]], axis=2)
    reap = np.bincount(full_top.reshape(-1), weights=(w * norms).reshape(-1), minlength=n_expert) / np.maximum(
        counts, 1
    )
    keep_of = {
        m: tuple(sorted(sorted(range(n_expert), key=lambda e: (-s[e], e))[:4]))
        for m, s in (("frequency", counts), ("reap", reap))
    }
    print(
        f"\n| blk.{block}: 8 experts keep 4, {len(x)} tokens | keep-set | error(S) "
        f"|\n|---|---|---:|\n| exhaustive optimum | {best} | {exhaustive[best]:.6g} |"
        f"\n| greedy (rank {rank} of 70) | {keep4} | {exhaustive[keep4]:.6g} |"
        + "".join(f"\n| {m} | {s} | {exhaustive[s]:.6g} |" for m, s in keep_of.items())
    )
    assert exhaustive[keep4] >= exhaustive[best]
    for method, keep in keep_of.items():
        assert exhaustive[keep4] <= exhaustive[keep] * (1 + 1e-9), method


def test_greedy_memory_estimate_is_the_traced_arrays_and_the_block_outputs(qwen_traced):
    """memory_estimate's captures are the bytes llama.cpp's traced nodes take (every block), its
    values the [T, E, n_embd] float32 expert outputs a block allocates."""
    from ggufcarve.select.greedy import memory_estimate

    path, trace = qwen_traced
    layout = inspect_layout(read_model(path))
    tokens = len(trace.nodes["ffn_moe_input"][0])
    estimate = memory_estimate(layout, tokens)
    assert estimate.captures == sum(
        trace.nodes[n][b].astype(np.float32 if n != "ffn_moe_topk" else np.int32).nbytes
        for n in NODES
        for b in trace.nodes[n]
    )
    assert estimate.values == _block(path, trace, 0).outputs.values.nbytes


def test_greedy_with_softmax_not_renormalised_rescales_every_token(qwen_traced):
    """qwen2moe-style routing (softmax over S, top-k weights not renormalised) on a traced block:
    removing an expert rescales the weights of every token, which the elimination computes from
    dot products for the tokens that keep their experts."""
    path, trace = qwen_traced
    greedy = _block(path, trace, 1)
    greedy.router = replace(greedy.router, normalised=False, scale=2.0)
    greedy.y = greedy.output(np.ones(8, dtype=bool))
    x = trace.nodes["ffn_moe_input"][1].astype(np.float64)
    logits = trace.nodes["ffn_moe_logits"][1].astype(np.float64)
    f = _expert_outputs(_tensors(path), 1, x)

    def output(keep) -> np.ndarray:
        masked = np.full_like(logits, -np.inf)
        masked[:, list(keep)] = logits[:, list(keep)]
        top = np.argsort(-masked, axis=1)[:, :2]
        p = np.exp(masked - masked.max(axis=1, keepdims=True))
        w = 2.0 * np.take_along_axis(p / p.sum(axis=1, keepdims=True), top, axis=1)
        return np.einsum("tj,tjd->td", w, f[top, np.arange(len(x))[:, None]])

    y = output(range(8))
    result = greedy.eliminate()
    for step, error in enumerate(result.errors):
        keep = sorted(set(range(8)) - set(result.removed[: step + 1]))
        assert error == pytest.approx(float(np.mean(np.sum((y - output(keep)) ** 2, axis=1))), rel=1e-4, abs=1e-9), keep


@pytest.mark.parametrize("v2_routing", [False, True])
def test_greedy_on_grouped_routing_keeps_groups_balanced(make_model, tmp_path, v2_routing):
    """deepseek2, 16 experts in 4 groups (2 used), top-4, exp_probs_b: V3's sigmoid gating,
    renormalised, x1.5; V2's softmax gating, not renormalised, x16 (every token recomputed)."""
    path = make_model("deepseek2", "F32", v2_routing=v2_routing)
    block = 1
    trace = _trace(path, _tokens(2 * CTX, seed=1))
    x = trace.nodes["ffn_moe_input"][block].astype(np.float64)
    logits = trace.nodes["ffn_moe_logits"][block].astype(np.float64)
    weights = _tensors(path)
    f = _expert_outputs(weights, block, x)
    bias = weights[f"blk.{block}.exp_probs_b.bias"].astype(np.float64)

    def output(keep) -> np.ndarray:
        masked = np.full_like(logits, -np.inf)
        masked[:, list(keep)] = logits[:, list(keep)]
        if v2_routing:
            probs = np.exp(masked - masked.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
        else:
            probs = 1 / (1 + np.exp(-masked))
        selection = np.full_like(probs, -np.inf)
        selection[:, list(keep)] = (probs + bias)[:, list(keep)]
        group_scores = np.sort(selection.reshape(len(x), 4, 4), axis=2)[:, :, -2:].sum(axis=2)
        used = np.argsort(-group_scores, axis=1)[:, :2]
        open_ = np.zeros((len(x), 16), dtype=bool)
        for g in range(2):
            open_[np.arange(len(x))[:, None], used[:, g, None] * 4 + np.arange(4)] = True
        top = np.argsort(-np.where(open_, selection, -np.inf), axis=1)[:, :4]
        w = np.take_along_axis(probs, top, axis=1)
        w = 16.0 * w if v2_routing else 1.5 * w / w.sum(axis=1, keepdims=True)
        return np.einsum("tj,tjd->td", w, f[top, np.arange(len(x))[:, None]])

    def oracle(keep) -> float:
        return float(np.mean(np.sum((y - output(keep)) ** 2, axis=1)))

    y = output(range(16))
    greedy = _block(path, trace, block)
    rng = np.random.default_rng(0)
    for _ in range(4):
        keep = sorted(int(e) for g in range(4) for e in rng.choice(range(4 * g, 4 * g + 4), size=2, replace=False))
        assert greedy.error(keep) == pytest.approx(oracle(keep), rel=1e-4, abs=1e-9), keep
    result = greedy.eliminate()
    assert len(result.removed) == 8
    for step in (0, 3, 4, 7):  # unbalanced (15, 12 + 1...) and balanced sets of the elimination
        assert result.errors[step] == pytest.approx(
            oracle(sorted(set(range(16)) - set(result.removed[: step + 1]))), rel=1e-4, abs=1e-9
        )
    if v2_routing:
        return

    calibration = tmp_path / "calibration.txt"
    calibration.write_text(" ".join(random.Random(2).choice(CALIBRATION_WORDS) for _ in range(400)))
    scores = tmp_path / "scores.json"
    run = ggufcarve(
        "score", path, "--method", "greedy", "--calibration", calibration, "--ctx", CTX, "-t", 2, "-o", scores, "-q"
    )
    assert run.code == 0, run.stderr
    doc = json.loads(scores.read_text())
    assert doc["parameters"]["pass"]["consumer"] == "greedy" and "greedy" in doc["parameters"]["pass"]["statistics"]
    record = doc["parameters"]["greedy"]
    for kept in (8, 12):  # the loadable K: 2 or 3 of each group
        out = tmp_path / f"select-{kept}.json"
        run = ggufcarve("select", scores, "--keep", kept, "-o", out, "--no-heatmap", "-q")
        assert run.code == 0, run.stderr
        layers = json.loads(out.read_text())["layers"]
        for b in ("1", "2"):
            removed = record[b]["removed"]
            assert len(removed) == 8 and len(record[b]["error"]) == 8 and len(record[b]["survivors"]) == 8
            held = sorted(set(range(16)) - set(removed[: 16 - kept]))
            assert [sum(1 for e in held if e // 4 == g) for g in range(4)] == [kept // 4] * 4
            assert layers[b] == held


@pytest.mark.parametrize("arch", ["gpt-oss", "qwen35moe"])
def test_greedy_full_output_is_llama_cpps_ffn_moe_out(make_model, arch):
    """The routing recomputed for the full expert set (gpt-oss: softmax over the selected biased
    logits, down biases; qwen35moe: renormalised softmax) gives llama.cpp's own block output, and
    the elimination's errors are error(S) of its sets."""
    path = make_model(arch, "F32")
    trace = trace_routing(
        path, _tokens(2 * CTX), nodes=(*NODES, "ffn_moe_out"), logits=False, context=CTX, compute=Compute(threads=2)
    )
    greedy = _block(path, trace, 1)
    out = trace.nodes["ffn_moe_out"][1].astype(np.float64)
    assert np.abs(greedy.y - out).max() <= 1e-5 * np.abs(out).max()
    assert greedy.error(range(8)) == 0.0
    result = greedy.eliminate()
    for step, error in enumerate(result.errors):
        assert error == pytest.approx(greedy.error(sorted(set(range(8)) - set(result.removed[: step + 1]))), rel=1e-6)
