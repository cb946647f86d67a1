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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gguf.constants import Keys

from ggufcarve import __version__
from ggufcarve import settings as S
from ggufcarve.errors import BadInput, OutputError
from ggufcarve.fileio import format_size
from ggufcarve.listing import pareto_front
from ggufcarve.moe.keepset import KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT
from ggufcarve.settings import key as setting_key

CARD_NAME = "README.md"
EVALUATION_DIR = "evaluation"
KLD_CHART = "size-vs-kld.png"  # evaluate.summary.KLD_CHART
SEGMENT_CHART = "size-vs-kld-segments.png"  # evaluate.summary.SEGMENT_CHART
SUMMARY = "summary.md"  # evaluate.summary.SUMMARY
TAGS = ("gguf", "mixture-of-experts", "expert-pruning")
SERVER_CONTEXT = 8192  # the llama-server context the card suggests, when the model supports it
MARKER = re.compile(r"^<!-- ggufcarve card sha256 (?P<digest>[0-9a-f]{64}) -->\n?$")

# License identifiers the Hugging Face Hub accepts in a card's `license:` field
# (huggingface.js, ApiModelMetadata / the Hub's "Licenses" documentation page).
HF_LICENSES = frozenset(
    (
        "apache-2.0",
        "mit",
        "openrail",
        "bigscience-openrail-m",
        "creativeml-openrail-m",
        "bigscience-bloom-rail-1.0",
        "bigcode-openrail-m",
        "afl-3.0",
        "artistic-2.0",
        "bsl-1.0",
        "bsd",
        "bsd-2-clause",
        "bsd-3-clause",
        "bsd-3-clause-clear",
        "c-uda",
        "cc",
        "cc0-1.0",
        "cc-by-2.0",
        "cc-by-2.5",
        "cc-by-3.0",
        "cc-by-4.0",
        "cc-by-sa-3.0",
        "cc-by-sa-4.0",
        "cc-by-nc-2.0",
        "cc-by-nc-3.0",
        "cc-by-nc-4.0",
        "cc-by-nd-4.0",
        "cc-by-nc-nd-3.0",
        "cc-by-nc-nd-4.0",
        "cc-by-nc-sa-2.0",
        "cc-by-nc-sa-3.0",
        "cc-by-nc-sa-4.0",
        "cdla-sharing-1.0",
        "cdla-permissive-1.0",
        "cdla-permissive-2.0",
        "wtfpl",
        "ecl-2.0",
        "epl-1.0",
        "epl-2.0",
        "etalab-2.0",
        "eupl-1.1",
        "eupl-1.2",
        "agpl-3.0",
        "gfdl",
        "gpl",
        "gpl-2.0",
        "gpl-3.0",
        "lgpl",
        "lgpl-2.1",
        "lgpl-3.0",
        "isc",
        "h-research",
        "intel-research",
        "lppl-1.3c",
        "ms-pl",
        "apple-ascl",
        "apple-amlr",
        "mpl-2.0",
        "odc-by",
        "odbl",
        "openrail++",
        "osl-3.0",
        "postgresql",
        "ofl-1.1",
        "ncsa",
        "unlicense",
        "zlib",
        "pddl",
        "lgpl-lr",
        "deepfloyd-if-license",
        "fair-noncommercial-research-license",
        "llama2",
        "llama3",
        "llama3.1",
        "llama3.2",
        "llama3.3",
        "llama4",
        "gemma",
        "unknown",
        "other",
    )
)
# A Hub repo id: owner/name, each of ASCII letters, digits, "-", "_" and "." (no "--" or ".."),
# starting and ending with a letter or digit, names up to 96 characters.
_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?"
REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
HF_URL = re.compile(r"^https?://(?:www\.)?huggingface\.co/(?P<path>[^?#]+)")


def valid_repo_id(value: object) -> bool:
    """Whether `value` is a Hub repo id (owner/name)."""
    return (
        isinstance(value, str)
        and bool(REPO_ID.match(value))
        and "--" not in value
        and ".." not in value
        and not value.endswith(".git")
    )


def repo_id_of_url(url: object) -> str | None:
    """The repo id of a model's huggingface.co URL (https://huggingface.co/OWNER/NAME[/...]), else None."""
    m = HF_URL.match(url.strip()) if isinstance(url, str) else None
    if m is None:
        return None
    parts = m["path"].strip("/").split("/")
    if len(parts) < 2 or parts[0] in ("datasets", "spaces", "docs", "models"):
        return None
    candidate = f"{parts[0]}/{parts[1]}"
    return candidate if valid_repo_id(candidate) else None


