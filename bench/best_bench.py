"""Benchmark: `ggufcarve best` scoring pruned candidates by masking on the unpruned rungs, against
the same command at an older commit (every K pruned and its rungs quantized before scoring), and
against the reference cost of the issue's target: the unpruned ladder's build plus six full
evaluations of the source on the same held-out text.

On a loadable qwen3moe Q8_0 written by the tests' model factory with a real model's expert geometry
(256 experts of 2048 x 512, top-8; --layers blocks; random weights), a generated calibration and
held-out text, and a three-rung ladder (Q8_0, Q4_K_M, Q2_K), it times, one after the other:
  - new:   ggufcarve best MODEL --memory M ... -o DIR/new
  - old:   the same command line run from a git worktree of --old-commit (-o DIR/old)
  - build: ggufcarve ladder run LADDER --source MODEL --imatrix IMATRIX -o DIR/ladder (the unpruned rungs)
  - eval:  ggufcarve eval MODEL --reference MODEL --heldout TEXT (reference log-probs cached), x6
and prints each time, new / old and new / (build + 6 eval). The machine's other load changes the
seconds, not much the ratios; run it on an idle machine.

    python bench/best_bench.py [--dir bench/out] [--layers 2] [--old-commit 79e0525] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import factory  # noqa: E402  (tests/ is put on the path above)

WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens through layers of matrices".split()
LADDER = """name = "bench"
[defaults]
file_pattern = "{model}-{quant}.gguf"
allow_requantize = true
imatrix_fallback_type = "Q4_K"
[[rungs]]
ftype = "Q8_0"
[[rungs]]
ftype = "Q4_K_M"
[[rungs]]
ftype = "Q2_K"
"""


def run(argv: list[str], cwd: Path | None = None, env: dict | None = None) -> float:
    started = time.perf_counter()
    proc = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})}
    )
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv[:4]))} failed:\n{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("bench/out"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--old-commit", default="79e0525")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    a = ap.parse_args()

    work = (a.dir / "best-bench").resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"qwen3moe-256x2048x512-{a.layers}L-Q8_0.gguf"
    if not model.is_file():
        factory.write_model(
            model, "qwen3moe", dtype="Q8_0", n_expert=256, n_expert_used=8, n_layer=a.layers, n_embd=2048, n_ff_exp=512
        )
    rng = random.Random(0)
    calibration, heldout = work / "calibration.txt", work / "heldout.txt"
    for path, n in ((calibration, 4 * a.ctx), (heldout, (a.chunks + 1) * a.ctx)):
        if not path.is_file():
            path.write_text(" ".join(rng.choice(WORDS) for _ in range(n)) + "\n")
    ladder = work / "ladder.toml"
    ladder.write_text(LADDER)
    size = model.stat().st_size
    memory = f"{int(size * 0.75)}B"  # below the unpruned Q8_0: pruned Q8_0, unpruned and pruned Q4_K_M and Q2_K compete
    common = [
        model,
        "--memory",
        memory,
        "--ctx",
        4096,
        "--ladder",
        ladder,
        "--calibration",
        calibration,
        "--heldout",
        heldout,
        "--eval-ctx",
        a.ctx,
        "--chunks",
        a.chunks,
        "--methods",
        "frequency,weights",
        "-t",
        a.threads,
        "--quiet",
        "--force",
    ]
    cache = {"GGUFCARVE_CACHE": str(work / "cache")}
    for d in ("new", "old", "ladder", "eval", "cache"):
        shutil.rmtree(work / d, ignore_errors=True)

    new = run([sys.executable, "-m", "ggufcarve", "best", *common, "-o", work / "new"], env=cache)
    report = json.loads((work / "new" / "best.json").read_text())
    old_tree = work / "old-tree"
    if not old_tree.exists():
        subprocess.run(
            ["git", "-C", ROOT, "worktree", "add", "--detach", old_tree, a.old_commit], check=True, capture_output=True
        )
    shutil.rmtree(work / "cache", ignore_errors=True)
    old = run(
        [sys.executable, "-m", "ggufcarve", "best", *common, "-o", work / "old"],
        cwd=old_tree,
        env={**cache, "PYTHONPATH": str(old_tree)},
    )
    imatrix = work / "new" / "work" / "calibration.imatrix.gguf"
    build = run(
        [
            sys.executable,
            "-m",
            "ggufcarve",
            "ladder",
            "run",
            ladder,
            "--source",
            model,
            "--imatrix",
            imatrix,
            "-o",
            work / "ladder",
            "-t",
            a.threads,
            "-q",
        ],
        env=cache,
    )
    evals = []
    for number in range(7):  # the first computes the reference log-probs; six timed with them cached
        seconds = run(
            [
                sys.executable,
                "-m",
                "ggufcarve",
                "eval",
                model,
                "--reference",
                model,
                "--heldout",
                heldout,
                "--ctx",
                a.ctx,
                "--chunks",
                a.chunks,
                "--speed-runs",
                0,
                "-o",
                work / "eval" / str(number),
                "-t",
                a.threads,
                "-q",
            ],
            env=cache,
        )
        if number:
            evals.append(seconds)
    reference = build + sum(evals)
    scored = [c for c in report["candidates"] if c.get("scored_by")]
    print(
        f"model {model.name}: {size / 2**30:.2f} GiB, {a.chunks} chunks of {a.ctx} held-out tokens, threads {a.threads}"
    )
    print(
        f"candidates scored: {len(scored)} ({sum(c['scored_by'] == 'mask' for c in scored)} "
        f"masked, {sum(c['scored_by'] == 'file' for c in scored)} as files); "
        f"winner {report['winner']['id'] if report['winner'] else None}"
    )
    for c in report["candidates"]:
        if c.get("confirmed"):
            k = c["confirmed"]
            print(
                f"confirmed {c['id']}: masked {k['masked_kld_mean']:.6f}, file "
                f"{k['file_kld_mean']:.6f} ± {k['file_kld_mean_stderr']:.6f}"
            )
    print(f"new best {new:.1f} s; old best {old:.1f} s; new / old {new / old:.2f}")
    print(
        f"unpruned ladder build {build:.1f} s + 6 evaluations {sum(evals):.1f} "
        f"s = {reference:.1f} s; new / that {new / reference:.2f}"
    )
    print(f"projection for {report['projection']['model']}: {report['projection']['total_seconds'] / 3600:.1f} h (new)")
    print("new timings: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(report["timings"].items())))


if __name__ == "__main__":
    main()
