"""Benchmark: `ggufcarve prune` against copying a file of the output's size.

Builds a synthetic qwen3moe-shaped Q8_0 GGUF (default 4 MoE layers x 128 experts, n_embd 2048,
n_ff_exp 768: 2.5 GiB), prunes it to half the experts, and times, side by side in one run:
  - cp:       `cp REF DST` of a file with the output's size (page cache only, no durability)
  - cp+sync:  `cp REF DST && sync DST` (the same durability as ggufcarve, which fsyncs)
  - prune:    `ggufcarve prune` (write, source sha256, xxh3 verification of every tensor, report)
Each is run --repeat times, alternating; the median is reported with prune's peak RSS.

    python bench/prune_bench.py [--dir bench/out] [--layers 4] [--experts 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType

from ggufcarve.container import TensorHeader, encode_header, make_kv, pad_to

Q8_0 = int(GGMLQuantizationType.Q8_0)
F32 = int(GGMLQuantizationType.F32)


def q8_bytes(ne0: int, rows: int) -> int:
    return ne0 // 32 * 34 * rows


def build_model(path: Path, layers: int, experts: int, n_embd: int, n_ff: int) -> None:
    arch = "qwen3moe"
    kvs = [
        make_kv("general.architecture", GGUFValueType.STRING, arch),
        make_kv("general.name", GGUFValueType.STRING, "ggufcarve bench"),
        make_kv(f"{arch}.block_count", GGUFValueType.UINT32, layers),
        make_kv(f"{arch}.embedding_length", GGUFValueType.UINT32, n_embd),
        make_kv(f"{arch}.expert_count", GGUFValueType.UINT32, experts),
        make_kv(f"{arch}.expert_used_count", GGUFValueType.UINT32, 8),
        make_kv(f"{arch}.expert_feed_forward_length", GGUFValueType.UINT32, n_ff),
    ]
    tensors = [TensorHeader("token_embd.weight", (n_embd, 32000), Q8_0, q8_bytes(n_embd, 32000))]
    for b in range(layers):
        p = f"blk.{b}."
        tensors += [
            TensorHeader(p + "attn_norm.weight", (n_embd,), F32, 4 * n_embd),
            TensorHeader(p + "attn_q.weight", (n_embd, n_embd), Q8_0, q8_bytes(n_embd, n_embd)),
            TensorHeader(p + "ffn_gate_inp.weight", (n_embd, experts), F32, 4 * n_embd * experts),
            TensorHeader(p + "ffn_gate_exps.weight", (n_embd, n_ff, experts), Q8_0, q8_bytes(n_embd, n_ff * experts)),
            TensorHeader(p + "ffn_up_exps.weight", (n_embd, n_ff, experts), Q8_0, q8_bytes(n_embd, n_ff * experts)),
            TensorHeader(p + "ffn_down_exps.weight", (n_ff, n_embd, experts), Q8_0, q8_bytes(n_ff, n_embd * experts)),
        ]
    header, _ = encode_header(3, kvs, tensors, 32)
    rng = np.random.default_rng(0)
    block = rng.bytes(64 << 20)
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors:
            left = t.nbytes
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
            f.write(bytes(pad_to(t.nbytes, 32) - t.nbytes))


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds, and the peak RSS in KiB of the largest child run so far."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("bench/out"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--embd", type=int, default=2048)
    parser.add_argument("--ff", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.dir / "bench-moe.gguf"
    if not src.exists():
        build_model(src, args.layers, args.experts, args.embd, args.ff)
    out = args.dir / "bench-pruned.gguf"
    prune = [sys.executable, "-m", "ggufcarve", "prune", str(src), "--keep-first", str(args.experts // 2), "-o", str(out), "--force", "-q"]

    seconds, rss = timed(prune)  # first, so that RUSAGE_CHILDREN's maximum is prune's own
    prune_times = [seconds]
    ref = args.dir / "reference.bin"
    with open(src, "rb") as f_in, open(ref, "wb") as f_out:
        shutil.copyfileobj(f_in, f_out, 16 << 20)
        f_out.truncate(out.stat().st_size)
    copy_dst = args.dir / "reference-copy.bin"
    cp_times, cp_sync_times = [], []
    for i in range(args.repeat):
        copy_dst.unlink(missing_ok=True)
        cp_times.append(timed(["cp", str(ref), str(copy_dst)])[0])
        copy_dst.unlink()
        cp_sync_times.append(timed(["sh", "-c", f"cp '{ref}' '{copy_dst}' && sync '{copy_dst}'"])[0])
        if i:
            prune_times.append(timed(prune)[0])

    src_gib, out_gib = src.stat().st_size / 2**30, out.stat().st_size / 2**30
    p, c, cs = statistics.median(prune_times), statistics.median(cp_times), statistics.median(cp_sync_times)
    print(f"source {src_gib:.2f} GiB ({args.layers} MoE layers x {args.experts} experts, Q8_0) -> output {out_gib:.2f} GiB ({args.experts // 2} experts)")
    print(f"{'':10} {'median s':>9} {'GiB/s':>7}   runs")
    for name, times in (("cp", cp_times), ("cp+sync", cp_sync_times), ("prune", prune_times)):
        print(f"{name:10} {statistics.median(times):9.2f} {out_gib / statistics.median(times):7.2f}   {' '.join(f'{t:.2f}' for t in times)}")
    print(f"ratio prune / (cp+sync) = {p / cs:.2f}   ratio prune / cp = {p / c:.2f}   prune peak RSS = {rss / 1024:.0f} MiB")
    for path in (ref, copy_dst):
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
