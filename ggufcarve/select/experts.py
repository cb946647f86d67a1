"""One routed expert evaluated in numpy from its dequantized weights, as llama.cpp's build_moe_ffn
(src/llama-graph.cpp) computes it for a selected expert e and MoE input x:

    gate = W_gate[e] x (+ b_gate[e]) (x s_gate[e])     up = W_up[e] x (+ b_up[e]) (x s_up[e])
    h    = act(gate, up)
    f_e  = W_down[e] h (x s_down[e])                   -> the graph node ffn_moe_down
    (+ b_down[e])                                      -> ffn_moe_down_biased (gpt-oss)

A fused `ffn_gate_up_exps` holds the gate rows first, then the up rows, per expert (its scale is
the up scale, as build_moe_ffn passes it). `act` by architecture (the `type_op` each
src/models/<arch>.cpp hands to build_moe_ffn; without a gate tensor build_moe_ffn applies the
activation to up alone):
    silu-glu    silu(gate) * up, silu(up) without gate                     (LLM_FFN_SILU)
    gelu-glu    gelu(gate) * up, gelu(up) without gate                     (LLM_FFN_GELU)
                gelu as ggml-cpu computes it for f32 (ggml/src/ggml-cpu/vec.h, GGML_GELU_FP16):
                0 for x <= -10, x for x >= 10, else the f16 table entry of x rounded to f16,
                the table holding f16(0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))))
    swiglu-oai  g = min(gate, 7); u = clamp(up, -7, 7); g * sigmoid(1.702 g) * (u + 1)
                                                                           (LLM_FFN_SWIGLU_OAI_MOE)
The three products run on one of two engines (`ExpertEvaluator(engine=...)`):
  * "numpy": float32 products with the dequantized weights, cached up to a byte budget (least
    recently used first out), so the model is never held in memory whole; `outputs_many` reads and
    evaluates a batch of experts on a few threads (in the eval callback llama.cpp's own threads
    wait, so the cores are free). Exact in float32: the oracle the ggml engine is checked against;
  * "ggml": build_moe_ffn's own op, ggml_mul_mat_id, on ggml's CPU backend (`llama.matmul`), one
    per weight tensor for all rows of a batch, on the quantized weights where they lie in a memory
    map of the file, the inputs quantized to the weights' dot-product type as llama.cpp quantizes
    them: no dequantized copy (dequantizing an expert costs more than its products for the few
    tokens a batch gives it: at n_embd 2048 and n_ff 512, 3 ms against 1 ms for 8 tokens), and the
    outputs are llama.cpp's ffn_moe_down bit for bit (tested on Q8_0). RAZOR's refill experts and
    greedy's rerouted experts use it.
The activation, scales and biases are numpy's in both.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ggufcarve.errors import UnsupportedModel
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.gguf.tensors import expert_values, tensor_values
from ggufcarve.llama.matmul import ExpertProduct, ExpertProducts
from ggufcarve.moe.layout import DOWN_EXPS, GATE_EXPS, GATE_UP_EXPS, UP_EXPS, MoeLayout, block_tensor

_CLAMPED = "its build_moe_ffn clamps the SiLU-GLU by the per-layer swiglu_clamp_exp key when the file sets it"
_OTHER_INPUT = (
    "its router reads another tensor than its experts, so the traced "
    "MoE input (src[1] of ffn_moe_logits) is not the experts' input"
)
# llama.cpp 0.3.36 MoE architectures whose routed experts are not what ExpertEvaluator computes
# from the traced ffn_moe_input, with the reason
NOT_EVALUATED: dict[str, str] = {
    "llama4": "its build_moe_ffn multiplies the input by the router weight before the experts (weight_before_ffn)",
    "grovemoe": "it runs a second build_moe_ffn over the ffn_*_chexps chunk experts",
    "kimi-k3": "its experts use LLM_FFN_SITU, set by the activation.situ_beta and situ_linear_beta keys",
    **{arch: _CLAMPED for arch in ("bailingmoe3", "step35", "deepseek4", "dflash", "glm5-next", "hy_v4", "maple")},
    **{arch: _OTHER_INPUT for arch in ("gemma4", "smallthinker", "nemotron_h", "nemotron_h_moe")},
}
ACTIVATIONS: dict[str, str] = {
    **{
        arch: "silu-glu"
        for arch in (
            "afmoe",
            "arctic",
            "bailingmoe",
            "bailingmoe2",
            "cohere2moe",
            "dbrx",
            "deepseek",
            "deepseek2",
            "deepseek2-ocr",
            "deepseek32",
            "dots1",
            "dots3note",
            "ernie4_5-moe",
            "exaone-moe",
            "glm-dsa",
            "glm4moe",
            "granite",
            "granite_swa",
            "granitehybrid",
            "granitemoe",
            "hunyuan-moe",
            "hy_v3",
            "jamba",
            "kimi-linear",
            "laguna",
            "lfm2",
            "lfm2moe",
            "llada-moe",
            "llama",
            "llama-embed",
            "mellum",
            "mimo2",
            "minicpm",
            "minimax-01",
            "minimax-m2",
            "mistral3",
            "mistral4",
            "olmoe",
            "phimoe",
            "qwen2moe",
            "qwen35moe",
            "qwen3moe",
            "qwen3next",
            "qwen3vlmoe",
            "qwen4exp",
            "rnd1",
        )
    },
    **{arch: "gelu-glu" for arch in ("grok", "nomic-bert-moe")},
    **{arch: "swiglu-oai" for arch in ("gpt-oss", "minimax-m3")},
}
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
CACHE_BYTES = 1 << 30
ENGINES = ("numpy", "ggml")
T = TypeVar("T")


def activation_of(architecture: str) -> str:
    try:
        return ACTIVATIONS[architecture]
    except KeyError:
        if architecture in NOT_EVALUATED:
            raise UnsupportedModel(
                f"razor cannot evaluate the experts of {architecture} in numpy: {NOT_EVALUATED[architecture]}",
                "use frequency, ean or reap, which read llama.cpp's own expert outputs",
            ) from None
        raise UnsupportedModel(
            f"ggufcarve does not know the expert activation of {architecture} (needed to evaluate experts in numpy)",
            f"use frequency, ean or reap; known architectures: {', '.join(sorted(ACTIVATIONS))}",
        ) from None


def ggml_gelu(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f32 of ggml-cpu (GGML_GELU_FP16): the f16 tanh-approximation table."""
    x = np.asarray(x, dtype=np.float32)
    h = x.astype(np.float16).astype(np.float32)
    with np.errstate(over="ignore"):
        table = (
            np.float32(0.5)
            * h
            * (np.float32(1.0) + np.tanh(SQRT_2_OVER_PI * h * (np.float32(1.0) + GELU_COEF_A * h * h)))
        )
    y = table.astype(np.float16).astype(np.float32)
    return np.where(x <= -10.0, np.float32(0.0), np.where(x >= 10.0, x, y))