# ---------------------------------------------------------------------------------------------
# what the card says about the model: options first, then the GGUF's general.* keys


@dataclass(frozen=True)
class CardSettings:
    """What a user states for the card (options of `ggufcarve card`, keys of a plan's [card]
    table); None leaves it to the GGUF's general.* keys."""

    base_model: str | None = setting_key(S.BASE_MODEL)  # a Hub repo id, owner/name
    license: str | None = setting_key(S.LICENSE)  # a Hub license identifier (HF_LICENSES)
    license_name: str | None = setting_key(S.LICENSE_NAME)  # with license "other": the license's short name
    license_link: str | None = setting_key(S.LICENSE_LINK)  # with license "other": a URL, or a file of the release
    model_name: str | None = setting_key(S.MODEL_NAME)  # the card's title
    repo_id: str | None = setting_key(S.REPO_ID)  # the Hub repo the release is uploaded to (download, llama-server -hf)

    def to_json(self) -> dict[str, str]:
        """The settings given (for a plan's record and its stage's parameters)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def check(self) -> CardSettings:
        """Raise BadInput (one line, naming the plan key / option) for a value the Hub would refuse."""
        for key, value in (("base_model", self.base_model), ("repo_id", self.repo_id)):
            if value is not None and not valid_repo_id(value):
                raise BadInput(
                    f"card {key} {value!r} is not a Hugging Face repo id",
                    "give OWNER/NAME as on huggingface.co (letters, digits, '-', '_', '.'), e.g. Qwen/Qwen3-30B-A3B",
                )
        if self.license is not None and self.license.strip().lower() not in HF_LICENSES:
            raise BadInput(
                f"card license {self.license!r} is not a license identifier the Hugging Face Hub accepts",
                "give one such as apache-2.0, mit, llama3.1, gemma; "
                'or license "other" with license_name and license_link',
            )
        for key, value in (
            ("license_name", self.license_name),
            ("license_link", self.license_link),
            ("model_name", self.model_name),
        ):
            if value is not None and (not value.strip() or "\n" in value):
                raise BadInput(f"card {key} {value!r} is empty or spans lines", "give it on one line")
        return self


@dataclass
class CardMetadata:
    base_models: list[str]  # Hub repo ids
    license: str | None
    license_name: str | None
    license_link: str | None
    model_name: str
    repo_id: str | None
    notes: list[str] = field(default_factory=list)  # sentences for the card's body about what is unknown
    warnings: list[str] = field(default_factory=list)  # the same, for the command line


def _key(name: str, **ids: Any) -> str:
    """A gguf-py key name (gguf.Keys), formatted with its ids."""
    return name.format(**ids)


def gguf_key_names() -> dict[str, str]:
    import gguf

    general = gguf.Keys.General
    return {
        "name": general.NAME,
        "basename": general.BASENAME,
        "size_label": general.SIZE_LABEL,
        "license": general.LICENSE,
        "license_name": general.LICENSE_NAME,
        "license_link": general.LICENSE_LINK,
        "base_count": general.BASE_MODEL_COUNT,
        "base_name": general.BASE_MODEL_NAME,
        "base_org": general.BASE_MODEL_ORGANIZATION,
        "base_repo_url": general.BASE_MODEL_REPO_URL,
        "context_length": gguf.Keys.LLM.CONTEXT_LENGTH,
        "architecture": general.ARCHITECTURE,
    }


def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def resolve_metadata(
    keys: dict[str, Any], manifest: dict[str, Any], settings: CardSettings | None = None
) -> CardMetadata:
    """Base model, license, model name and repo id: each from `settings` when given, else from
    the GGUF keys (`keys`, by gguf-py's key names), else unknown (with a note and a warning)."""
    s = settings or CardSettings()
    n = gguf_key_names()
    notes: list[str] = []
    warnings: list[str] = []

    bases: list[str] = []
    if s.base_model is not None:
        bases = [s.base_model]
    else:
        count = keys.get(n["base_count"])
        seen = []
        for i in range(int(count) if isinstance(count, int) and count > 0 else 1):
            url = _text(keys.get(_key(n["base_repo_url"], id=i)))
            org, name = _text(keys.get(_key(n["base_org"], id=i))), _text(keys.get(_key(n["base_name"], id=i)))
            repo = repo_id_of_url(url) or (f"{org}/{name}" if org and name and valid_repo_id(f"{org}/{name}") else None)
            if repo is not None:
                bases.append(repo)
            elif url or name:
                seen.append(
                    f"{_key(n['base_repo_url'] if url else n['base_name'], id=i)} "
                    f"= {json.dumps(url or name, ensure_ascii=False)}"
                )
        if not bases:
            why = (
                f"the source GGUF records no Hub repo id for it ({'; '.join(seen)})"
                if seen
                else f"the source GGUF has no {_key(n['base_repo_url'], id=0)} key"
            )
            notes.append(f"The base model is not stated: {why}.")
            warnings.append(
                f"no base_model in the card: {why} (give `ggufcarve card RELEASE --base-model OWNER/NAME --force`, "
                "or base_model in the plan's [card] table, so the Hub links this model to its base)"
            )

    license_ = s.license.strip().lower() if s.license is not None else None
    license_from = "--license"
    if license_ is None:
        recorded = _text(keys.get(n["license"]))
        license_from = n["license"]
        if recorded is None:
            notes.append(f"The license is not stated: the source GGUF has no {n['license']} key.")
            warnings.append(
                f"no license in the card: the source GGUF has no {n['license']} "
                "key (give `ggufcarve card RELEASE --license ID --force`, "
                "or license in the plan's [card] table; check the base model's license first)"
            )
        elif recorded.lower() in HF_LICENSES:
            license_ = recorded.lower()
        else:
            notes.append(
                f"The source GGUF records the license as {json.dumps(recorded, ensure_ascii=False)}, "
                "which is not a license identifier the Hugging Face Hub accepts; "
                "the front matter leaves it out."
            )
            warnings.append(
                f"no license in the card: {n['license']} = {recorded!r} is not a Hub "
                "license identifier (give `ggufcarve card RELEASE --license ID --force`, "
                "or --license other with --license-name and --license-link)"
            )
    license_name = s.license_name or (_text(keys.get(n["license_name"])) if license_ == "other" else None)
    license_link = s.license_link or (_text(keys.get(n["license_link"])) if license_ == "other" else None)
    if license_ == "other" and (license_name is None or license_link is None):
        lacking = " and ".join(
            k for k, v in (("license_name", license_name), ("license_link", license_link)) if v is None
        )
        notes.append(f'The license is "other" (from {license_from}) without its {lacking}.')
        warnings.append(
            f'license "other" without {lacking} (give --license-name and --license-link: a URL, or a LICENSE file '
            "recorded in the release with `ggufcarve release record LICENSE`)"
        )

    basename, size_label = _text(keys.get(n["basename"])), _text(keys.get(n["size_label"]))
    model_name = (
        s.model_name
        or (f"{basename}-{size_label}" if basename and size_label else basename)
        or _text((manifest.get("parameters") or {}).get("model_name"))
        or _text(keys.get(n["name"]))
        or Path(str((manifest.get("source") or {}).get("name") or "model")).stem
    )
    return CardMetadata(
        bases,
        license_,
        license_name if license_ == "other" else None,
        license_link if license_ == "other" else None,
        model_name.strip(),
        s.repo_id,
        notes,
        warnings,
    )


# ---------------------------------------------------------------------------------------------
# what the release records


@dataclass
class CardInputs:
    manifest: dict
    rungs: list[dict]  # built rungs whose files are present
    keys: dict[str, Any]  # GGUF keys of the first rung
    pruning: dict | None
    selection: dict | None
    evaluation: dict[str, dict]  # model file name -> evaluation document (rungs and the models compared with them)
    evaluation_dir: str | None = None  # the evaluation directory relative to the release, when inside it
    linked: frozenset[str] = frozenset()  # files of the release the card may link (relative names)
    tournament: bool = False  # method/tune.md is in the release (the selection won `ggufcarve tune`)


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError as err:
        raise BadInput(
            f"{path}: not valid JSON ({err})", "re-create it, or remove it to leave it out of the card"
        ) from None
    return doc if isinstance(doc, dict) else None


def _rung_bytes(rung: dict) -> int:
    files = [f for f in rung.get("files") or [] if isinstance(f, dict)]
    return int(sum(f.get("bytes") or 0 for f in files)) or int(rung.get("bytes") or 0)


def gather(release: Path, evaluation_dir: Path | None = None) -> CardInputs:
    from ggufcarve.gguf.container import read_model
    from ggufcarve.release.manifest import MANIFEST_NAME, read_manifest

    manifest = read_manifest(release)
    if manifest is None:
        raise BadInput(f"{release}: no {MANIFEST_NAME}", "give a release directory made by ggufcarve ladder run")
    rungs = [
        r
        for r in manifest.get("rungs", [])
        if r.get("status") in ("built", "skipped")
        and r.get("files")
        and all((release / f["name"]).exists() for f in r["files"])
    ]
    if not rungs:
        raise BadInput(
            f"{release}: the manifest lists no built rung present in the directory", "run ggufcarve ladder run first"
        )
    model = read_model(release / rungs[0]["files"][0]["name"])
    names = gguf_key_names()
    arch = model.get(names["architecture"])
    wanted = [
        names[k]
        for k in (
            "name",
            "basename",
            "size_label",
            "license",
            "license_name",
            "license_link",
            "base_count",
            "architecture",
        )
    ]
    wanted += [KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT]
    count = model.get(names["base_count"])
    for i in range(int(count) if isinstance(count, int) and count > 0 else 1):
        wanted += [_key(names[k], id=i) for k in ("base_name", "base_org", "base_repo_url")]
    if arch:
        wanted += [
            k.format(arch=arch)
            for k in (
                Keys.LLM.EXPERT_COUNT,
                Keys.LLM.EXPERT_USED_COUNT,
                Keys.LLM.BLOCK_COUNT,
                Keys.LLM.NEXTN_PREDICT_LAYERS,
            )
        ]
        wanted.append(_key(names["context_length"], arch=arch))
    keys = {k: model.get(k) for k in wanted}
    evaluation: dict[str, dict] = {}
    directory = (evaluation_dir or release / EVALUATION_DIR).resolve()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        doc = _read_json(path)
        if doc and isinstance(doc.get("model"), dict) and "ppl" in doc:
            evaluation[doc["model"]["file"]] = doc
    root = release.resolve()
    inside = directory.is_relative_to(root)
    linked = (
        frozenset(p.relative_to(root).as_posix() for p in directory.iterdir() if p.is_file())
        if inside and directory.is_dir()
        else frozenset()
    )
    return CardInputs(
        manifest,
        rungs,
        keys,
        _read_json(release / "method" / "pruning-report.json"),
        _read_json(release / "method" / "expert-selection.json"),
        evaluation,
        directory.relative_to(root).as_posix() if inside else None,
        linked,
        (release / "method" / "tune.md").is_file(),
    )


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


def _calibration_rows(inputs: CardInputs) -> list[str]:
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
    docs = _rung_docs(inputs)
    if docs and _segment_names(docs[0]):
        rows += _segment_rows(docs[0])
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


def _segment_names(doc: dict) -> list[str]:
    """The held-out files an evaluation scored as segments, in order; none with one file."""
    return [str(s.get("name")) for s in doc.get("segments") or [] if isinstance(s, dict)]


def _segment_rows(doc: dict) -> list[str]:
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


def _segments(inputs: CardInputs) -> list[str]:
    """Each evaluated model's mean KLD on each held-out file beside its overall one; none with one file."""
    docs = sorted(
        (
            d
            for d in inputs.evaluation.values()
            if _segment_names(d) and isinstance(d.get("model", {}).get("bytes"), int)
        ),
        key=lambda d: (d["model"]["bytes"], d["model"]["file"]),
    )
    if not docs:
        return []
    names = list(dict.fromkeys(n for d in docs for n in _segment_names(d)))
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


def _pruning_lines(inputs: CardInputs) -> list[str]:
    keys, arch = inputs.keys, _arch(inputs)
    kept, source = keys.get(KEY_KEPT_COUNT), keys.get(KEY_SOURCE_EXPERT_COUNT)
    used = keys.get(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))
    used = int(max(used)) if hasattr(used, "__len__") else used
    lines = []
    if kept is None:
        lines.append(
            "These files keep every expert of the source "
            f"({keys.get(Keys.LLM.EXPERT_COUNT.format(arch=arch))} per MoE layer); no expert was pruned."
        )
        return lines
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
    if used:
        lines.append(f"- Experts used per token (top-k) stay {used}.")
    records = ["method/pruning-report.json"] if inputs.pruning else []
    records += ["method/expert-selection.json"] if inputs.selection else []
    records += ["method/tune.md"] if inputs.tournament else []
    lines.append("- Records: " + ", ".join(f"`{r}`" for r in [*records, "quant-manifest.json"]) + ".")
    return lines


