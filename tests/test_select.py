"""Expert selection: scores, keep-set construction, zero-shot and imatrix criteria, the CLI."""

from __future__ import annotations

import json
import struct

import factory
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.select.keep import choose, compare, super_experts
from ggufcarve.select.methods import score_model
from ggufcarve.select.scores import BlockStats, ExpertScores, ModelFacts, merge_scores


def facts(n=8, k=2, blocks=(0, 1), groups=0, group_used=0, nextn=0):
    return ModelFacts("m.gguf", 1, "qwen3moe", max(blocks) + 1, nextn, n, k, groups, group_used, tuple(blocks))


def value_scores(per_block, **kw):
    f = facts(n=len(next(iter(per_block.values()))), blocks=tuple(per_block), **kw)
    return ExpertScores("weights", f, {b: BlockStats("weights", "value", sums=np.asarray(v, float)) for b, v in per_block.items()})


def test_top_k_ties_go_to_the_lower_id_and_ids_are_ascending():
    s = value_scores({0: [1, 5, 5, 0, 5, 2, 2, 9], 1: [0] * 8})
    sel = choose(s, 4)
    assert sel.keepset.layers == {0: (1, 2, 4, 7), 1: (0, 1, 2, 3)}
    rec = sel.record()
    assert rec["layers"] == {"0": [1, 2, 4, 7], "1": [0, 1, 2, 3]}
    assert rec["per_block"]["0"]["pruned"] == [0, 3, 5, 6] and rec["per_block"]["0"]["score"][7] == 9.0
    assert "lower original expert id" in rec["tie_break"]


def test_groups_keep_the_same_quota_each_and_protected_ids_stay():
    # 16 experts, 4 groups of 4, top-4 with 2 groups used: K=8 keeps 2 per group.
    score = np.arange(16, dtype=float)[::-1].copy()  # expert 0 best
    s = value_scores({1: score, 2: score}, k=4, groups=4, group_used=2)
    sel = choose(s, 8, protect={1: {3}})
    assert sel.keepset.layers[2] == (0, 1, 4, 5, 8, 9, 12, 13)
    assert sel.keepset.layers[1] == (0, 3, 4, 5, 8, 9, 12, 13)
    with pytest.raises(BadInput, match="multiple of the 4 expert groups"):
        choose(s, 6)
    with pytest.raises(BadInput, match="protected experts in group 0"):
        choose(s, 8, protect={1: {0, 1, 2}})
    with pytest.raises(BadInput, match="below the 4 experts"):
        choose(value_scores({0: score}, k=4), 3)


def test_super_experts_follow_reaps_rule():
    maxima = {b: np.ones(128) for b in range(4)}
    maxima[0][5] = 50.0  # an outlier in the first 75% of the blocks: protected
    maxima[3][2] = 60.0  # an outlier in the last quarter: not protected
    f = facts(n=128, blocks=(0, 1, 2, 3))
    blocks = {b: BlockStats("reap", "mean", counts=np.ones(128, np.int64), sums=np.ones(128), maxima=m) for b, m in maxima.items()}
    s = ExpertScores("reap", f, blocks)
    assert super_experts(s) == {0: {5}, 1: set(), 2: set()}
    sel = choose(s, 2, protect_super_experts=True)
    assert 5 in sel.keepset.layers[0] and sel.record()["per_block"]["0"]["super_experts"] == [5]
    with pytest.raises(BadInput, match="maximum outputs"):
        choose(value_scores({0: np.ones(8)}), 2, protect_super_experts=True)


def test_scores_merge_and_round_trip():
    f = facts(blocks=(0,))
    part = lambda c, s, m: ExpertScores("reap", f, {0: BlockStats("reap", "mean", counts=np.array(c, np.int64), sums=np.array(s, float), maxima=np.array(m, float))},
                                        {"ctx": 512, "max_tokens": 10}, ({"kind": "calibration", "name": "a.txt"},), 10)
    a = part([1, 0, 2, 0, 0, 0, 0, 1], [2.0, 0, 1, 0, 0, 0, 0, 4], [1, 0, 3, 0, 0, 0, 0, 1])
    b = part([1, 1, 0, 0, 0, 0, 0, 1], [4.0, 1, 0, 0, 0, 0, 0, 2], [5, 1, 0, 0, 0, 0, 0, 2])
    merged = merge_scores([a, b])
    assert merged.tokens == 20 and len(merged.inputs) == 2
    np.testing.assert_array_equal(merged.blocks[0].counts, [2, 1, 2, 0, 0, 0, 0, 2])
    np.testing.assert_array_equal(merged.blocks[0].maxima, [5, 1, 3, 0, 0, 0, 0, 2])
    np.testing.assert_allclose(merged.scores()[0], [3.0, 1.0, 0.5, 0, 0, 0, 0, 3.0])
    again = ExpertScores.from_json(json.loads(merged.dumps()))
    assert again.dumps() == merged.dumps()
    with pytest.raises(BadInput, match="nothing to merge"):
        merge_scores([value_scores({0: np.ones(8)}), value_scores({0: np.ones(8)})])
    with pytest.raises(BadInput, match="different parameters"):
        merge_scores([a, ExpertScores("reap", f, a.blocks, {"ctx": 256})])


