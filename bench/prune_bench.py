"""Benchmark: `ggufcarve prune` against copying a file of the output's size, side by side in one run.

Builds a qwen3moe-shaped Q8_0 GGUF of random bytes with the test factory (default 4 MoE layers x
64 experts, n_embd 2048, n_ff_exp 768: 1.28 GiB), prunes it to half the experts, and times,
--repeat times alternating, each from the same start (no earlier output, `sync`, both inputs in
the page cache, so every contender reads from memory):
  - cp:            `cp REF DST` of a file with the output's size (no durability)
  - cp+sync:       `cp REF DST && sync DST` (the durability ggufcarve gives: it fsyncs)
  - sha256 source: hashlib (OpenSSL) sha256 of the source, which a first prune must compute
  - prune (cold):  a first prune: the source's sha256 is computed (the whole source is read)
  - prune (warm):  the source's sha256 is cached (device, inode, size, mtime, ctime): only the
                   kept ranges are read
Both prunes write, fsync, re-read every tensor of the output (xxh3-128) and write the report.
Each prune is timed twice: the command's wall clock (interpreter start and imports included) and
the library's own `total_seconds` from the report (parsing, planning, copying, verification).
Prints medians (wall and CPU seconds), the ratios against the targets, and the prunes' peak RSS.

    python bench/prune_bench.py [--dir bench/out] [--layers 4] [--experts 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import factory  # noqa: E402

CPU: dict[str, list[float]] = {}  # contender -> CPU seconds (user + system) of each run


def timed(cmd: list[str], env: dict[str, str] | None = None, name: str = "") -> tuple[float, int]:
    """Wall seconds and this child's own peak RSS in KiB; its CPU seconds go to CPU[name]."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()}")
    CPU.setdefault(name, []).append(usage.ru_utime + usage.ru_stime)
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
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--embd", type=int, default=2048)
    parser.add_argument("--ff", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.dir / f"bench-moe-{args.layers}x{args.experts}-{args.embd}-{args.ff}.gguf"
    if not src.exists():
        factory.write_bulk_moe(src, n_layer=args.layers, n_expert=args.experts, n_embd=args.embd, n_ff_exp=args.ff)
    out = args.dir / "bench-pruned.gguf"
    report = args.dir / "bench-pruned.pruning-report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    prune = [
        sys.executable,
        "-m",
        "ggufcarve",
        "prune",
        str(src),
        "--keep-first",
        str(args.experts // 2),
        "-o",
        str(out),
        "--force",
        "-q",
        "--report",
        str(report),
    ]
    warm_cache = tempfile.mkdtemp(prefix="ggufcarve-bench-cache-")
    warm_env = {**env, "GGUFCARVE_CACHE": warm_cache}

    load_before = os.getloadavg()
    read_through(src)
    timed(prune, warm_env, name="fill cache")  # fills the warm sha256 cache
    ref = args.dir / "reference.bin"
    with open(src, "rb") as f_in, open(ref, "wb") as f_out:
        shutil.copyfileobj(f_in, f_out, 16 << 20)
        f_out.truncate(out.stat().st_size)
        os.fsync(f_out.fileno())
    copy_dst = args.dir / "reference-copy.bin"
    prune_rss: list[int] = []
    sha256_source = [
        sys.executable,
        "-c",
        "import hashlib, sys; hashlib.file_digest(open(sys.argv[1], 'rb'), 'sha256')",
        str(src),
    ]
    times: dict[str, list[float]] = {
        "cp": [],
        "cp+sync": [],
        "sha256 source": [],
        "prune (cold)": [],
        "prune (warm)": [],
        "library (cold)": [],
        "library (warm)": [],
    }
    out_bytes = out.stat().st_size

    def settle() -> None:
        """The same start for every contender: no earlier output, nothing dirty, both inputs cached."""
        for path in (copy_dst, out):
            path.unlink(missing_ok=True)
        os.sync()
        read_through(src)
        read_through(ref)

    for _ in range(args.repeat):
        settle()
        times["cp"].append(timed(["cp", str(ref), str(copy_dst)], name="cp")[0])
        settle()
        times["cp+sync"].append(timed(["sh", "-c", f"cp '{ref}' '{copy_dst}' && sync '{copy_dst}'"], name="cp+sync")[0])
        settle()
        times["sha256 source"].append(timed(sha256_source, name="sha256 source")[0])
        for kind in ("cold", "warm"):
            settle()
            with tempfile.TemporaryDirectory(prefix="ggufcarve-bench-cold-") as cold_cache:
                seconds, rss = timed(
                    prune,
                    warm_env if kind == "warm" else {**env, "GGUFCARVE_CACHE": cold_cache},
                    name=f"prune ({kind})",
                )
            times[f"prune ({kind})"].append(seconds)
            times[f"library ({kind})"].append(json.loads(report.read_text())["timings"]["total_seconds"])
            prune_rss.append(rss)
    shutil.rmtree(warm_cache)

    src_gib, out_gib = src.stat().st_size / 2**30, out_bytes / 2**30
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"source {src_gib:.2f} GiB ({args.layers} MoE layers x {args.experts} experts, "
        f"Q8_0) -> output {out_gib:.2f} GiB ({args.experts // 2} experts); page cache warm"
    )
    print(f"{os.cpu_count()} cores; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'':15} {'median s':>9} {'out GiB/s':>9} {'CPU s':>6}   runs")
    for name, t in times.items():
        cpu = f"{statistics.median(CPU[name]):6.2f}" if name in CPU else f"{'':6}"
        print(f"{name:15} {median[name]:9.2f} {out_gib / median[name]:9.2f} {cpu}   {' '.join(f'{x:.2f}' for x in t)}")
    floor = max(median["cp+sync"], median["sha256 source"])
    for what in ("prune", "library"):
        warm, cold = median[f"{what} (warm)"], median[f"{what} (cold)"]
        print(
            f"{what:8} warm / (cp+sync) = {warm / median['cp+sync']:.2f} (target <= 1.10) "
            f"  cold / max(cp+sync, sha256 source) = {cold / floor:.2f} (target <= 1.10)"
        )
    print(f"prune peak RSS = {max(prune_rss) / 1024:.0f} MiB (target <= 256)")
    for path in (ref, copy_dst, report):
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
