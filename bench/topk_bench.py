"""Benchmark: the experts used per token (top-k) as a speed axis, against dropping kept experts or bits.

For each model (the demo, trained top-4 of 16 experts; and a loadable qwen3moe Q8_0 of a real model's
expert geometry written by the tests' factory: 256 experts of 2048 x 512, top-8, --layers blocks,
random weights), at every N from the trained count down to half of it:
  - the unpruned Q8_0, and one pruned rung (K = E/2 experts kept, chosen by `ggufcarve select`: frequency on the
    demo's calibration text, the zero-shot weights criterion on the random model; Q8_0), routed to N;
  - and, at the trained N, the unpruned model quantized to Q4_K_M by llama-quantize (fewer bits);
each scored against the unpruned Q8_0 at its trained N by the one measurement layer (masked-free:
the file loaded with `--override-kv {arch}.expert_used_count=int:N` through kv_overrides; mean KLD
with its standard error over chunks), and timed by llama-bench on a file rewritten to N
(`ggufcarve topk`'s copy: llama-bench has no --override-kv) with --reps repetitions of pp512 and
tg128, llama-bench's mean tok/s with the standard error of its repetitions.

    python bench/topk_bench.py [--dir bench/out] [--layers 2] [--threads 2] [--chunks 8] [--ctx 256] [--reps 5]

Prints one table per model and writes bench/out/topk-bench/topk-bench.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import factory

from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT
from ggufcarve.evaluate.speed import SpeedSettings, bench_speed
from ggufcarve.gguf.container import read_model
from ggufcarve.llama.devices import Compute
from ggufcarve.llama.launch import child_env
from ggufcarve.llama.tools import require_tool
from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, prepare_segments
from ggufcarve.moe.experts_used import experts_used_overrides
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.prune.execute import write_routed

WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens through layers of matrices".split()


def pruned(source: Path, kept: int, out: Path, calibration: Path | None) -> Path:
    """`source` pruned to `kept` experts per block chosen by `ggufcarve select`: frequency on `calibration` (a
    trained model), else the zero-shot weights criterion (random weights)."""
    if not out.is_file():
        selection = out.with_suffix(".selection.json")
        method = ["-m", "frequency", "--calibration", str(calibration)] if calibration else ["-m", "weights"]
        subprocess.run(
            [sys.executable, "-m", "ggufcarve", "select", str(source), *method, "--keep", str(kept), "-o",
             str(selection), "-q"],
            check=True, capture_output=True,
        )  # fmt: skip
        subprocess.run(
            [sys.executable, "-m", "ggufcarve", "prune", str(source), "--keep", str(selection), "-o", str(out), "-q"],
            check=True, capture_output=True,
        )  # fmt: skip
    return out


def quantized(source: Path, ftype: str, out: Path) -> Path:
    if not out.is_file():
        subprocess.run(
            [str(require_tool("llama-quantize")), "--allow-requantize", str(source), str(out), ftype],
            check=True, capture_output=True, env=child_env(),
        )  # fmt: skip
    return out


def bench_model(
    name: str, source: Path, heldout: Path, calibration: Path | None, work: Path, a: argparse.Namespace
) -> dict:
    model = read_model(source)
    layout = inspect_layout(model)
    trained = layout.expert_used_count
    counts = list(range(trained, max(1, math.ceil(trained / 2)) - 1, -1))
    files = {
        "unpruned Q8_0": source,
        f"K{layout.expert_count // 2} Q8_0": pruned(
            source, layout.expert_count // 2, work / f"{name}-K-half.gguf", calibration
        ),
    }
    compute = Compute(threads=a.threads)
    segments = prepare_segments(source, [heldout], chunk_ctx=a.ctx, chunks=a.chunks, compute=compute, work=work)
    candidates, rows = [], []
    for label, path in files.items():
        m = read_model(path)
        for n in counts:
            cid = f"{label} top-{n}"
            candidates.append(Candidate(cid, path, overrides=experts_used_overrides(m, inspect_layout(m), n)))
            rows.append({"model": label, "bits": "Q8_0", "experts_used": n, "id": cid, "path": path})
    fewer_bits = quantized(source, "Q4_K_M", work / f"{name}-Q4_K_M.gguf")
    candidates.append(Candidate(f"unpruned Q4_K_M top-{trained}", fewer_bits))
    rows.append(
        {"model": "unpruned Q4_K_M", "bits": "Q4_K_M", "experts_used": trained, "id": candidates[-1].id,
         "path": fewer_bits}
    )  # fmt: skip
    scored = measure(candidates, segments, MeasureSettings(compute, first_units=10**6), work)
    tool = require_tool("llama-bench")
    settings = SpeedSettings(pp_tokens=512, tg_tokens=128, runs=a.reps, statistic="mean")
    for row in rows:
        record = scored.records[row["id"]]
        row["kld_mean"], row["kld_mean_stderr"] = record["kld_mean"], record["kld_mean_stderr"]
        path = row.pop("path")
        timed = path
        if row["experts_used"] != trained:
            timed = work / f"{path.stem}-top{row['experts_used']}.gguf"
            write_routed(path, timed, row["experts_used"])
        speed = bench_speed(tool, timed, settings, compute)
        row["decode_tok_s"], row["prompt_tok_s"] = speed.tg_tok_s, speed.pp_tok_s
        runs = speed.tg_runs
        row["decode_tok_s_stderr"] = statistics.stdev(runs) / math.sqrt(len(runs)) if len(runs) > 1 else None
        row["file_bytes"] = timed.stat().st_size
        if timed != path:
            timed.unlink()
    return {"model": name, "trained": trained, "experts": layout.expert_count, "chunks": a.chunks, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("bench/out"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-large", action="store_true", help="the demo alone")
    a = ap.parse_args()

    work = (a.dir / "topk-bench").resolve()
    work.mkdir(parents=True, exist_ok=True)
    results = [bench_model("demo", DEMO_MODEL, HELDOUT, CALIBRATION, work, a)]
    if not a.skip_large:
        large = work / f"qwen3moe-256x2048x512-{a.layers}L-Q8_0.gguf"
        if not large.is_file():
            factory.write_model(
                large, "qwen3moe", dtype="Q8_0", n_expert=256, n_expert_used=8, n_layer=a.layers, n_embd=2048,
                n_ff_exp=512,
            )  # fmt: skip
        text = work / "heldout.txt"
        rng = random.Random(0)
        text.write_text(" ".join(rng.choice(WORDS) for _ in range(a.ctx * (a.chunks + 1))) + "\n")
        results.append(bench_model("256-expert factory", large, text, None, work, a))
    for result in results:
        print(f"\n{result['model']}: {result['experts']} experts, trained top-{result['trained']}, {result['chunks']} "
              f"chunks of {a.ctx} tokens, {a.threads} threads, llama-bench pp512/tg128 x {a.reps}")  # fmt: skip
        print("| model | top-k | mean KLD | ± | decode tok/s | ± | prompt tok/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in result["rows"]:
            print(
                f"| {r['model']} | {r['experts_used']} | {r['kld_mean']:.4f} | {r['kld_mean_stderr']:.4f} "
                f"| {r['decode_tok_s']:.1f} | {r['decode_tok_s_stderr'] or 0:.1f} | {r['prompt_tok_s']:.1f} |"
            )
    (work / "topk-bench.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
