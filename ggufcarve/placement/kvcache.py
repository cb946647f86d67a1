"""The memory llama.cpp allocates for one context of a model: KV cache and recurrent state, from the file's keys.

The sizes are those of llama.cpp 0.3.36's allocation (src/llama-context.cpp, llama_model::create_memory
in src/llama-model.cpp, llama-kv-cache.cpp, llama-kv-cache-iswa.cpp, llama-memory-recurrent.cpp,
llama-hparams.cpp):
  * the context is padded to a multiple of 256 cells (`n_ctx_seq`; per sequence when sequences
    are not unified), and every sequence has its own stream of cells;
  * an attention layer holds K `[n_embd_head_k * n_head_kv(il), cells, streams]` and V likewise
    with `n_embd_head_v`; without flash attention V is stored transposed and padded to the widest
    layer's V; MLA (deepseek2 with `attention.key_length_mla`/`value_length_mla`) stores K only,
    the latent `kv_lora_rank + rope` row, and reads V out of it;
  * sliding-window layers (iSWA) hold `pad(min(cells, n_swa * (unified ? seqs : 1) + n_ubatch), 256)`
    cells, or as many as the full layers with `swa_full`;
  * recurrent (linear-attention) layers of hybrid models hold, per sequence, an F32 conv state of
    `(ssm.conv_kernel - 1) * (ssm.inner_size + 2 * ssm.group_count * ssm.state_size)` values and an
    F32 SSM state of `ssm.state_size * ssm.inner_size` values, whatever the context;
  * MTP/NextN blocks (the last `nextn_predict_layers` blocks) hold nothing in the main context:
    llama.cpp caches them only in a separate MTP draft context.
Which layers are recurrent or sliding-window is each architecture's load_arch_hparams rule
(`ARCHITECTURE_CACHES`); an architecture not listed there is sized as plain attention and the
estimate says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, Keys

from ggufcarve.errors import BadInput, UnsupportedModel

KV_TYPES = ("F16", "Q8_0", "F32", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")  # llama.cpp's -ctk/-ctv choices
CELL_PADDING = 256  # GGML_PAD(n_ctx, 256) in llama_context; also the iSWA cache's padding
RECURRENT_STATE_TYPE = "F32"  # create_memory gives the recurrent memory GGML_TYPE_F32 for R and S
# LLM_KV_ATTENTION_RECURRENT_LAYERS (src/llama-arch.cpp); gguf-py 0.19 has no name for it
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"


@dataclass(frozen=True)
class CacheRules:
    """How an architecture's load_arch_hparams marks its layers (src/models/<arch>.cpp)."""

    recurrent: str = (
        ""  # "full_attention_interval": attention.recurrent_layers, else every interval-th layer is attention
    )
    default_full_attention_interval: int = 4
    swa_pattern: int = 0  # load_swa_pattern(ml, n): attention.sliding_window_pattern, else this period
    mla: bool = False  # reads attention.key_length_mla / value_length_mla


# Architectures whose cache layout is checked against llama.cpp 0.3.36's source; a plain-attention
# entry says the architecture has neither recurrent, sliding-window nor MLA layers there.
ARCHITECTURE_CACHES: dict[str, CacheRules] = {
    **{
        arch: CacheRules()
        for arch in (
            "qwen3moe",
            "qwen2moe",
            "qwen3vlmoe",
            "olmoe",
            "granitemoe",
            "glm4moe",
            "ernie4_5-moe",
            "hunyuan-moe",
            "dots1",
            "bailingmoe",
            "bailingmoe2",
            "llama",
            "minimax-m2",
            "qwen3",
            "qwen2",
            "deepseek",
        )
    },
    **{arch: CacheRules(recurrent="full_attention_interval") for arch in ("qwen35moe", "qwen35", "qwen3next")},
    "gpt-oss": CacheRules(swa_pattern=2),
    "deepseek2": CacheRules(mla=True),
}


@dataclass(frozen=True)
class ContextSettings:
    """The context whose memory is sized; defaults are llama.cpp's tools' (common/common.h)."""

    n_ctx: int
    type_k: str = "F16"
    type_v: str = "F16"
    n_seq: int = 1
    n_ubatch: int = 512
    flash_attn: bool = True  # "auto" counts as on when the cache is allocated (cparams.flash_attn)
    swa_full: bool = False  # the tools' default; libllama's llama_context_default_params has True
    unified: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "n_ctx": self.n_ctx,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "n_seq": self.n_seq,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn,
            "swa_full": self.swa_full,
            "unified": self.unified,
        }


@dataclass(frozen=True)
class LayerCache:
    block: int
    kind: str  # "attention", "sliding-window", "recurrent"
    cells: int
    first_bytes: int  # K, or the recurrent conv state R
    second_bytes: int  # V, or the recurrent SSM state S

    @property
    def bytes(self) -> int:
        return self.first_bytes + self.second_bytes


