"""How to run a rung on one GPU: whole, or with llama.cpp's `--n-cpu-moe N` expert offload.

    answer = file_offload(read_model("Model-Q4_K_M.gguf"), gpu_memory=parse_memory("16GiB"),
        context=ContextSettings(16384))
    answer.n_cpu_moe, answer.override  # 12, 'blk\\.([0-9]|1[0-1])\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU'
    # or, from tensor sizes and a cache size: plan_offload(placement_of(tensors, blocks, nextn), gpu_memory=...,
        cache_bytes=...)

The rule is llama.cpp 0.3.36's (common/common.h, common/arg.cpp, src/llama-model.cpp,
src/llama-model-loader.cpp):
  * `--n-cpu-moe N` adds, for every block i in 0..N-1, the buffer override
    `blk\\.{i}` + LLM_FFN_EXPS_REGEX = `blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps` to the CPU
    buffer type (llm_add_n_cpu_ffn_overrides); `--cpu-moe` adds LLM_FFN_EXPS_REGEX alone (every
    block). The loader applies each override with std::regex_search, unanchored, so a block's
    pattern matches its routed experts' weights (`ffn_{gate,up,down}_exps.weight`, the fused
    `ffn_gate_up_exps.weight`, grovemoe's chunk experts `*_chexps`) and everything after the name
    stem: the per-expert biases `ffn_*_exps.bias` and scales `.scale`/`.input_scale`. It matches
    no shared expert (`ffn_*_shexp`), no router (`ffn_gate_inp`, `exp_probs_b`) and no other block
    (`blk\\.1\\.` does not match `blk.10.`). Blocks are counted from 0 as the file names them,
    dense lead blocks included (they hold no expert, so N counts them without moving anything).
  * With every layer offloaded (`-ngl all`, or what `--fit` settles on when the GPU holds the
    rest) the GPU holds every loaded tensor except the input layer's (`token_embd`, and the
    position / token-type / per-layer embeddings: llama.cpp always keeps the input layer on the
    CPU) and the overridden experts. A file without `output.weight` reads the output projection
    from `token_embd`, which llama.cpp then loads a second time on the output layer's device (the
    GPU).
  * The MTP/NextN blocks (the last `nextn_predict_layers` blocks) are not loaded at all unless
    an MTP draft is asked for (`--spec-type draft-mtp` sets load_mtp; otherwise TENSOR_SKIP):
    they count neither on the GPU nor in N.
  * The KV cache and recurrent state (placement/kvcache.py) are on the GPU with the layers.
  * The compute buffers: given `compute` (bytes on the GPU at N), they count on the GPU; `margin`
    stays free on top, by default 1 GiB, the target margin llama.cpp's own `--fit` keeps free per
    device beyond model, context and compute (`fit_params_target`, `--fit-target`,
    common/common.h). Without `compute` the margin alone stands for them.
  * The GPU compute buffer at partial offload (`gpu_compute`): ggml_backend_sched assigns an op
    whose weight is in a host buffer to the GPU when the GPU backend's offload_op accepts it (a
    large batch: CUDA's threshold is 32 tokens), and copies the weight into that split's inputs,
    allocated in the GPU's compute buffer; with --n-cpu-moe N the largest such copy is one block's
    experts. So the GPU's compute buffer is the full-offload graph's (measured by llama.cpp's dry
    load on the CPU, the same graph) plus the largest expert block kept on the CPU: an estimate on
    a llama.cpp without a GPU backend, never run on a device here.

The answer is the smallest N whose GPU bytes (non-expert weights + experts of blocks N.. + cache
+ compute + margin) fit `gpu_memory`; N = 0 means the file fits whole. If even all experts on the CPU do not
fit, there is no N: fewer layers on the GPU (`-ngl`) or a smaller rung is the way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gguf.constants import Keys

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.llama.devices import FIT_MARGIN, LLM_FFN_EXPS_REGEX, block_regex
from ggufcarve.llama.memory import HOST, DeviceMemory, DryLoad
from ggufcarve.placement.kvcache import ContextSettings, context_memory

INPUT_LAYER_TENSORS = (
    "token_embd",
    "position_embd",
    "token_types",
    "per_layer_token_embd",
    "masked_embd_centroids",
    "masked_embd_ordering",
)  # LLM_TENSOR_LAYER_INPUT (src/llama-arch.cpp)
# Where a rung runs, fastest first: every layer and expert on the GPU; on the GPU with the experts of
# --n-cpu-moe N blocks in system memory; all in system memory; paging the weights from disk through
# mmap (a file larger than the memory runs, slowly).
TIERS = ("gpu", "gpu+cpu", "ram", "disk")
GPU_TIERS = ("gpu", "gpu+cpu")
DEFAULT_MARGIN = FIT_MARGIN  # llama.cpp's --fit target margin per device


def _digits_range(lo: str, hi: str) -> str:
    """A regex for the integers lo..hi written with the same number of digits."""
    if len(lo) == 1:
        return lo if lo == hi else f"[{lo}-{hi}]"
    rest = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + _group(_digits_range(lo[1:], hi[1:]))
    parts = []
    first = int(lo[0])
    last = int(hi[0])
    if lo[1:] != "0" * rest:
        parts.append(lo[0] + _group(_digits_range(lo[1:], "9" * rest)))
        first += 1
    tail = None
    if hi[1:] != "9" * rest:
        tail = hi[0] + _group(_digits_range("0" * rest, hi[1:]))
        last -= 1
    if first <= last:
        head = str(first) if first == last else f"[{first}-{last}]"
        parts.append(head + "[0-9]" * rest)
    if tail:
        parts.append(tail)
    return "|".join(parts)


def _group(regex: str) -> str:
    return f"({regex})" if "|" in regex else regex


def block_range_regex(count: int) -> str:
    """A regex matching exactly the decimal numbers 0..count-1 (no leading zeros), for -ot."""
    if count < 1:
        raise BadInput(f"a range of {count} blocks is empty", "give at least one block")
    parts = []
    top = count - 1
    for digits in range(1, len(str(top)) + 1):
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        hi = min(top, 10**digits - 1)
        parts.append(_digits_range(str(lo), str(hi)))
    return "|".join(parts)


def override_regex(n_cpu_moe: int) -> str:
    """One `-ot` pattern matching what `--n-cpu-moe N` matches: the experts of blocks 0..N-1."""
    return rf"blk\.{_group(block_range_regex(n_cpu_moe))}{LLM_FFN_EXPS_REGEX}" if n_cpu_moe > 1 else block_regex(0)


@dataclass(frozen=True)
class WeightPlacement:
    """Where llama.cpp puts a file's tensors with every layer on the GPU, in bytes."""

    gpu_other: int  # loaded on the GPU and never matched by an expert override
    expert_bytes: tuple[int, ...]  # per main block i: the bytes blk\.{i} + LLM_FFN_EXPS_REGEX matches
    input_bytes: int  # the input layer's tensors, always in system memory
    skipped_bytes: int  # the MTP blocks', not loaded without an MTP draft
    output_from_embedding: bool  # no output.weight: token_embd is loaded again as the output
    block_other: tuple[int, ...] = ()  # per main block i: its bytes the expert override does not match
    output_bytes: int = 0  # the output layer's (output.weight, output_norm; token_embd again without output.weight)
    nextn_blocks: int = 0  # the MTP blocks after the main ones: counted in llama.cpp's layer split, not loaded

    @property
    def gpu_whole(self) -> int:
        return self.gpu_other + sum(self.expert_bytes)

    def gpu_weights(self, n_cpu_moe: int) -> int:
        """The weights on the GPU with --n-cpu-moe N."""
        return self.gpu_other + sum(self.expert_bytes[n_cpu_moe:])

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu_other_bytes": self.gpu_other,
            "expert_bytes_per_block": list(self.expert_bytes),
            "input_layer_bytes": self.input_bytes,
            "mtp_skipped_bytes": self.skipped_bytes,
            "output_from_embedding": self.output_from_embedding,
        }


