"""Benchmark: `ggufcarve prune` against copying a file of the output's size.

Builds a synthetic qwen3moe-shaped Q8_0 GGUF (default 4 MoE layers x 128 experts, n_embd 2048,
n_ff_exp 768: 2.5 GiB), prunes it to half the experts, and times, side by side in one run:
  - cp:       `cp REF DST` of a file with the output's size (page cache only, no durability)
  - cp+sync:  `cp REF DST && sync DST` (the same durability as ggufcarve, which fsyncs)
  - sha256 source: hashlib (OpenSSL) sha256 of the source, which a first prune must compute
  - prune:    `ggufcarve prune` (write, fsync, xxh3 verification of every tensor, report), as
  - prune (cold): a first prune of the source (its sha256 computed: one full read on one core)
  - prune (warm): the source's sha256 already known (cached by device, inode, size, mtime, ctime)
Each is run --repeat times, alternating, with the page cache warm; medians and prune's peak RSS.

    python bench/prune_bench.py [--dir bench/out] [--layers 4] [--experts 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType

from ggufcarve.gguf.container import TensorHeader, encode_header, make_kv, pad_to

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


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and this child's own peak RSS in KiB."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()}")
    return seconds, usage.ru_maxrss


def read_through(path: Path) -> None:
    """Bring a file into the page cache, so that every contender reads it from memory."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


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
    warm_cache = tempfile.mkdtemp(prefix="ggufcarve-bench-cache-")
    warm_env = {**os.environ, "GGUFCARVE_CACHE": warm_cache}

    read_through(src)
    timed(prune, warm_env)  # fills the warm sha256 cache
    ref = args.dir / "reference.bin"
    with open(src, "rb") as f_in, open(ref, "wb") as f_out:
        shutil.copyfileobj(f_in, f_out, 16 << 20)
        f_out.truncate(out.stat().st_size)
        os.fsync(f_out.fileno())
    copy_dst = args.dir / "reference-copy.bin"
    prune_rss: list[int] = []
    sha256_source = [sys.executable, "-c", "import hashlib, sys; hashlib.file_digest(open(sys.argv[1], 'rb'), 'sha256')", str(src)]
    times: dict[str, list[float]] = {"cp": [], "cp+sync": [], "sha256 source": [], "prune (cold)": [], "prune (warm)": []}
    for _ in range(args.repeat):
        read_through(src)
        read_through(ref)
        copy_dst.unlink(missing_ok=True)
        times["cp"].append(timed(["cp", str(ref), str(copy_dst)])[0])
        copy_dst.unlink()
        times["cp+sync"].append(timed(["sh", "-c", f"cp '{ref}' '{copy_dst}' && sync '{copy_dst}'"])[0])
        copy_dst.unlink()
        times["sha256 source"].append(timed(sha256_source)[0])
        with tempfile.TemporaryDirectory(prefix="ggufcarve-bench-cold-") as cold_cache:
            seconds, rss = timed(prune, {**os.environ, "GGUFCARVE_CACHE": cold_cache})
            times["prune (cold)"].append(seconds)
            prune_rss.append(rss)
        seconds, rss = timed(prune, warm_env)
        times["prune (warm)"].append(seconds)
        prune_rss.append(rss)
    rss_mib = max(prune_rss) / 1024
    shutil.rmtree(warm_cache)

    src_gib, out_gib = src.stat().st_size / 2**30, out.stat().st_size / 2**30
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"source {src_gib:.2f} GiB ({args.layers} MoE layers x {args.experts} experts, Q8_0) -> output {out_gib:.2f} GiB ({args.experts // 2} experts); page cache warm")
    print(f"{'':13} {'median s':>9} {'out GiB/s':>9}   runs")
    for name, t in times.items():
        print(f"{name:13} {median[name]:9.2f} {out_gib / median[name]:9.2f}   {' '.join(f'{x:.2f}' for x in t)}")
    floor = max(median["cp+sync"], median["sha256 source"])
    for kind in ("cold", "warm"):
        p = median[f"prune ({kind})"]
        print(f"prune ({kind}) / (cp+sync) = {p / median['cp+sync']:.2f}   / cp = {p / median['cp']:.2f}", end="")
        print(f"   / max(cp+sync, sha256 source) = {p / floor:.2f}" if kind == "cold" else "")
    print(f"prune peak RSS = {rss_mib:.0f} MiB")
    for path in (ref, copy_dst):
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
