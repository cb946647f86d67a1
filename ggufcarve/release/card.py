"""The Hugging Face model card (README.md) of a release, written from what the release records.

Sources, all inside the release directory: quant-manifest.json (rungs, sizes, hashes, quantizer,
imatrix, commands), the first rung's GGUF keys (general.*, expert counts, context length),
method/pruning-report.json and method/expert-selection.json when present (what was pruned, how,
and from which calibration texts), and the evaluation JSON files (`ggufcarve eval ... -o
RELEASE/evaluation`: the rungs and the models they were compared with). The front matter is YAML
(every value written as a JSON scalar or list, which YAML reads as is). No absolute local path is
written, and nothing is guessed: a base model, license or model name the GGUF does not record and
no option gives is left out of the front matter and named in the body as unknown.

The card ends with a marker line holding the sha256 of everything above it: `card_edited` tells
a card as ggufcarve wrote it from one edited since (or written by hand).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from gguf.constants import Keys

from ggufcarve import __version__
from ggufcarve.errors import BadInput, OutputError
from ggufcarve.fileio import format_size
from ggufcarve.moe.experts_used import TRAINED_KEY
from ggufcarve.moe.keepset import KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT
from ggufcarve.release.card_inputs import (
    CardInputs,
    gather,
    rung_bytes,
)
from ggufcarve.release.card_metadata import CardMetadata, CardSettings, resolve_metadata
from ggufcarve.release.card_tables import (
    calibration_rows,
    comparison,
    gate_section,
    quant_table,
    rung_docs,
    segments_section,
    speed_rows,
)

CARD_NAME = "README.md"
TAGS = ("gguf", "mixture-of-experts", "expert-pruning")
SERVER_CONTEXT = 8192  # the llama-server context the card suggests, when the model supports it
MARKER = re.compile(r"^<!-- ggufcarve card sha256 (?P<digest>[0-9a-f]{64}) -->\n?$")


# License identifiers the Hugging Face Hub accepts in a card's `license:` field
# (huggingface.js, ApiModelMetadata / the Hub's "Licenses" documentation page).
def _yaml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def base_model(inputs: CardInputs, settings: CardSettings | None = None) -> str | None:
    """The base model's Hub repo id (the first, for several), or None when none is known."""
    bases = resolve_metadata(inputs.keys, inputs.manifest, settings).base_models
    return bases[0] if bases else None


# ---------------------------------------------------------------------------------------------
# the card's sections


def _arch(inputs: CardInputs) -> str | None:
    return inputs.keys.get(Keys.General.ARCHITECTURE)


def _pruning_lines(inputs: CardInputs) -> list[str]:
    keys, arch = inputs.keys, _arch(inputs)
    kept, source = keys.get(KEY_KEPT_COUNT), keys.get(KEY_SOURCE_EXPERT_COUNT)
    lines = []
    if kept is None:
        lines.append(
            "These files keep every expert of the source "
            f"({keys.get(Keys.LLM.EXPERT_COUNT.format(arch=arch))} per MoE layer); no expert was pruned."
        )
        return [*lines, *_topk_lines(inputs)]
    lines.append(
        f"Routed experts were pruned from {source} to {kept} per MoE layer "
        f"({100 * (1 - kept / source):.0f}% removed), byte for byte: "
        "kept experts and router rows keep their original bytes; "
        "shared experts, attention and all other tensors are unchanged."
    )
    report = inputs.pruning or {}
    meta = {k: v for k, v in (report.get("keep_set") or {}).items() if k != "layers"}
    selection = inputs.selection or {}
    method = selection.get("criterion") or selection.get("method") or meta.get("criterion") or meta.get("selection")
    if method:
        lines.append(
            f"- Selection: {method}"
            + (" (the calibration texts are listed below)" if selection.get("calibration") else "")
        )
    if inputs.tournament:
        lines.append(
            "- The selection won a tournament: every criterion's keep-set "
            "scored against the unpruned model on held-out text with the "
            "pruned experts masked out of routing (`method/tune.md`: each criterion's mean KLD at each K)."
        )
    calibration = meta.get("calibration")
    if isinstance(calibration, str) and not selection.get("calibration"):
        lines.append(f"- Calibration: {calibration}")
    mtp = (report.get("source") or {}).get("mtp_blocks")
    if mtp:
        lines.append(
            f"- MTP block(s) {', '.join(map(str, mtp))} pruned with the trunk (llama.cpp shape-checks them on load)."
        )
    if report.get("verification"):
        v = report["verification"]
        lines.append(
            f"- Verified after writing: {v.get('tensors_checked')} tensors re-read "
            f"and hash-checked ({v.get('hash')}): {'ok' if v.get('ok') else 'FAILED'}."
        )
    lines += _topk_lines(inputs)
    records = ["method/pruning-report.json"] if inputs.pruning else []
    records += ["method/expert-selection.json"] if inputs.selection else []
    records += ["method/tune.md"] if inputs.tournament else []
    lines.append("- Records: " + ", ".join(f"`{r}`" for r in [*records, "quant-manifest.json"]) + ".")
    return lines


