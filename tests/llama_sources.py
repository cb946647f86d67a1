"""The llama.cpp sources in the llama-cpp-python sdist, read as the oracle of ggufcarve's
per-architecture tables (routing, cache kinds, activations, expert tensor names).

The sdist is the file named by GGUFCARVE_LLAMA_SDIST, else the one in ggufcarve's cache
(llama/build.py `sdist_path`), which `ggufcarve toolchain build` downloads and which is downloaded
here the same way (`fetch_sdist`) when missing. When it cannot be had the tests that read it skip,
which the conftest turns into a failure under CI=true.

An architecture's classes are its llama_model_mapping class (src/llama-model.cpp), the class its
`using graph =` names and the classes they derive from (src/models/models.h). Its graph's
build_moe_ffn calls are those in function definitions of the first two in src/models/*.cpp; its
load_arch_hparams is the one of the nearest class that defines one, with the base class's it calls.
"""

from __future__ import annotations

import functools
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gguf import GGUFReader

SDIST_ENV = "GGUFCARVE_LLAMA_SDIST"


def sdist() -> Path:
    """GGUFCARVE_LLAMA_SDIST, else the sdist in ggufcarve's cache, downloaded with pip when missing."""
    from ggufcarve.errors import CarveError
    from ggufcarve.llama import build
    from ggufcarve.llama.tools import llama_cpp_version

    given = os.environ.get(SDIST_ENV)
    if given:
        if not Path(given).is_file():
            pytest.skip(
                f"the llama-cpp-python sdist is not at {given} (fix {SDIST_ENV}, or unset it to use ggufcarve's cache)"
            )
        return Path(given)
    path = build.sdist_path(llama_cpp_version())
    if not path.is_file():
        try:
            path = build.fetch_sdist(llama_cpp_version())
        except CarveError as e:
            pytest.skip(
                f"the llama-cpp-python sdist is not at {path} and could not be "
                f"fetched: {e} (set {SDIST_ENV}, or run ggufcarve toolchain build)"
            )
    return path


@functools.cache
def _read(path: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            parts = member.name.split("/vendor/llama.cpp/src/", 1)
            if member.isfile() and len(parts) == 2 and parts[1].endswith((".cpp", ".h")):
                found[parts[1]] = tar.extractfile(member).read().decode()
    return found


def sources() -> dict[str, str]:
    """src/ of the vendored llama.cpp: relative path -> text."""
    return _read(sdist())


@functools.cache
def _member(path: Path, relative: str) -> str:
    with tarfile.open(path) as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(f"/vendor/llama.cpp/{relative}"):
                return tar.extractfile(member).read().decode()
    raise FileNotFoundError(f"{relative} is not in {path.name}")


def source_text(relative: str) -> str:
    """One file of the vendored llama.cpp (`common/arg.cpp`, `tools/llama-bench/llama-bench.cpp`)."""
    return _member(sdist(), relative)


@dataclass
class MoeCall:
    """One build_moe_ffn call: its top-level arguments, comments removed."""

    args: list[str]

    @property
    def _op(self) -> int:  # the short overload has type_op at 8, the one with bias tensors at 12
        return next(i for i, a in enumerate(self.args) if re.fullmatch(r"LLM_FFN_\w+", a))

    @property
    def type_op(self) -> str:
        return self.args[self._op]

    @property
    def norm_w(self) -> str:
        return self.args[self._op + 1]

    @property
    def w_scale(self) -> str:
        return self.args[self._op + 2]

    @property
    def gating_op(self) -> str:
        return self.args[self._op + 3]

    @property
    def probs_in(self) -> bool:
        """Precomputed router logits are passed."""
        i = self._op + 5
        return len(self.args) > i and self.args[i] != "nullptr"


@dataclass
class Architecture:
    name: str  # the GGUF architecture name (general.architecture)
    classes: list[str]  # llama_model_<class>, graph class and base classes, nearest first
    calls: list[MoeCall] = field(default_factory=list)
    load: str = ""  # the body of its load_arch_hparams
    clamp: bool = False  # a class reads LLM_KV_SWIGLU_CLAMP_EXP


def _split_args(text: str) -> list[str]:
    args, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            args.append(text[start:i])
            start = i + 1
    args.append(text[start:])
    return [" ".join(a.split()) for a in args]


def _bodies(text: str) -> list[tuple[int, str]]:
    """(position, class) of every function definition `... llama_model_<class>::...` in a file."""
    return [(m.start(), m.group(1)) for m in re.finditer(r"^[^\s/#][^\n]*?\bllama_model_(\w+)::", text, re.M)]


def _function(text: str, start: int) -> str:
    """The body of the function whose definition starts at `start` (brace matched)."""
    open_at = text.index("{", start)
    depth, i = 0, open_at
    while True:
        depth += (text[i] == "{") - (text[i] == "}")
        i += 1
        if depth == 0:
            return text[open_at:i]


@functools.cache
def _architectures(path: Path) -> dict[str, Architecture]:
    src = _read(path)
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+)\s*,\s*"([^"]+)"\s*\}', src["llama-arch.cpp"]))
    mapping = re.search(r"llama_model_mapping\(.*?\n}\n", src["llama-model.cpp"], re.S).group(0)
    classes = re.findall(r"case (LLM_ARCH_\w+):\s*return new llama_model_(\w+)\(", mapping)
    graph_of, base_of = {}, {}
    for struct in re.finditer(
        r"^struct llama_model_(\w+) : public (\w+) \{(.*?)^\};", src["models/models.h"], re.S | re.M
    ):
        used = re.search(r"using graph = llama_model_(\w+)::graph", struct.group(3))
        graph_of[struct.group(1)] = used.group(1) if used else struct.group(1)
        base_of[struct.group(1)] = struct.group(2).removeprefix("llama_model_")
    calls: dict[str, list[MoeCall]] = {}
    loads: dict[str, str] = {}
    clamped: set[str] = set()
    for name, text in src.items():
        if not (name.startswith("models/") and name.endswith(".cpp")):
            continue
        defs = _bodies(text)
        for m in re.finditer(r"^void llama_model_(\w+)::load_arch_hparams\(", text, re.M):
            loads[m.group(1)] = _function(text, m.start())
        for m in re.finditer(r"LLM_KV_SWIGLU_CLAMP_EXP", text):
            clamped.add([c for pos, c in defs if pos < m.start()][-1])
        for m in re.finditer(r"\bbuild_moe_ffn\(", text):
            depth, end = 1, m.end()
            while depth:
                depth += (text[end] == "(") - (text[end] == ")")
                end += 1
            args = re.sub(r"//[^\n]*|/\*.*?\*/", "", text[m.end() : end - 1], flags=re.S)
            owner = [c for pos, c in defs if pos < m.start()][-1]
            call = MoeCall(_split_args(args))
            assert sum(bool(re.fullmatch(r"LLM_FFN_\w+", a)) for a in call.args) == 1, (name, call.args)
            calls.setdefault(owner, []).append(call)
    result = {}
    for arch, cls in classes:
        chain, todo = [], [cls, graph_of.get(cls, cls)]
        while todo:
            c = todo.pop(0)
            if c not in chain and c != "base":
                chain.append(c)
                todo += [base_of[c]] if c in base_of else []
        found = Architecture(names[arch], chain)
        owners = {cls, graph_of.get(cls, cls)}
        found.calls = [call for c in sorted(owners) for call in calls.get(c, [])]
        found.load = next((loads[c] for c in chain if c in loads), "")
        for called in re.findall(
            r"\bllama_model_(\w+)::load_arch_hparams\(", found.load
        ):  # a base class's, called first
            found.load += loads.get(called, "")
        found.clamp = bool(owners & clamped)
        result[found.name] = found
    return result


