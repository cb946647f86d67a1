"""The test fixtures themselves: tiny MoE GGUFs that llama.cpp loads and routes through."""

from __future__ import annotations

import factory
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from llama_probe import probe

TOKENS = [factory.BOS_ID] + [int(t) for t in np.random.default_rng(123).integers(3, factory.N_VOCAB, 31)]
K_QUANTS = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields[key]
    return f.contents(), f.types


def _tensors(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in reader.tensors}


def _moe_blocks(reader: gguf.GGUFReader) -> list[int]:
    """Main (non-MTP) blocks with a router: the blocks llama.cpp routes in its decode graph."""
    arch = reader.fields["general.architecture"].contents()
    n_blocks = reader.fields[f"{arch}.block_count"].contents()
    nextn = (
        reader.fields[f"{arch}.nextn_predict_layers"].contents()
        if f"{arch}.nextn_predict_layers" in reader.fields
        else 0
    )
    names = _tensors(reader)
    return [b for b in range(n_blocks - nextn) if f"blk.{b}.ffn_gate_inp.weight" in names]


# ---------------------------------------------------------------------------------------------
# file layout (no llama.cpp)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", factory.ARCHES)
@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_layout(make_model, arch, dtype):
    r = gguf.GGUFReader(make_model(arch, dtype))
    gguf_arch = factory.FUSED_BASE_ARCH if arch == "fused" else arch
    d = factory.ARCH_DEFAULTS[arch]
    assert r.fields["general.architecture"].contents() == gguf_arch
    count, types = _field(r, f"{gguf_arch}.expert_count")
    assert count == d["n_expert"] and types == [gguf.GGUFValueType.UINT32]
    assert r.fields[f"{gguf_arch}.expert_used_count"].contents() == d["n_expert_used"]
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == factory.N_VOCAB

    t = _tensors(r)
    n_blocks = r.fields[f"{gguf_arch}.block_count"].contents()
    moe = _moe_blocks(r)
    for b in range(n_blocks):
        if f"blk.{b}.ffn_gate_inp.weight" not in t:
            continue
        router = t[f"blk.{b}.ffn_gate_inp.weight"]
        assert router.tensor_type == QT.F32
        assert list(router.shape) == [256, d["n_expert"]]
        exps = [t[f"blk.{b}.ffn_down_exps.weight"]]
        exps += (
            [t[f"blk.{b}.ffn_gate_up_exps.weight"]]
            if arch == "fused"
            else [t[f"blk.{b}.ffn_gate_exps.weight"], t[f"blk.{b}.ffn_up_exps.weight"]]
        )
        for e in exps:
            assert int(e.shape[-1]) == d["n_expert"], e.name
            assert e.tensor_type == (QT.Q8_0 if dtype == "Q8_0" else QT.F16), e.name

    if gguf_arch == "qwen35moe":
        assert r.fields["qwen35moe.nextn_predict_layers"].contents() == 1
        assert n_blocks == d["n_layer"] + 1
        mtp = n_blocks - 1
        assert f"blk.{mtp}.nextn.eh_proj.weight" in t and f"blk.{mtp}.ffn_gate_inp.weight" in t
        assert moe == list(range(d["n_layer"]))
        assert "blk.0.ssm_a" in t and "blk.0.attn_q.weight" not in t  # linear attention
        assert "blk.1.attn_q.weight" in t and "blk.1.ssm_a" not in t  # full attention
        assert all(f"blk.{b}.ffn_gate_inp_shexp.weight" in t for b in range(n_blocks))
        fused_names = [n for n in t if n.endswith("ffn_gate_up_exps.weight")]
        split_names = [n for n in t if n.endswith("ffn_gate_exps.weight")]
        if arch == "fused":
            assert len(fused_names) == n_blocks and not split_names
            assert list(t["blk.0.ffn_gate_up_exps.weight"].shape) == [256, 512, d["n_expert"]]
        else:
            assert len(split_names) == n_blocks and not fused_names
    elif arch == "deepseek2":
        assert r.fields["deepseek2.expert_group_count"].contents() == d["n_group"]
        assert r.fields["deepseek2.expert_group_used_count"].contents() == d["n_group_used"]
        assert r.fields["deepseek2.leading_dense_block_count"].contents() == 1
        assert "blk.0.ffn_gate_inp.weight" not in t and "blk.0.ffn_up.weight" in t
        assert moe == list(range(1, d["n_layer"]))
        assert all(f"blk.{b}.exp_probs_b.bias" in t and f"blk.{b}.ffn_up_shexp.weight" in t for b in moe)
    elif arch == "gpt-oss":
        for b in moe:
            assert list(t[f"blk.{b}.ffn_gate_inp.bias"].shape) == [d["n_expert"]]
            assert list(t[f"blk.{b}.ffn_down_exps.bias"].shape) == [256, d["n_expert"]]
            assert f"blk.{b}.attn_sinks.weight" in t