def _experts_used(inputs: CardInputs) -> tuple[int | None, int | None]:
    """The files' experts per token (the largest entry of a per-layer array) and the trained value: the
    files' record, else the manifest's, else the files' own."""
    used = inputs.keys.get(Keys.LLM.EXPERT_USED_COUNT.format(arch=_arch(inputs)))
    used = int(max(used)) if hasattr(used, "__len__") else used
    recorded = inputs.manifest.get("expert_used_count") or {}
    return used, inputs.keys.get(TRAINED_KEY) or recorded.get("trained") or used


def _topk_lines(inputs: CardInputs) -> list[str]:
    """The experts each token is routed to, beside the trained value (the file's record, else the manifest's) when
    they differ, with the load-time override that runs a file at its trained top-k."""
    key = Keys.LLM.EXPERT_USED_COUNT.format(arch=_arch(inputs))
    used, trained = _experts_used(inputs)
    if not used:
        return []
    if trained == used:
        return [f"- Experts used per token (top-k) stay {used}."]
    return [
        f"- Experts used per token (top-k): {used}, lowered from the trained {trained} (`{key}`): fewer experts "
        f"read per token, faster decoding, some quality lost (KLD below). To run a file at its trained top-k: "
        f"`--override-kv {key}=int:{trained}`."
    ]


def _example(inputs: CardInputs) -> tuple[dict, list[str]]:
    """The rung the usage example runs, and what the card says about the choice: the file of lowest
    mean KLD among those that pass the release gate; when none passes, the lowest of all, said so;
    without gate verdicts, Q4_K_M (else the first rung)."""
    judged = [
        (r, inputs.evaluation[r["files"][0]["name"]])
        for r in inputs.rungs
        if (inputs.evaluation.get(r["files"][0]["name"]) or {}).get("gate")
        and isinstance(inputs.evaluation[r["files"][0]["name"]].get("kld_mean"), (int, float))
    ]
    passing = [(r, d) for r, d in judged if d["gate"] == "PASS"]
    if passing:
        rung = min(passing, key=lambda p: (p[1]["kld_mean"], rung_bytes(p[0])))[0]
        return rung, [
            f"The example uses {rung['files'][0]['name']}, the file of lowest mean KLD that passes the release gate."
        ]
    if judged:
        rung = min(judged, key=lambda p: (p[1]["kld_mean"], rung_bytes(p[0])))[0]
        return rung, [
            "No file of this release passes the release gate; the example "
            f"uses {rung['files'][0]['name']}, the one of lowest mean KLD."
        ]
    return next((r for r in inputs.rungs if r["name"] == "Q4_K_M"), inputs.rungs[0]), []