def activate(kind: str, gate: np.ndarray | None, up: np.ndarray) -> np.ndarray:
    if kind == "swiglu-oai":
        if gate is None:
            raise UnsupportedModel(
                "the swiglu-oai activation needs a gate tensor (ffn_gate_exps) and the model has none",
                "the model's expert tensors are not the layout its architecture uses",
            )
        g = np.minimum(gate, SWIGLU_OAI_LIMIT)
        u = np.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return g / (1.0 + np.exp(-SWIGLU_OAI_ALPHA * g)) * (u + 1.0)
    if kind == "gelu-glu":
        return ggml_gelu(up) if gate is None else ggml_gelu(gate) * up
    if kind != "silu-glu":
        raise ValueError(f"unknown activation kind {kind!r}")
    if gate is None:  # no gate tensor: build_moe_ffn applies silu to up alone
        return up / (1.0 + np.exp(-up))
    return gate / (1.0 + np.exp(-gate)) * up


class ExpertEvaluator:
    """f_e(x) for the routed experts of one model: weights read and dequantized on demand (numpy),
    or multiplied where they lie by ggml (see the module docstring)."""

    def __init__(
        self,
        model: GGUFModel,
        layout: MoeLayout,
        cache_bytes: int = CACHE_BYTES,
        threads: int = 1,
        engine: str = "numpy",
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
        self.model, self.layout, self.engine = model, layout, engine
        self.cache_bytes = cache_bytes
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._weights: OrderedDict[tuple[int, int], tuple[np.ndarray, int, np.ndarray]] = OrderedDict()
        self._held = 0
        self._vectors: dict[str, np.ndarray | None] = {}
        self._products: ExpertProducts | None = None
        self._mapped: dict[int, np.ndarray] = {}  # shard -> the bytes of its file, memory-mapped

    def _has(self, name: str) -> bool:
        return name in self.model.tensor_index

    def _per_expert(self, name: str) -> np.ndarray | None:
        """A bias or scale tensor of the block as numpy [n_expert, ...] (None when absent)."""
        if name not in self._vectors:
            self._vectors[name] = tensor_values(self.model, name).astype(np.float32) if self._has(name) else None
        return self._vectors[name]

    def _read_matrices(self, block: int, expert: int) -> tuple[np.ndarray, int, np.ndarray]:
        """float32 (the gate rows then the up rows, or the up rows alone; the gate row count; down)."""
        if self._has(block_tensor(block, GATE_UP_EXPS)):
            first = expert_values(self.model, block_tensor(block, GATE_UP_EXPS), expert)
            gate_rows = first.shape[0] // 2
        else:
            up = expert_values(self.model, block_tensor(block, UP_EXPS), expert)
            if self._has(block_tensor(block, GATE_EXPS)):
                first = np.concatenate([expert_values(self.model, block_tensor(block, GATE_EXPS), expert), up])
                gate_rows = len(first) - len(up)
            else:
                first, gate_rows = up, 0
        return first, gate_rows, expert_values(self.model, block_tensor(block, DOWN_EXPS), expert)

    def _remember(self, key: tuple[int, int], matrices: tuple[np.ndarray, int, np.ndarray]) -> None:
        size = matrices[0].nbytes + matrices[2].nbytes
        while self._weights and self._held + size > self.cache_bytes:
            _, (dropped_first, _, dropped_down) = self._weights.popitem(last=False)
            self._held -= dropped_first.nbytes + dropped_down.nbytes
        self._weights[key] = matrices
        self._held += size

    def _matrices(self, block: int, expert: int) -> tuple[np.ndarray, int, np.ndarray]:
        key = (block, expert)
        if key in self._weights:
            self._weights.move_to_end(key)
            return self._weights[key]
        matrices = self._read_matrices(block, expert)
        self._remember(key, matrices)
        return matrices

    def _map(self, function: Callable[..., T], *iterables: Iterable[Any]) -> list[T]:
        """`function` over `iterables` on `threads` threads (numpy's products and the reads release the GIL)."""
        if self.threads == 1:
            return list(map(function, *iterables))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ggufcarve-experts")
        return list(self._pool.map(function, *iterables))

    def outputs_many(self, block: int, work: Sequence[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """`outputs(block, expert, x)` for every (expert, x) of `work`: with the numpy engine the
        experts not yet cached read and all of them evaluated on `threads` threads; with ggml's,
        the gate and up products of all of them one graph, the down products another."""
        if self.engine == "ggml":
            return self._outputs_ggml(block, work)
        experts = [int(e) for e, _ in work]
        distinct = list(dict.fromkeys(experts))
        held = {e: self._matrices(block, e) for e in distinct if (block, e) in self._weights}
        missing = [e for e in distinct if e not in held]
        for expert, matrices in zip(missing, self._map(lambda e: self._read_matrices(block, e), missing)):
            held[expert] = matrices
            self._remember((block, expert), matrices)
        for name in self._block_vectors(block):  # read here, not concurrently in the threads below
            self._per_expert(name)
        return self._map(lambda e, x: self._evaluate(block, e, held[e], x), experts, [x for _, x in work])

    def _block_vectors(self, block: int) -> list[str]:
        return [
            block_tensor(block, base, kind)
            for base in (UP_EXPS, GATE_EXPS, GATE_UP_EXPS, DOWN_EXPS)
            for kind in ("scale", "bias")
        ]

    def down_bias(self, block: int) -> np.ndarray | None:
        """[n_expert, n_embd] down-projection biases (gpt-oss), None when the block has none."""
        return self._per_expert(block_tensor(block, DOWN_EXPS, "bias"))

    def outputs(self, block: int, expert: int, x: np.ndarray) -> np.ndarray:
        """ffn_moe_down of `expert` for the MoE inputs `x` [T, n_embd]: float32 [T, n_embd] (no down bias)."""
        if self.engine == "ggml":
            return self._outputs_ggml(block, [(expert, x)])[0]
        return self._evaluate(block, expert, self._matrices(block, expert), x)

    def _evaluate(
        self, block: int, expert: int, matrices: tuple[np.ndarray, int, np.ndarray], x: np.ndarray
    ) -> np.ndarray:
        first_w, gate_rows, down_w = matrices
        projected = np.asarray(x, dtype=np.float32) @ first_w.T  # gate and up in one product
        gate, up = (projected[:, :gate_rows], projected[:, gate_rows:]) if gate_rows else (None, projected)
        return self._scaled_down(block, expert, self._hidden(block, expert, gate, up) @ down_w.T)

    def _outputs_ggml(self, block: int, work: Sequence[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """All rows of `work` in one ggml_mul_mat_id per weight tensor, as build_moe_ffn runs them."""
        if self._products is None:
            self._products = ExpertProducts(self.threads)
        if not work:
            return []
        lengths = [len(x) for _, x in work]
        x = np.ascontiguousarray(np.concatenate([np.asarray(x, dtype=np.float32) for _, x in work]))
        experts = np.repeat(np.asarray([int(e) for e, _ in work], dtype=np.int32), lengths)
        fused = self._has(block_tensor(block, GATE_UP_EXPS))
        gated = fused or self._has(block_tensor(block, GATE_EXPS))
        first_names = (
            [block_tensor(block, GATE_UP_EXPS)]
            if fused
            else [block_tensor(block, n) for n in ((GATE_EXPS, UP_EXPS) if gated else (UP_EXPS,))]
        )
        first = self._products.run([self._product(name, x, experts) for name in first_names])
        if fused:
            gate_rows = first[0].shape[1] // 2
            gate, up = first[0][:, :gate_rows], first[0][:, gate_rows:]
        else:
            gate, up = (first[0], first[1]) if gated else (None, first[0])
        routed = experts.astype(np.intp)
        hidden = np.ascontiguousarray(self._hidden(block, routed, gate, up), dtype=np.float32)
        out = self._scaled_down(
            block, routed, self._products.run([self._product(block_tensor(block, DOWN_EXPS), hidden, experts)])[0]
        )
        return np.split(out, np.cumsum(lengths)[:-1])

    def _product(self, name: str, x: np.ndarray, experts: np.ndarray) -> ExpertProduct:
        """Row t: the expert experts[t] of the expert-axis tensor `name` (its bytes in the file's map) at x[t]."""
        shard, info = self.model.tensor_index[name]
        if shard not in self._mapped:
            with open(self.model.shards[shard].path, "rb") as f:
                self._mapped[shard] = np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), np.uint8)
        start, _ = self.model.shards[shard].data_range(info)
        cols, rows, n_expert = info.shape
        return ExpertProduct(self._mapped[shard].ctypes.data + start, info.type_id, cols, rows, n_expert, x, experts)

    def _hidden(self, block: int, expert: int | np.ndarray, gate: np.ndarray | None, up: np.ndarray) -> np.ndarray:
        """act(gate, up) after the gate and up scales and biases of `expert` (one expert, or one per row)."""
        fused = self._has(block_tensor(block, GATE_UP_EXPS))
        if fused:
            scale = self._per_expert(block_tensor(block, UP_EXPS, "scale"))
            if scale is not None:
                gate, up = gate * _per_row(scale, expert), up * _per_row(scale, expert)
            bias = self._per_expert(block_tensor(block, GATE_UP_EXPS, "bias"))
            if bias is not None:
                half = bias.shape[1] // 2
                gate, up = gate + _per_row(bias, expert)[..., :half], up + _per_row(bias, expert)[..., half:]
        else:
            for base, kind in ((UP_EXPS, "up"), (GATE_EXPS, "gate")):
                if kind == "gate" and gate is None:
                    continue
                value = up if kind == "up" else gate
                scale = self._per_expert(block_tensor(block, base, "scale"))
                if scale is not None:
                    value = value * _per_row(scale, expert)
                bias = self._per_expert(block_tensor(block, base, "bias"))
                if bias is not None:
                    value = value + _per_row(bias, expert)
                if kind == "up":
                    up = value
                else:
                    gate = value
        return activate(activation_of(self.layout.architecture), gate, up)

    def _scaled_down(self, block: int, expert: int | np.ndarray, out: np.ndarray) -> np.ndarray:
        scale = self._per_expert(block_tensor(block, DOWN_EXPS, "scale"))
        return out * _per_row(scale, expert) if scale is not None else out


def _per_row(values: np.ndarray, expert: int | np.ndarray) -> np.ndarray:
    """values[expert] of a per-expert table ([n_expert] scales, [n_expert, n] biases), shaped to
    broadcast over products [rows, n]: one expert's, or with an expert per row its values as
    [rows, n], a scalar's as [rows, 1]."""
    picked = values[expert]
    return picked[:, None] if isinstance(expert, np.ndarray) and picked.ndim == 1 else picked