def test_deterministic(models_dir):
    a = factory.write_model(models_dir / "det-a.gguf", "qwen3moe", seed=7)
    b = factory.write_model(models_dir / "det-b.gguf", "qwen3moe", seed=7)
    c = factory.write_model(models_dir / "det-c.gguf", "qwen3moe", seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_expert_slabs_do_not_depend_on_n_expert(make_model):
    """Expert e has the same bytes whatever n_expert is (the expert axis is outermost)."""
    big = _tensors(gguf.GGUFReader(make_model("qwen3moe", "Q8_0")))
    small = _tensors(gguf.GGUFReader(make_model("qwen3moe", "Q8_0", n_expert=4)))
    for name in ("blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.1.ffn_gate_inp.weight"):
        assert np.array_equal(np.asarray(big[name].data)[:4], np.asarray(small[name].data)), name
    assert np.array_equal(np.asarray(big["blk.1.attn_q.weight"].data), np.asarray(small["blk.1.attn_q.weight"].data))


def test_fused_holds_split_gate_then_up(make_model):
    fused = _tensors(gguf.GGUFReader(make_model("fused")))
    split = _tensors(gguf.GGUFReader(make_model("qwen35moe")))
    for b in range(3):  # includes the MTP block
        gate_up = np.asarray(fused[f"blk.{b}.ffn_gate_up_exps.weight"].data)  # [n_expert, 2*n_ff, n_embd]
        gate = np.asarray(split[f"blk.{b}.ffn_gate_exps.weight"].data)
        up = np.asarray(split[f"blk.{b}.ffn_up_exps.weight"].data)
        assert np.array_equal(gate_up, np.concatenate([gate, up], axis=1))


def test_router_rows_have_distinct_norms(make_model):
    t = _tensors(gguf.GGUFReader(make_model("qwen3moe")))
    norms = np.linalg.norm(np.asarray(t["blk.0.ffn_gate_inp.weight"].data), axis=1)
    assert len(np.unique(np.round(norms, 3))) == len(norms)


def test_alignment_is_written_and_used(make_model):
    r = gguf.GGUFReader(make_model("qwen3moe", "Q8_0", alignment=64))
    value, types = _field(r, "general.alignment")
    assert value == 64 and types == [gguf.GGUFValueType.UINT32]
    assert r.alignment == 64 and r.data_offset % 64 == 0
    assert all(t.data_offset % 64 == 0 for t in r.tensors)


def test_invalid_routing_is_rejected_before_llama(models_dir):
    with pytest.raises(ValueError, match="grouped routing"):  # 1 group of 4 cannot fill top-8
        factory.write_model(models_dir / "bad.gguf", "deepseek2", n_expert_used=8, n_group_used=1)
    with pytest.raises(ValueError):
        factory.write_model(models_dir / "bad.gguf", "qwen3moe", n_expert=2, n_expert_used=3)


# ---------------------------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------------------------


def _check_run(path, n_expert: int, k: int):
    res = probe(path, TOKENS, trace_routing=True)
    assert res.ok, res.stderr[-4000:]
    assert res.logits.shape == (len(TOKENS), factory.N_VOCAB)
    assert np.isfinite(res.logits).all()
    assert res.logits.std() > 0.1
    assert sorted(res.routed) == _moe_blocks(gguf.GGUFReader(path))
    for block, ids in res.routed.items():
        assert ids.shape == (len(TOKENS), k) and ids.dtype == np.int32, block
        assert ids.min() >= 0 and ids.max() < n_expert, block
        assert all(len(set(row)) == k for row in ids.tolist()), block
    return res


@pytest.mark.slow
@pytest.mark.parametrize("arch", factory.ARCHES)
@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_fixture_runs_in_llama(make_model, arch, dtype):
    d = factory.ARCH_DEFAULTS[arch]
    res = _check_run(make_model(arch, dtype), d["n_expert"], d["n_expert_used"])
    if arch == "deepseek2":
        per_group = d["n_expert"] // d["n_group"]
        for ids in res.routed.values():
            groups_hit = [len(set((row // per_group).tolist())) for row in ids]
            assert max(groups_hit) <= d["n_group_used"]


@pytest.mark.slow
def test_routing_trace_varies_and_is_per_token(make_model):
    path = make_model("qwen3moe")
    full = _check_run(path, 8, 2)
    for block, ids in full.routed.items():
        pairs = {tuple(sorted(row)) for row in ids.tolist()}
        assert len(pairs) > 1, f"block {block}: every token routed to {pairs}"
        assert len(np.unique(ids)) >= 4, f"block {block}: only experts {np.unique(ids)}"
    # Causal attention: routing of a prefix does not depend on later tokens, so the trace of the
    # first 8 tokens alone must equal the first 8 rows of the full trace.
    prefix = probe(path, TOKENS[:8], trace_routing=True)
    assert prefix.ok, prefix.stderr[-4000:]
    for block, ids in full.routed.items():
        np.testing.assert_array_equal(np.sort(prefix.routed[block], axis=1), np.sort(ids[:8], axis=1))
    np.testing.assert_allclose(prefix.logits, full.logits[:8], rtol=1e-3, atol=1e-3)


def _qwen3moe_block0_router_logits(path, tokens: list[int]) -> np.ndarray:
    """Router logits [n_tokens, n_expert] of block 0 of an F32 qwen3moe fixture, in numpy.

    Mirrors src/models/qwen3moe.cpp: RMS norm, Q/K/V, per-head Q/K RMS norm, NEOX RoPE, causal
    GQA attention, output projection, residual, RMS norm, router matmul.
    """
    r = gguf.GGUFReader(path)
    w = {t.name: np.asarray(t.data, dtype=np.float64) for t in r.tensors if t.name.startswith(("token_embd", "blk.0."))}
    n_head = r.fields["qwen3moe.attention.head_count"].contents()
    n_head_kv = r.fields["qwen3moe.attention.head_count_kv"].contents()
    hd = r.fields["qwen3moe.attention.key_length"].contents()
    eps = r.fields["qwen3moe.attention.layer_norm_rms_epsilon"].contents()
    base = r.fields["qwen3moe.rope.freq_base"].contents()

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rope_neox(x):  # x [T, H, hd]; NEOX pairs element i with i + hd/2
        pos = np.arange(x.shape[0])[:, None, None]
        inv = base ** (-np.arange(hd // 2) * 2.0 / hd)
        ang = pos * inv[None, None, :]
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1)

    x = w["token_embd.weight"][tokens]
    h = rms(x, w["blk.0.attn_norm.weight"])
    n = len(tokens)
    q = rope_neox(rms((h @ w["blk.0.attn_q.weight"].T).reshape(n, n_head, hd), w["blk.0.attn_q_norm.weight"]))
    k = rope_neox(rms((h @ w["blk.0.attn_k.weight"].T).reshape(n, n_head_kv, hd), w["blk.0.attn_k_norm.weight"]))
    v = (h @ w["blk.0.attn_v.weight"].T).reshape(n, n_head_kv, hd)
    k = np.repeat(k, n_head // n_head_kv, axis=1)
    v = np.repeat(v, n_head // n_head_kv, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("hts,shd->thd", p, v).reshape(n, n_head * hd)
    ffn_inp = attn @ w["blk.0.attn_output.weight"].T + x
    return rms(ffn_inp, w["blk.0.ffn_norm.weight"]) @ w["blk.0.ffn_gate_inp.weight"].T


@pytest.mark.slow
def test_routing_trace_matches_numpy_reference(make_model):
    path = make_model("qwen3moe", "F32")
    res = probe(path, TOKENS, trace_routing=True)
    assert res.ok, res.stderr[-4000:]
    logits = _qwen3moe_block0_router_logits(path, TOKENS)
    order = np.argsort(-logits, axis=1)
    top = np.sort(logits, axis=1)[:, ::-1]
    clear = (top[:, 1] - top[:, 2]) > 1e-2  # llama.cpp keeps K/V in F16: skip near-ties
    assert clear.sum() >= len(TOKENS) * 3 // 4
    expected = np.sort(order[:, :2], axis=1)[clear]
    np.testing.assert_array_equal(np.sort(res.routed[0], axis=1)[clear], expected)


@pytest.mark.slow
def test_fused_and_split_experts_give_the_same_logits(make_model):
    fused = probe(make_model("fused"), TOKENS)
    split = probe(make_model("qwen35moe"), TOKENS)
    assert fused.ok and split.ok, fused.stderr[-2000:] + split.stderr[-2000:]
    np.testing.assert_allclose(fused.logits, split.logits, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_aligned_fixture_loads(make_model):
    _check_run(make_model("qwen3moe", "Q8_0", alignment=64), 8, 2)


@pytest.mark.slow
def test_k_quant_from_llama_quantizer(make_model, models_dir):
    dst = factory.quantize_with_llama(make_model("qwen3moe"), models_dir / "qwen3moe-Q4_K_M.gguf", "Q4_K_M")
    r = gguf.GGUFReader(dst)
    assert r.fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    t = _tensors(r)
    for b in range(2):
        for kind in ("gate", "up", "down"):
            assert t[f"blk.{b}.ffn_{kind}_exps.weight"].tensor_type in K_QUANTS
        assert t[f"blk.{b}.ffn_gate_inp.weight"].tensor_type == QT.F32
    _check_run(dst, 8, 2)


@pytest.mark.slow
def test_quantizer_failure_raises_with_llama_stderr(make_model, models_dir):
    dst = models_dir / "needs-imatrix.gguf"
    with pytest.raises(RuntimeError, match="requires an imatrix"):
        factory.quantize_with_llama(make_model("qwen3moe"), dst, "IQ2_XXS")
    assert not dst.exists()


@pytest.mark.slow
def test_dense_model_loads(dense_model):
    res = probe(dense_model, TOKENS, trace_routing=True)
    assert res.ok, res.stderr[-4000:]
    assert res.logits.shape == (len(TOKENS), factory.N_VOCAB) and np.isfinite(res.logits).all()
    assert res.routed == {}


@pytest.mark.slow
def test_probe_reports_llama_failure(models_dir):
    bad = models_dir / "truncated.gguf"
    src = factory.write_model(models_dir / "to-truncate.gguf", "qwen3moe")
    bad.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    res = probe(bad, TOKENS[:4])
    assert not res.ok and res.logits is None
    assert "llama_model_load" in res.stderr or "failed" in res.stderr