def _rung_docs(inputs: CardInputs) -> list[dict]:
    return [
        inputs.evaluation[r["files"][0]["name"]] for r in inputs.rungs if r["files"][0]["name"] in inputs.evaluation
    ]


def _quant_table(inputs: CardInputs) -> list[str]:
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
            f"| {name} | {rung['name']} | {format_size(_rung_bytes(rung))} "
            f"| {bits} | {figures} | `{str(rung.get('sha256'))[:16]}` |"
        )
    from ggufcarve.listing import add_loop_column

    add_loop_column(rows, [inputs.evaluation.get(r["files"][0]["name"]) or {} for r in inputs.rungs])
    return rows


def _speed_rows(inputs: CardInputs) -> list[str]:
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
        rows.append(f"| {name} | {doc['tg_tok_s']:.1f} | {prompt} | {_placement_words(doc.get('speed_placement'))} |")
    speed = measured[0][1].get("speed") or {}
    method = (
        f"{speed.get('engine', 'libllama')}: prompt of {speed.get('pp_tokens')} tokens, "
        f"{speed.get('tg_tokens')} tokens decoded, the median of {len(speed.get('tg_runs') or []) or 1} run(s)"
    )
    return [*rows, "", f"Measured by `ggufcarve eval` on the machine that evaluated the files ({method})."]


