"""What each device holds for one placement of a model, from llama.cpp's dry load of it.

    load = dry_load(path, MemorySettings(4096, compute=Placement(tensor_split=(1, 1)).compute(rpc)))
    rows = device_memory(read_model(path), load)     # [RPC0, RPC1, host]: weights, cache, compute, output

A dry load (llama.memory: no_alloc, nothing mapped) on the devices present places the model as a
run with the same flags would, and says where: llama.cpp logs at debug level the device each layer
is assigned to ("load_tensors: layer N assigned to device RPC0"), each tensor an -ot pattern moved
("tensor X ... buffer type overridden to CPU"), the device of each layer's cache ("llama_kv_cache:
layer N: dev = RPC0") and the compute and output buffers by buffer. Its model buffers log 0 MiB, so
the weights on each device are the file's tensor bytes by llama.cpp's load rule
(src/llama-model.cpp, load_tensors, llama.cpp of llama-cpp-python 0.3.36):
  * the input layer (token_embd and the other LLM_TENSOR_LAYER_INPUT tensors) is in system memory;
  * a tensor of block i is on layer i's device, unless a buffer override moved it;
  * the output layer (output.weight, output_norm; token_embd again when the file has no
    output.weight) is on the device of layer n_layer, the one llama.cpp logs after the last block;
  * the MTP/NextN blocks are not loaded without an MTP draft (load_mtp).
This is what llama-fit-params' "model" column sums per device (llama_model's memory_breakdown,
common/fit.cpp), up to each backend's alignment padding; its "context" is the cache and its
"compute" the compute buffers. The output buffer (logits, in host memory) is a row of its own here
and not in llama-fit-params' figures.
"""

from __future__ import annotations

import re
from typing import Any

from gguf.constants import Keys

from ggufcarve.llama.memory import HOST, DeviceMemory, DryLoad
from ggufcarve.placement.offload import INPUT_LAYER_TENSORS

BLOCK = re.compile(r"^blk\.(\d+)\.")


def _device(name: str) -> str:
    return HOST if name == "CPU" or name.startswith("CPU") else name


def weights_by_device(model: Any, load: DryLoad) -> dict[str, int]:
    """The bytes of the model's tensors on each device of `load`'s placement (module docstring)."""
    arch = model.get(Keys.General.ARCHITECTURE)
    blocks = int(model.get(Keys.LLM.BLOCK_COUNT.format(arch=arch)) or 0)
    main = blocks - int(model.get(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch)) or 0)
    output_device = _device(load.layers.get(blocks, "CPU"))  # layer n_layer_all: the output layer
    out: dict[str, int] = {}

    def add(device: str, nbytes: int) -> None:
        out[device] = out.get(device, 0) + nbytes

    has_output = any(t.name == "output.weight" for t in model.tensors)
    for tensor in model.tensors:
        block = BLOCK.match(tensor.name)
        if block and int(block[1]) >= main:
            continue  # an MTP block: not loaded
        if tensor.name.split(".", 1)[0] in INPUT_LAYER_TENSORS:
            add(HOST, tensor.nbytes)
            if tensor.name == "token_embd.weight" and not has_output:
                add(output_device, tensor.nbytes)  # read again as the output projection
            continue
        overridden = load.overridden.get(tensor.name)
        if overridden is not None:
            add(load.device_of(overridden), tensor.nbytes)
        elif block:
            add(_device(load.layers.get(int(block[1]), "CPU")), tensor.nbytes)
        else:
            add(output_device, tensor.nbytes)
    return out


def device_memory(model: Any, load: DryLoad) -> list[DeviceMemory]:
    """One row per device of `load` (the offload devices in llama.cpp's order, then the host):
    weights, cache, compute and output buffers, as llama.cpp placed them."""
    weights = weights_by_device(model, load)
    names = [name for name, _ in load.offload_devices]
    names += sorted({*weights, *load.cache_by_device, *load.devices} - {*names, HOST})
    rows = [
        DeviceMemory(
            name,
            weights.get(name, 0),
            load.cache_by_device.get(name, 0),
            load.on(name, load.compute),
            load.on(name, load.output),
        )
        for name in [*names, HOST]
    ]
    return [r for r in rows if r.total or r.device == HOST or r.device in dict(load.offload_devices)]