def placement_of(tensors: Iterable[tuple[str, int]], block_count: int, nextn_layers: int = 0) -> WeightPlacement:
    """WeightPlacement of tensors given as (name, bytes), by the rules in the module docstring."""
    main = block_count - nextn_layers
    patterns = [re.compile(block_regex(i)) for i in range(main)]
    mtp = re.compile(r"blk\.(\d+)\.")
    experts = [0] * main
    block_other = [0] * main
    other = inputs = skipped = output = 0
    embedding = 0
    has_output = False
    for name, nbytes in tensors:
        block = mtp.match(name)
        if block and int(block[1]) >= main:
            skipped += nbytes
            continue
        if name.split(".", 1)[0] in INPUT_LAYER_TENSORS:
            inputs += nbytes
            if name == "token_embd.weight":
                embedding = nbytes
            continue
        has_output = has_output or name == "output.weight"
        index = int(block[1]) if block else -1
        if 0 <= index < main and patterns[index].search(name):
            experts[index] += nbytes
        else:
            other += nbytes
            if 0 <= index < main:
                block_other[index] += nbytes
            else:
                output += nbytes
    if not has_output:
        other += embedding
        output += embedding
    return WeightPlacement(
        other, tuple(experts), inputs, skipped, not has_output, tuple(block_other), output, block_count - main
    )