def _placement_words(placement: dict | None) -> str:
    """llama.devices.Compute.key() in words."""
    if not placement:
        return "not recorded"
    threads = f"{placement['threads']} CPU threads" if placement.get("threads") else "CPU"
    if not placement.get("gpu_layers"):
        return threads
    where = f"{placement['rpc_servers']} RPC server(s)" if placement.get("rpc_servers") else placement.get("backend")
    split = placement.get("tensor_split") or []
    return (
        f"-ngl {placement['gpu_layers']} on {where}"
        + (f", split {':'.join(f'{x:g}' for x in split)}" if len(split) > 1 else "")
        + f", {threads}"
    )


def _pareto(docs: list[dict]) -> set[str]:
    """Files on the Pareto front of mean KLD against file size (listing.pareto_front)."""
    return {d["model"]["file"] for d in pareto_front(docs, lambda d: d["model"]["bytes"], lambda d: d["kld_mean"])}


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
        rung = min(passing, key=lambda p: (p[1]["kld_mean"], _rung_bytes(p[0])))[0]
        return rung, [
            f"The example uses {rung['files'][0]['name']}, the file of lowest mean KLD that passes the release gate."
        ]
    if judged:
        rung = min(judged, key=lambda p: (p[1]["kld_mean"], _rung_bytes(p[0])))[0]
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


