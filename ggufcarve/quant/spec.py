"""Ladder specs: a TOML file of rungs, validated as a whole."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.gguf.types import FILE_TYPES, QUANTIZE_TARGET_TYPES
from ggufcarve.quant.quantizer import IMATRIX_FTYPES, tensor_requires_imatrix
from ggufcarve.shipped import shipped

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


DEFAULT_FILE_PATTERN = "{model}-{quant}.gguf"
# The reference ladder, shipped with the package (ggufcarve/shipped.py).
SPEC_DIRECTORY = shipped("ladders")
DEFAULT_LADDER = SPEC_DIRECTORY / "q8-to-iq1.toml"
DEFAULT_FALLBACK_TYPE = "Q4_K"
DISK_MARGIN = 64 << 20  # headroom on top of the estimated sizes
RUNG_KEYS = {
    "ftype",
    "name",
    "description",
    "file_pattern",
    "output_tensor_type",
    "token_embedding_type",
    "tensor_types",
    "imatrix_fallback_type",
    "allow_requantize",
    "pure",
}


# ---------------------------------------------------------------------------------------------
# The spec


@dataclass(frozen=True)
class Rung:
    name: str  # upper-case quant tag: file names and --only
    ftype: str
    description: str = ""
    file_pattern: str = DEFAULT_FILE_PATTERN
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    tensor_types: tuple[tuple[str, str], ...] = ()
    imatrix_fallback_type: str = DEFAULT_FALLBACK_TYPE
    allow_requantize: bool = True
    pure: bool = False

    @property
    def needs_imatrix(self) -> bool:
        """Whether some tensor may need an imatrix, from the ftype and the overrides (before any dry run:
        llama.cpp's tensor_requires_imatrix on the dry run's target types decides per tensor)."""
        return self.ftype in IMATRIX_FTYPES or any(
            tensor_requires_imatrix("", t, self.ftype) for _, t in self.tensor_types
        )

    def file_name(self, model: str) -> str:
        return self.file_pattern.format(model=model, quant=self.name)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ftype": self.ftype,
            "description": self.description,
            "file_pattern": self.file_pattern,
            "output_tensor_type": self.output_tensor_type,
            "token_embedding_type": self.token_embedding_type,
            "tensor_types": [list(p) for p in self.tensor_types],
            "imatrix_fallback_type": self.imatrix_fallback_type,
            "allow_requantize": self.allow_requantize,
            "pure": self.pure,
            "needs_imatrix": self.needs_imatrix,
        }


@dataclass(frozen=True)
class LadderSpec:
    name: str
    description: str
    rungs: tuple[Rung, ...]
    path: Path | None = None
    sha256: str | None = None

    def select(self, only: Sequence[str] | None) -> tuple[Rung, ...]:
        if not only:
            return self.rungs
        wanted = [o.strip().upper() for item in only for o in item.split(",") if o.strip()]
        names = {r.name for r in self.rungs}
        unknown = [w for w in wanted if w not in names]
        if unknown:
            raise BadInput(
                f"--only {', '.join(unknown)}: no such rung in {self.name}",
                f"rungs are {', '.join(r.name for r in self.rungs)}",
            )
        return tuple(r for r in self.rungs if r.name in wanted)


def _type_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.upper() not in QUANTIZE_TARGET_TYPES:
        raise BadInput(
            f"{where}: {value!r} is not a ggml tensor type llama-quantize writes",
            f"use one of {', '.join(sorted(QUANTIZE_TARGET_TYPES))}",
        )
    return value.upper()


def _tensor_types(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    items: list[Any]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = value
    else:
        raise BadInput(
            f"{where}: tensor_types must be a list of [regex, type] pairs",
            'e.g. tensor_types = [["ffn_down_exps", "Q5_K"]]',
        )
    for item in items:
        if isinstance(item, str) and "=" in item:
            item = item.rsplit("=", 1)
        if isinstance(item, dict) and set(item) == {"pattern", "type"}:
            item = (item["pattern"], item["type"])
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and item[0]):
            raise BadInput(
                f"{where}: bad tensor_types entry {item!r}", 'each entry is ["regex", "TYPE"] or "regex=TYPE"'
            )
        try:
            re.compile(item[0])
        except re.error as err:
            raise BadInput(
                f"{where}: tensor_types regex {item[0]!r} is invalid ({err})", "fix the regular expression"
            ) from None
        pairs.append((item[0], _type_name(item[1], where)))
    return tuple(pairs)


def parse_spec(doc: dict[str, Any], path: Path | None = None) -> LadderSpec:
    where = str(path) if path else "ladder spec"
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise BadInput(f"{where}: [defaults] must be a table", "see ladders/q8-to-iq1.toml")
    unknown = set(defaults) - (RUNG_KEYS - {"ftype", "name", "description"})
    if unknown:
        raise BadInput(
            f"{where}: unknown key(s) in [defaults]: {', '.join(sorted(unknown))}",
            f"allowed: {', '.join(sorted(RUNG_KEYS - {'ftype', 'name', 'description'}))}",
        )
    raw_rungs = doc.get("rungs")
    if not isinstance(raw_rungs, list) or not raw_rungs:
        raise BadInput(f"{where}: no [[rungs]]", "add at least one [[rungs]] table with an ftype")
    rungs: list[Rung] = []
    for i, raw in enumerate(raw_rungs):
        here = f"{where}: rung {i + 1}"
        if not isinstance(raw, dict):
            raise BadInput(f"{here} is not a table", "write each rung as [[rungs]]")
        merged = {**defaults, **raw}
        unknown = set(merged) - RUNG_KEYS
        if unknown:
            raise BadInput(
                f"{here}: unknown key(s) {', '.join(sorted(unknown))}", f"allowed: {', '.join(sorted(RUNG_KEYS))}"
            )
        ftype = str(merged.get("ftype", "")).upper()
        if ftype not in FILE_TYPES:
            raise BadInput(
                f"{here}: unknown ftype {merged.get('ftype')!r}",
                f"use a llama-quantize type such as {', '.join(list(FILE_TYPES)[:12])}",
            )
        name = str(merged.get("name", ftype)).upper()
        if not re.fullmatch(r"[A-Z0-9_.+-]+", name):
            raise BadInput(f"{here}: name {name!r} must be an upper-case quant tag", "e.g. Q4_K_M or IQ2_XS-MTPQ8")
        pattern = str(merged.get("file_pattern", DEFAULT_FILE_PATTERN))
        if "{quant}" not in pattern or "/" in pattern or not pattern.endswith(".gguf"):
            raise BadInput(
                f"{here}: file_pattern {pattern!r} must contain {{quant}}, end in .gguf and name a file",
                'e.g. "{model}-{quant}.gguf"',
            )
        fallback = _type_name(
            merged.get("imatrix_fallback_type", DEFAULT_FALLBACK_TYPE), f"{here}: imatrix_fallback_type"
        )
        if tensor_requires_imatrix("", fallback, ftype):
            raise BadInput(
                f"{here}: imatrix_fallback_type {fallback} itself needs an imatrix",
                "use a K or legacy type such as Q4_K or Q8_0",
            )
        rungs.append(
            Rung(
                name=name,
                ftype=ftype,
                description=str(merged.get("description", "")),
                file_pattern=pattern,
                output_tensor_type=_type_name(merged["output_tensor_type"], f"{here}: output_tensor_type")
                if merged.get("output_tensor_type")
                else None,
                token_embedding_type=_type_name(merged["token_embedding_type"], f"{here}: token_embedding_type")
                if merged.get("token_embedding_type")
                else None,
                tensor_types=_tensor_types(merged.get("tensor_types", []), here),
                imatrix_fallback_type=fallback,
                allow_requantize=bool(merged.get("allow_requantize", True)),
                pure=bool(merged.get("pure", False)),
            )
        )
    names = [r.name for r in rungs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BadInput(f"{where}: rung name(s) {', '.join(dup)} appear twice", "give repeated ftypes distinct names")
    return LadderSpec(
        str(doc.get("name", path.stem if path else "ladder")), str(doc.get("description", "")), tuple(rungs), path
    )


def find_spec(value: str, base: Path | None = None, what: str = "ladder spec") -> Path:
    """A ladder spec path (relative to `base`, default the current directory), or the name of a
    spec shipped in ladders/ (with or without .toml)."""
    given = Path(os.path.expanduser(value))
    candidates = [given if given.is_absolute() or base is None else base / given]
    if not given.is_absolute() and given.parent == Path("."):
        candidates += [SPEC_DIRECTORY / given, SPEC_DIRECTORY / f"{value}.toml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in SPEC_DIRECTORY.glob("*.toml")) if SPEC_DIRECTORY.is_dir() else []
    raise BadInput(
        f"{what} {value!r}: no such spec file",
        "give a path to a ladder TOML, or one of: "
        f"{', '.join(known) or '(no ladders/ directory beside this installation)'}",
    )


def load_spec(path: str | os.PathLike[str]) -> LadderSpec:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise BadInput(f"{path}: cannot read the ladder spec ({err.strerror})", "give a ladders/*.toml file") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: not valid TOML ({err})", "fix the spec file") from None
    spec = parse_spec(doc, path)
    return replace(spec, sha256=hashlib.sha256(raw).hexdigest())