def weight_placement(model: GGUFModel) -> WeightPlacement:
    """WeightPlacement of a GGUF file (or split set) from its header: tensor names and byte sizes."""
    arch = model.get(Keys.General.ARCHITECTURE)
    blocks = model.get(Keys.LLM.BLOCK_COUNT.format(arch=arch))
    if not isinstance(arch, str) or blocks is None:
        raise BadInput(
            f"{model.path}: no {Keys.General.ARCHITECTURE} or block_count key", "this is not a llama.cpp model file"
        )
    nextn = model.get(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch)) or 0
    return placement_of(((t.name, t.nbytes) for t in model.tensors), int(blocks), int(nextn))


@dataclass(frozen=True)
class Offload:
    """The answer for one file and one GPU: N = 0 fits whole, None fits with no N."""

    gpu_memory: int
    cache_bytes: int
    margin: int
    n_cpu_moe: int | None
    gpu_bytes: int  # weights + cache + compute + margin on the GPU at n_cpu_moe (at all experts on the CPU when None)
    cpu_expert_bytes: int  # the experts the overrides keep in system memory
    main_blocks: int
    compute_bytes: int = 0  # the GPU's compute buffers at n_cpu_moe (0: not counted, the margin stands for them)

    @property
    def fits_whole(self) -> bool:
        return self.n_cpu_moe == 0

    @property
    def override(self) -> str | None:
        """The `-ot`/`--override-tensor` value equal to --n-cpu-moe N (None when nothing moves)."""
        return f"{override_regex(self.n_cpu_moe)}=CPU" if self.n_cpu_moe else None

    @property
    def flags(self) -> str:
        """The llama.cpp argument: '--n-cpu-moe N', or '' when the file fits whole or not at all."""
        return f"--n-cpu-moe {self.n_cpu_moe}" if self.n_cpu_moe else ""

    def label(self) -> str:
        """'whole', 'n-cpu-moe 12' or 'no'."""
        return "no" if self.n_cpu_moe is None else "whole" if self.n_cpu_moe == 0 else f"n-cpu-moe {self.n_cpu_moe}"

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu_memory_bytes": self.gpu_memory,
            "cache_bytes": self.cache_bytes,
            "margin_bytes": self.margin,
            "fits_whole": self.fits_whole,
            "fits": self.n_cpu_moe is not None,
            "n_cpu_moe": self.n_cpu_moe,
            "override_tensor": self.override,
            "gpu_bytes": self.gpu_bytes,
            "cpu_expert_bytes": self.cpu_expert_bytes,
            "compute_bytes": self.compute_bytes,
        }


def plan_offload(
    placement: WeightPlacement,
    *,
    gpu_memory: int,
    cache_bytes: int,
    margin: int = DEFAULT_MARGIN,
    compute: Callable[[int], int] | None = None,
) -> Offload:
    """The smallest --n-cpu-moe N with weights(N) + cache + compute(N) + margin <= gpu_memory (see
    the module docstring)."""
    blocks = len(placement.expert_bytes)
    at = compute or (lambda n: 0)
    for n in range(blocks + 1):
        need = placement.gpu_weights(n) + cache_bytes + at(n) + margin
        if need <= gpu_memory:
            return Offload(gpu_memory, cache_bytes, margin, n, need, sum(placement.expert_bytes[:n]), blocks, at(n))
    return Offload(
        gpu_memory,
        cache_bytes,
        margin,
        None,
        placement.gpu_weights(blocks) + cache_bytes + at(blocks) + margin,
        sum(placement.expert_bytes),
        blocks,
        at(blocks),
    )


def gpu_compute(placement: WeightPlacement, full_offload_compute: int) -> Callable[[int], int]:
    """The GPU's compute buffer bytes at --n-cpu-moe N (module docstring): the full-offload graph's
    plus the largest expert block kept on the CPU."""
    return lambda n: full_offload_compute + max(placement.expert_bytes[:n], default=0)


