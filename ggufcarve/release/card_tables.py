"""The model card's tables: calibration and held-out texts, the files with their quality figures, their
speed, the held-out segments, pruned against unpruned, and the release gate (markdown rows)."""

from __future__ import annotations

from ggufcarve.fileio import format_size
from ggufcarve.listing import pareto_front
from ggufcarve.release.card_inputs import KLD_CHART, SEGMENT_CHART, SPEED_CHART, SUMMARY, CardInputs, rung_bytes


def calibration_rows(inputs: CardInputs) -> list[str]:
    """Rows (use, file, sha256, tokens used) of the texts that chose the experts and made the imatrix."""
    rows = []
    selection = inputs.selection or {}
    traced = selection.get("tokens") if isinstance(selection.get("tokens"), int) else None
    params = selection.get("parameters") if isinstance(selection.get("parameters"), dict) else {}
    left = traced
    calibration = [c for c in selection.get("calibration") or [] if isinstance(c, dict)]
    for c in calibration:
        in_file = c.get("tokens") if isinstance(c.get("tokens"), int) else None
        used = c.get("tokens_used") if isinstance(c.get("tokens_used"), int) else None
        if used is None and left is not None and in_file is not None:
            used = min(in_file, left)  # the files' tokens are concatenated in order and cut at the traced total
            left -= used
        of = f" of {in_file:,}" if in_file is not None and used is not None and used != in_file else ""
        chunking = (
            f" ({used // params['ctx']} chunks of {params['ctx']})"
            if used and isinstance(params.get("ctx"), int) and used % params["ctx"] == 0
            else ""
        )
        rows.append(
            f"| expert selection ({selection.get('method') or 'calibration'}) "
            f"| {c.get('name')} | `{str(c.get('sha256') or '')[:12]}` | "
            f"{f'{used:,}{of}{chunking}' if used is not None else '–'} |"
        )
    imatrix = inputs.manifest.get("imatrix") if isinstance(inputs.manifest.get("imatrix"), dict) else None
    if imatrix:
        datasets = ", ".join(str(d) for d in imatrix.get("datasets") or []) or "not recorded"
        chunks, size = imatrix.get("chunk_count"), imatrix.get("chunk_size")
        tokens = (
            f"{chunks * size:,} ({chunks} chunks of {size})"
            if isinstance(chunks, int) and isinstance(size, int) and chunks and size
            else "–"
        )
        digest = f"`{str(imatrix['sha256'])[:12]}`" if imatrix.get("sha256") else "–"
        rows.append(f"| importance matrix | {imatrix.get('name')} (from {datasets}) | {digest} | {tokens} |")
    docs = rung_docs(inputs)
    if docs and segment_names(docs[0]):
        rows += segment_rows(docs[0])
    elif docs:
        doc = docs[0]
        p = doc.get("parameters") or {}
        heldout = doc.get("heldout") if isinstance(doc.get("heldout"), dict) else {}
        total = p["ctx"] * p["chunks"] if isinstance(p.get("ctx"), int) and isinstance(p.get("chunks"), int) else None
        name = heldout.get("name") or f"the text of {doc['reference'].get('name')}"
        used = (
            f"{total:,} ({p['chunks']} chunks of {p['ctx']}; {p.get('scored_tokens'):,} scored)"
            if total is not None and isinstance(p.get("scored_tokens"), int)
            else "–"
        )
        digest = f"`{str(heldout['sha256'])[:12]}`" if heldout.get("sha256") else "–"
        rows.append(f"| evaluation (held out) | {name} | {digest} | {used} |")
    if not rows:
        return []
    return ["| Used for | File | sha256 | Tokens used |", "|---|---|---|---|", *rows]


def segment_names(doc: dict) -> list[str]:
    """The held-out files an evaluation scored as segments, in order; none with one file."""
    return [str(s.get("name")) for s in doc.get("segments") or [] if isinstance(s, dict)]


