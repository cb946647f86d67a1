"""Selection quality, side by side: `ggufcarve tune` over every criterion at one K, on the demo MoE
and on a model with more experts made by the test factory, against the old way of answering the
same question (each criterion's keep-set pruned into a file and evaluated with `ggufcarve eval`).

    PYTHONPATH=. python bench/selection_quality.py [--models demo,factory] [--ctx 256] [--chunks 16]
        [--max-tokens 4096] [--threads 2] [--work DIR] [--no-old-way]

Only public commands run, each as its own process:
  tune:     `ggufcarve tune MODEL --calibration CAL --heldout HELDOUT --keep K --methods all`
            (one calibration pass, every keep-set scored by masking, successive halving over the
            held-out chunks; the finalists get every chunk);
  old way:  per criterion `ggufcarve select` (each traced criterion its own calibration pass; the
            imatrix criteria read one `ggufcarve imatrix collect`), `ggufcarve prune --keep`, then
            one `ggufcarve eval` of every pruned file on every chunk against the unpruned model
            (GGUFCARVE_CACHE is a fresh directory, so the old way also pays its reference pass).
One Markdown table per model, ranked as tune ranks (the finalists first), with the old way's mean
KLD of the same criterion on every chunk beside tune's, and the wall time of each way, is printed
and written to WORK/selection-quality.md (WORK/selection-quality.json: the figures).

Models: `demo`, the trained demo MoE shipped in ggufcarve/demo/data (16 experts, top-4, 4 layers;
K = 8); `factory`, tests/factory.py's qwen3moe with 64 experts (top-8, 4 layers, random weights:
its ranking says nothing about real models, its cost does; K = 32); or a GGUF path (K = half).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

DATA = ROOT / "ggufcarve" / "demo" / "data"
DEMO = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
CALIBRATION, HELDOUT = DATA / "calibration.txt", DATA / "heldout.txt"
sys.path.insert(0, str(ROOT))
from ggufcarve.select.criteria import IMATRIX_METHODS, TRACE_METHODS  # noqa: E402

TRACED = tuple(m for m in TRACE_METHODS if m != "greedy")


def ggufcarve(*args: object, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run one ggufcarve command; its wall seconds and stdout."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ggufcarve", *map(str, args)], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"ggufcarve {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def factory_model(work: Path) -> Path:
    import factory

    path = work / "factory-qwen3moe-64x256-top8-4L-Q8_0.gguf"
    if not path.exists():
        factory.write_model(
            path, "qwen3moe", dtype="Q8_0", n_expert=64, n_expert_used=8, n_layer=4, n_embd=256, n_ff_exp=256
        )
    return path


def expert_count(path: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = next(f for name, f in reader.fields.items() if name.endswith(".expert_count"))
    return int(field.parts[field.data[0]][0])


def run_tune(model: Path, keep: int, args: argparse.Namespace, out: Path, env: dict[str, str]) -> tuple[float, dict]:
    seconds, _ = ggufcarve(
        "tune",
        model,
        "--calibration",
        CALIBRATION,
        "--heldout",
        HELDOUT,
        "--keep",
        keep,
        "--methods",
        "all",
        "--ctx",
        args.ctx,
        "--chunks",
        args.chunks,
        "--max-tokens",
        args.max_tokens,
        "-t",
        args.threads,
        "-o",
        out,
        "--force",
        "-q",
        env=env,
    )
    return seconds, json.loads((out / "tune.json").read_text())


def old_way(
    model: Path, keep: int, methods: list[str], args: argparse.Namespace, out: Path, env: dict[str, str]
) -> dict:
    """Every criterion's keep-set by `select`, pruned by `prune`, all evaluated by one `eval`."""
    out.mkdir(parents=True, exist_ok=True)
    seconds = {"select": 0.0, "imatrix": 0.0, "prune": 0.0, "eval": 0.0}
    calibration = ["--calibration", CALIBRATION, "--ctx", args.ctx, "--max-tokens", args.max_tokens]
    imatrix = out / "calibration.imatrix.gguf"
    if any(m in IMATRIX_METHODS for m in methods):
        seconds["imatrix"], _ = ggufcarve(
            "imatrix",
            "collect",
            model,
            "--calibration",
            CALIBRATION,
            "--ctx",
            args.ctx,
            "--chunks",
            args.max_tokens // args.ctx,
            "-t",
            args.threads,
            "-o",
            imatrix,
            "--force",
            "-q",
            env=env,
        )
    pruned: dict[str, Path] = {}
    layers: dict[str, dict] = {}
    for method in methods:
        selection = out / f"{method}-{keep}.json"
        extra = calibration if method in TRACED else ["--imatrix", imatrix] if method in IMATRIX_METHODS else []
        took, _ = ggufcarve(
            "select",
            model,
            "--method",
            method,
            "--keep",
            keep,
            *extra,
            "-t",
            args.threads,
            "-o",
            selection,
            "--no-heatmap",
            "--force",
            "-q",
            env=env,
        )
        seconds["select"] += took
        layers[method] = json.loads(selection.read_text())["layers"]
        pruned[method] = out / f"{method}-{keep}.gguf"
        took, _ = ggufcarve("prune", model, "--keep", selection, "-o", pruned[method], "--force", "-q", env=env)
        seconds["prune"] += took
    seconds["eval"], _ = ggufcarve(
        "eval",
        *pruned.values(),
        "--reference",
        model,
        "--heldout",
        HELDOUT,
        "--ctx",
        args.ctx,
        "--chunks",
        args.chunks,
        "--speed-runs",
        0,
        "-t",
        args.threads,
        "-o",
        out / "evaluation",
        env=env,
    )
    results = {m: json.loads((out / "evaluation" / f"{m}-{keep}.json").read_text()) for m in methods}
    return {"seconds": seconds, "total_seconds": sum(seconds.values()), "layers": layers, "results": results}