def split_devices(placement: WeightPlacement, offload: Offload, load: DryLoad) -> list[DeviceMemory]:
    """The GPU's and the host's memory at `offload`'s --n-cpu-moe N with every layer on the GPU.

    `load` is llama.cpp's dry load: of that placement on a llama.cpp with a GPU backend (its
    buffers name the GPU: compute measured), else of the CPU run, whose compute buffers give the
    GPU's by `gpu_compute` and the host's as at most the whole graph's (both marked estimated).
    The weights follow the placement rule; the KV cache and recurrent state are the GPU's (every
    layer there); the output buffer is in host memory (llama_context allocates it in the host
    buffer type of the output layer's device)."""
    n = offload.n_cpu_moe if offload.n_cpu_moe is not None else len(placement.expert_bytes)
    host_weights = placement.input_bytes + sum(placement.expert_bytes[:n])
    devices = [d for d in load.devices if d != HOST]
    if devices:
        gpu = DeviceMemory(
            devices[0],
            placement.gpu_weights(n),
            load.cache,
            load.on(devices[0], load.compute),
            load.on(devices[0], load.output),
        )
        host = DeviceMemory(HOST, host_weights, 0, load.on(HOST, load.compute), load.on(HOST, load.output))
        return [gpu, host]
    graph = load.on(HOST, load.compute)
    gpu = DeviceMemory("gpu", placement.gpu_weights(n), load.cache, gpu_compute(placement, graph)(n), 0, ("compute",))
    host = DeviceMemory(HOST, host_weights, 0, graph, load.on(HOST, load.output), ("compute",))
    return [gpu, host]


def tiers_of(cpu_total: int, memory: int, offload: Offload | None, split: list[DeviceMemory]) -> tuple[str, ...]:
    """The TIERS a rung runs in, fastest first: on the GPU (whole, or with --n-cpu-moe N) when the
    offload fits and the host's share `split[-1]` is within `memory`; in system memory when the
    CPU run's total is; from disk always."""
    out = []
    if offload is not None and offload.n_cpu_moe is not None and split and split[-1].total <= memory:
        out += ["gpu", "gpu+cpu"] if offload.fits_whole else ["gpu+cpu"]
    if cpu_total <= memory:
        out.append("ram")
    return (*out, "disk")


@dataclass(frozen=True)
class Placed:
    """A file's memory: its CPU run's (`host`), split over the GPU and the host at its offload
    (`split`, empty when it has none), the offload and its tiers; `weights` its tensor bytes by
    block; over several GPUs, `several` (placement.search.PlacedMemory) instead of the offload."""

    host: DeviceMemory
    split: list[DeviceMemory]
    offload: Offload | None
    tiers: tuple[str, ...]
    weights: WeightPlacement | None = None
    several: Any = None
    load: DryLoad | None = None  # llama.cpp's dry load of the CPU run it was placed from

    def devices(self, tier: str | None = None) -> list[DeviceMemory]:
        """The memory per device running in `tier` (default: the fastest it runs in)."""
        return self.split if (tier or self.tiers[0]) in GPU_TIERS and self.split else [self.host]


def place(
    placement: WeightPlacement,
    weights: int,
    load: DryLoad,
    *,
    memory: int,
    gpu_memory: int | None,
    margin: int = DEFAULT_MARGIN,
) -> Placed:
    """Where a rung of `weights` bytes runs, from llama.cpp's dry load of its CPU run (`load`) and,
    with `gpu_memory`, the GPU placement rule with the compute buffers counted."""
    host = DeviceMemory(HOST, weights, load.cache, load.on(HOST, load.compute), load.on(HOST, load.output))
    if gpu_memory is None:
        return Placed(host, [], None, tiers_of(host.total, memory, None, []), placement, load=load)
    offload = plan_offload(
        placement,
        gpu_memory=gpu_memory,
        cache_bytes=load.cache,
        margin=margin,
        compute=gpu_compute(placement, host.compute),
    )
    split = split_devices(placement, offload, load) if offload.n_cpu_moe is not None else []
    return Placed(host, split, offload, tiers_of(host.total, memory, offload, split), placement, load=load)


def file_offload(
    model: GGUFModel, *, gpu_memory: int, context: ContextSettings, margin: int = DEFAULT_MARGIN
) -> Offload:
    """plan_offload for a rung file: its tensor sizes from the header, its cache at `context` (placement/kvcache.py)."""
    return plan_offload(
        weight_placement(model),
        gpu_memory=gpu_memory,
        cache_bytes=context_memory(model.get, context).total_bytes,
        margin=margin,
    )
