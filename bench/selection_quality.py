"""Selection quality, side by side: the demo MoE pruned to half its experts by every selection
method (and by three random keep-sets), each pruned model evaluated against the unpruned one.

    python bench/selection_quality.py [--keep 8] [--chunks 16] [--work DIR]

Every method scores the shipped demo model (ggufcarve/demo/data): zero-shot `weights` and
`router-norm`; `imatrix-counts` and `imatrix-energy` from an imatrix collected on the calibration
text (`ggufcarve imatrix collect`); `frequency`, `ean`, `reap` and `razor` from a calibration trace
in llama.cpp; `random` with seeds 0, 1, 2. Each keep-set is pruned byte for byte (Q8_0, no
requantization) and scored on the held-out text against the unpruned model: mean KL divergence,
PPL, same top token. One table, ranked by mean KLD, is printed (Markdown) and written to
WORK/selection-quality.md with the per-model evaluation JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT
from ggufcarve.evaluate.models import read_entry
from ggufcarve.evaluate.run import EvalSettings, evaluate
from ggufcarve.gguf.container import read_model
from ggufcarve.imatrix.collect import collect_imatrix
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.prune.execute import execute
from ggufcarve.prune.plan import plan_prune
from ggufcarve.select.keep import choose
from ggufcarve.select.methods import score_model

METHODS = ("weights", "router-norm", "imatrix-counts", "imatrix-energy", "imatrix-msan", "frequency", "ean", "ean-sum", "msan", "mone", "reap", "razor")
TRACED = ("frequency", "ean", "ean-sum", "msan", "mone", "reap", "razor")
RANDOM_SEEDS = (0, 1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=int, default=None, help="experts kept per block (default: half)")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=16, help="held-out chunks scored")
    parser.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens traced")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ggufcarve-selection-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    model = read_model(DEMO_MODEL)
    layout = inspect_layout(model)
    keep = args.keep or layout.expert_count // 2
    imatrix = work / "demo.imatrix.gguf"
    if not imatrix.exists():
        collect_imatrix(model, [CALIBRATION], imatrix, ctx=args.ctx, chunks=args.max_tokens // args.ctx, threads=args.threads)
    runs = [(m, 0) for m in METHODS] + [("random", s) for s in RANDOM_SEEDS]
    pruned: dict[str, tuple[Path, float]] = {}
    for method, seed in runs:
        label = method if method != "random" else f"random (seed {seed})"
        started = time.monotonic()
        scores = score_model(model, layout, method, imatrix=imatrix if method.startswith("imatrix") else None,
                             calibration=[CALIBRATION] if method in TRACED else [],
                             seed=seed, ctx=args.ctx, max_tokens=args.max_tokens, threads=args.threads)
        selection = choose(scores, keep)
        out = work / f"demo-{method}{seed if method == 'random' else ''}-{keep}e.gguf"
        if out.exists():
            out.unlink()
        execute(plan_prune(model, layout, selection.keepset, out), model, force=True)
        pruned[label] = (out, time.monotonic() - started)
        print(f"{label}: scored and pruned in {pruned[label][1]:.1f} s", file=sys.stderr)
    settings = EvalSettings(ctx=args.ctx, chunks=args.chunks, threads=args.threads, speed=None)
    results_dir = work / "evaluation"
    run = evaluate([read_entry(path) for path, _ in pruned.values()], DEMO_MODEL, HELDOUT, settings, results_dir)
    by_file = {r["model"]["file"]: r for r in run.results}
    rows = sorted(((label, by_file[path.name], seconds) for label, (path, seconds) in pruned.items()), key=lambda row: row[1]["kld_mean"])
    params = rows[0][1]["parameters"]
    lines = [
        f"{layout.expert_count} -> {keep} experts per block on {DEMO_MODEL.name}; held-out text {HELDOUT.name}, ctx {params['ctx']}, "
        f"{params['chunks']} chunks ({params['scored_tokens']} scored tokens); reference: the unpruned model, PPL {rows[0][1]['ppl_reference']:.2f}",
        "",
        "| rank | method | mean KLD | ± | PPL | Δ PPL | same top p | score + prune s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rank, (label, r, seconds) in enumerate(rows, 1):
        lines.append(f"| {rank} | {label} | {r['kld_mean']:.4f} | {r['kld_mean_stderr']:.4f} | {r['ppl']:.2f} | {r['ppl_delta_percent']:+.1f}% | {100 * r['same_top_p']:.1f}% | {seconds:.1f} |")
    table = "\n".join(lines) + "\n"
    (work / "selection-quality.md").write_text(table)
    (work / "selection-quality.json").write_text(json.dumps([{"method": label, "kld_mean": r["kld_mean"], "ppl": r["ppl"], "same_top_p": r["same_top_p"]} for label, r, _ in rows], indent=1))
    print(table)
    print(f"work directory: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