def architectures() -> dict[str, Architecture]:
    """GGUF architecture name -> its classes, build_moe_ffn calls and load_arch_hparams."""
    return _architectures(sdist())


def ffn_exps_regexes() -> tuple[str, str]:
    """LLM_FFN_EXPS_REGEX and llm_ffn_block_regex's format, as C string literals in common/common.h."""
    with tarfile.open(sdist()) as tar:
        member = next(m for m in tar if m.name.endswith("/vendor/llama.cpp/common/common.h"))
        text = tar.extractfile(member).read().decode()
    exps = re.search(r'LLM_FFN_EXPS_REGEX\s*=\s*"((?:[^"\\]|\\.)*)"', text)[1]
    block = re.search(
        r'llm_ffn_block_regex\(int idx, const char \* ffn_regex\) \{\s*return string_format\("((?:[^"\\]|\\.)*)"', text
    )[1]

    def unescape(literal: str) -> str:
        return re.sub(r"\\(.)", r"\1", literal)

    return unescape(exps), unescape(block)


def offload_oracle(path, exps: str, block_format: str):
    """GPU weight bytes for every N and the tensors each N moves, from gguf-py's tensor sizes:
    all tensors but token_embd (kept on the CPU; loaded again as the output when output.weight is
    missing), the MTP blocks (not loaded) and those matched by blocks 0..N-1's patterns."""
    reader = GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    blocks = reader.get_field(f"{arch}.block_count").contents()
    nextn_field = reader.get_field(f"{arch}.nextn_predict_layers")
    main = blocks - (nextn_field.contents() if nextn_field else 0)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    loaded = {
        n: b
        for n, b in sizes.items()
        if not (re.match(r"blk\.(\d+)\.", n) and int(n.split(".")[1]) >= main) and not n.startswith("token_embd.")
    }
    if "output.weight" not in sizes:
        loaded["token_embd.weight"] = sizes["token_embd.weight"]
    patterns = [re.compile(block_format.replace("%d", str(i)).replace("%s", exps)) for i in range(main)]
    moved = [{n for n in loaded if any(p.search(n) for p in patterns[:count])} for count in range(main + 1)]
    gpu = [sum(b for n, b in loaded.items() if n not in moved[count]) for count in range(main + 1)]
    return main, sizes, gpu, moved
