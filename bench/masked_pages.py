"""Measure: the pages of a model file that llama.cpp reads while it scores with experts masked out of routing.

llama.cpp (src/llama-mmap.cpp of llama-cpp-python 0.3.36) maps a model file with MAP_POPULATE when
it loads it on the CPU: the load reads the whole file once (into the page cache, as far as memory
holds it). What scoring then touches is what a machine must keep in memory. This script loads a
model once in libllama, clears the referenced bits of its pages (/proc/self/clear_refs), decodes
the same tokens with a routing mask keeping K experts per block, and reads the file mapping's
Referenced kB from /proc/self/smaps; then again for the next K. It prints, per K, the pages touched
beside the bytes of the file less the routed experts plus K / n of them (the pruned file's share).

    python bench/masked_pages.py MODEL.gguf [--keep 256,128,64,16] [--tokens 512] [--threads 2]
(MODEL: e.g. the 256-expert factory model bench/best_bench.py writes)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def referenced_bytes(path: Path) -> int:
    """Referenced kB of the mappings of `path` in this process (/proc/self/smaps), as bytes."""
    total, inside = 0, False
    name = str(path.resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            inside = line.rstrip().endswith(name)
        elif inside and line.startswith("Referenced:"):
            total += int(head[1]) * 1024
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--keep", default="256,128,64,16")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    from ggufcarve.evaluate.engine import Engine
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.masking import RoutingMask
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(a.model)
    layout = inspect_layout(model)
    experts = sum(t.nbytes for t in model.tensors if "_exps." in t.name)
    engine = Engine(str(a.model), a.threads)
    mask = RoutingMask()
    context = engine.context(a.tokens, 1, a.tokens, eval_callback=mask)
    tokens = np.random.default_rng(0).integers(3, engine.n_vocab, a.tokens)
    print(
        f"{a.model.name}: {model.total_bytes / 2**20:.0f} MiB, routed experts "
        f"{experts / 2**20:.0f} MiB, {layout.expert_count} experts, top-{layout.expert_used_count}"
    )
    print(f"{'K':>5} {'touched MiB':>12} {'pruned file share MiB':>22}")
    for k in (int(x) for x in a.keep.split(",")):
        mask.keep = (
            {}
            if k >= layout.expert_count
            else {layer.block: tuple(range(k)) for layer in layout.layers if not layer.is_mtp}
        )
        Path("/proc/self/clear_refs").write_text("1")
        context.chunk_logits([tokens], 0)
        touched = referenced_bytes(a.model)
        share = model.total_bytes - experts + experts * k / layout.expert_count
        print(f"{k:>5} {touched / 2**20:>12.1f} {share / 2**20:>22.1f}")
    context.close()
    engine.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