def _unpruned_beats(inputs: CardInputs) -> list[str]:
    """A sentence when a compared model that keeps every expert has a lower mean KLD than every file
    of this release of its size or larger (the smallest such model)."""
    rung_files = {r["files"][0]["name"] for r in inputs.rungs}
    ours = [
        d
        for d in inputs.evaluation.values()
        if d.get("model", {}).get("file") in rung_files
        and isinstance(d["model"].get("bytes"), int)
        and isinstance(d.get("kld_mean"), (int, float))
    ]
    others = sorted(
        (
            d
            for d in inputs.evaluation.values()
            if d.get("model", {}).get("file") not in rung_files
            and d["model"].get("pruned") is False
            and isinstance(d["model"].get("bytes"), int)
            and isinstance(d.get("kld_mean"), (int, float))
        ),
        key=lambda d: (d["model"]["bytes"], d["kld_mean"]),
    )
    for other in others:
        size, kld = other["model"]["bytes"], other["kld_mean"]
        larger = [d for d in ours if d["model"]["bytes"] >= size]
        if larger and all(kld < d["kld_mean"] for d in larger):
            scope = (
                "every file of this release"
                if len(larger) == len(ours) and all(kld < d["kld_mean"] for d in ours)
                else "every file of this release of its size or larger "
                f"({', '.join(d['model']['file'] for d in sorted(larger, key=lambda d: d['model']['bytes']))})"
            )
            quant = f" quantized to {other['model']['quant']}" if other["model"].get("quant") else ""
            return [
                f"Measured here, the unpruned model{quant} ({other['model']['file']}, "
                f"{format_size(size)}, mean KLD {kld:.6f}) is closer to the reference "
                f"than {scope}: at these sizes, quantizing the unpruned model costs less than pruning its experts."
            ]
    return []


def _limitations(inputs: CardInputs) -> list[str]:
    keys = inputs.keys
    lines = []
    if keys.get(KEY_KEPT_COUNT) is not None:
        lines.append(
            "- Experts were removed without retraining; the loss is measured "
            "above, not absent. Skills the calibration did not exercise "
            "(other languages, other domains) can degrade more than perplexity shows."
        )
        selection = inputs.selection or {}
        if not selection.get("calibration"):
            lines.append(
                "- No calibration record ships with this release: the selection's data and size are not stated here."
            )
        used, trained = _experts_used(inputs)
        lines.append(
            f"- Top-k routing is unchanged ({used} experts per token), so "
            "compute per token is unchanged; memory and file size fall."
            if used == trained
            else f"- Top-k routing was lowered from {trained} to {used} experts per token: a routing the model "
            "was not trained with, whose loss the KLD above measures."
        )
    if any("--allow-requantize" in (r.get("command") or []) for r in inputs.rungs):
        lines.append(
            f"- Rungs were requantized from {inputs.manifest.get('source', {}).get('name')} "
            "(already quantized), which compounds quantization error."
        )
    docs = rung_docs(inputs)
    if docs:
        p = docs[0]["parameters"]
        scored = f"{p['scored_tokens']:,}" if isinstance(p.get("scored_tokens"), int) else "the"
        lines.append(
            f"- Evaluation: {scored} scored tokens of held-out text (context "
            f"{p.get('ctx')}) against {docs[0]['reference']['name']}"
            + (f"; {docs[0]['qa_total']} QA checks." if docs[0].get("qa_total") else "; no QA suite was run.")
        )
    else:
        lines.append("- These files were not evaluated (no evaluation JSON in the release).")
    return lines


def _quantizer_line(quantizer: dict[str, Any], rungs: list[dict[str, Any]]) -> str:
    """The attribution of the quantizer; rungs record their own when different builds made them."""
    if any("quantizer" in r for r in rungs):
        return (
            "- Quantized with llama.cpp; the rungs were made by different builds, each named in `quant-manifest.json`."
        )
    build = (
        f", build {quantizer['build']} {quantizer.get('commit', '')}".rstrip()
        if quantizer.get("build") is not None
        else ""
    )
    return f"- Quantized with llama.cpp ({quantizer.get('backend', 'llama-quantize')}{build})."


