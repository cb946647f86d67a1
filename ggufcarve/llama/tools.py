"""llama.cpp tools: finding, probing and building them; the two quantizer backends.

Where a tool is looked for, in order (`find_tool`):
    1. `--llama-cpp DIR` (or `GGUFCARVE_LLAMA_CPP`): DIR/NAME, DIR/bin/NAME, DIR/build/bin/NAME
    2. PATH
    3. ggufcarve's cache: ${GGUFCARVE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ggufcarve}/llama.cpp-<version>/bin

`build_tools` fills the cache: it compiles llama-quantize, llama-imatrix, llama-perplexity and
llama-gguf-split (and nothing else) with cmake from the llama.cpp source vendored in the
llama-cpp-python sdist of the installed version, in a temp directory that is renamed into place.

Quantizer backends (`make_quantizer`): `binary` runs llama-quantize; `libllama` runs
llama-cpp-python's `llama_model_quantize` in a child process (`python -m ggufcarve.llama.quantize_child`)
with the imatrix normalised exactly as llama-quantize does and the tensor-type overrides passed in
the C structs, so a ladder works right after `pip install`. Both render an exact argv, stream the
quantizer's log lines and report per-tensor progress.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ggufcarve.errors import ToolMissing
from ggufcarve.fileio import cache_root, sha256_file_cached
from ggufcarve.llama import launch

TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity", "llama-gguf-split")
ENV_LLAMA_CPP = "GGUFCARVE_LLAMA_CPP"
# The cmake flags of llama.cpp's own static CPU build, without network or server code.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF")
PROBE_TIMEOUT = 30.0

# Strings only ik_llama.cpp's llama-quantize usage text contains (its extra quant types and flags).
IK_MARKERS = ("--custom-q", "--ignore-imatrix-rules", "--attn-q-type", "IQ4_KS", "IQ2_KT", "IQ3_K ", "Custom Quant Scheme")
# "version: 0.5.0-dev (build 1, commit 0c1e570)"  (current common/build-info)
VERSION_LINE = re.compile(r"version:\s*(?P<version>\S+)\s*\(build (?P<build>-?\d+), commit (?P<commit>[^)\s]+)\)")
# "version: 1234 (abcdef0)" and "main: build = 1234 (abcdef0)"  (older builds, ik_llama.cpp)
OLD_VERSION_LINE = re.compile(r"(?:version:|build =)\s*(?P<build>\d+)\s*\((?P<commit>[0-9a-fA-F]+|unknown)\)")


# ---------------------------------------------------------------------------------------------
# Locations


def llama_cpp_version() -> str:
    """The installed llama-cpp-python version (the sdist the tools are built from)."""
    from importlib import metadata

    for dist in ("llama_cpp_python", "llama-cpp-python"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise ToolMissing("llama-cpp-python is not installed", "pip install llama-cpp-python (ggufcarve depends on it)")


def cache_dir(version: str | None = None) -> Path:
    return cache_root() / f"llama.cpp-{version or llama_cpp_version()}"


def cache_bin_dir(version: str | None = None) -> Path:
    return cache_dir(version) / "bin"


def _candidates_in(directory: Path, name: str) -> list[Path]:
    return [directory / name, directory / "bin" / name, directory / "build" / "bin" / name]


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def locate_tool(name: str, llama_cpp_dir: str | os.PathLike[str] | None = None) -> tuple[Path, str] | None:
    """(path, where it was found: "--llama-cpp", "GGUFCARVE_LLAMA_CPP", "PATH" or "cache") or None."""
    explicit = [(Path(llama_cpp_dir), "--llama-cpp")] if llama_cpp_dir else []
    if os.environ.get(ENV_LLAMA_CPP):
        explicit.append((Path(os.environ[ENV_LLAMA_CPP]), ENV_LLAMA_CPP))
    for directory, origin in explicit:
        for candidate in _candidates_in(directory.expanduser(), name):
            if _is_executable(candidate):
                return candidate.resolve(), origin
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path).resolve(), "PATH"
    try:
        cached = cache_bin_dir() / name
    except ToolMissing:
        return None
    if _is_executable(cached):
        return cached, "cache"
    return None


def find_tool(name: str, llama_cpp_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The path of llama.cpp tool `name`: --llama-cpp DIR / GGUFCARVE_LLAMA_CPP, then PATH, then the cache."""
    found = locate_tool(name, llama_cpp_dir)
    return found[0] if found else None


def require_tool(name: str, llama_cpp_dir: str | os.PathLike[str] | None = None) -> Path:
    path = find_tool(name, llama_cpp_dir)
    if path is None:
        raise ToolMissing(
            f"{name} not found (looked in --llama-cpp/{ENV_LLAMA_CPP}, PATH and {cache_bin_dir()})",
            "run `ggufcarve toolchain build` (about 10-13 minutes on 2 cores), or pass --llama-cpp DIR",
        )
    return path