def segment_rows(doc: dict) -> list[str]:
    """One "evaluation (held out)" row per held-out file of a segmented evaluation."""
    p = doc.get("parameters") or {}
    files = {h.get("name"): h for h in doc.get("heldout") or [] if isinstance(h, dict)}
    rows = []
    for segment in doc["segments"]:
        record = files.get(segment.get("name")) or {}
        digest = f"`{str(record['sha256'])[:12]}`" if record.get("sha256") else "–"
        chunks, tokens = segment.get("chunks"), segment.get("tokens")
        used = (
            f"{chunks * p['ctx']:,} ({chunks} chunks of {p['ctx']}; {tokens:,} scored)"
            if isinstance(chunks, int) and isinstance(tokens, int) and isinstance(p.get("ctx"), int)
            else "–"
        )
        rows.append(f"| evaluation (held out) | {segment.get('name')} | {digest} | {used} |")
    return rows


def segments_section(inputs: CardInputs) -> list[str]:
    """Each evaluated model's mean KLD on each held-out file beside its overall one; none with one file."""
    docs = sorted(
        (
            d
            for d in inputs.evaluation.values()
            if segment_names(d) and isinstance(d.get("model", {}).get("bytes"), int)
        ),
        key=lambda d: (d["model"]["bytes"], d["model"]["file"]),
    )
    if not docs:
        return []
    names = list(dict.fromkeys(n for d in docs for n in segment_names(d)))
    rung_files = {r["files"][0]["name"] for r in inputs.rungs}
    modes = {d.get("gate_segments") for d in docs if d.get("gate_segments")}
    lines = [
        "Each held-out file is scored on its own against the reference "
        "(mean KLD, nats per token): a loss that one kind of text "
        "shows (another language, code, structured output) is not averaged "
        "away by the others. *All* is every file's tokens together."
    ]
    if modes == {"every"}:
        lines[0] += " The release gate requires every file to pass."
    elif modes == {"overall"}:
        lines[0] += " The release gate judges *all*; the files' own verdicts are in each JSON (`segments`)."
    lines += [
        "",
        f"| Model | Size | All | {' | '.join(names)} | Gate |",
        "|---|---|---|" + "---|" * len(names) + "---|",
    ]
    for d in docs:
        by_name = {s.get("name"): s for s in d["segments"] if isinstance(s, dict)}
        cells = []
        for n in names:
            s = by_name.get(n) or {}
            cell = f"{s['kld_mean']:.6f}" if isinstance(s.get("kld_mean"), (int, float)) else "–"
            cells.append(cell + (" ✗" if s.get("gate") == "FAIL" else ""))
        name = f"**{d['model']['file']}**" if d["model"]["file"] in rung_files else d["model"]["file"]
        lines.append(
            f"| {name} | {format_size(d['model']['bytes'])} | {d['kld_mean']:.6f} "
            f"| {' | '.join(cells)} | {d.get('gate') or '–'} |"
        )
    lines += ["", "Files of this release in bold; ✗: the file fails the gate on its own."]
    if inputs.evaluation_dir is not None:
        chart = f"{inputs.evaluation_dir}/{SEGMENT_CHART}"
        if chart in inputs.linked:
            lines += ["", f"![File size vs mean KLD on each held-out file]({chart})"]
    return lines


def rung_docs(inputs: CardInputs) -> list[dict]:
    return [
        inputs.evaluation[r["files"][0]["name"]] for r in inputs.rungs if r["files"][0]["name"] in inputs.evaluation
    ]