def table(name: str, keep: int, experts: int, tuned: dict, tune_seconds: float, old: dict | None, work: Path) -> str:
    from ggufcarve.tune.run import ranked

    candidates = ranked(tuned["candidates"], keep)  # tune's ranking (tune.md)
    t = tuned["timings"]
    lines = [
        f"**{name}**: {experts} -> {keep} experts per block; held-out "
        f"text {HELDOUT.name}, ctx {tuned['parameters']['ctx']}, "
        f"{tuned['parameters']['chunks']} chunks; calibration "
        f"{CALIBRATION.name}, {tuned['calibration_pass']['tokens']} tokens.",
        "",
        "| rank | method | tune: mean KLD | ± | same top p | PPL | chunks |"
        + (" old way: mean KLD (every chunk) | same keep-set |" if old else ""),
        "|---:|---|---:|---:|---:|---:|---:|" + ("---:|---|" if old else ""),
    ]
    for rank, c in enumerate(candidates, 1):
        method = f"**{c['method']}**" if c["winner"] else c["method"]
        if c["identical_to"]:
            method += f" (= {c['identical_to'].rsplit('-', 1)[0]})"
        row = (
            f"| {rank} | {method} | {c['kld_mean']:.4f} | {c['kld_mean_stderr']:.4f} "
            f"| {100 * c['same_top_p']:.1f}% | {c['ppl']:.2f} | {c['chunks_scored']} |"
        )
        if old:
            r = old["results"][c["method"]]
            tuned_layers = json.loads((work / "candidates" / f"{c['id']}.json").read_text())["layers"]
            row += f" {r['kld_mean']:.4f} | {'yes' if tuned_layers == old['layers'][c['method']] else 'no'} |"
        lines.append(row)
    lines += [
        "",
        f"tune: {tune_seconds:.1f} s wall (calibration pass "
        f"{t['calibration_seconds']:.1f} s, reference {t['reference_seconds']:.1f} s, "
        f"scoring {len({c['identical_to'] or c['id'] for c in candidates})} "
        f"distinct keep-sets {t['score_seconds']:.1f} s).",
    ]
    if old:
        s = old["seconds"]
        lines.append(
            f"old way: {old['total_seconds']:.1f} s wall (select {s['select']:.1f} "
            f"s, imatrix collect {s['imatrix']:.1f} s, prune {s['prune']:.1f} s, "
            f"eval {s['eval']:.1f} s): tune takes {tune_seconds / old['total_seconds']:.2f}x the old way's time."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="demo,factory", help="demo, factory or GGUF paths, comma-separated")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=16, help="held-out chunks scored")
    parser.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens traced")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--no-old-way", action="store_true", help="run tune only")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ggufcarve-selection-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    sections, figures = [], {}
    for name in args.models.split(","):
        model = DEMO if name == "demo" else factory_model(work) if name == "factory" else Path(name)
        experts = expert_count(model)
        keep = experts // 2
        env = {
            **os.environ,
            "GGUFCARVE_CACHE": tempfile.mkdtemp(prefix="cache-", dir=work),
        }  # no reference log-probs cached before
        tune_seconds, tuned = run_tune(model, keep, args, work / name / "tune", env)
        print(f"{name}: tune {tune_seconds:.1f} s", file=sys.stderr)
        old = None
        if not args.no_old_way:
            methods = [c["method"] for c in tuned["candidates"]]
            old = old_way(model, keep, methods, args, work / name / "old-way", env)
            print(f"{name}: old way {old['total_seconds']:.1f} s", file=sys.stderr)
        sections.append(
            table(
                name if name in ("demo", "factory") else model.name,
                keep,
                experts,
                tuned,
                tune_seconds,
                old,
                work / name / "tune",
            )
        )
        figures[name] = {
            "model": model.name,
            "keep": keep,
            "tune_seconds": tune_seconds,
            "tune": tuned["candidates"],
            "tune_timings": tuned["timings"],
            "old_way": None
            if old is None
            else {
                "seconds": old["seconds"],
                "total_seconds": old["total_seconds"],
                "kld_mean": {m: r["kld_mean"] for m, r in old["results"].items()},
            },
        }
    text = "\n".join(sections)
    (work / "selection-quality.md").write_text(text)
    (work / "selection-quality.json").write_text(json.dumps(figures, indent=1))
    print(text)
    print(f"work directory: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