# ---------------------------------------------------------------------------------------------
# Probing

@dataclass(frozen=True)
class ToolInfo:
    name: str
    path: str
    origin: str  # where find_tool found it
    sha256: str
    version: str | None  # e.g. "0.5.0-dev"
    build_number: int | None
    commit: str | None
    flavour: str  # "llama.cpp" or "ik_llama.cpp"
    works: bool  # printed its usage/version text
    imatrix_formats: tuple[str, ...]  # what its quantizer reads
    note: str = ""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _run_probe(argv: Sequence[str]) -> tuple[int, str]:
    try:
        finished = launch.run(argv, timeout=PROBE_TIMEOUT, tail_lines=400)
    except ToolMissing as err:
        return -1, str(err)
    return (finished.returncode if not finished.timed_out else -1), "\n".join(finished.tail)


def parse_build(text: str) -> tuple[str | None, int | None, str | None]:
    """(version, build number, commit) from a tool's output, whichever format it prints."""
    m = VERSION_LINE.search(text)
    if m:
        return m["version"], int(m["build"]), m["commit"]
    m = OLD_VERSION_LINE.search(text)
    if m:
        return None, int(m["build"]), m["commit"]
    return None, None, None


def detect_flavour(usage_text: str) -> str:
    return "ik_llama.cpp" if any(marker in usage_text for marker in IK_MARKERS) else "llama.cpp"


def probe_tool(path: Path, name: str | None = None, origin: str = "") -> ToolInfo:
    """Run a tool harmlessly and record what it is.

    llama-quantize has no --version and exits 1 on --help: its usage text is accepted, and its build
    line is taken from a --dry-run on a path that does not exist (it prints the build, then fails to
    open the file; nothing is written). The other tools print their build with --version.
    """
    name = name or path.name
    sha = sha256_file_cached(path)
    if name == "llama-quantize":
        code, usage = _run_probe([str(path), "--help"])
        works = "usage:" in usage and ("--allow-requantize" in usage or "--imatrix" in usage)
        flavour = detect_flavour(usage)
        with tempfile.TemporaryDirectory(prefix="ggufcarve-probe-") as tmp:
            _, text = _run_probe([str(path), "--dry-run", str(Path(tmp) / "absent.gguf"), "Q8_0"])
        version, build, commit = parse_build(text + usage)
        formats = ("dat",) if flavour == "ik_llama.cpp" else ("gguf", "dat")
        note = "" if works else f"--help exited {code} without llama-quantize's usage text"
        return ToolInfo(name, str(path), origin, sha, version, build, commit, flavour, works, formats, note)
    code, text = _run_probe([str(path), "--version"])
    version, build, commit = parse_build(text)
    works = build is not None
    if not works:
        code, usage = _run_probe([str(path), "--help"])
        works = "usage" in usage.lower()
        text += usage
    flavour = "ik_llama.cpp" if "ik_llama" in text else "llama.cpp"
    return ToolInfo(name, str(path), origin, sha, version, build, commit, flavour, works, (), "" if works else f"--version exited {code}")


@dataclass(frozen=True)
class Toolchain:
    tools: dict[str, ToolInfo | None]
    cache_bin: str
    llama_cpp_python: str | None
    libllama: dict[str, str] | None  # path and sha256 of the libllama the libllama backend uses

    def to_json(self) -> dict[str, object]:
        return {
            "tools": {k: (v.to_json() if v else None) for k, v in self.tools.items()},
            "cache_bin": self.cache_bin,
            "llama_cpp_python": self.llama_cpp_python,
            "libllama": self.libllama,
        }


def libllama_info() -> dict[str, str] | None:
    """Where llama-cpp-python's shared library is, without loading it."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    lib_dir = Path(spec.origin).parent / "lib"
    for candidate in ("libllama.so", "libllama.dylib", "llama.dll"):
        path = lib_dir / candidate
        if path.exists():
            real = path.resolve()
            return {"path": str(real), "sha256": sha256_file_cached(real)}
    return None


def show_toolchain(llama_cpp_dir: str | os.PathLike[str] | None = None) -> Toolchain:
    tools: dict[str, ToolInfo | None] = {}
    for name in TOOLS:
        found = locate_tool(name, llama_cpp_dir)
        tools[name] = probe_tool(found[0], name, found[1]) if found else None
    try:
        version: str | None = llama_cpp_version()
        bin_dir = str(cache_bin_dir(version))
    except ToolMissing:
        version, bin_dir = None, str(cache_root() / "llama.cpp-?" / "bin")
    return Toolchain(tools, bin_dir, version, libllama_info())


