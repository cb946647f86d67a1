"""The model card's metadata: what the Hugging Face Hub reads from its front matter (license, base model,
repo id, model name), resolved from the first rung's GGUF keys and the card's settings, never guessed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ggufcarve import settings as S
from ggufcarve.errors import BadInput
from ggufcarve.settings import key as setting_key

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


def key_name(name: str, **ids: Any) -> str:
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
            url = _text(keys.get(key_name(n["base_repo_url"], id=i)))
            org, name = _text(keys.get(key_name(n["base_org"], id=i))), _text(keys.get(key_name(n["base_name"], id=i)))
            repo = repo_id_of_url(url) or (f"{org}/{name}" if org and name and valid_repo_id(f"{org}/{name}") else None)
            if repo is not None:
                bases.append(repo)
            elif url or name:
                seen.append(
                    f"{key_name(n['base_repo_url'] if url else n['base_name'], id=i)} "
                    f"= {json.dumps(url or name, ensure_ascii=False)}"
                )
        if not bases:
            why = (
                f"the source GGUF records no Hub repo id for it ({'; '.join(seen)})"
                if seen
                else f"the source GGUF has no {key_name(n['base_repo_url'], id=0)} key"
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