def _link(repo: str) -> str:
    return f"[{repo}](https://huggingface.co/{repo})"


def _license_link(meta: CardMetadata) -> str:
    if meta.license is None:
        return "not stated"
    if meta.license == "other":
        name = meta.license_name or "other"
        return f"[{name}]({meta.license_link})" if meta.license_link else name
    return f"`{meta.license}`"


def render_card(inputs: CardInputs, settings: CardSettings | None = None) -> str:
    """The card's text (without its marker line)."""
    keys, manifest = inputs.keys, inputs.manifest
    meta = resolve_metadata(keys, manifest, settings)
    arch = _arch(inputs)
    tags = [*TAGS, arch] if arch else list(TAGS)
    front = ["---"]
    if meta.base_models:
        front += [
            f"base_model: {_yaml(meta.base_models[0] if len(meta.base_models) == 1 else meta.base_models)}",
            "base_model_relation: quantized",
        ]
    if meta.license is not None:
        front.append(f"license: {_yaml(meta.license)}")
        if meta.license_name:
            front.append(f"license_name: {_yaml(meta.license_name)}")
        if meta.license_link:
            front.append(f"license_link: {_yaml(meta.license_link)}")
    front += ["library_name: gguf", "pipeline_tag: text-generation", f"tags: {_yaml(tags)}", "---"]
    kept = keys.get(KEY_KEPT_COUNT)
    pruned = f" with routed experts pruned to {kept} of {keys[KEY_SOURCE_EXPERT_COUNT]}" if kept is not None else ""
    base = ", ".join(_link(b) for b in meta.base_models)
    intro = (
        f"GGUF quantizations of {base}{pruned}."
        if base
        else f"GGUF quantizations of a base model this card does not name{',' if pruned else ''}{pruned}."
    )
    example_rung, example_lines = _example(inputs)
    example = example_rung["files"][0]["name"]
    context = keys.get(Keys.LLM.CONTEXT_LENGTH.format(arch=arch)) if arch else None
    server_ctx = f" -c {min(SERVER_CONTEXT, int(context))}" if isinstance(context, int) and context > 0 else ""
    quantizer = manifest.get("quantizer") or {}
    title = (
        f"{meta.model_name}, pruned to {kept} of {keys[KEY_SOURCE_EXPERT_COUNT]} experts, GGUF"
        if kept is not None
        else f"{meta.model_name} GGUF"
    )
    lines = [
        *front,
        "",
        f"# {title}",
        "",
        intro,
        *(line for note in [*meta.notes, *_unpruned_beats(inputs)] for line in ("", note)),
        "",
        "## What was pruned and how",
        "",
        *_pruning_lines(inputs),
    ]
    texts = calibration_rows(inputs)
    if texts:
        lines += ["", "### Calibration and held-out texts", "", *texts]
    lines += [
        "",
        "## Files",
        "",
        *quant_table(inputs),
        "",
        "PPL, KLD and QA from `ggufcarve eval` against the reference named under Limitations; KLD in nats per token.",
    ]
    speeds = speed_rows(inputs)
    if speeds:
        lines += ["", "### Speed", "", *speeds]
    compared = comparison(inputs)
    if compared:
        lines += ["", "## Pruned vs unpruned", "", *compared]
    segments = segments_section(inputs)
    if segments:
        lines += ["", "## Held-out segments", "", *segments]
    gate = gate_section(inputs)
    if gate:
        lines += ["", "## The release gate", "", *gate]
    if meta.repo_id:
        lines += ["", "## Download", "", "```sh", f"hf download {meta.repo_id} {example} --local-dir .", "```"]
    lines += [
        "",
        "## Verify the download",
        "",
        "```sh",
        "sha256sum -c SHA256SUMS",
        "```",
        "",
        "## Use with llama.cpp",
        "",
        "```sh",
        f'llama-cli -m {example} -p "Explain mixture-of-experts in one paragraph." -n 256',
        f"llama-server -m {example}{server_ctx} --port 8080",
    ]
    if meta.repo_id:
        lines.append(f"llama-server -hf {meta.repo_id}:{example_rung['name']}{server_ctx} --port 8080")
    lines += ["```", *(line for note in example_lines for line in ("", note))]
    if server_ctx:
        lines += [
            "",
            f"The model's context length is {int(context):,} tokens (`{Keys.LLM.CONTEXT_LENGTH.format(arch=arch)}`).",
        ]
    lines += [
        "",
        "## Limitations",
        "",
        *_limitations(inputs),
        "",
        "## Attribution",
        "",
        (f"- Base model: {base}" if base else "- Base model: not stated") + f"; license {_license_link(meta)}.",
        _quantizer_line(quantizer, inputs.rungs),
        f"- Pruned, quantized and evaluated with ggufcarve {__version__}; "
        "every file is described by `quant-manifest.json`.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the card in the release


def with_marker(text: str) -> str:
    """The card as written: its text, then the marker line holding the text's sha256."""
    body = text if text.endswith("\n") else text + "\n"
    return f"{body}<!-- ggufcarve card sha256 {hashlib.sha256(body.encode()).hexdigest()} -->\n"


def card_edited(release: Path) -> bool:
    """Whether RELEASE/README.md differs from the card ggufcarve wrote last: it was edited after
    (recorded with `card --record` or not), or ggufcarve did not write it. False when there is none."""
    path = release / CARD_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    text = data.decode("utf-8", errors="replace")
    body, _, last = text.rstrip("\n").rpartition("\n")
    m = MARKER.match(last)
    return m is None or hashlib.sha256((body + "\n").encode()).hexdigest() != m["digest"]


def card_recorded(release: Path) -> bool:
    """Whether RELEASE/README.md is the card the release's manifest records (its sha256), so that
    `verify` passes for it; False when there is none or the manifest records none."""
    from ggufcarve.fileio import sha256_file
    from ggufcarve.release.manifest import read_manifest

    path = release / CARD_NAME
    manifest = read_manifest(release)
    published = (
        manifest.get("published") if manifest is not None and isinstance(manifest.get("published"), dict) else {}
    )
    records = [r for r in published.get("card") or [] if isinstance(r, dict) and r.get("name") == CARD_NAME]
    return path.is_file() and bool(records) and records[0].get("sha256") == sha256_file(path)


def card_warnings(release: Path, settings: CardSettings | None = None, evaluation_dir: Path | None = None) -> list[str]:
    """What the card would leave unknown (base model, license), as warnings for the command line."""
    inputs = gather(release, evaluation_dir)
    return resolve_metadata(inputs.keys, inputs.manifest, settings).warnings


def write_card(
    release: Path, evaluation_dir: Path | None = None, force: bool = False, settings: CardSettings | None = None
) -> Path:
    """Write RELEASE/README.md and record it in the release's manifest and SHA256SUMS. An existing
    card is replaced only with `force`."""
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.release.publish import record_published

    path = release / CARD_NAME
    if path.exists() and not force:
        raise OutputError(
            f"{path} already exists", "use --force to write the card again, or --record to publish the card as it is"
        )
    text = with_marker(render_card(gather(release, evaluation_dir), settings.check() if settings is not None else None))
    write_text_atomic(path, text)
    record_published(release, "card", [path])
    return path


def record_card(release: Path) -> Path:
    """Record RELEASE/README.md as it is (after a hand edit) in the manifest and SHA256SUMS."""
    from ggufcarve.release.publish import record_published

    path = release / CARD_NAME
    if not path.is_file():
        raise BadInput(f"{release} has no {CARD_NAME}", "write it with ggufcarve card RELEASE first")
    record_published(release, "card", [path])
    return path
