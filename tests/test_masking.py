"""llama.cpp is the judge: the unpruned model with the pruned experts masked out of routing
computes the logits of the file `ggufcarve prune` writes.

The oracle of every comparison is llama.cpp decoding the really pruned file (written by the CLI);
the unmasked model and a mask of the router logits alone (no selection scores) show that the
comparison can fail.
"""

from __future__ import annotations

import json

import factory
import numpy as np
import pytest
from clirun import ggufcarve

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.llama import masking
from ggufcarve.llama.devices import Compute
from ggufcarve.moe.keepset import KeepSet, check_keepset
from ggufcarve.moe.layout import inspect_layout

pytestmark = pytest.mark.slow

# Largest |masked - pruned| logit allowed (the fixtures' logits are of order 1-5; pruning moves
# them by 2-6). Measured on llama-cpp-python 0.3.36, CPU with AVX-512, F16 fixtures: 0.0
# (bit-identical) for qwen3moe, qwen35moe, fused, gpt-oss and sigmoid-gated deepseek2; 1.5e-3 for
# softmax-gated deepseek2 without renormalisation (DeepSeek-V2 routing, weights x16): ggml's
# softmax sums exp() in SIMD lanes (ggml_vec_soft_max_f32), so the -inf entries regroup the sum and
# its last bit, which the F16 rounding of later activations amplifies (F32 fixture: 1e-4).
# Decoding the same tokens in micro-batches of 16 instead of 64 moves llama.cpp's own logits by 3e-3.
TOLERANCE = 5e-3
CONTEXT = 64


