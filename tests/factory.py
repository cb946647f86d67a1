"""Tiny, loadable Mixture-of-Experts GGUF fixtures for tests.

Every fixture loads in llama.cpp (llama-cpp-python 0.3.36) and produces finite logits.
Shapes follow ``src/models/<arch>.cpp`` (``load_arch_tensors``) of that llama.cpp version;
``ne`` below is ggml order (innermost first), numpy arrays are the reverse.

Architectures (``ARCHES``) and their defaults (``write_model`` arguments left at ``None``):

============  ========  =====  ======  ==========================================================
arch          n_expert  top-k  blocks  layout
============  ========  =====  ======  ==========================================================
qwen3moe      8         2      2       plain MoE: router ``ffn_gate_inp`` + ``ffn_{gate,up,down}_exps``
qwen35moe     8         2      2+1     Qwen3.5/3.6 hybrid: blk.0 gated-delta-net (linear
                                       attention), blk.1 full attention (``full_attention_interval``
                                       = 2), blk.2 is the MTP/NextN block (``nextn_predict_layers``
                                       = 1, counted in ``block_count``) with its own routed experts;
                                       every MoE block has a sigmoid-gated shared expert
fused         8         2      2+1     qwen35moe with ``ffn_gate_up_exps`` (gate rows first, then
                                       up rows, per expert) instead of separate gate/up tensors
deepseek2     16        4      3       MLA attention, blk.0 dense (``leading_dense_block_count``
                                       = 1), blk.1-2 MoE with 4 expert groups / 2 used, sigmoid
                                       gating, ``exp_probs_b.bias``, one shared expert
gpt-oss       8         2      2       router bias, per-expert biases, attention sinks, SWA on
                                       every other layer
============  ========  =====  ======  ==========================================================

``n_layer`` counts the main (non-MTP) blocks; a qwen35moe/fused file has ``n_layer + 1`` blocks.

Weights are generated per tensor from ``(seed, crc32(tensor name))`` and, for tensors with an
expert axis, per expert from ``(seed, crc32(name), expert index)``. Expert ``e`` therefore has
the same bytes in every fixture with the same seed and dimensions whatever ``n_expert`` is, and
``fused`` holds exactly the gate/up values of the matching ``qwen35moe`` fixture. Router rows are
scaled by a distinct factor per expert (``_router_scale``) so that experts differ in how often
they win while different tokens still pick different experts.

Tensor types: matrices use ``dtype``; 1-D tensors, ``*_norm.weight``, biases, ``ssm_a``,
``ssm_conv1d`` and the routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``) stay F32 as
llama.cpp's converter and quantizer keep them. With ``dtype="Q8_0"`` a matrix whose row length
is not a multiple of 32 falls back to F16 (the converter does the same).
"""

from __future__ import annotations

import os
import pathlib
import zlib
from dataclasses import dataclass, field

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

ARCHES = ("qwen3moe", "qwen35moe", "deepseek2", "gpt-oss", "fused")

#: The real llama.cpp architecture written by the ``fused`` fixture.
FUSED_BASE_ARCH = "qwen35moe"

#: Per-architecture defaults for the ``None`` arguments of ``write_model``.
ARCH_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3moe": {"n_expert": 8, "n_expert_used": 2, "n_layer": 2},
    "qwen35moe": {"n_expert": 8, "n_expert_used": 2, "n_layer": 2},
    "fused": {"n_expert": 8, "n_expert_used": 2, "n_layer": 2},
    "deepseek2": {"n_expert": 16, "n_expert_used": 4, "n_layer": 3, "n_group": 4, "n_group_used": 2},
    "gpt-oss": {"n_expert": 8, "n_expert_used": 2, "n_layer": 2},
}

N_VOCAB = 259  # <unk>, <s>, </s>, <0x00>..<0xFF>
BOS_ID = 1
EOS_ID = 2

_DTYPES = {"F32": QT.F32, "F16": QT.F16, "Q8_0": QT.Q8_0}
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}

# Sub-strings of tensor names that are always stored as F32 (matches the converter's list).
_F32_NAME_PARTS = ("ffn_gate_inp.", "ffn_gate_inp_shexp.", "ssm_conv1d.")


# ---------------------------------------------------------------------------------------------
# deterministic data
# ---------------------------------------------------------------------------------------------


def _rng(seed: int, name: str, *extra: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), *extra])


def _router_scale(e: int) -> float:
    """Distinct per-expert router row scale in [0.5, 1.5): fractional parts of e * golden ratio."""
    return 0.5 + (e * 0.6180339887498949) % 1.0


@dataclass
class _Spec:
    """One tensor: ggml shape ``ne`` and the float32 values in numpy order."""

    name: str
    ne: tuple[int, ...]
    values: np.ndarray
    force_f32: bool = False