def quant_table(inputs: CardInputs) -> list[str]:
    rows = [
        "| File | Quant | Size | Bits/weight | PPL | Δ PPL vs reference | Mean KLD | Same top p | QA | Gate | sha256 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rung in inputs.rungs:
        name = rung["files"][0]["name"]
        doc = inputs.evaluation.get(name)
        if doc:
            qa = f"{doc['qa_passed']}/{doc['qa_total']}" if doc.get("qa_total") else "–"
            figures = (
                f"{doc['ppl']:.4f} | {round(doc['ppl_delta_percent'], 2) + 0.0:+.2f}% | "
                f"{doc['kld_mean']:.6f} | {100 * doc['same_top_p']:.2f}% | {qa} | {doc.get('gate') or '–'}"
            )
        else:
            figures = "– | – | – | – | – | not evaluated"
        bits = f"{rung['bits_per_weight']:.2f}" if rung.get("bits_per_weight") else "–"
        rows.append(
            f"| {name} | {rung['name']} | {format_size(rung_bytes(rung))} "
            f"| {bits} | {figures} | `{str(rung.get('sha256'))[:16]}` |"
        )
    from ggufcarve.listing import add_loop_column

    add_loop_column(rows, [inputs.evaluation.get(r["files"][0]["name"]) or {} for r in inputs.rungs])
    return rows


def speed_rows(inputs: CardInputs) -> list[str]:
    """Decode and prompt tok/s of every evaluated file, with where they were measured (`speed_placement`)."""
    measured = [
        (r["files"][0]["name"], doc)
        for r in inputs.rungs
        if (doc := inputs.evaluation.get(r["files"][0]["name"])) and doc.get("tg_tok_s") is not None
    ]
    if not measured:
        return []
    rows = ["| File | Decode tok/s | Prompt tok/s | Placement |", "|---|---|---|---|"]
    for name, doc in measured:
        prompt = f"{doc['pp_tok_s']:.1f}" if doc.get("pp_tok_s") is not None else "–"
        rows.append(f"| {name} | {doc['tg_tok_s']:.1f} | {prompt} | {placement_words(doc.get('speed_placement'))} |")
    speed = measured[0][1].get("speed") or {}
    method = (
        f"{speed.get('engine', 'libllama')}: prompt of {speed.get('pp_tokens')} tokens, "
        f"{speed.get('tg_tokens')} tokens decoded, the median of {len(speed.get('tg_runs') or []) or 1} run(s)"
    )
    return [*rows, "", f"Measured by `ggufcarve eval` on the machine that evaluated the files ({method})."]


def placement_words(placement: dict | None) -> str:
    """llama.devices.Compute.key() in words: "CPU", "16 CPU threads (a cuda build)", "-ngl 99 on
    RPC0 (23.54 GiB over RPC), 2 CPU threads", "-ngl 99 on cuda, split 3:1, 16 CPU threads" (a
    record of before the RPC devices were described counts its RPC servers)."""
    if not placement:
        return "not recorded"
    threads = f"{placement['threads']} CPU threads" if placement.get("threads") else "CPU"
    backend = placement.get("backend")
    if not placement.get("gpu_layers"):
        return threads + (f" (a {backend} build)" if backend and backend not in ("cpu", "rpc") else "")
    rpc = {d.get("name"): d for d in placement.get("rpc_devices") or []}
    named = placement.get("devices") or list(rpc)
    if named:
        where = ", ".join(
            f"{name} ({format_size(rpc[name]['total'])} over RPC)" if name in rpc else f"{name} ({backend})"
            for name in named
        )
    elif placement.get("rpc_servers"):
        where = f"{placement['rpc_servers']} RPC server(s)"
    else:
        where = backend or "an unrecorded backend"
    split = placement.get("tensor_split") or []
    return (
        f"-ngl {placement['gpu_layers']} on {where}"
        + (f", split {':'.join(f'{x:g}' for x in split)}" if len(split) > 1 else "")
        + (f", --n-cpu-moe {placement['n_cpu_moe']}" if placement.get("n_cpu_moe") else "")
        + f", {threads}"
    )


def pareto(docs: list[dict]) -> set[str]:
    """Files on the Pareto front of mean KLD against file size (listing.pareto_front)."""
    return {d["model"]["file"] for d in pareto_front(docs, lambda d: d["model"]["bytes"], lambda d: d["kld_mean"])}


def comparison(inputs: CardInputs) -> list[str]:
    """Every evaluated model (the rungs and the unpruned models they were compared with) by size."""
    docs = sorted(
        (d for d in inputs.evaluation.values() if isinstance(d.get("model", {}).get("bytes"), int)),
        key=lambda d: (d["model"]["bytes"], d["model"]["file"]),
    )
    families = {d["model"].get("family") for d in docs}
    lines: list[str] = []
    rung_files = {r["files"][0]["name"] for r in inputs.rungs}
    if len(families) > 1:
        front = pareto(docs)
        lines += [
            "Every evaluated model by size: these files and the models they "
            "were compared with (such as quants of the unpruned model). "
            "A model is on the Pareto front when no other model is at most its size with a lower mean KLD.",
            "",
            "| Model | Experts | Quant | Size | Mean KLD | PPL | Δ PPL | Pareto front | Gate |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for d in docs:
            m = d["model"]
            name = f"**{m['file']}**" if m["file"] in rung_files else m["file"]
            lines.append(
                f"| {name} | {m.get('family') or '–'} | {m.get('quant') or '–'} | "
                f"{format_size(m['bytes'])} | {d['kld_mean']:.6f} | {d['ppl']:.4f} | "
                f"{round(d['ppl_delta_percent'], 2) + 0.0:+.2f}% | "
                f"{'yes' if m['file'] in front else ''} | {d.get('gate') or '–'} |"
            )
        lines += ["", "Files of this release in bold."]
    if inputs.evaluation_dir is not None:
        chart, summary = f"{inputs.evaluation_dir}/{KLD_CHART}", f"{inputs.evaluation_dir}/{SUMMARY}"
        if chart in inputs.linked:
            lines += ["", f"![File size vs mean KLD against the reference]({chart})"]
        speed_chart = f"{inputs.evaluation_dir}/{SPEED_CHART}"
        if speed_chart in inputs.linked:
            lines += ["", f"![Decode tok/s vs mean KLD against the reference]({speed_chart})"]
        if summary in inputs.linked:
            lines += [
                "",
                "All figures, the quality table and the perplexity chart: "
                f"[{summary}]({summary}); one JSON per model beside it.",
            ]
    return lines


GATE_TEXT = {
    "max_ppl_increase_percent": "perplexity at most {v:g}% above the reference's",
    "max_kld_mean": "mean KLD at most {v:g}",
    "max_kld_p99": "99th percentile KLD at most {v:g}",
    "max_kld_p999": "99.9th percentile KLD at most {v:g}",
    "max_rms_dp": "RMS of the change in the reference token's probability at most {v:g}",
    "min_same_top_p": "the same most likely token as the reference on at least {p:g}% of tokens",
    "min_qa_passed": "at least {v:g} QA checks passed",
    "min_qa_pass_rate": "at least {p:g}% of QA checks passed",
    "min_qa_exact_vs_reference": "at least {p:g}% of QA answers identical to the reference's",
    "min_pp_tok_s": "prompt processing at least {v:g} tokens/s",
    "min_tg_tok_s": "decoding at least {v:g} tokens/s",
    "max_loop_share": "at most {p:g}% of the loop prompts ending in a repeating cycle",
    "max_loop_share_increase": "at most {p:g} percentage points more loop prompts "
    "ending in a repeating cycle than the reference",
}


def gate_section(inputs: CardInputs) -> list[str]:
    docs = rung_docs(inputs)
    judged = [d for d in docs if d.get("gate")]
    if not judged:
        return []
    thresholds = next((d["gate_thresholds"] for d in judged if isinstance(d.get("gate_thresholds"), dict)), None)
    passed = sum(d["gate"] == "PASS" for d in judged)
    lines = [
        f"{passed} of {len(judged)} evaluated files pass the release gate"
        + (
            f" ({', '.join(d['model']['file'] for d in judged if d['gate'] != 'PASS')} fail it)."
            if passed < len(judged)
            else "."
        )
    ]
    if thresholds:
        source = next((d.get("gate_source") for d in judged if d.get("gate_source")), None)
        lines += ["", f"A file passes when it has{f' (thresholds of {source})' if source else ''}:", ""]
        lines += [
            f"- {GATE_TEXT.get(k, k + ' {v:g}').format(v=v, p=100 * v)}"
            for k, v in thresholds.items()
            if isinstance(v, (int, float))
        ]
        unmeasured = sorted({k for d in judged for k in d.get("gate_not_measured") or []})
        if unmeasured:
            lines += ["", f"Not measured in this evaluation, so not judged: {', '.join(f'`{k}`' for k in unmeasured)}."]
    else:
        lines += [
            "",
            "The gate's thresholds are not recorded in these evaluation results; "
            "each file's failed criteria are in its JSON (`gate_failed`).",
        ]
    return lines
