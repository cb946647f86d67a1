"""Benchmark: `ggufcarve eval` (PPL + KLD of one model, reference log-probs cached) against `llama-perplexity
--kl-divergence`.

Builds a loadable qwen3moe F16 reference and its Q8_0 version with the tests' model factory
(default 8 layers, n_embd 1024, 8 experts of n_ff 1024: ~0.5 GiB F16), a generated text of
--chunks x --ctx byte tokens, and times, side by side in one run, alternating, --repeat times:
  - llama-perplexity: `llama-perplexity -m Q8_0 --kl-divergence-base BASE --kl-divergence -c CTX -t T`
    (its base file of the reference written once beforehand)
  - eval (top-k cache): `ggufcarve eval Q8_0 --reference F16 --heldout TEXT --ctx CTX --top-k 128 --speed-runs 0`,
    the reference's top-k cache already computed (the CLI end to end: startup, headers, the
    libllama child, statistics, JSON, summary and charts)
  - eval (base file): `ggufcarve eval Q8_0 --reference BASE` (llama-perplexity's own base file)
Medians are printed with the ratio to llama-perplexity.

    python bench/eval_bench.py [--dir bench/out] [--layers 8] [--n-embd 1024] [--ctx 512] [--chunks 8] [--threads \\
        2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import factory

from ggufcarve.llama.tools import require_tool

WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens through layers of matrices".split()


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "GGML_NO_BACKTRACE": "1", "LLAMA_ARG_REPACK": "0"}
    )
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed:\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("bench/out"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-ff", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    work = a.dir / "eval-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape = {"n_embd": a.n_embd, "n_ff_exp": a.n_ff, "n_layer": a.layers}
    reference = factory.write_model(work / "reference-F16.gguf", "qwen3moe", dtype="F16", **shape)
    model = factory.write_model(work / "model-Q8_0.gguf", "qwen3moe", dtype="Q8_0", **shape)
    rng = random.Random(0)
    text = work / "heldout.txt"
    words = []
    while len(" ".join(words)) < a.ctx * (a.chunks + 1):
        words.append(rng.choice(WORDS))
    text.write_text(" ".join(words) + "\n")
    tool = str(require_tool("llama-perplexity"))
    base = work / "reference.kld"
    timed(
        [
            tool,
            "-m",
            str(reference),
            "-f",
            str(text),
            "-c",
            str(a.ctx),
            "--chunks",
            str(a.chunks),
            "--kl-divergence-base",
            str(base),
            "-t",
            str(a.threads),
        ]
    )
    cache = work / "cache"
    common = ["--speed-runs", "0", "-t", str(a.threads), "--force", "-q"]
    ours = [
        sys.executable,
        "-m",
        "ggufcarve",
        "eval",
        str(model),
        "--reference",
        str(reference),
        "--heldout",
        str(text),
        "--ctx",
        str(a.ctx),
        "--chunks",
        str(a.chunks),
        "--top-k",
        "128",
        "--cache",
        str(cache),
        "-o",
        str(work / "out-topk"),
        *common,
    ]
    timed(ours)  # computes the reference's top-k cache once
    runs = {
        "llama-perplexity": [
            tool,
            "-m",
            str(model),
            "--kl-divergence-base",
            str(base),
            "--kl-divergence",
            "-c",
            str(a.ctx),
            "-t",
            str(a.threads),
        ],
        "eval (top-k cache)": ours,
        "eval (base file)": [
            sys.executable,
            "-m",
            "ggufcarve",
            "eval",
            str(model),
            "--reference",
            str(base),
            "-o",
            str(work / "out-base"),
            *common,
        ],
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(a.repeat):
        for name, argv in runs.items():
            seconds[name].append(timed(argv))
    gib = model.stat().st_size / 2**30
    print(
        f"model {model.name} {gib:.2f} GiB, reference {reference.stat().st_size / 2**30:.2f} "
        f"GiB, ctx {a.ctx}, {a.chunks} chunks, {a.threads} threads, {a.repeat} runs each"
    )
    baseline = statistics.median(seconds["llama-perplexity"])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(
            f"{name:20s} median {median:7.2f} s  ({median / baseline:.2f}x "
            f"llama-perplexity)  runs: {', '.join(f'{v:.2f}' for v in values)}"
        )


if __name__ == "__main__":
    main()
