"""best: the best model for a memory budget, pruned or unpruned, which K and which quant, by measurement.

Examples:
    ggufcarve best model-Q8_0.gguf --memory 24GiB --calibration cal.txt --heldout wiki.txt --heldout code.txt -o best/
    ggufcarve best model-Q8_0.gguf --memory 24GiB --gpu-memory 16GiB --ctx 32768 --kv-type q8_0 --calibration \\
        cal.txt --heldout wiki.txt -o best/ --dry-run
    ggufcarve best model-Q8_0.gguf --memory 24GiB --calibration cal.txt --heldout wiki.txt -o best/ --only \\
        K128-Q4_K_M   # one build job of several hosts
    ggufcarve run best/plan.toml     # publish the winner and its neighbours on the front, fully evaluated
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import (
    ForceOption,
    GpuLayersOption,
    JsonOption,
    LlamaCppOption,
    NCpuMoeOption,
    QuietResultOption,
    RpcOption,
    TensorSplitOption,
    ThreadsOption,
    option,
)
from ggufcarve.cli.render import out, print_command, progress, size
from ggufcarve.errors import BadInput, OutputError
from ggufcarve.select.criteria import BEST_DEFAULT
from ggufcarve.settings import Keep

SHOWN_LEFT = 4  # candidates that left early, printed closest first; best.md lists all


def _seconds(value: float | None) -> str:
    if value is None:
        return "not measured"
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.1f} h"


def _table(report: dict) -> object:
    from rich.box import SIMPLE_HEAD

    from ggufcarve.best.render import REASONS
    from ggufcarve.cli.render import escape, new_table
    from ggufcarve.fileio import size_unit

    metric = report["parameters"]["metric"]
    unit = size_unit(max(c["file_bytes"] for c in report["candidates"]))
    winner = report["winner"]["id"] if report["winner"] else None
    table = new_table(
        box=SIMPLE_HEAD,
        pad_edge=False,
        caption=f"{unit[0]} of the file (built, else fit's size); ranked by {metric}; *: the answer; "
        "scored by mask: on the unpruned rung, no file built; each "
        "figure over its chunks; tg tok/s: llama-bench's decode speed of a built finalist in its placement; "
        "99.9% KLD, same top p, PPL: best.md",
        caption_justify="left",
    )
    for name in (
        "candidate",
        "K",
        "quant",
        unit[0],
        "fits",
        "scored by",
        "mean KLD",
        *(f"KLD {Path(n).stem}" for n in report["heldout"]),
        "tg tok/s",
        "chunks",
        "left",
    ):
        table.add_column(
            escape(name),
            justify="left" if name in ("candidate", "quant", "fits", "scored by", "left") else "right",
            no_wrap=True,
        )

    def cell(value: object, digits: int = 4) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    for c in report["candidates"]:
        segs = {s["name"]: s for s in c.get("segments", [])}
        stopped = REASONS.get(c["stopped_reason"] or "", "")
        table.add_row(
            escape(c["id"] + ("*" if c["id"] == winner else "")),
            f"{c['kept_experts']}/{c['expert_count']}",
            escape(c["quant"]),
            f"{c['file_bytes'] / unit[1]:.2f}",
            "yes" if c["fits"] else "no",
            c.get("scored_by") or "",
            cell(c["kld_mean"]),
            *(cell(segs.get(n, {}).get("kld_mean")) for n in report["heldout"]),
            cell(c.get("decode_tok_s"), 1),
            str(c["chunks_scored"]),
            stopped,
        )
    return table


def _where(computed_on: dict, stage: str) -> str:
    """ " (on RPC0)", " (on CUDA0 + CPU)": the devices llama.cpp's loader gave a stage's layers; "" for
    a stage no child reported."""
    devices = sorted({d for entry in computed_on.get(stage) or () for d in entry["layers"]}, key=lambda d: d == "CPU")
    return f" (on {' + '.join(devices)})" if devices else ""


def _speed_text(record: dict) -> str:
    """ "decode 41.2 tok/s at depth 8192 on CUDA0 (llama-bench)", "decode 9.8 tok/s at depth 256 on the
    CPU", or why it was not measured."""
    rate = record.get("decode_tok_s")
    if rate is None:
        return "decode " + (record.get("speed_note") or "not measured")
    where = record.get("speed_computed_on") or {}
    devices = [name for name in where if name != "CPU"]
    on = (
        " + ".join(f"{name}" for name in devices) + (" and the CPU" if "CPU" in where else "") if devices else "the CPU"
    )
    depth = (record.get("speed_method") or {}).get("depth")
    tool = (record.get("speed_method") or {}).get("tool", "llama-bench")
    return f"decode {rate:.1f} tok/s" + (f" at depth {depth}" if depth else "") + f" on {on} ({tool})"


