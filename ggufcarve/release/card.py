"""The Hugging Face model card (README.md) of a release, written from what the release records.

Sources, all inside the release directory: quant-manifest.json (rungs, sizes, hashes, quantizer,
commands), the first rung's GGUF keys (general.license, general.base_model.*, expert counts),
method/pruning-report.json and method/expert-selection.json when present (what was pruned and
how), and the evaluation JSON files (`ggufcarve eval ... -o RELEASE/evaluation`) matched to the
rungs by file name. The front matter is YAML (every value written as a JSON scalar or list,
which YAML reads as is). No absolute local path is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import Keys

from ggufcarve import __version__
from ggufcarve.errors import BadInput
from ggufcarve.evaluate.summary import format_gib
from ggufcarve.moe.keepset import KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT

CARD_NAME = "README.md"
EVALUATION_DIR = "evaluation"
TAGS = ("gguf", "mixture-of-experts", "expert-pruning")


@dataclass
class CardInputs:
    manifest: dict
    rungs: list[dict]  # built rungs whose files are present
    keys: dict[str, Any]  # GGUF keys of the first rung
    pruning: dict | None
    selection: dict | None
    evaluation: dict[str, dict]  # rung file name -> evaluation document


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise BadInput(f"{path}: not valid JSON ({err})", "re-create it, or remove it to leave it out of the card") from None


def gather(release: Path, evaluation_dir: Path | None = None) -> CardInputs:
    from ggufcarve.gguf.container import read_model
    from ggufcarve.release.manifest import MANIFEST_NAME, read_manifest

    manifest = read_manifest(release)
    if manifest is None:
        raise BadInput(f"{release}: no {MANIFEST_NAME}", "give a release directory made by ggufcarve ladder run")
    rungs = [r for r in manifest.get("rungs", []) if r.get("status") in ("built", "skipped") and r.get("files") and all((release / f["name"]).exists() for f in r["files"])]
    if not rungs:
        raise BadInput(f"{release}: the manifest lists no built rung present in the directory", "run ggufcarve ladder run first")
    model = read_model(release / rungs[0]["files"][0]["name"])
    wanted = (Keys.General.LICENSE, Keys.General.NAME, Keys.General.ARCHITECTURE, Keys.General.BASE_MODEL_COUNT, KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT,
              BASE_NAME, BASE_ORGANIZATION, BASE_REPO_URL)
    keys = {k: model.get(k) for k in wanted}
    arch = keys[Keys.General.ARCHITECTURE]
    for template in ARCH_KEYS:
        keys[template.format(arch=arch)] = model.get(template.format(arch=arch))
    evaluation: dict[str, dict] = {}
    directory = evaluation_dir or release / EVALUATION_DIR
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        doc = _read_json(path)
        if doc and isinstance(doc.get("model"), dict) and "ppl" in doc:
            evaluation[doc["model"]["file"]] = doc
    return CardInputs(manifest, rungs, keys, _read_json(release / "method" / "pruning-report.json"), _read_json(release / "method" / "expert-selection.json"), evaluation)


# the first base model's keys (general.base_model.0.*) and the architecture keys the card reads
BASE_NAME, BASE_ORGANIZATION, BASE_REPO_URL = (k.format(id=0) for k in (Keys.General.BASE_MODEL_NAME, Keys.General.BASE_MODEL_ORGANIZATION, Keys.General.BASE_MODEL_REPO_URL))
ARCH_KEYS = (Keys.LLM.EXPERT_COUNT, Keys.LLM.EXPERT_USED_COUNT, Keys.LLM.BLOCK_COUNT, Keys.LLM.NEXTN_PREDICT_LAYERS)


def _yaml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def base_model(inputs: CardInputs) -> str:
    """The base model as a repo id (organization/name) when the GGUF names one, else its name."""
    keys = inputs.keys
    url = keys.get(BASE_REPO_URL) or ""
    if "huggingface.co/" in url:
        return url.split("huggingface.co/", 1)[1].strip("/")
    org, name = keys.get(BASE_ORGANIZATION), keys.get(BASE_NAME)
    if name:
        return f"{org}/{name}".replace(" ", "-") if org else str(name)
    return str(keys.get(Keys.General.NAME) or inputs.manifest.get("source", {}).get("name") or "unknown")


def _pruning_lines(inputs: CardInputs) -> list[str]:
    keys, arch = inputs.keys, inputs.keys[Keys.General.ARCHITECTURE]
    kept, source = keys.get(KEY_KEPT_COUNT), keys.get(KEY_SOURCE_EXPERT_COUNT)
    used = keys.get(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))
    used = int(max(used)) if hasattr(used, "__len__") else used
    lines = []
    if kept is None:
        lines.append(f"These files keep every expert of the source ({keys.get(Keys.LLM.EXPERT_COUNT.format(arch=arch))} per MoE layer); no expert was pruned.")
        return lines
    lines.append(f"Routed experts were pruned from {source} to {kept} per MoE layer ({100 * (1 - kept / source):.0f}% removed), byte for byte: "
                 "kept experts and router rows keep their original bytes; shared experts, attention and all other tensors are unchanged.")
    report = inputs.pruning or {}
    meta = {k: v for k, v in (report.get("keep_set") or {}).items() if k != "layers"}
    selection = inputs.selection or {}
    method = selection.get("criterion") or selection.get("method") or meta.get("criterion") or meta.get("selection")
    if method:
        lines.append(f"- Selection: {method}")
    calibration = selection.get("calibration") or meta.get("calibration")
    if calibration:
        lines.append(f"- Calibration: {calibration if isinstance(calibration, str) else json.dumps(calibration, sort_keys=True)}")
    mtp = (report.get("source") or {}).get("mtp_blocks")
    if mtp:
        lines.append(f"- MTP block(s) {', '.join(map(str, mtp))} pruned with the trunk (llama.cpp shape-checks them on load).")
    if report.get("verification"):
        v = report["verification"]
        lines.append(f"- Verified after writing: {v.get('tensors_checked')} tensors re-read and hash-checked ({v.get('hash')}): {'ok' if v.get('ok') else 'FAILED'}.")
    if used:
        lines.append(f"- Experts used per token (top-k) stay {used}.")
    lines.append("- Records: `method/pruning-report.json`" + (", `method/expert-selection.json`" if inputs.selection else "") + ", `quant-manifest.json`.")
    return lines


def _quant_table(inputs: CardInputs) -> list[str]:
    rows = ["| File | Quant | Size GiB | Bits/weight | PPL | Δ PPL vs reference | Mean KLD | Same top p | QA | Gate | sha256 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rung in inputs.rungs:
        name = rung["files"][0]["name"]
        doc = inputs.evaluation.get(name)
        if doc:
            qa = f"{doc['qa_passed']}/{doc['qa_total']}" if doc.get("qa_total") else "–"
            figures = f"{doc['ppl']:.4f} | {round(doc['ppl_delta_percent'], 2) + 0.0:+.2f}% | {doc['kld_mean']:.6f} | {100 * doc['same_top_p']:.2f}% | {qa} | {doc.get('gate') or '–'}"
        else:
            figures = "– | – | – | – | – | not evaluated"
        bits = f"{rung['bits_per_weight']:.2f}" if rung.get("bits_per_weight") else "–"
        rows.append(f"| {name} | {rung['name']} | {format_gib(rung['gib'])} | {bits} | {figures} | `{rung['sha256'][:16]}` |")
    return rows


def _limitations(inputs: CardInputs) -> list[str]:
    keys, arch = inputs.keys, inputs.keys[Keys.General.ARCHITECTURE]
    lines = []
    if keys.get(KEY_KEPT_COUNT) is not None:
        lines.append("- Experts were removed without retraining; the loss is measured above, not absent. Skills the calibration did not exercise "
                     "(other languages, other domains) can degrade more than perplexity shows.")
        calibration = (inputs.selection or {}).get("calibration") or ((inputs.pruning or {}).get("keep_set") or {}).get("calibration")
        lines.append(f"- Calibration: {calibration}." if calibration else "- No calibration record ships with this release: the selection's data and size are not stated here.")
        lines.append(f"- Top-k routing is unchanged ({keys.get(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))} experts per token), so compute per token is unchanged; "
                     "memory and file size fall.")
    if any("--allow-requantize" in (r.get("command") or []) for r in inputs.rungs):
        lines.append(f"- Rungs were requantized from {inputs.manifest.get('source', {}).get('name')} (already quantized), which compounds quantization error.")
    docs = list(inputs.evaluation.values())
    if docs:
        p = docs[0]["parameters"]
        lines.append(f"- Evaluation: {p.get('scored_tokens')} scored tokens of held-out text (context {p.get('ctx')}) against {docs[0]['reference']['name']}"
                     + (f"; {docs[0]['qa_total']} QA checks." if docs[0].get("qa_total") else "; no QA suite was run."))
    else:
        lines.append("- These files were not evaluated (no evaluation JSON in the release).")
    return lines


def _quantizer_line(quantizer: dict[str, Any], rungs: list[dict[str, Any]]) -> str:
    """The attribution of the quantizer; rungs record their own when different builds made them."""
    if any("quantizer" in r for r in rungs):
        return "- Quantized with llama.cpp; the rungs were made by different builds, each named in `quant-manifest.json`."
    build = f", build {quantizer['build']} {quantizer.get('commit', '')}".rstrip() if quantizer.get("build") is not None else ""
    return f"- Quantized with llama.cpp ({quantizer.get('backend', 'llama-quantize')}{build})."


def render_card(inputs: CardInputs) -> str:
    keys, manifest = inputs.keys, inputs.manifest
    arch = keys[Keys.General.ARCHITECTURE]
    base = base_model(inputs)
    tags = [*TAGS, arch] if arch else list(TAGS)
    front = ["---", f"base_model: {_yaml(base)}", "base_model_relation: quantized", f"license: {_yaml(keys.get(Keys.General.LICENSE) or 'other')}",
             "library_name: gguf", "pipeline_tag: text-generation", f"tags: {_yaml(tags)}", "---"]
    title = f"{keys.get(Keys.General.NAME) or base} GGUF"
    example = next((r for r in inputs.rungs if r["name"] == "Q4_K_M"), inputs.rungs[0])["files"][0]["name"]
    quantizer = manifest.get("quantizer") or {}
    lines = [*front, "", f"# {title}", "",
             f"GGUF quantizations of {base}" + (f" with routed experts pruned to {keys[KEY_KEPT_COUNT]} of {keys[KEY_SOURCE_EXPERT_COUNT]}" if keys.get(KEY_KEPT_COUNT) is not None else "") + ".",
             "", "## What was pruned and how", "", *_pruning_lines(inputs),
             "", "## Files", "", *_quant_table(inputs),
             "", "PPL, KLD and QA from `ggufcarve eval` against the reference named under Limitations; KLD in nats per token.",
             "", "## Verify the download", "", "```sh", "sha256sum -c SHA256SUMS", "```",
             "", "## Use with llama.cpp", "", "```sh", f"llama-cli -m {example} -p \"Explain mixture-of-experts in one paragraph.\" -n 256",
             f"llama-server -m {example} -c 8192 --port 8080", "```",
             "", "## Limitations", "", *_limitations(inputs),
             "", "## Attribution", "",
             f"- Base model: {base}" + (f" ({keys[BASE_REPO_URL]})" if keys.get(BASE_REPO_URL) else "") + f"; license {keys.get(Keys.General.LICENSE) or 'as the base model'}.",
             _quantizer_line(quantizer, inputs.rungs),
             f"- Pruned, quantized and evaluated with ggufcarve {__version__}; every file is described by `quant-manifest.json`.", ""]
    return "\n".join(lines)


def write_card(release: Path, evaluation_dir: Path | None = None, force: bool = False) -> Path:
    from ggufcarve.errors import OutputError
    from ggufcarve.fileio import write_text_atomic

    path = release / CARD_NAME
    if path.exists() and not force:
        raise OutputError(f"{path} already exists", "use --force to write the card again")
    write_text_atomic(path, render_card(gather(release, evaluation_dir)))
    return path