@dataclass
class _Builder:
    seed: int
    specs: list[_Spec] = field(default_factory=list)

    def _add(self, name: str, ne: tuple[int, ...], values: np.ndarray, force_f32: bool) -> None:
        assert values.shape == tuple(reversed(ne)), (name, values.shape, ne)
        self.specs.append(_Spec(name, tuple(ne), values.astype(np.float32), force_f32))

    def dense(self, name: str, ne: tuple[int, ...], std: float | None = None) -> None:
        """A weight matrix without expert axis; std defaults to 1/sqrt(ne[0]) (fan-in)."""
        std = (1.0 / np.sqrt(ne[0])) if std is None else std
        vals = _rng(self.seed, name).standard_normal(tuple(reversed(ne)), dtype=np.float32) * std
        self._add(name, ne, vals, force_f32=False)

    def norm(self, name: str, n: int) -> None:
        vals = 1.0 + 0.05 * _rng(self.seed, name).standard_normal(n, dtype=np.float32)
        self._add(name, (n,), vals, force_f32=True)

    def vec(self, name: str, n: int, std: float, offset: float = 0.0) -> None:
        vals = offset + std * _rng(self.seed, name).standard_normal(n, dtype=np.float32)
        self._add(name, (n,), vals, force_f32=True)

    def raw(self, name: str, ne: tuple[int, ...], values: np.ndarray, force_f32: bool) -> None:
        self._add(name, ne, values, force_f32)

    def expert_values(self, name: str, per_expert_ne: tuple[int, ...], n_expert: int, std: float) -> np.ndarray:
        """Stack of per-expert values, numpy shape (n_expert, *reversed(per_expert_ne))."""
        shape = tuple(reversed(per_expert_ne))
        return np.stack(
            [_rng(self.seed, name, e).standard_normal(shape, dtype=np.float32) * std for e in range(n_expert)]
        )

    def experts(
        self,
        name: str,
        per_expert_ne: tuple[int, ...],
        n_expert: int,
        std: float | None = None,
        force_f32: bool = False,
    ) -> None:
        """Tensor with the expert axis last in ggml order: ne = (*per_expert_ne, n_expert)."""
        std = (1.0 / np.sqrt(per_expert_ne[0])) if std is None else std
        vals = self.expert_values(name, per_expert_ne, n_expert, std)
        self._add(name, (*per_expert_ne, n_expert), vals, force_f32)

    def router(self, name: str, n_embd: int, n_expert: int) -> None:
        """``ffn_gate_inp.weight`` [n_embd, n_expert]: row e has its own norm (_router_scale)."""
        rows = self.expert_values(name, (n_embd,), n_expert, 1.5 / np.sqrt(n_embd))
        rows *= np.array([_router_scale(e) for e in range(n_expert)], dtype=np.float32)[:, None]
        self._add(name, (n_embd, n_expert), rows, force_f32=True)

    def expert_vec(self, name: str, n_expert: int, std: float) -> None:
        """1-D tensor [n_expert] with one value per expert (router bias, exp_probs_b)."""
        vals = np.array(
            [_rng(self.seed, name, e).standard_normal(dtype=np.float32) * std for e in range(n_expert)],
            dtype=np.float32,
        )
        self._add(name, (n_expert,), vals, force_f32=True)

    def gate_up_exps(self, bid: int, n_embd: int, n_ff_exp: int, n_expert: int, fused: bool) -> None:
        gate = f"blk.{bid}.ffn_gate_exps.weight"
        up = f"blk.{bid}.ffn_up_exps.weight"
        std = 1.0 / np.sqrt(n_embd)
        if not fused:
            self.experts(gate, (n_embd, n_ff_exp), n_expert, std)
            self.experts(up, (n_embd, n_ff_exp), n_expert, std)
            return
        # ffn_gate_up_exps ne = [n_embd, 2*n_ff_exp, n_expert]: per expert the n_ff_exp gate rows
        # come first, then the up rows (llama-graph.cpp build_moe_ffn splits it at n_ff).
        g = self.expert_values(gate, (n_embd, n_ff_exp), n_expert, std)
        u = self.expert_values(up, (n_embd, n_ff_exp), n_expert, std)
        self._add(
            f"blk.{bid}.ffn_gate_up_exps.weight",
            (n_embd, 2 * n_ff_exp, n_expert),
            np.concatenate([g, u], axis=1),
            force_f32=False,
        )


def _storage_type(spec: _Spec, qtype: QT) -> QT:
    name = spec.name
    if (
        spec.force_f32
        or len(spec.ne) == 1
        or not name.endswith(".weight")
        or name.endswith("_norm.weight")
        or any(p in name for p in _F32_NAME_PARTS)
    ):
        return QT.F32
    if qtype == QT.Q8_0 and spec.ne[0] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0] != 0:
        return QT.F16
    return qtype


def _encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return values.astype(np.float32)
    if qtype == QT.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    types = [int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL), int(gguf.TokenType.CONTROL)]
    types += [int(gguf.TokenType.BYTE)] * 256
    return tokens, scores, types


def _write(
    path: pathlib.Path,
    gguf_arch: str,
    kv: list[tuple[str, str, object]],
    specs: list[_Spec],
    dtype: str,
    alignment: int | None,
) -> pathlib.Path:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    qtype = _DTYPES[dtype]
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    w = gguf.GGUFWriter(str(path), gguf_arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)  # writes general.alignment (u32) and pads to it
    w.add_name(f"ggufcarve test {gguf_arch}")
    w.add_file_type(int(_FILE_TYPES[dtype]))
    if qtype == QT.Q8_0:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, kind, value in kv:
        key = key.format(arch=gguf_arch)
        getattr(w, f"add_{kind}")(key, value)

    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(0)

    for spec in specs:
        st = _storage_type(spec, qtype)
        data = _encode(spec.values, st)
        w.add_tensor(spec.name, data, raw_dtype=st if st == QT.Q8_0 else None)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _common_kv(
    n_ctx: int, n_embd: int, n_blocks: int, n_ff: int, n_head: int, n_head_kv: int, eps: float, freq_base: float
) -> list[tuple[str, str, object]]:
    return [
        ("{arch}.context_length", "uint32", n_ctx),
        ("{arch}.embedding_length", "uint32", n_embd),
        ("{arch}.block_count", "uint32", n_blocks),
        ("{arch}.feed_forward_length", "uint32", n_ff),
        ("{arch}.attention.head_count", "uint32", n_head),
        ("{arch}.attention.head_count_kv", "uint32", n_head_kv),
        ("{arch}.attention.layer_norm_rms_epsilon", "float32", eps),
        ("{arch}.rope.freq_base", "float32", freq_base),
    ]


