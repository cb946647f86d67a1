"""Benchmark: expert selection against the cost of what it replaces, side by side in one run.

  weights:  `ggufcarve score MODEL --method weights` against `cat MODEL > /dev/null` (one read of
            the file) on a synthetic qwen3moe-shaped Q8_0 file (tests/factory.py write_bulk_moe with finite
            scales, 128 experts, 8 layers: 5 GiB by default), and the library call alone, timed inside
            its process (no interpreter start or imports); warm (page cache filled by a cat first),
            then cold (the file's pages dropped with posix_fadvise DONTNEED before each run; a cold
            cat far slower than the warm one shows they were dropped)
  trace:    `ggufcarve score MODEL --method frequency|ean|reap|razor` against `llama-imatrix` on the
            same loadable model (tests/factory.py qwen3moe, Q8_0), the same text, context and
            threads; each includes process start and model load
Each is run --repeat times, alternating; medians are printed with the ratio to the baseline.

    PYTHONPATH=. python bench/select_bench.py [--dir bench/out] [--repeat 3] [--tokens 8192] [--threads 2] [--only \\
        weights|trace] [--no-cold]
        [--trace-model MODEL.gguf] [--text FILE] [--methods reap,razor]

`--trace-model` times the trace benchmark on a loadable model of your own, for example a factory
qwen3moe of 256 experts x 40 layers:
    factory.write_model(PATH, "qwen3moe", dtype="Q8_0", n_expert=256, n_expert_used=8, n_layer=40, n_embd=256,
        n_ff_exp=64)
`--text` calibrates on a text of your own, `--tokens 0` on the whole of it (no --chunks, no
--max-tokens); the demo's one-pass figures in the README:
    PYTHONPATH=. python bench/select_bench.py --only trace --repeat 7 --ctx 256 --tokens 0 --methods reap,razor \
        --trace-model ggufcarve/demo/data/tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf --text \\
            ggufcarve/demo/data/calibration.txt
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import factory

from ggufcarve.llama.tools import find_tool

WORDS = (
    "the quick brown fox jumps over a lazy dog while experts route "
    "tokens through layers of matrices that quantize and prune weights"
).split()


def make_finite(path: Path) -> None:
    """write_bulk_moe's file holds random bytes: give its routers and Q8_0 block scales finite values."""
    import numpy as np

    from ggufcarve.gguf.container import read_model

    model = read_model(path)
    rng = np.random.default_rng(0)
    data = np.memmap(path, dtype=np.uint8, mode="r+")
    for info in model.tensors:
        start, end = model.shards[0].data_range(info)
        if info.type_name == "F32":
            data[start:end] = rng.normal(0, 0.05, (end - start) // 4).astype(np.float32).view(np.uint8)
        elif info.type_name == "Q8_0":
            blocks = data[start:end].reshape(-1, 34)
            blocks[:, :2] = rng.uniform(1e-4, 1e-2, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    data.flush()


def seconds(cmd: list[str], inner: bool = False, drop: Path | None = None) -> float:
    """Wall time of `cmd`, or with `inner` the seconds it prints; `drop`: that file's pages are
    dropped from the page cache first."""
    if drop is not None:
        drop_pages(drop)
    started = time.perf_counter()
    done = subprocess.run(
        cmd, check=True, stdout=subprocess.PIPE if inner else subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    )
    return float(done.stdout) if inner else time.perf_counter() - started


def drop_pages(path: Path) -> None:
    """Drop `path`'s clean pages from the page cache (no root needed; pages another process maps stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def compare(
    label: str,
    baseline: list[str],
    runs: dict[str, list[str]],
    repeat: int,
    inner: tuple[str, ...] = (),
    drop: Path | None = None,
    shown: str = "",
) -> None:
    """`inner`: the runs timed by the seconds they print (the rest by wall time); `shown`: the
    baseline as printed (else its first two words)."""
    times: dict[str, list[float]] = {"baseline": [], **{name: [] for name in runs}}
    for _ in range(repeat):
        times["baseline"].append(seconds(baseline, drop=drop))
        for name, cmd in runs.items():
            times[name].append(seconds(cmd, name in inner, drop))
    base = statistics.median(times["baseline"])
    shown = shown or " ".join(Path(baseline[0]).name if i == 0 else a for i, a in enumerate(baseline[:2])) + " ..."
    print(f"{label}: baseline {shown} {base:.2f} s")
    for name in runs:
        t = statistics.median(times[name])
        print(
            f"  {name:<11} {t:7.2f} s  {t / base:5.2f}x"
            + ("  (timed inside its process: no interpreter start or imports)" if name in inner else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("bench/out"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--tokens", type=int, default=8192, help="calibration tokens (whole --ctx chunks); 0: the whole text"
    )
    parser.add_argument("--text", type=Path, help="trace: this calibration text instead of a synthetic one")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8, help="layers of the weights benchmark's file (0.62 GiB each)")
    parser.add_argument("--only", choices=("weights", "trace"), help="run one of the two benchmarks")
    parser.add_argument("--no-cold", dest="cold", action="store_false", help="weights: skip the cold-cache runs")
    parser.add_argument(
        "--trace-model", type=Path, help="trace: this loadable model instead of the 32-expert factory model"
    )
    parser.add_argument(
        "--methods", default="frequency,ean,reap,razor", help="trace: the passes timed, comma-separated"
    )
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    ggufcarve = [sys.executable, "-m", "ggufcarve"]

    if args.only in (None, "weights"):
        weights(args, ggufcarve)
    if args.only in (None, "trace"):
        trace(args, ggufcarve)


def weights(args: argparse.Namespace, ggufcarve: list[str]) -> None:
    big = args.dir / "select-weights.gguf"
    if not big.exists():
        factory.write_bulk_moe(big, n_layer=args.layers, n_expert=128, n_embd=2048, n_ff_exp=768)
        make_finite(big)
    print(f"weights: {big.stat().st_size / 2**30:.2f} GiB")
    library = (
        "from ggufcarve.gguf.container import read_model; from ggufcarve.moe.layout import inspect_layout; "
        "from ggufcarve.select.methods import score_model; import time, sys; m = read_model(sys.argv[1]); "
        "t = time.perf_counter(); score_model(m, inspect_layout(m), 'weights'); print(time.perf_counter() - t)"
    )
    runs = {
        "weights": [
            *ggufcarve,
            "score",
            str(big),
            "--method",
            "weights",
            "-o",
            str(args.dir / "weights.json"),
            "--force",
            "-q",
        ],
        "score_model": [sys.executable, "-c", library, str(big)],
    }
    cat = ["sh", "-c", f"cat '{big}' > /dev/null"]
    subprocess.run(cat, check=True)
    compare("weights, warm", cat, runs, args.repeat, inner=("score_model",), shown="cat MODEL > /dev/null")
    if args.cold:
        compare(
            "weights, cold", cat, runs, args.repeat, inner=("score_model",), drop=big, shown="cat MODEL > /dev/null"
        )


def trace(args: argparse.Namespace, ggufcarve: list[str]) -> None:
    model = args.trace_model or args.dir / "select-trace.gguf"
    if args.trace_model is not None and not model.exists():
        raise SystemExit(f"{model}: no such model")
    if not model.exists():
        factory.write_model(
            model, "qwen3moe", dtype="Q8_0", n_expert=32, n_expert_used=4, n_layer=4, n_embd=512, n_ff_exp=512
        )
    text = args.text
    if text is None:
        if not args.tokens:
            raise SystemExit("--tokens 0 (the whole text) needs --text")
        text = args.dir / "select-calibration.txt"
        rng = random.Random(0)
        text.write_text(
            " ".join(rng.choice(WORDS) for _ in range(args.tokens // 5 + args.ctx))
        )  # ~5.4 byte tokens per word
    imatrix = find_tool("llama-imatrix")
    if imatrix is None:
        raise SystemExit("llama-imatrix not found (ggufcarve toolchain build)")
    chunks = args.tokens // args.ctx
    cut_imatrix = ["--chunks", str(chunks)] if chunks else []
    cut_score = ["--max-tokens", str(chunks * args.ctx)] if chunks else []
    baseline = [
        str(imatrix),
        "-m",
        str(model),
        "-f",
        str(text),
        "-o",
        str(args.dir / "bench.imatrix.gguf"),
        "-c",
        str(args.ctx),
        *cut_imatrix,
        "-t",
        str(args.threads),
        "--no-repack",
    ]
    runs = {
        m: [
            *ggufcarve,
            "score",
            str(model),
            "--method",
            m,
            "--calibration",
            str(text),
            "--ctx",
            str(args.ctx),
            *cut_score,
            "-t",
            str(args.threads),
            "-o",
            str(args.dir / f"{m}.json"),
            "--force",
            "-q",
        ]
        for m in args.methods.split(",")
    }
    extent = f"{chunks} chunks x {args.ctx} tokens" if chunks else f"the whole of {text.name} in chunks of {args.ctx}"
    print(f"trace: {model.stat().st_size / 2**20:.0f} MiB model, {extent}, {args.threads} threads")
    compare("trace", baseline, runs, args.repeat)


if __name__ == "__main__":
    main()