def _memory_text(record: dict, memory: int, gpu_memory: tuple[int, ...]) -> str:
    """What a candidate takes of its budgets: llama.cpp's measured figures when there are (in system
    memory its parts; on GPUs each device's total of its budget, then the host's), else the file and
    the cache."""
    rows = record.get("memory") or []
    if not rows:
        return f"file {size(record['file_bytes'])} + cache {size(record['cache_bytes'])} of {size(memory)}"
    if len(rows) == 1:
        m = rows[0]
        return (
            f"weights {size(m['weights'])} + cache {size(m['cache'])} + "
            f"compute {size(m['compute'])} + output {size(m['output'])} "
            f"= {size(m['total'])} of {size(memory)}"
        )
    devices = [m for m in rows if m["device"] != "host"]
    budgets = [*gpu_memory, *([None] * len(devices))]
    parts = [f"{m['device']} {size(m['total'])}" + (f" of {size(b)}" if b else "") for m, b in zip(devices, budgets)]
    parts += [f"host {size(m['total'])} of {size(memory)}" for m in rows if m["device"] == "host"]
    return ", ".join(parts)


def best_command(
    model: Annotated[Path, typer.Argument(help="The unpruned GGUF model (first shard if split).", show_default=False)],
    memory: Annotated[int, option(S.MEMORY, show_default=False)],
    output: Annotated[
        Path,
        option(
            S.OUTPUT,
            "DIR: best.json, best.md, best-pareto.png, best-speed.png, plan.toml, models/, work/.",
            show_default=False,
        ),
    ],
    heldout: Annotated[list[Path], option(S.HELDOUT, show_default=False)],
    calibration: Annotated[
        list[Path],
        option(S.CALIBRATION, "One pass for every criterion and K, and the imatrix.", show_default=False),
    ],
    gpu_memory: Annotated[
        str | None,
        option(
            S.GPU_MEMORY,
            "each candidate's tiers and run command place the model for it; several sizes are "
            "several GPUs in device order, the layers split by the budgets (-ts).",
        ),
    ] = None,
    gpu_margin: Annotated[int | None, option(S.GPU_MARGIN, show_default=False)] = None,
    tier: Annotated[
        str | None,
        typer.Option(
            "--tier",
            help="Where the answer runs: gpu (all on the GPU), gpu+cpu (--n-cpu-moe N), ram (system "
            "memory) or disk (paging through mmap). Default: the fastest tier any candidate runs in.",
        ),
    ] = None,
    ctx: Annotated[int, option(S.CTX, "the KV cache counted against --memory.")] = 16384,
    kv_type: Annotated[str, option(S.KV_TYPE)] = "f16",
    ladder: Annotated[str | None, option(S.LADDER)] = None,
    methods: Annotated[str, option(S.METHODS, "The keep-set tournament at each K (tune's --methods).")] = ",".join(
        BEST_DEFAULT
    ),
    chunk_ctx: Annotated[int | None, option(S.CHUNK_CTX, "[default: 512]")] = None,
    eval_ctx: Annotated[int | None, typer.Option("--eval-ctx", hidden=True)] = None,
    keep: Annotated[
        Keep | None,
        option(
            S.KEEP,
            "the K values weighed; a keep-set file is weighed at its K beside the criteria's keep-sets "
            "(default: fit's grid).",
        ),
    ] = None,
    chunks: Annotated[int | None, option(S.CHUNKS, "the held-out files scored.")] = None,
    max_tokens: Annotated[int | None, option(S.MAX_TOKENS)] = None,
    metric: Annotated[
        str, typer.Option("--metric", help="What ranks the candidates, lower is better: kld_mean, kld_p999 or ppl.")
    ] = "kld_mean",
    gate: Annotated[Path | None, option(S.GATE, "The answer must pass it.")] = None,
    confirm: Annotated[
        int,
        typer.Option(
            "--confirm", help="Runners-up built and scored as files besides the winner, to confirm their masked scores."
        ),
    ] = 1,
    prefer: Annotated[
        str,
        typer.Option(
            "--prefer",
            help="Among candidates tied with the leader within noise: "
            "smaller (file), faster (fewer bytes per token; then the finalists' measured decode speed) or metric.",
        ),
    ] = "smaller",
    min_decode: Annotated[
        float | None,
        typer.Option(
            "--min-decode",
            metavar="TOK_S",
            help="The answer must decode at least this many tokens per second, measured by llama-bench in its "
            "placement on this machine's devices, with its run line's cache type and flash attention, at "
            "--bench-depth.",
        ),
    ] = None,
    bench_depth: Annotated[int | None, option(S.BENCH_DEPTH, "The finalists' timing.")] = None,
    topk: Annotated[
        str | None,
        option(
            S.TOPK,
            "Here the counts weighed beside the trained one: auto (the trained count less one down to half of it) "
            "or N[,N...]; each survivor of the first round is scored at them by masking with the count overridden "
            "at load, its finalists timed on files rewritten to N.",
            metavar="auto|N[,N...]",
        ),
    ] = None,
    z: Annotated[float | None, option(S.Z, show_default=False)] = None,
    search: Annotated[
        bool,
        option(
            S.SEARCH, "From the winner when it is pruned and scored by mask; it must then beat it on held-out text."
        ),
    ] = False,
    search_passes: Annotated[int | None, option(S.SEARCH_PASSES)] = None,
    only: Annotated[
        list[str] | None,
        option(
            S.ONLY, "candidates, by the ids the dry run lists; build them and score nothing (one job of several hosts)."
        ),
    ] = None,
    quantizer_choice: Annotated[str, option(S.QUANTIZER)] = "auto",
    dry_run: Annotated[
        bool, option(S.DRY_RUN, "print the candidates, the builds, the disk and a time estimate from measured speed.")
    ] = False,
    llama_cpp: LlamaCppOption = None,
    threads: ThreadsOption = None,
    gpu_layers: GpuLayersOption = None,
    rpc: RpcOption = None,
    tensor_split: TensorSplitOption = None,
    n_cpu_moe: NCpuMoeOption = 0,
    force: ForceOption = False,
    quiet: QuietResultOption = False,
    as_json: JsonOption = False,
) -> None:
    """Score every (K, keep-set, quant) that fits a budget by masking on the unpruned rungs; build and confirm the
    answer."""
    from ggufcarve.best.cost import device_words, estimate, measure_speed, project_estimate
    from ggufcarve.best.plan import BestSettings, placed_settings, plan_best
    from ggufcarve.best.render import stopped_lines
    from ggufcarve.best.run import best
    from ggufcarve.llama.devices import FIT_MARGIN
    from ggufcarve.measure.statistics import DEFAULT_Z
    from ggufcarve.quant.spec import DEFAULT_LADDER, find_spec
    from ggufcarve.tune.run import parse_methods

    if chunk_ctx is not None and eval_ctx is not None:
        raise BadInput(
            "--chunk-ctx and --eval-ctx name the same thing",
            "give --chunk-ctx alone (--eval-ctx is its older spelling)",
        )
    wanted = keep
    cache_type = kv_type.upper()
    if output.exists() and not output.is_dir():
        raise OutputError(
            f"-o {output} is a file; best writes a folder of results there",
            "give a folder path (it is made when missing)",
        )
    if (output / "best.json").exists() and not force and not dry_run and not only:
        raise OutputError(
            f"{output / 'best.json'} already exists",
            "pass --force to search again (built models are reused), or choose another -o DIR",
        )
    settings = BestSettings(
        memory=memory,
        ladder=find_spec(ladder) if ladder else DEFAULT_LADDER,
        heldout=tuple(heldout),
        calibration=tuple(calibration),
        methods=parse_methods(methods),
        ctx=ctx,
        kv_type=cache_type,
        eval_ctx=chunk_ctx or eval_ctx or 512,
        chunks=chunks,
        keep_counts=wanted.counts if wanted else None,
        keep_file=wanted.file if wanted else None,
        max_tokens=max_tokens,
        compute=S.compute(threads, gpu_layers, rpc, tensor_split, n_cpu_moe),
        metric=metric,
        gate=gate,
        gpu_memory=gpu_memory or S.Budgets(),
        gpu_margin=FIT_MARGIN if gpu_margin is None else gpu_margin,
        tier=tier,
        quantizer=quantizer_choice,
        llama_cpp_dir=llama_cpp,
        only=tuple(only or ()),
        confirm=confirm,
        prefer=prefer,
        min_decode=min_decode,
        bench_depth=bench_depth,
        topk=topk,
        search=search,
        search_passes=search_passes,
        z=DEFAULT_Z if z is None else z,
    )
    with progress(not quiet and not as_json) as sink:
        settings = placed_settings(settings, model)
        plan = plan_best(model, settings, on_event=sink)
        if dry_run:
            with tempfile.TemporaryDirectory(prefix="ggufcarve-best-speed-") as tmp:
                speed = measure_speed(model, plan, settings, Path(tmp), sink)
            guess = estimate(plan, settings, speed)
            guess["projection"] = project_estimate(plan, guess, device_words(settings.compute))
        else:
            result = best(model, settings, output, plan=plan, on_event=sink)
    if dry_run:
        if as_json:
            out.print_json(
                json.dumps(
                    {
                        "tier": plan.tier,
                        "candidates": [c.to_json() for c in plan.candidates],
                        "kept_counts": plan.kept_counts,
                        "speed": speed,
                        "estimate": guess,
                    }
                )
            )
            return
        out.print(
            f"{model.name}: {plan.layout.expert_count} experts, "
            f"top-{plan.layout.expert_used_count}; budget {size(settings.memory)} "
            f"with a {ctx}-token cache of {size(plan.fit.cache.total_bytes)}; ranked in tier {plan.tier}"
            + (f" (GPU {' + '.join(size(b) for b in settings.gpu_memory)})" if settings.gpu_memory else ""),
            highlight=False,
            markup=False,
        )
        out.print(
            f"candidates ({len(plan.candidates)}, from fit's sizes; total: "
            "llama.cpp's dry load, weights + cache + compute + output):",
            highlight=False,
        )
        for c in plan.candidates:
            total = f"; total {size(c.total)}" if c.measured else ""
            total += f"; tiers {', '.join(c.tiers[:-1]) or 'disk only'}" if settings.gpu_memory else ""
            out.print(
                f"  {c.id:<22} {c.family:<8} {c.kept:>4} of {c.expert_count}  {c.quant:<8} "
                f"file {size(c.file_bytes)} + cache {size(c.cache_bytes)}{total}",
                highlight=False,
                markup=False,
            )
        out.print(
            f"will build: the unpruned rungs {', '.join(plan.quants)}; score "
            f"{guess['scored_candidates']} candidate(s): {guess['masked']} by masking on "
            f"those rungs, {guess['file_scored']} as built pruned rungs "
            "(llama-quantize chooses other types at their K); then build and confirm "
            f"the winner and {settings.confirm} runner(s)-up",
            highlight=False,
            markup=False,
        )
        if plan.used_counts:
            out.print(
                f"experts per token weighed: {plan.layout.expert_used_count} (trained) and "
                f"{', '.join(map(str, plan.used_counts))}, for each survivor of the first round (scored by masking "
                "with the count overridden at load)",
                highlight=False,
                markup=False,
            )
        out.print(f"disk needed: at most {size(guess['disk_bytes'])} under {output}", highlight=False)
        rate, qrate = speed.get("decode_tok_s"), speed.get("quantize_bytes_s")
        out.print(
            f"measured here: decode {rate or 0:.0f} tok/s, quantizer "
            f"{size(qrate) + '/s' if qrate else 'not measured (source over 2 GiB)'}; "
            f"calibration {speed['calibration_tokens']} tokens, held-out {speed['heldout_tokens']} tokens",
            highlight=False,
            markup=False,
        )
        out.print(
            "estimate: "
            + ", ".join(f"{stage} {_seconds(v)}" for stage, v in guess["stages"].items())
            + f"; total {_seconds(guess['total'])}",
            highlight=False,
            markup=False,
        )
        proj = guess["projection"]
        out.print(
            f"projected for {proj['model']}: {proj['rule']}"
            if proj["total"] is None and proj["rule"].startswith("not projected")
            else f"projected for {proj['model']} ({proj['device']}) with this plan of work: "
            + ", ".join(f"{stage} {_seconds(v)}" for stage, v in proj["stages"].items())
            + f"; total {_seconds(proj['total'])}",
            highlight=False,
            markup=False,
        )
        out.print("nothing was written", highlight=False)
        return
    report = result.report
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "winner": report["winner"],
                    "candidates": report["candidates"],
                    "timings": report["timings"],
                    "outputs": [str(p) for p in result.outputs],
                }
            )
        )
        return
    if settings.only:
        built = [c["id"] for c in report["candidates"] if c["built"]]
        out.print(
            f"built: {', '.join(built) or 'nothing'} under {output / 'models'}; run best without --only to score them",
            highlight=False,
            markup=False,
        )
        return
    if not quiet:
        out.print(_table(report))
        lines = stopped_lines(report)
        shown = (
            lines
            if len(lines) <= SHOWN_LEFT + 1
            else [*lines[:SHOWN_LEFT], f"... and {len(lines) - SHOWN_LEFT} more: best.md lists every one"]
        )
        for line in shown:
            out.print(f"left: {line}", highlight=False, markup=False)
        t = report["timings"]
        proj = report["projection"]
        out.print(
            "cost of this run: "
            + ", ".join(
                f"{s} {t.get(f'{s}_seconds', 0.0):.1f} s" + _where(report.get("computed_on") or {}, s)
                for s in proj["stages_seconds"]
            )
            + f"; total {t['total_seconds']:.1f} s; projected for {proj['model']} ({proj.get('device')}): "
            + (proj["rule"] if proj["total_seconds"] is None else _seconds(proj["total_seconds"])),
            highlight=False,
            markup=False,
        )
        previous = report.get("previous_run_timings")
        if previous:
            out.print(
                f"the run before it in {output}: total {previous.get('total_seconds', 0.0):.1f} "
                f"s; reused by content: {report['chunks_cached']} chunk(s) of scoring"
                + (", the keep-sets and the imatrix" if report["keep_sets_reused"] else ""),
                highlight=False,
                markup=False,
            )
    w = report["winner"]
    if w is None:
        out.print("answer: no finalist fits and passes the gate", highlight=False)
        return
    routed = f", top-{w['experts_used']} of trained {plan.layout.expert_used_count}" if w.get("topk_of") else ""
    out.print(
        f"answer: {w['id']} ({w['family']}, {w['kept_experts']} of {w['expert_count']} "
        f"experts, {w['quant']}{routed}): {settings.metric} {w[settings.metric]:.4f}, "
        f"{_memory_text(w, settings.memory, settings.gpu_memory)}; {_speed_text(w)}: {output / w['path']}",
        highlight=False,
        markup=False,
    )
    if w.get("tie_with"):
        out.print(
            f"tie within noise: {', '.join(w['tie_with'])} (within {settings.z:g} "
            f"standard errors); the answer is the {settings.prefer} of them",
            highlight=False,
            markup=False,
        )
    found = report.get("search")
    if found and found.get("searched"):
        moves = sum(len(p["moves"]) for p in found["path"])
        out.print(
            f"search from {found['start']}: {moves} move(s), calibration KLD {found['start_calibration_kld_mean']:.4f}"
            f" -> {found['calibration_kld_mean']:.4f}; on held-out text "
            + ("better beyond noise: the answer" if found["beats_start"] else "not better beyond noise"),
            highlight=False,
            markup=False,
        )
    if w.get("confirmed"):
        k = w["confirmed"]
        out.print(
            f"confirmed as a file: masked mean KLD {k['masked_kld_mean']:.4f}, "
            f"built file {k['file_kld_mean']:.4f} ± {k['file_kld_mean_stderr']:.4f}",
            highlight=False,
            markup=False,
        )
    print_command("run it", w["run_command"]["argv"])
    if w.get("run_command_override"):
        print_command(f"or the file at its trained top-k ({w['routed_from']})", w["run_command_override"]["argv"])
    if w.get("answer_note"):
        out.print(f"note: {w['answer_note']}", highlight=False, markup=False)
    if report.get("publish"):
        print_command("publish it", report["publish"]["command"], f" (in {output})")
    out.print(f"written: {', '.join(str(p) for p in result.outputs)}", highlight=False, markup=False)