def _moe_kv(n_expert: int, n_expert_used: int, n_ff_exp: int) -> list[tuple[str, str, object]]:
    # expert_count must be u32: llama.cpp type-checks keys on load.
    return [
        ("{arch}.expert_count", "uint32", n_expert),
        ("{arch}.expert_used_count", "uint32", n_expert_used),
        ("{arch}.expert_feed_forward_length", "uint32", n_ff_exp),
    ]


# ---------------------------------------------------------------------------------------------
# architectures
# ---------------------------------------------------------------------------------------------


def _qwen3moe(b: _Builder, *, n_expert, n_expert_used, n_layer, n_embd, n_ff_exp, **_):
    n_head, n_head_kv, head_dim = 4, 2, 64
    kv = _common_kv(4096, n_embd, n_layer, n_ff_exp * n_expert_used, n_head, n_head_kv, 1e-6, 1e6)
    kv += [("{arch}.attention.key_length", "uint32", head_dim), ("{arch}.attention.value_length", "uint32", head_dim)]
    kv += _moe_kv(n_expert, n_expert_used, n_ff_exp)

    b.dense("token_embd.weight", (n_embd, N_VOCAB), std=1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.norm(p + "attn_norm.weight", n_embd)
        b.dense(p + "attn_q.weight", (n_embd, n_head * head_dim))
        b.dense(p + "attn_k.weight", (n_embd, n_head_kv * head_dim))
        b.dense(p + "attn_v.weight", (n_embd, n_head_kv * head_dim))
        b.dense(p + "attn_output.weight", (n_head * head_dim, n_embd))
        b.norm(p + "attn_q_norm.weight", head_dim)
        b.norm(p + "attn_k_norm.weight", head_dim)
        b.norm(p + "ffn_norm.weight", n_embd)
        b.router(p + "ffn_gate_inp.weight", n_embd, n_expert)
        b.gate_up_exps(i, n_embd, n_ff_exp, n_expert, fused=False)
        b.experts(p + "ffn_down_exps.weight", (n_ff_exp, n_embd), n_expert)
    b.norm("output_norm.weight", n_embd)
    b.dense("output.weight", (n_embd, N_VOCAB))
    return "qwen3moe", kv


def _qwen35moe(b: _Builder, *, n_expert, n_expert_used, n_layer, n_embd, n_ff_exp, fused=False, **_):
    n_head, n_head_kv, head_dim, n_rot = 2, 1, 64, 32
    # gated delta net: k heads = ssm.group_count, v heads = ssm.time_step_rank, head dims =
    # ssm.state_size; the graph derives head_v_dim = ssm.inner_size / v heads, so
    # inner_size = state_size * time_step_rank.
    d_state, n_k_heads, n_v_heads, d_conv = 64, 1, 2, 4
    d_inner = d_state * n_v_heads
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    full_attn_interval = 2
    n_ff_shexp = n_ff_exp
    n_blocks = n_layer + 1

    kv = _common_kv(4096, n_embd, n_blocks, n_ff_exp * n_expert_used, n_head, n_head_kv, 1e-6, 1e7)
    kv += [
        ("{arch}.attention.key_length", "uint32", head_dim),
        ("{arch}.attention.value_length", "uint32", head_dim),
        ("{arch}.rope.dimension_count", "uint32", n_rot),
        # interleaved M-RoPE sections count rotary pairs: they sum to n_rot / 2
        ("{arch}.rope.dimension_sections", "array", [6, 5, 5, 0]),
        ("{arch}.full_attention_interval", "uint32", full_attn_interval),
        ("{arch}.ssm.conv_kernel", "uint32", d_conv),
        ("{arch}.ssm.state_size", "uint32", d_state),
        ("{arch}.ssm.group_count", "uint32", n_k_heads),
        ("{arch}.ssm.time_step_rank", "uint32", n_v_heads),
        ("{arch}.ssm.inner_size", "uint32", d_inner),
        ("{arch}.expert_shared_feed_forward_length", "uint32", n_ff_shexp),
        ("{arch}.nextn_predict_layers", "uint32", 1),
    ]
    kv += _moe_kv(n_expert, n_expert_used, n_ff_exp)

    def full_attention(p: str) -> None:
        # attn_q carries query and output gate interleaved per head: 2 * head_dim rows per head
        b.dense(p + "attn_q.weight", (n_embd, n_head * head_dim * 2))
        b.dense(p + "attn_k.weight", (n_embd, n_head_kv * head_dim))
        b.dense(p + "attn_v.weight", (n_embd, n_head_kv * head_dim))
        b.dense(p + "attn_output.weight", (n_head * head_dim, n_embd))
        b.norm(p + "attn_q_norm.weight", head_dim)
        b.norm(p + "attn_k_norm.weight", head_dim)

    def moe(i: int) -> None:
        p = f"blk.{i}."
        b.router(p + "ffn_gate_inp.weight", n_embd, n_expert)
        b.gate_up_exps(i, n_embd, n_ff_exp, n_expert, fused=fused)
        b.experts(p + "ffn_down_exps.weight", (n_ff_exp, n_embd), n_expert)
        b.vec(p + "ffn_gate_inp_shexp.weight", n_embd, std=1.0 / np.sqrt(n_embd))
        b.dense(p + "ffn_gate_shexp.weight", (n_embd, n_ff_shexp))
        b.dense(p + "ffn_up_shexp.weight", (n_embd, n_ff_shexp))
        b.dense(p + "ffn_down_shexp.weight", (n_ff_shexp, n_embd))

    b.dense("token_embd.weight", (n_embd, N_VOCAB), std=1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.norm(p + "attn_norm.weight", n_embd)
        b.norm(p + "post_attention_norm.weight", n_embd)
        if (i + 1) % full_attn_interval == 0:
            full_attention(p)
        else:
            b.dense(p + "attn_qkv.weight", (n_embd, conv_dim))
            b.dense(p + "attn_gate.weight", (n_embd, value_dim))
            b.raw(
                p + "ssm_conv1d.weight",
                (d_conv, conv_dim),
                0.5 * _rng(b.seed, p + "ssm_conv1d.weight").standard_normal((conv_dim, d_conv), dtype=np.float32),
                force_f32=True,
            )
            b.vec(p + "ssm_dt.bias", n_v_heads, std=0.5)
            # ssm_a = -exp(A_log): must be negative (state decay)
            b.raw(
                p + "ssm_a",
                (n_v_heads,),
                -np.exp(_rng(b.seed, p + "ssm_a").uniform(-1.0, 0.5, n_v_heads)).astype(np.float32),
                force_f32=True,
            )
            b.dense(p + "ssm_beta.weight", (n_embd, n_v_heads))
            b.dense(p + "ssm_alpha.weight", (n_embd, n_v_heads))
            b.norm(p + "ssm_norm.weight", d_state)
            b.dense(p + "ssm_out.weight", (value_dim, n_embd))
        moe(i)

    # MTP / NextN block: a full-attention decoder block with MoE plus the nextn tensors.
    m = n_layer
    p = f"blk.{m}."
    b.norm(p + "attn_norm.weight", n_embd)
    b.norm(p + "post_attention_norm.weight", n_embd)
    full_attention(p)
    moe(m)
    b.dense(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd))
    b.norm(p + "nextn.enorm.weight", n_embd)
    b.norm(p + "nextn.hnorm.weight", n_embd)
    b.norm(p + "nextn.shared_head_norm.weight", n_embd)

    b.norm("output_norm.weight", n_embd)
    b.dense("output.weight", (n_embd, N_VOCAB))
    return "qwen35moe", kv


def _deepseek2(
    b: _Builder, *, n_expert, n_expert_used, n_layer, n_embd, n_ff_exp, n_group, n_group_used, v2_routing=False, **_
):
    n_head = 2
    q_lora_rank, kv_lora_rank = 64, 64
    n_rot = 32  # rope part of each q/k head
    qk_nope = 32  # non-rope part of each q/k head
    k_mla, v_mla = qk_nope + n_rot, 64
    n_ff_dense = 2 * n_ff_exp
    n_shared = 1
    n_dense_lead = 1

    # MLA: the KV cache holds one latent "head": key = kv_lora_rank + n_rot, value = kv_lora_rank
    kv = _common_kv(4096, n_embd, n_layer, n_ff_dense, n_head, 1, 1e-6, 10000.0)
    kv += [
        ("{arch}.attention.key_length", "uint32", kv_lora_rank + n_rot),
        ("{arch}.attention.value_length", "uint32", kv_lora_rank),
        ("{arch}.attention.key_length_mla", "uint32", k_mla),
        ("{arch}.attention.value_length_mla", "uint32", v_mla),
        ("{arch}.rope.dimension_count", "uint32", n_rot),
        ("{arch}.attention.q_lora_rank", "uint32", q_lora_rank),
        ("{arch}.attention.kv_lora_rank", "uint32", kv_lora_rank),
        ("{arch}.leading_dense_block_count", "uint32", n_dense_lead),
        ("{arch}.expert_shared_count", "uint32", n_shared),
    ]
    if v2_routing:  # as DeepSeek-V2/V2.5 GGUFs: no gating key (llama.cpp: softmax), weights not renormalised
        kv += [("{arch}.expert_weights_scale", "float32", 16.0), ("{arch}.expert_weights_norm", "bool", False)]
    else:
        kv += [
            ("{arch}.expert_weights_scale", "float32", 1.5),
            ("{arch}.expert_weights_norm", "bool", True),
            ("{arch}.expert_gating_func", "uint32", int(gguf.ExpertGatingFuncType.SIGMOID)),
        ]
    kv += _moe_kv(n_expert, n_expert_used, n_ff_exp)
    if n_group > 1:
        kv += [
            ("{arch}.expert_group_count", "uint32", n_group),
            ("{arch}.expert_group_used_count", "uint32", n_group_used),
        ]

    b.dense("token_embd.weight", (n_embd, N_VOCAB), std=1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.norm(p + "attn_norm.weight", n_embd)
        b.norm(p + "attn_q_a_norm.weight", q_lora_rank)
        b.norm(p + "attn_kv_a_norm.weight", kv_lora_rank)
        b.dense(p + "attn_q_a.weight", (n_embd, q_lora_rank))
        b.dense(p + "attn_q_b.weight", (q_lora_rank, n_head * k_mla))
        b.dense(p + "attn_kv_a_mqa.weight", (n_embd, kv_lora_rank + n_rot))
        b.dense(p + "attn_k_b.weight", (qk_nope, kv_lora_rank, n_head))
        b.dense(p + "attn_v_b.weight", (kv_lora_rank, v_mla, n_head))
        b.dense(p + "attn_output.weight", (n_head * v_mla, n_embd))
        b.norm(p + "ffn_norm.weight", n_embd)
        if i < n_dense_lead:
            b.dense(p + "ffn_gate.weight", (n_embd, n_ff_dense))
            b.dense(p + "ffn_up.weight", (n_embd, n_ff_dense))
            b.dense(p + "ffn_down.weight", (n_ff_dense, n_embd))
            continue
        b.router(p + "ffn_gate_inp.weight", n_embd, n_expert)
        b.expert_vec(p + "exp_probs_b.bias", n_expert, std=0.05)
        b.gate_up_exps(i, n_embd, n_ff_exp, n_expert, fused=False)
        b.experts(p + "ffn_down_exps.weight", (n_ff_exp, n_embd), n_expert)
        b.dense(p + "ffn_gate_shexp.weight", (n_embd, n_ff_exp * n_shared))
        b.dense(p + "ffn_up_shexp.weight", (n_embd, n_ff_exp * n_shared))
        b.dense(p + "ffn_down_shexp.weight", (n_ff_exp * n_shared, n_embd))
    b.norm("output_norm.weight", n_embd)
    b.dense("output.weight", (n_embd, N_VOCAB))
    return "deepseek2", kv


def _gpt_oss(b: _Builder, *, n_expert, n_expert_used, n_layer, n_embd, n_ff_exp, **_):
    n_head, n_head_kv, head_dim = 4, 2, 64
    kv = _common_kv(4096, n_embd, n_layer, n_ff_exp, n_head, n_head_kv, 1e-5, 150000.0)
    kv += [
        ("{arch}.attention.key_length", "uint32", head_dim),
        ("{arch}.attention.value_length", "uint32", head_dim),
        ("{arch}.attention.sliding_window", "uint32", 128),
    ]
    kv += _moe_kv(n_expert, n_expert_used, n_ff_exp)

    b.dense("token_embd.weight", (n_embd, N_VOCAB), std=1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.norm(p + "attn_norm.weight", n_embd)
        b.norm(p + "post_attention_norm.weight", n_embd)
        b.dense(p + "attn_q.weight", (n_embd, n_head * head_dim))
        b.dense(p + "attn_k.weight", (n_embd, n_head_kv * head_dim))
        b.dense(p + "attn_v.weight", (n_embd, n_head_kv * head_dim))
        b.vec(p + "attn_q.bias", n_head * head_dim, std=0.02)
        b.vec(p + "attn_k.bias", n_head_kv * head_dim, std=0.02)
        b.vec(p + "attn_v.bias", n_head_kv * head_dim, std=0.02)
        b.dense(p + "attn_output.weight", (n_head * head_dim, n_embd))
        b.vec(p + "attn_output.bias", n_embd, std=0.02)
        b.vec(p + "attn_sinks.weight", n_head, std=0.5)
        b.router(p + "ffn_gate_inp.weight", n_embd, n_expert)
        b.expert_vec(p + "ffn_gate_inp.bias", n_expert, std=0.1)
        b.gate_up_exps(i, n_embd, n_ff_exp, n_expert, fused=False)
        b.experts(p + "ffn_down_exps.weight", (n_ff_exp, n_embd), n_expert)
        b.experts(p + "ffn_gate_exps.bias", (n_ff_exp,), n_expert, std=0.02, force_f32=True)
        b.experts(p + "ffn_up_exps.bias", (n_ff_exp,), n_expert, std=0.02, force_f32=True)
        b.experts(p + "ffn_down_exps.bias", (n_embd,), n_expert, std=0.02, force_f32=True)
    b.norm("output_norm.weight", n_embd)
    b.dense("output.weight", (n_embd, N_VOCAB))
    return "gpt-oss", kv


def _check_routing(arch: str, n_expert: int, n_expert_used: int, n_group: int, n_group_used: int) -> None:
    # Mirrors the GGML_ASSERTs in llama-model.cpp load_hparams, which abort the process.
    if not (0 < n_expert_used <= n_expert <= 1024):
        raise ValueError(f"need 0 < n_expert_used <= n_expert <= 1024, got {n_expert_used}, {n_expert}")
    if arch == "deepseek2" and n_group > 1:
        per_group = n_expert // n_group
        if (
            n_expert % n_group
            or per_group < 2
            or not (0 < n_group_used < n_group)
            or n_group_used * per_group < n_expert_used
        ):
            raise ValueError(
                f"invalid grouped routing: n_expert={n_expert} n_group={n_group} "
                f"n_group_used={n_group_used} top-k={n_expert_used}"
            )


def write_model(
    path,
    arch,
    *,
    dtype="F16",
    seed=0,
    n_expert=None,
    n_expert_used=None,
    n_layer=None,
    n_embd=256,
    n_ff_exp=256,
    alignment=None,
    n_group=None,
    n_group_used=None,
    v2_routing=False,
) -> pathlib.Path:
    """Write a tiny loadable MoE model of ``arch`` (one of ``ARCHES``) to ``path``.

    ``n_expert``, ``n_expert_used``, ``n_layer`` (main blocks, MTP excluded) and, for deepseek2,
    ``n_group``/``n_group_used`` default to ``ARCH_DEFAULTS[arch]``. ``alignment`` writes
    ``general.alignment`` and pads tensor data to it (default: GGUF's 32, key not written).
    ``v2_routing`` (deepseek2 only) writes DeepSeek-V2's routing keys: no ``expert_gating_func``,
    ``expert_weights_norm`` false, ``expert_weights_scale`` 16 (default: V3's sigmoid, renormalised,
    scale 1.5). Returns the path.
    """
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    d = ARCH_DEFAULTS[arch]
    n_expert = d["n_expert"] if n_expert is None else n_expert
    n_expert_used = d["n_expert_used"] if n_expert_used is None else n_expert_used
    n_layer = d["n_layer"] if n_layer is None else n_layer
    n_group = d.get("n_group", 0) if n_group is None else n_group
    n_group_used = d.get("n_group_used", 0) if n_group_used is None else n_group_used
    _check_routing(arch, n_expert, n_expert_used, n_group, n_group_used)
    if v2_routing and arch != "deepseek2":
        raise ValueError("v2_routing is a deepseek2 option")
    if arch == "deepseek2" and n_layer < 2:
        raise ValueError("deepseek2 needs n_layer >= 2 (block 0 is dense)")

    b = _Builder(seed)
    args = dict(
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff_exp=n_ff_exp,
        n_group=n_group,
        n_group_used=n_group_used,
        v2_routing=v2_routing,
    )
    if arch == "qwen3moe":
        gguf_arch, kv = _qwen3moe(b, **args)
    elif arch in ("qwen35moe", "fused"):
        gguf_arch, kv = _qwen35moe(b, fused=(arch == "fused"), **args)
    elif arch == "deepseek2":
        gguf_arch, kv = _deepseek2(b, **args)
    else:
        gguf_arch, kv = _gpt_oss(b, **args)
    return _write(pathlib.Path(path), gguf_arch, kv, b.specs, dtype, alignment)


def write_dense_model(path) -> pathlib.Path:
    """Write a tiny loadable dense (non-MoE) ``llama`` model, F16, 2 blocks, n_embd 64."""
    n_embd, n_head, n_ff, n_layer = 64, 2, 128, 2
    head_dim = n_embd // n_head
    b = _Builder(0)
    kv = _common_kv(2048, n_embd, n_layer, n_ff, n_head, n_head, 1e-5, 10000.0)
    kv += [("{arch}.rope.dimension_count", "uint32", head_dim)]
    b.dense("token_embd.weight", (n_embd, N_VOCAB), std=1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.norm(p + "attn_norm.weight", n_embd)
        b.dense(p + "attn_q.weight", (n_embd, n_embd))
        b.dense(p + "attn_k.weight", (n_embd, n_embd))
        b.dense(p + "attn_v.weight", (n_embd, n_embd))
        b.dense(p + "attn_output.weight", (n_embd, n_embd))
        b.norm(p + "ffn_norm.weight", n_embd)
        b.dense(p + "ffn_gate.weight", (n_embd, n_ff))
        b.dense(p + "ffn_up.weight", (n_embd, n_ff))
        b.dense(p + "ffn_down.weight", (n_ff, n_embd))
    b.norm("output_norm.weight", n_embd)
    b.dense("output.weight", (n_embd, N_VOCAB))
    return _write(pathlib.Path(path), "llama", kv, b.specs, "F16", None)


def write_bulk_moe(
    path, *, n_layer=4, n_expert=32, n_embd=1024, n_ff_exp=512, n_vocab=32000, seed=0, sparse=False
) -> pathlib.Path:
    """A qwen3moe-shaped Q8_0 file whose tensor data is random bytes, for tests and benchmarks of
    byte movement at sizes the loadable fixtures do not reach (n_embd x n_ff_exp x n_expert x 3
    expert tensors per layer, ~1.06 bytes per weight). ggufcarve inspects, prunes and checks it;
    llama.cpp does not load it (no attention, no tokenizer). With ``sparse`` the tensor data is a
    hole (zeros taking no disk space): enough for what reads only the header. Returns the path.
    """
    from gguf.constants import GGUFValueType

    from ggufcarve.gguf.container import TensorHeader, encode_header, make_kv, pad_to

    q8, f32 = int(QT.Q8_0), int(QT.F32)

    def q8_bytes(ne0: int, rows: int) -> int:
        return ne0 // 32 * 34 * rows

    arch = "qwen3moe"
    kvs = [
        make_kv("general.architecture", GGUFValueType.STRING, arch),
        make_kv("general.name", GGUFValueType.STRING, "ggufcarve bulk"),
        make_kv(f"{arch}.block_count", GGUFValueType.UINT32, n_layer),
        make_kv(f"{arch}.embedding_length", GGUFValueType.UINT32, n_embd),
        make_kv(f"{arch}.expert_count", GGUFValueType.UINT32, n_expert),
        make_kv(f"{arch}.expert_used_count", GGUFValueType.UINT32, 2),
        make_kv(f"{arch}.expert_feed_forward_length", GGUFValueType.UINT32, n_ff_exp),
    ]
    tensors = [TensorHeader("token_embd.weight", (n_embd, n_vocab), q8, q8_bytes(n_embd, n_vocab))]
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors += [
            TensorHeader(p + "attn_norm.weight", (n_embd,), f32, 4 * n_embd),
            TensorHeader(p + "attn_q.weight", (n_embd, n_embd), q8, q8_bytes(n_embd, n_embd)),
            TensorHeader(p + "ffn_gate_inp.weight", (n_embd, n_expert), f32, 4 * n_embd * n_expert),
            TensorHeader(
                p + "ffn_gate_exps.weight", (n_embd, n_ff_exp, n_expert), q8, q8_bytes(n_embd, n_ff_exp * n_expert)
            ),
            TensorHeader(
                p + "ffn_up_exps.weight", (n_embd, n_ff_exp, n_expert), q8, q8_bytes(n_embd, n_ff_exp * n_expert)
            ),
            TensorHeader(
                p + "ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert), q8, q8_bytes(n_ff_exp, n_embd * n_expert)
            ),
        ]
    header, _ = encode_header(3, kvs, tensors, 32)
    rng = np.random.default_rng(seed)
    path = pathlib.Path(path)
    with open(path, "wb") as f:
        f.write(header)
        if sparse:
            f.truncate(len(header) + sum(pad_to(t.nbytes, 32) for t in tensors))
            return path
        for t in tensors:
            left = t.nbytes
            while left:
                n = min(left, 64 << 20)
                f.write(rng.bytes(n))
                left -= n
            f.write(bytes(pad_to(t.nbytes, 32) - t.nbytes))
    return path


# ---------------------------------------------------------------------------------------------
# llama.cpp quantizer
# ---------------------------------------------------------------------------------------------


def quantize_with_llama(
    src,
    dst,
    ftype: str,
    *,
    allow_requantize: bool = False,
    tensor_types: tuple[tuple[str, str], ...] = (),
    timeout: float = 600,
) -> pathlib.Path:
    """Quantize ``src`` to ``dst`` with llama.cpp's own quantizer (``llama_model_quantize``).

    Runs ggufcarve's libllama quantizer child through the one launcher (llama.cpp aborts the
    process on some failures). ``ftype`` is a llama.cpp file-type name such as ``"Q4_K_M"``;
    ``tensor_types`` are llama-quantize's ``--tensor-type REGEX=TYPE`` overrides (first match wins).
    Raises ``RuntimeError`` carrying llama.cpp's decisive error and last output on failure; a
    partial ``dst`` is removed.
    """
    from ggufcarve.quant.quantizer import LibllamaQuantizer, QuantizeJob

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    quantizer = LibllamaQuantizer()
    quantizer.timeout = timeout
    result = quantizer.run(
        QuantizeJob(
            src,
            dst,
            ftype,
            allow_requantize=allow_requantize,
            tensor_types=tuple(tensor_types),
            nthreads=min(2, os.cpu_count() or 1),
        )
    )
    if result.returncode != 0 or not dst.exists():
        dst.unlink(missing_ok=True)
        raise RuntimeError(
            f"llama_model_quantize({src.name} -> {ftype}) failed: {result.error}\n" + "\n".join(result.tail)
        )
    return dst


def write_qwen35moe_replica(
    path, *, n_expert=256, n_layer=40, n_embd=2048, n_ff_exp=512, n_vocab=248320, mtp=True
) -> pathlib.Path:
    """A header-only (sparse) Q8_0 qwen35moe file with the tensor layout of Qwen3.6-35B-A3B: 40
    blocks (every 4th full attention, 16 heads / 2 KV heads of 256; gated delta net with 16 key
    and 32 value heads of 128, conv kernel 4) plus one MTP block, 256 experts of 512 (top-8), a
    shared expert of 512, 248320 tokens, untied output (``mtp=False``: without the MTP block, as
    converters that drop it write the file). Norms, routers, ``ssm_a``, ``ssm_dt`` and
    ``ssm_conv1d`` are F32, every other matrix Q8_0, as the converter's ``--outtype q8_0`` writes
    them. The data is a hole: for what reads only the header (ggufcarve fit, llama-quantize
    --dry-run). Returns the path.
    """
    from gguf.constants import GGUFValueType

    from ggufcarve.gguf.container import TensorHeader, encode_header, make_kv, pad_to

    q8, f32 = int(QT.Q8_0), int(QT.F32)
    arch = "qwen35moe"
    n_head, n_head_kv, head_dim = 16, 2, 256
    d_state, n_k_heads, n_v_heads, d_conv = 128, 16, 32, 4
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    u32 = GGUFValueType.UINT32
    kvs = [
        make_kv("general.architecture", GGUFValueType.STRING, arch),
        make_kv("general.name", GGUFValueType.STRING, "Qwen3.6-35B-A3B replica"),
        make_kv("general.file_type", u32, int(gguf.LlamaFileType.MOSTLY_Q8_0)),
        make_kv("general.quantization_version", u32, gguf.GGML_QUANT_VERSION),
        make_kv(f"{arch}.block_count", u32, n_layer + int(mtp)),
        make_kv(f"{arch}.context_length", u32, 262144),
        make_kv(f"{arch}.embedding_length", u32, n_embd),
        make_kv(f"{arch}.feed_forward_length", u32, n_ff_exp * 8),
        make_kv(f"{arch}.attention.head_count", u32, n_head),
        make_kv(f"{arch}.attention.head_count_kv", u32, n_head_kv),
        make_kv(f"{arch}.attention.key_length", u32, head_dim),
        make_kv(f"{arch}.attention.value_length", u32, head_dim),
        make_kv(f"{arch}.attention.layer_norm_rms_epsilon", GGUFValueType.FLOAT32, 1e-6),
        make_kv(f"{arch}.rope.freq_base", GGUFValueType.FLOAT32, 1e7),
        make_kv(f"{arch}.rope.dimension_count", u32, 64),
        make_kv(f"{arch}.rope.dimension_sections", GGUFValueType.ARRAY, [11, 11, 10, 0], GGUFValueType.INT32),
        make_kv(f"{arch}.full_attention_interval", u32, 4),
        make_kv(f"{arch}.ssm.conv_kernel", u32, d_conv),
        make_kv(f"{arch}.ssm.state_size", u32, d_state),
        make_kv(f"{arch}.ssm.group_count", u32, n_k_heads),
        make_kv(f"{arch}.ssm.time_step_rank", u32, n_v_heads),
        make_kv(f"{arch}.ssm.inner_size", u32, value_dim),
        make_kv(f"{arch}.expert_count", u32, n_expert),
        make_kv(f"{arch}.expert_used_count", u32, 8),
        make_kv(f"{arch}.expert_feed_forward_length", u32, n_ff_exp),
        make_kv(f"{arch}.expert_shared_feed_forward_length", u32, n_ff_exp),
        *([make_kv(f"{arch}.nextn_predict_layers", u32, 1)] if mtp else []),
        make_kv("tokenizer.ggml.model", GGUFValueType.STRING, "gpt2"),
        make_kv("tokenizer.ggml.tokens", GGUFValueType.ARRAY, [f"t{i}" for i in range(n_vocab)], GGUFValueType.STRING),
        make_kv(
            "tokenizer.ggml.merges", GGUFValueType.ARRAY, ["t 1"], GGUFValueType.STRING
        ),  # llama.cpp's BPE vocabulary needs merges to load
    ]

    def q8_0(name: str, *ne: int) -> TensorHeader:
        rows = 1
        for n in ne[1:]:
            rows *= n
        return TensorHeader(name, ne, q8, ne[0] // 32 * 34 * rows)

    def f32_(name: str, *ne: int) -> TensorHeader:
        count = 1
        for n in ne:
            count *= n
        return TensorHeader(name, ne, f32, 4 * count)

    def attention(p: str) -> list[TensorHeader]:
        return [
            q8_0(p + "attn_q.weight", n_embd, n_head * head_dim * 2),
            q8_0(p + "attn_k.weight", n_embd, n_head_kv * head_dim),
            q8_0(p + "attn_v.weight", n_embd, n_head_kv * head_dim),
            q8_0(p + "attn_output.weight", n_head * head_dim, n_embd),
            f32_(p + "attn_q_norm.weight", head_dim),
            f32_(p + "attn_k_norm.weight", head_dim),
        ]

    def moe(p: str) -> list[TensorHeader]:
        return [
            f32_(p + "ffn_gate_inp.weight", n_embd, n_expert),
            q8_0(p + "ffn_gate_exps.weight", n_embd, n_ff_exp, n_expert),
            q8_0(p + "ffn_up_exps.weight", n_embd, n_ff_exp, n_expert),
            q8_0(p + "ffn_down_exps.weight", n_ff_exp, n_embd, n_expert),
            f32_(p + "ffn_gate_inp_shexp.weight", n_embd),
            q8_0(p + "ffn_gate_shexp.weight", n_embd, n_ff_exp),
            q8_0(p + "ffn_up_shexp.weight", n_embd, n_ff_exp),
            q8_0(p + "ffn_down_shexp.weight", n_ff_exp, n_embd),
        ]

    tensors = [q8_0("token_embd.weight", n_embd, n_vocab)]
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors += [f32_(p + "attn_norm.weight", n_embd), f32_(p + "post_attention_norm.weight", n_embd)]
        if (i + 1) % 4 == 0:
            tensors += attention(p)
        else:
            tensors += [
                q8_0(p + "attn_qkv.weight", n_embd, conv_dim),
                q8_0(p + "attn_gate.weight", n_embd, value_dim),
                f32_(p + "ssm_conv1d.weight", d_conv, conv_dim),
                f32_(p + "ssm_dt.bias", n_v_heads),
                f32_(p + "ssm_a", n_v_heads),
                q8_0(p + "ssm_beta.weight", n_embd, n_v_heads),
                q8_0(p + "ssm_alpha.weight", n_embd, n_v_heads),
                f32_(p + "ssm_norm.weight", d_state),
                q8_0(p + "ssm_out.weight", value_dim, n_embd),
            ]
        tensors += moe(p)
    if mtp:
        p = f"blk.{n_layer}."
        tensors += [
            f32_(p + "attn_norm.weight", n_embd),
            f32_(p + "post_attention_norm.weight", n_embd),
            *attention(p),
            *moe(p),
            q8_0(p + "nextn.eh_proj.weight", 2 * n_embd, n_embd),
            f32_(p + "nextn.enorm.weight", n_embd),
            f32_(p + "nextn.hnorm.weight", n_embd),
            f32_(p + "nextn.shared_head_norm.weight", n_embd),
        ]
    tensors += [f32_("output_norm.weight", n_embd), q8_0("output.weight", n_embd, n_vocab)]
    header, _ = encode_header(3, kvs, tensors, 32)
    path = pathlib.Path(path)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(pad_to(t.nbytes, 32) for t in tensors))
    return path
