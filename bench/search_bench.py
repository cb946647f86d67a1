"""Search quality and cost, side by side: `ggufcarve tune --search` against `ggufcarve tune`, and the keep-sets
of greedy, REAP, HOPE and the search judged on the really pruned files by llama-perplexity.

    PYTHONPATH=. python bench/search_bench.py [--keep 8,12] [--ctx 256] [--chunks 16] [--threads 2]
        [--search-passes N] [--work DIR]

For each K, on the demo MoE (16 experts, top-4, 4 layers; its calibration and held-out texts):
  1. `ggufcarve tune MODEL --methods greedy,reap,hope --keep K` (timed), then the same with `--search`
     (timed), each with its own fresh GGUFCARVE_CACHE, so both pay the same reference and scoring;
  2. every keep-set of the second run (greedy-K, reap-K, hope-K, search-K) pruned by `ggufcarve prune`;
  3. llama-perplexity --kl-divergence of each pruned file against the unpruned model's base file on the
     held-out text (`--kl-divergence-base` written once per K by llama-perplexity itself), at --ctx and
     --chunks: the "Mean    KLD" it prints. The search never sees the held-out text.
A Markdown table per K is printed and written to WORK/search-bench.md (WORK/search-bench.json: the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "ggufcarve" / "demo" / "data"
DEMO = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
CALIBRATION, HELDOUT = DATA / "calibration.txt", DATA / "heldout.txt"
METHODS = ("greedy", "reap", "hope")
MEAN_KLD = re.compile(r"Mean\s+KLD:\s+([0-9.eE+-]+)\s+±\s+([0-9.eE+-]+)")


def ggufcarve(*args: object, env: dict[str, str] | None = None) -> float:
    """Run one ggufcarve command; its wall seconds."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ggufcarve", *map(str, args)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"ggufcarve {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def perplexity(tool: Path, model: Path, args: argparse.Namespace, *extra: object) -> str:
    argv = [tool, "-m", model, "-f", HELDOUT, "-c", args.ctx, "--chunks", args.chunks, "-t", args.threads, *extra]
    proc = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, env={**os.environ, "GGML_NO_BACKTRACE": "1"}
    )
    if proc.returncode != 0:
        sys.exit(f"llama-perplexity failed on {model.name}:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def file_kld(tool: Path, pruned: Path, base: Path, args: argparse.Namespace) -> tuple[float, float]:
    """llama-perplexity's mean KLD of `pruned` against the base file (again when its closing lines are lost)."""
    for _ in range(3):
        found = MEAN_KLD.search(perplexity(tool, pruned, args, "--kl-divergence-base", base, "--kl-divergence"))
        if found:
            return float(found[1]), float(found[2])
    sys.exit(f"llama-perplexity printed no Mean KLD for {pruned.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", default="8,12")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--search-passes", type=int, default=None)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    from ggufcarve.llama.tools import find_tool

    tool = find_tool("llama-perplexity", None)
    if tool is None:
        sys.exit("llama-perplexity is not built: ggufcarve toolchain build")
    work = args.work or Path(tempfile.mkdtemp(prefix="search-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    common = [
        "--calibration", CALIBRATION, "--heldout", HELDOUT, "--ctx", args.ctx, "--chunks", args.chunks,
        "-t", args.threads, "--methods", ",".join(METHODS), "-q",
    ]  # fmt: skip
    passes = ["--search-passes", args.search_passes] if args.search_passes else []
    results = []
    lines = []
    for k in (int(x) for x in args.keep.split(",")):
        seconds = {}
        for name, extra in (("tune", []), ("tune --search", ["--search", *passes])):
            env = {**os.environ, "GGUFCARVE_CACHE": str(work / f"cache-{k}-{len(extra)}")}
            out = work / f"K{k}-{'search' if extra else 'plain'}"
            seconds[name] = ggufcarve("tune", DEMO, "--keep", k, *common, *extra, "-o", out, "--force", env=env)
        report = json.loads((work / f"K{k}-search" / "tune.json").read_text())
        base = work / f"K{k}-base.kld"
        perplexity(tool, DEMO, args, "--kl-divergence-base", base)
        rows = []
        for c in sorted(report["candidates"], key=lambda c: c["method"]):
            pruned = work / f"K{k}-{c['id']}.gguf"
            ggufcarve("prune", DEMO, "--keep", work / f"K{k}-search" / "candidates" / f"{c['id']}.json", "-o", pruned)
            kld, stderr = file_kld(tool, pruned, base, args)
            search = c.get("search") or {}
            rows.append(
                {
                    "id": c["id"],
                    "method": c["method"],
                    "file_kld_mean": kld,
                    "file_kld_stderr": stderr,
                    "masked_kld_mean": c["kld_mean"],
                    "moves": sum(len(p["moves"]) for p in search.get("path", [])),
                    "start": search.get("start"),
                    "calibration": [search.get("start_calibration_kld_mean"), search.get("calibration_kld_mean")],
                    "passes_used": search.get("passes_used"),
                }
            )
            pruned.unlink()
        greedy = next(r["file_kld_mean"] for r in rows if r["method"] == "greedy")
        results.append({"K": k, "seconds": seconds, "rows": rows})
        lines += [
            f"### K = {k} of 16 (demo model, held-out {HELDOUT.name}, ctx {args.ctx}, {args.chunks} chunks)",
            "",
            "| keep-set | llama-perplexity mean KLD of the pruned file | / greedy's | masked (tune) | search |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            note = (
                f"{r['moves']} move(s) from {r['start']}, calibration KLD {r['calibration'][0]:.4f} -> "
                f"{r['calibration'][1]:.4f}, {r['passes_used']:.1f} passes"
                if r["method"] == "search"
                else ""
            )
            lines.append(
                f"| {r['id']} | {r['file_kld_mean']:.4f} ± {r['file_kld_stderr']:.4f} | "
                f"{r['file_kld_mean'] / greedy:.3f} | {r['masked_kld_mean']:.4f} | {note} |"
            )
        lines += [
            "",
            f"tune: {seconds['tune']:.0f} s; tune --search: {seconds['tune --search']:.0f} s "
            f"({seconds['tune --search'] / seconds['tune']:.2f} x)",
            "",
        ]
        print("\n".join(lines[-(len(rows) + 7) :]), flush=True)
    (work / "search-bench.md").write_text("\n".join(lines) + "\n")
    (work / "search-bench.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {work / 'search-bench.md'}")


if __name__ == "__main__":
    main()