@dataclass(frozen=True)
class ContextMemory:
    architecture: str
    settings: ContextSettings
    cells: int  # per stream, of the full-attention layers
    swa_cells: int
    layers: tuple[LayerCache, ...]
    exact: bool  # False: the architecture's cache rules are not known here
    notes: tuple[str, ...] = field(default_factory=tuple)

    def _sum(self, kinds: tuple[str, ...]) -> int:
        return sum(layer.bytes for layer in self.layers if layer.kind in kinds)

    @property
    def kv_bytes(self) -> int:
        return self._sum(("attention", "sliding-window"))

    @property
    def recurrent_bytes(self) -> int:
        return self._sum(("recurrent",))

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.recurrent_bytes

    def to_json(self) -> dict[str, Any]:
        def blocks(kind: str) -> list[int]:
            return [layer.block for layer in self.layers if layer.kind == kind]

        return {
            "architecture": self.architecture,
            "settings": self.settings.to_json(),
            "cells": self.cells,
            "swa_cells": self.swa_cells,
            "attention_blocks": blocks("attention"),
            "sliding_window_blocks": blocks("sliding-window"),
            "recurrent_blocks": blocks("recurrent"),
            "kv_bytes": self.kv_bytes,
            "recurrent_bytes": self.recurrent_bytes,
            "total_bytes": self.total_bytes,
            "exact": self.exact,
            "notes": list(self.notes),
        }


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _row_bytes(type_name: str, n: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if n % block:
        raise BadInput(
            f"a {type_name} cache row needs a multiple of {block} values, this model's has {n}", "use --kv-type f16"
        )
    return n // block * size


def _per_layer(get: Callable[[str], Any], key: str, n_layer: int, default: list[int]) -> list[int]:
    value = get(key)
    if value is None:
        return default
    if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        values = [int(v) for v in value]
        if len(values) != n_layer:
            raise BadInput(f"{key} has {len(values)} entries for {n_layer} blocks", "the file's metadata is corrupt")
        return values
    return [int(value)] * n_layer


def _u32(get: Callable[[str], Any], key: str, default: int = 0) -> int:
    value = get(key)
    return default if value is None else int(value)


def context_memory(get: Callable[[str], Any], settings: ContextSettings) -> ContextMemory:
    """The KV cache and recurrent state llama.cpp allocates for a context of the model whose keys
    `get` reads (a GGUFModel's `get`). See the module docstring for the rules."""
    arch = get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise BadInput(f"no {Keys.General.ARCHITECTURE} key", "this is not a llama.cpp model file")

    def key(template: str) -> str:
        return template.format(arch=arch)

    if settings.n_ctx < 1 or settings.n_seq < 1:
        raise BadInput(
            f"context {settings.n_ctx} with {settings.n_seq} sequence(s) is not a context",
            "give --ctx a positive number of tokens",
        )
    for kind, type_name in (("K", settings.type_k), ("V", settings.type_v)):
        if type_name not in KV_TYPES:
            raise BadInput(
                f"{type_name} is not a KV cache type llama.cpp offers for {kind}",
                f"use one of {', '.join(t.lower() for t in KV_TYPES)}",
            )
    quantized_v = GGML_QUANT_SIZES[GGMLQuantizationType[settings.type_v]][0] > 1
    if quantized_v and not settings.flash_attn:
        raise BadInput(
            f"a {settings.type_v} V cache needs flash attention (llama.cpp refuses it otherwise)",
            "keep flash attention on, or use an f16 V cache",
        )
    rules = ARCHITECTURE_CACHES.get(arch)
    notes: list[str] = []
    if rules is None:
        notes.append(
            f"{arch}: llama.cpp's cache rules for this architecture are "
            "not modelled; sized as plain attention on every main block"
        )
        rules = CacheRules()

    n_layer_all = _u32(get, key(Keys.LLM.BLOCK_COUNT))
    if n_layer_all < 1:
        raise BadInput(f"{key(Keys.LLM.BLOCK_COUNT)} is missing", "the file's metadata is incomplete")
    n_nextn = _u32(get, key(Keys.LLM.NEXTN_PREDICT_LAYERS))
    n_layer = n_layer_all - n_nextn
    n_embd = _u32(get, key(Keys.LLM.EMBEDDING_LENGTH))
    n_head = _per_layer(get, key(Keys.Attention.HEAD_COUNT), n_layer_all, [0] * n_layer_all)
    n_head_kv = _per_layer(get, key(Keys.Attention.HEAD_COUNT_KV), n_layer_all, n_head)
    head0 = n_head[0] if n_head else 0
    head_k = _u32(get, key(Keys.Attention.KEY_LENGTH), n_embd // head0 if head0 else 0)
    head_v = _u32(get, key(Keys.Attention.VALUE_LENGTH), n_embd // head0 if head0 else 0)
    head_k_swa = _u32(get, key(Keys.Attention.KEY_LENGTH_SWA), head_k)
    head_v_swa = _u32(get, key(Keys.Attention.VALUE_LENGTH_SWA), head_v)
    is_mla = (
        rules.mla and bool(get(key(Keys.Attention.KEY_LENGTH_MLA))) and bool(get(key(Keys.Attention.VALUE_LENGTH_MLA)))
    )

    recurrent = [False] * n_layer_all
    if rules.recurrent == "full_attention_interval":
        marked = get(key(RECURRENT_LAYERS))
        if marked is not None and hasattr(marked, "__len__"):
            recurrent = [bool(v) for v in marked][:n_layer_all] + [False] * max(0, n_layer_all - len(marked))
        else:
            interval = _u32(get, key(Keys.LLM.FULL_ATTENTION_INTERVAL), rules.default_full_attention_interval)
            recurrent = [il < n_layer and (il + 1) % interval != 0 for il in range(n_layer_all)]

    swa = [False] * n_layer_all
    n_swa = _u32(get, key(Keys.Attention.SLIDING_WINDOW))
    if rules.swa_pattern:
        pattern = get(key(Keys.Attention.SLIDING_WINDOW_PATTERN))
        if pattern is not None and hasattr(pattern, "__len__"):
            swa = [bool(v) for v in pattern][:n_layer_all] + [False] * max(0, n_layer_all - len(pattern))
        else:
            period = int(pattern) if pattern is not None else rules.swa_pattern
            swa = [il < n_layer and (period == 0 or il % period < period - 1) for il in range(n_layer_all)]

    def width_k(il: int) -> int:
        return (head_k_swa if swa[il] else head_k) * n_head_kv[il]

    def width_v(il: int) -> int:
        return (head_v_swa if swa[il] else head_v) * n_head_kv[il]

    streams = 1 if settings.unified else settings.n_seq
    n_ctx = _pad(settings.n_ctx, CELL_PADDING)
    cells = n_ctx if settings.unified else _pad(n_ctx // settings.n_seq, CELL_PADDING)
    swa_cells = (
        cells
        if settings.swa_full
        else _pad(min(cells, n_swa * (settings.n_seq if settings.unified else 1) + settings.n_ubatch), CELL_PADDING)
    )
    attention = [il for il in range(n_layer) if not recurrent[il]]
    # [TAG_V_CACHE_VARIABLE]: a transposed V is padded to the widest V of all blocks, MTP included
    widest_v = max([width_v(il) for il in range(n_layer_all)] + [0])
    if not settings.flash_attn and any(width_v(il) != widest_v for il in attention):
        notes.append(f"without flash attention V is padded to the widest layer ({widest_v} values)")

    layers: list[LayerCache] = []
    for il in range(n_layer):
        if recurrent[il]:
            d_conv = _u32(get, key(Keys.SSM.CONV_KERNEL))
            d_inner = _u32(get, key(Keys.SSM.INNER_SIZE))
            d_state = _u32(get, key(Keys.SSM.STATE_SIZE))
            n_group = _u32(get, key(Keys.SSM.GROUP_COUNT))
            rows = max(1, settings.n_seq)
            n_embd_r = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
            n_embd_s = d_state * d_inner
            layers.append(
                LayerCache(
                    il,
                    "recurrent",
                    rows,
                    rows * _row_bytes(RECURRENT_STATE_TYPE, n_embd_r),
                    rows * _row_bytes(RECURRENT_STATE_TYPE, n_embd_s),
                )
            )
            continue
        layer_cells = swa_cells if swa[il] else cells
        k = _row_bytes(settings.type_k, width_k(il)) * layer_cells * streams
        v = (
            0
            if is_mla
            else _row_bytes(settings.type_v, width_v(il) if settings.flash_attn else widest_v) * layer_cells * streams
        )
        layers.append(LayerCache(il, "sliding-window" if swa[il] else "attention", layer_cells, k, v))
    if not layers:
        raise UnsupportedModel(f"{arch}: no block holds a cache", "the file's metadata is incomplete")
    if n_nextn:
        notes.append(
            f"the {n_nextn} MTP block(s) hold no cache in the main "
            "context (llama.cpp caches them only in an MTP draft context)"
        )
    if is_mla:
        notes.append("MLA: K holds the latent kv_lora_rank + rope row; V is read out of it")
    return ContextMemory(
        arch, settings, cells, swa_cells if any(swa) else 0, tuple(layers), arch in ARCHITECTURE_CACHES, tuple(notes)
    )