def test_compare_reports_overlap_and_disagreement():
    rows = compare({0: (0, 1, 2, 3)}, {0: (0, 1, 2, 5)})
    assert rows == [{"block": 0, "kept": 4, "overlap": 0.75, "only_a": [3], "only_b": [5]}]


# --- weights: brute force against gguf-py's reader --------------------------------------------

def _get_scale_min_k4(j, q):
    """ggml-quants.c get_scale_min_k4: 6-bit scale j of a Q4_K/Q5_K super-block."""
    if j < 4:
        return q[j] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)


def brute_force_energy(raw: bytes, type_name: str, values: np.ndarray) -> float:
    """One expert's scale energy, block by block in plain Python (F16: from gguf-py's values)."""
    if type_name in ("F16", "F32", "BF16"):
        return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))
    if type_name == "Q8_0":  # the quantizer sets d = amax / 127, so d = max |x| / 127 of each block
        blocks = values.reshape(-1, 32)
        return float(np.mean(np.abs(blocks).max(axis=1) / 127))
    size = {"Q4_K": 144, "Q6_K": 210, "Q5_K": 176}[type_name]
    out = []
    for i in range(0, len(raw), size):
        b = raw[i:i + size]
        if type_name == "Q6_K":
            d = struct.unpack("<e", b[208:210])[0]
            out += [abs(d * s) for s in struct.unpack("<16b", b[192:208])]
        else:
            d = struct.unpack("<e", b[0:2])[0]
            out += [abs(d * _get_scale_min_k4(j, b[4:16])) for j in range(8)]
    return float(np.mean(out))


def brute_force_weights(path) -> dict[int, np.ndarray]:
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layout = inspect_layout(read_model(path))
    result = {}
    for block in layout.blocks:
        router = gguf_dequantize(np.asarray(tensors[f"blk.{block}.ffn_gate_inp.weight"].data), tensors[f"blk.{block}.ffn_gate_inp.weight"].tensor_type)
        norms = np.linalg.norm(router.reshape(layout.expert_count, -1).astype(np.float64), axis=1)
        energies = []
        for suffix in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"):
            t = tensors.get(f"blk.{block}.{suffix}.weight")
            if t is None:
                continue
            raw = np.asarray(t.data).view(np.uint8).tobytes()
            values = gguf_dequantize(np.asarray(t.data), t.tensor_type).reshape(layout.expert_count, -1)
            slab = len(raw) // layout.expert_count
            energies.append([brute_force_energy(raw[e * slab:(e + 1) * slab], t.tensor_type.name, values[e]) for e in range(layout.expert_count)])
        result[block] = norms * np.mean(energies, axis=0)
    return result


def assert_weights_match(path):
    model = read_model(path)
    scores = score_model(model, inspect_layout(model), "weights")
    expected = brute_force_weights(path)
    for block, score in scores.scores().items():
        np.testing.assert_allclose(score, expected[block], rtol=1e-6)
    return scores


@pytest.mark.parametrize("arch,dtype", [("qwen3moe", "F16"), ("qwen3moe", "Q8_0"), ("fused", "Q8_0"), ("gpt-oss", "F16")])
def test_weights_equals_brute_force(make_model, arch, dtype):
    scores = assert_weights_match(make_model(arch, dtype))
    assert set(scores.parameters["scale_rules"]) == {dtype}


@pytest.mark.slow
def test_weights_equals_brute_force_on_k_quants(make_model, tmp_path):
    path = factory.quantize_with_llama(make_model("qwen3moe", "F16"), tmp_path / "q4km.gguf", "Q4_K_M")
    scores = assert_weights_match(path)
    assert {"Q4_K", "Q6_K"} <= set(scores.parameters["scale_rules"])


def test_imatrix_counts_equal_what_llama_imatrix_wrote(q8_moe, q8_moe_imatrix):
    model = read_model(q8_moe)
    scores = score_model(model, inspect_layout(model), "imatrix-counts", imatrix=q8_moe_imatrix)
    tensors = {t.name: t for t in GGUFReader(q8_moe_imatrix).tensors}
    for block, stats in scores.blocks.items():
        written = np.asarray(tensors[f"blk.{block}.ffn_down_exps.weight.counts"].data).reshape(-1)
        np.testing.assert_array_equal(stats.counts, np.rint(written).astype(np.int64))
        assert stats.counts.sum() == 2 * 4 * 128  # top-2 x 4 chunks of 128 tokens
    energy = score_model(model, inspect_layout(model), "imatrix-energy", imatrix=q8_moe_imatrix)
    sums = np.asarray(tensors["blk.0.ffn_down_exps.weight.in_sum2"].data).reshape(8, -1).sum(axis=1)
    np.testing.assert_allclose(energy.scores()[0], sums / scores.blocks[0].counts, rtol=1e-6)
