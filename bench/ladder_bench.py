"""Benchmark: ladder overhead and `ggufcarve verify` against `sha256sum -c`, side by side.

1. Builds a loadable qwen3moe Q8_0 model of >= 1 GiB with the test factory (default 6 MoE layers x
   64 experts, n_embd = n_ff_exp = 1024: 1.2 GiB) and an imatrix for it with llama-imatrix.
2. Times `ggufcarve ladder run` (a child process, wall clock) and reads the quantizer's own
   seconds from quant-manifest.json: overhead = wall - quantizer = everything ggufcarve adds
   (validation, dry runs, source sha256, hashing outputs, manifest, SHA256SUMS, start-up).
3. Times `ggufcarve verify DIR`, `sha256sum -c SHA256SUMS` and the hashing limit on the same files
   (a Python child hashing every listed file with hashlib on one thread per core, largest file
   first, 16 MiB reads: the floor any verifier reaches), warm page cache, --repeat times
   alternating; prints medians and the ratios.

    python bench/ladder_bench.py [--dir bench/out] [--layers 6] [--experts 64] [--only Q8_0,Q6_K,...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import factory  # noqa: E402
from conftest import make_imatrix  # noqa: E402

from ggufcarve.llama.build import build_tools  # noqa: E402
from ggufcarve.llama.tools import find_tool  # noqa: E402

# The hashing limit: every file's sha256 with hashlib, one thread per core, largest file first;
# argv[1] is the read size in bytes (16 MiB: the limit as first measured; 128 KiB: the read size
# ggufcarve's own hashing uses, so the floor of verify's method).
HASH_ALL = """
import hashlib, os, sys
from concurrent.futures import ThreadPoolExecutor
def one(path):
    h, buf = hashlib.sha256(), bytearray(int(sys.argv[1]))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
paths = sorted(sys.argv[2:], key=lambda p: -os.path.getsize(p))
with ThreadPoolExecutor(os.cpu_count()) as pool:
    list(pool.map(one, paths))
"""


def timed(argv: list[str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(map(str, argv))} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024, help="n_embd = n_ff_exp")
    parser.add_argument("--only", default=None, help="rungs of ladders/q8-to-iq1.toml to run (default: all nine)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--skip-ladder", action="store_true", help="reuse an existing ladder directory (verify timing only)"
    )
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    tools = find_tool("llama-quantize")
    bin_dir = tools.parent if tools and find_tool("llama-imatrix") else build_tools()

    source = args.dir / f"bench-moe-{args.layers}x{args.experts}-Q8_0.gguf"
    if not source.exists():
        t = time.perf_counter()
        factory.write_model(
            source,
            "qwen3moe",
            dtype="Q8_0",
            n_expert=args.experts,
            n_expert_used=8,
            n_layer=args.layers,
            n_embd=args.width,
            n_ff_exp=args.width,
        )
        print(
            f"built {source.name}: {source.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
    size = source.stat().st_size
    imatrix = args.dir / f"{source.stem}.imatrix.gguf"
    if not imatrix.exists():
        made = make_imatrix(bin_dir, source, args.dir, chunks=2)
        made.rename(imatrix)

    out = args.dir / "ladder"
    if not args.skip_ladder:
        shutil.rmtree(out, ignore_errors=True)
        argv = [
            sys.executable,
            "-m",
            "ggufcarve",
            "ladder",
            "run",
            str(ROOT / "ladders" / "q8-to-iq1.toml"),
            "--source",
            str(source),
            "--imatrix",
            str(imatrix),
            "-o",
            str(out),
            "--quantizer",
            str(bin_dir / "llama-quantize"),
            "-q",
        ]
        if args.only:
            argv += ["--only", args.only]
        print("$ " + " ".join(argv), flush=True)
        wall = timed(argv)
        manifest = json.loads((out / "quant-manifest.json").read_text())
        quantizer = sum(r["seconds"] for r in manifest["rungs"])
        overhead = wall - quantizer
        print(
            f"\nladder: source {size / 2**30:.2f} GiB, {len(manifest['rungs'])} rungs, "
            f"outputs {sum(r['bytes'] for r in manifest['rungs']) / 2**30:.2f} GiB"
        )
        print("| rung | GiB | bits/weight | quantizer s |\n|---|---:|---:|---:|")
        for r in manifest["rungs"]:
            print(f"| {r['name']} | {r['gib']:.2f} | {r['bits_per_weight']:.2f} | {r['seconds']:.1f} |")
        print(
            f"wall {wall:.1f} s, quantizer {quantizer:.1f} s, overhead {overhead:.1f} s = {100 * overhead / wall:.2f}% "
            f"(hashing {manifest['timings']['hash_seconds']:.1f} s ran beside the quantizer)\n",
            flush=True,
        )

    listed = [out / line.split("  ", 1)[1] for line in (out / "SHA256SUMS").read_text().splitlines()]
    files = sum(p.stat().st_size for p in listed)
    verify = [sys.executable, "-m", "ggufcarve", "verify", str(out), "-q"]
    coreutils = ["sha256sum", "-c", "--quiet", "SHA256SUMS"]
    limit = [sys.executable, "-c", HASH_ALL, str(16 << 20), *map(str, listed)]
    small_reads = [sys.executable, "-c", HASH_ALL, str(128 << 10), *map(str, listed)]
    timed(verify), timed(coreutils, out), timed(limit)  # warm the page cache
    contenders = {
        "sha256sum -c SHA256SUMS": (coreutils, out),
        "hashlib, all cores (the limit)": (limit, None),
        "hashlib, all cores, 128 KiB reads": (small_reads, None),
        "ggufcarve verify DIR": (verify, None),
    }
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeat):
        for name, (argv, cwd) in contenders.items():
            runs[name].append(timed(argv, cwd))
    medians = {name: statistics.median(times) for name, times in runs.items()}
    print(
        f"verify: {files / 2**30:.2f} GiB in {len(listed)} files, "
        f"warm cache, {os.cpu_count()} cores, median of {args.repeat}"
    )
    print("| command | seconds | MiB/s |\n|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.2f} | {files / seconds / 2**20:.0f} |")
    ours = medians["ggufcarve verify DIR"]
    print(
        f"verify / hashing limit = {ours / medians['hashlib, all cores (the limit)']:.2f}x (target <= 1.1x); "
        f"verify / the same reads hashed = {ours / medians['hashlib, all cores, 128 KiB reads']:.2f}x; "
        f"sha256sum -c / verify = {medians['sha256sum -c SHA256SUMS'] / ours:.2f}x"
    )


if __name__ == "__main__":
    main()