def _comparison(inputs: CardInputs) -> list[str]:
    """Every evaluated model (the rungs and the unpruned models they were compared with) by size."""
    docs = sorted(
        (d for d in inputs.evaluation.values() if isinstance(d.get("model", {}).get("bytes"), int)),
        key=lambda d: (d["model"]["bytes"], d["model"]["file"]),
    )
    families = {d["model"].get("family") for d in docs}
    lines: list[str] = []
    rung_files = {r["files"][0]["name"] for r in inputs.rungs}
    if len(families) > 1:
        front = _pareto(docs)
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


def _gate(inputs: CardInputs) -> list[str]:
    docs = _rung_docs(inputs)
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


def _limitations(inputs: CardInputs) -> list[str]:
    keys, arch = inputs.keys, _arch(inputs)
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
        used = keys.get(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))
        used = int(max(used)) if hasattr(used, "__len__") else used
        lines.append(
            f"- Top-k routing is unchanged ({used} experts per token), so "
            "compute per token is unchanged; memory and file size fall."
        )
    if any("--allow-requantize" in (r.get("command") or []) for r in inputs.rungs):
        lines.append(
            f"- Rungs were requantized from {inputs.manifest.get('source', {}).get('name')} "
            "(already quantized), which compounds quantization error."
        )
    docs = _rung_docs(inputs)
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
    texts = _calibration_rows(inputs)
    if texts:
        lines += ["", "### Calibration and held-out texts", "", *texts]
    lines += [
        "",
        "## Files",
        "",
        *_quant_table(inputs),
        "",
        "PPL, KLD and QA from `ggufcarve eval` against the reference named under Limitations; KLD in nats per token.",
    ]
    speeds = _speed_rows(inputs)
    if speeds:
        lines += ["", "### Speed", "", *speeds]
    comparison = _comparison(inputs)
    if comparison:
        lines += ["", "## Pruned vs unpruned", "", *comparison]
    segments = _segments(inputs)
    if segments:
        lines += ["", "## Held-out segments", "", *segments]
    gate = _gate(inputs)
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