def random_keepset(layout, seed: int) -> KeepSet:
    """Half of every routing group of every MoE block, chosen at random, group by group."""
    rng = np.random.default_rng(seed)
    groups = max(layout.group_count, 1)
    size = layout.expert_count // groups
    return KeepSet(
        {
            b: tuple(
                sorted(int(g * size + i) for g in range(groups) for i in rng.choice(size, size // 2, replace=False))
            )
            for b in layout.blocks
        }
    )


def prune(src, keepset: KeepSet, out):
    keep = out.with_suffix(".json")
    keep.write_text(json.dumps(keepset.to_json()))
    r = ggufcarve("prune", src, "--keep", keep, "-o", out, "-q")
    assert r.code == 0, r.stderr
    return out


def engine_logits(path, ids: list[int], mask: masking.RoutingMask | None = None, batch: int = 16) -> np.ndarray:
    """llama.cpp's logits of `ids` in chunks of CONTEXT tokens, micro-batches of `batch`, through the
    evaluation engine (the path tune and best score keep-sets by), with `mask` as its eval callback."""
    from ggufcarve.evaluate.engine import Engine

    engine = Engine(str(path), Compute(threads=2))
    context = engine.context(CONTEXT, 1, batch, eval_callback=mask)
    try:
        chunks = [np.asarray(ids[i : i + CONTEXT], dtype=np.int32) for i in range(0, len(ids), CONTEXT)]
        return np.concatenate([context.chunk_logits([chunk], 0)[0] for chunk in chunks])
    finally:
        context.close()
        engine.close()


def tokens(n: int, seed: int = 7) -> list[int]:
    return [factory.BOS_ID] + np.random.default_rng(seed).integers(3, factory.N_VOCAB, n - 1).tolist()


def mean_kld(reference: np.ndarray, logits: np.ndarray) -> float:
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    p, q = log_softmax(reference), log_softmax(logits)
    return float((np.exp(p) * (p - q)).sum(axis=1).mean())


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("qwen3moe", {}),
        ("qwen35moe", {}),
        ("deepseek2", {}),
        ("deepseek2", {"v2_routing": True}),
        ("gpt-oss", {}),
        ("fused", {}),
    ],
    ids=["qwen3moe", "qwen35moe-mtp", "deepseek2-grouped-sigmoid", "deepseek2-grouped-softmax", "gpt-oss", "fused"],
)
def test_masked_logits_equal_the_pruned_files(make_model, tmp_path, arch, options):
    src = make_model(arch, "F16", **options)
    layout = inspect_layout(read_model(src))
    keepset = random_keepset(layout, seed=1)
    ids = tokens(2 * CONTEXT)
    # micro-batches of 16 (the mask is written in every micro-batch's graph) on both sides: the
    # micro-batch size changes llama.cpp's arithmetic by itself (~3e-3 here between 16 and 64)
    pruned = engine_logits(prune(src, keepset, tmp_path / "p.gguf"), ids)
    mask = masking.RoutingMask(dict(keepset.layers))
    masked = engine_logits(src, ids, mask)
    full = engine_logits(src, ids)

    assert not mask.errors
    assert np.abs(masked - pruned).max() <= TOLERANCE
    assert np.abs(full - pruned).max() > 100 * TOLERANCE  # pruning changes the logits: the comparison can fail
    assert mean_kld(full, masked) == pytest.approx(mean_kld(full, pruned), rel=1e-3)
    assert mean_kld(pruned, masked) <= 1e-6
    decoded = [b for b in layout.blocks if not layout.is_mtp(b)]
    assert {key for key in mask.masked if key.startswith("ffn_moe_logits:")} == {f"ffn_moe_logits:{b}" for b in decoded}
    assert all(count == 2 * CONTEXT // 16 for count in mask.masked.values())
    assert {f"{node}:{block}" for node, block in masking.required_nodes(layout, keepset)} <= set(mask.masked)


def test_grouped_sigmoid_routing_needs_the_selection_scores_masked(make_model, tmp_path):
    """deepseek2 (sigmoid gating, exp_probs_b, 4 groups / 2 used): -inf router logits alone leave
    a pruned expert its selection bias, so it can still be selected; masking the biased scores too
    is what matches the pruned file."""
    src = make_model("deepseek2", "F16")
    layout = inspect_layout(read_model(src))
    keepset = random_keepset(layout, seed=1)
    ids = tokens(2 * CONTEXT)
    pruned = engine_logits(prune(src, keepset, tmp_path / "p.gguf"), ids, batch=CONTEXT)
    logits_only = engine_logits(
        src, ids, masking.RoutingMask(dict(keepset.layers), frozenset({masking.ROUTER_LOGITS})), batch=CONTEXT
    )
    both = engine_logits(src, ids, masking.RoutingMask(dict(keepset.layers)), batch=CONTEXT)
    assert np.abs(logits_only - pruned).max() > 100 * TOLERANCE
    assert np.abs(both - pruned).max() <= TOLERANCE
    assert masking.required_nodes(layout, keepset) == [
        (node, b) for b in (1, 2) for node in (masking.ROUTER_LOGITS, masking.SELECTION_SCORES)
    ]


def test_a_keepset_no_pruned_file_could_hold_is_refused(make_model):
    src = make_model("qwen3moe", "F16")
    with pytest.raises(BadInput, match="different expert counts"):
        check_keepset(KeepSet({0: (0, 1, 2, 3), 1: (0, 1, 2)}), inspect_layout(read_model(src)))


def test_one_loaded_model_scores_several_keepsets(make_model, tmp_path, monkeypatch):
    """The evaluation engine with a RoutingMask: one load, keep-sets swapped between decodes, two
    chunks side by side (two sequences), each keep-set equal to its pruned file in the same engine."""
    monkeypatch.setenv("GGML_NO_BACKTRACE", "1")
    from ggufcarve.evaluate.engine import Engine

    src = make_model("qwen3moe", "F16")
    layout = inspect_layout(read_model(src))
    ids = np.asarray(tokens(2 * CONTEXT), dtype=np.int32)
    chunks = [ids[:CONTEXT], ids[CONTEXT:]]
    chunks[1][0] = factory.BOS_ID
    keepsets = [random_keepset(layout, seed) for seed in (1, 2)]
    assert keepsets[0] != keepsets[1]

    def pruned_logits(path):
        engine = Engine(str(path), Compute(threads=2))
        context = engine.context(CONTEXT, 2)
        try:
            return context.chunk_logits(chunks, 1)
        finally:
            context.close()
            engine.close()

    expected = [pruned_logits(prune(src, k, tmp_path / f"p{i}.gguf")) for i, k in enumerate(keepsets)]
    mask = masking.RoutingMask()
    engine = Engine(str(src), Compute(threads=2))
    context = engine.context(CONTEXT, 2, eval_callback=mask)
    try:
        got = []
        for keepset in keepsets:
            mask.keep = dict(keepset.layers)
            got.append(context.chunk_logits(chunks, 1))
    finally:
        context.close()
        engine.close()
    assert not mask.errors
    for want, have in zip(expected, got):
        for w, h in zip(want, have):
            assert np.abs(w - h).max() <= TOLERANCE
    assert np.abs(expected[0][0] - expected[1][0]).max() > 100 * TOLERANCE
