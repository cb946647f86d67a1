"""llama.cpp tools: finding, probing and building them; the two quantizer backends.

Where a tool is looked for, in order (`find_tool`):
    1. `--llama-cpp DIR` (or `GGUFCARVE_LLAMA_CPP`): DIR/NAME, DIR/bin/NAME, DIR/build/bin/NAME
    2. PATH
    3. ggufcarve's cache: ${GGUFCARVE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ggufcarve}/llama.cpp-<version>/bin

`build_tools` fills the cache: it compiles llama-quantize, llama-imatrix, llama-perplexity and
llama-gguf-split (and nothing else) with cmake from the llama.cpp source vendored in the
llama-cpp-python sdist of the installed version, in a temp directory that is renamed into place.

Quantizer backends (`make_quantizer`): `binary` runs llama-quantize; `libllama` runs
llama-cpp-python's `llama_model_quantize` in a child process (`python -m ggufcarve.quantize_child`)
with the imatrix normalised exactly as llama-quantize does and the tensor-type overrides passed in
the C structs, so a ladder works right after `pip install`. Both render an exact argv, stream the
quantizer's log lines and report per-tensor progress.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ggufcarve.errors import BadInput, ToolFailed, ToolMissing
from ggufcarve.fileio import cache_root, sha256_file_cached

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


@dataclass(frozen=True)
class ToolchainEvent:
    """Progress of `build_tools`: a stage, a message, and a fraction in [0, 1] when known."""

    stage: str  # "download", "extract", "configure", "build", "install", "cached"
    message: str
    fraction: float | None = None


EventSink = Callable[[ToolchainEvent], None]


def _ignore(_: ToolchainEvent) -> None:
    pass


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


def tool_env() -> dict[str, str]:
    """The environment for running llama.cpp code in a child process.

    GGML_NO_BACKTRACE: on an abort (GGML_ASSERT, uncaught exception) ggml otherwise forks gdb to
    attach to the dying process and print a backtrace; gdb inherits the output pipe and can
    hang for minutes, so the abort would never reach us.
    """
    return {**os.environ, "GGML_NO_BACKTRACE": "1"}


def _run_probe(argv: Sequence[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL, env=tool_env())
    except (OSError, subprocess.TimeoutExpired) as err:
        return -1, str(err)
    return proc.returncode, proc.stdout + proc.stderr


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


# ---------------------------------------------------------------------------------------------
# Building


def _all_tools_in(bin_dir: Path) -> bool:
    return all(_is_executable(bin_dir / t) for t in TOOLS)


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so concurrent builds of one version wait for each other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def sdist_name(version: str) -> str:
    return f"llama_cpp_python-{version}.tar.gz"


def fetch_sdist(version: str, on_event: EventSink = _ignore) -> Path:
    """The llama-cpp-python sdist of `version`, downloaded with pip into the cache once."""
    target_dir = cache_root() / "sdist"
    target = target_dir / sdist_name(version)
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    on_event(ToolchainEvent("download", f"pip download llama-cpp-python=={version} (sdist)"))
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target_dir) as tmp:
        argv = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps", "--no-binary", ":all:", "--dest", tmp]
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
        files = sorted(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not files:
            raise ToolFailed(f"pip could not download the llama-cpp-python {version} sdist: {_tail(proc.stderr or proc.stdout)}", "check network access to PyPI, or pass --llama-cpp DIR with prebuilt tools")
        os.replace(files[0], target)
    return target


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract `<top>/vendor/llama.cpp` of the sdist into dest; returns the llama.cpp source dir."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/" and (m.isfile() or m.isdir() or m.issym())]
        if not members:
            raise BadInput(f"{sdist} has no vendor/llama.cpp directory", "the file is not a llama-cpp-python sdist")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python without extraction filters: regular files and directories only, no links
            tar.extractall(dest, members=[m for m in members if (m.isfile() or m.isdir()) and not Path(m.name).is_absolute() and ".." not in Path(m.name).parts])
    found = sorted(dest.glob("*/vendor/llama.cpp"))
    if not found or not (found[0] / "CMakeLists.txt").exists():
        raise BadInput(f"{sdist}: vendor/llama.cpp has no CMakeLists.txt", "the sdist is incomplete")
    return found[0]


PERCENT = re.compile(r"^\[\s*(\d+)%\]")
NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def _stream(argv: list[str], stage: str, on_event: EventSink, cwd: Path | None = None) -> None:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", cwd=cwd, stdin=subprocess.DEVNULL)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail = (tail + [line])[-20:]
        fraction = None
        if m := PERCENT.match(line):
            fraction = int(m[1]) / 100
        elif m := NINJA_STEP.match(line):
            fraction = int(m[1]) / max(int(m[2]), 1)
        on_event(ToolchainEvent(stage, line, fraction))
    code = proc.wait()
    if code != 0:
        raise ToolFailed(f"{' '.join(argv[:3])} ... exited {code}: {_tail(chr(10).join(tail), 5)}", "install a C++ compiler and cmake >= 3.14, or pass --llama-cpp DIR with prebuilt tools")


def compile_tools(source_dir: Path, build_dir: Path, bin_out: Path, on_event: EventSink = _ignore, jobs: int | None = None) -> None:
    """Configure and build only TOOLS from a llama.cpp source tree; copy them into bin_out."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise ToolMissing("cmake not found on PATH", "install cmake (and a C++ compiler), or pass --llama-cpp DIR with prebuilt tools")
    jobs = jobs or os.cpu_count() or 2
    on_event(ToolchainEvent("configure", f"cmake -S {source_dir} -B {build_dir}"))
    _stream([cmake, "-S", str(source_dir), "-B", str(build_dir), *CMAKE_FLAGS], "configure", on_event)
    _stream([cmake, "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TOOLS], "build", on_event)
    bin_out.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        built = next((p for p in (build_dir / "bin" / tool, build_dir / "bin" / "Release" / tool, build_dir / tool) if _is_executable(p)), None)
        if built is None:
            raise ToolFailed(f"the build finished but {tool} was not produced in {build_dir / 'bin'}", "see the build output above; run `ggufcarve toolchain build` again")
        shutil.copy2(built, bin_out / tool)
    on_event(ToolchainEvent("install", f"copied {', '.join(TOOLS)}", 1.0))


def install_prebuilt(bin_dir: Path, version: str | None = None, origin: str = "prebuilt", force: bool = False) -> tuple[Path, bool]:
    """Put already built tools (e.g. from a llama.cpp build of the same source) into the cache layout.

    Returns the cache's bin dir and whether anything was copied (False: the cache had them, no force).
    """
    version = version or llama_cpp_version()
    final = cache_dir(version)
    with _lock(cache_root() / f".llama.cpp-{version}.lock"):
        if not force and _all_tools_in(final / "bin"):
            return final / "bin", False
        missing = [t for t in TOOLS if not _is_executable(bin_dir / t)]
        if missing:
            raise BadInput(f"{bin_dir} lacks {', '.join(missing)}", "give the bin directory of a llama.cpp build that has all four tools")
        staging = Path(tempfile.mkdtemp(prefix=f".llama.cpp-{version}.", dir=cache_root()))
        try:
            (staging / "bin").mkdir()
            for tool in TOOLS:
                shutil.copy2(bin_dir / tool, staging / "bin" / tool)
            _write_build_info(staging, version, origin=origin)
            _move_into_place(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final / "bin", True


def _write_build_info(staging: Path, version: str, **extra: object) -> None:
    info = {
        "llama_cpp_python": version,
        "tools": {t: sha256_file_cached(staging / "bin" / t) for t in TOOLS},
        "cmake_flags": list(CMAKE_FLAGS),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
    (staging / "build-info.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")


def _move_into_place(staging: Path, final: Path) -> None:
    if final.exists():  # an incomplete earlier attempt: replace it
        shutil.rmtree(final)
    os.rename(staging, final)


def build_tools(on_event: EventSink | None = None, *, version: str | None = None, sdist: Path | None = None, jobs: int | None = None, force: bool = False) -> Path:
    """Build TOOLS for the installed llama-cpp-python version into the cache; returns the bin dir.

    Never rebuilds what is cached (unless force). Concurrent callers wait on a lock. The build runs in
    a temp directory beside the cache entry, which is renamed into place only when complete.
    """
    sink = on_event or _ignore
    version = version or llama_cpp_version()
    final = cache_dir(version)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".llama.cpp-{version}.lock"):
        if not force and _all_tools_in(final / "bin"):
            sink(ToolchainEvent("cached", f"{final / 'bin'} already has {', '.join(TOOLS)}", 1.0))
            return final / "bin"
        sdist = sdist or fetch_sdist(version, sink)
        staging = Path(tempfile.mkdtemp(prefix=f".llama.cpp-{version}.", dir=root))
        try:
            sink(ToolchainEvent("extract", f"extracting vendor/llama.cpp from {sdist.name}"))
            source = extract_llama_cpp(sdist, staging / "src")
            compile_tools(source, staging / "build", staging / "bin", sink, jobs)
            _write_build_info(staging, version, sdist=sdist.name, sdist_sha256=sha256_file_cached(sdist))
            shutil.rmtree(staging / "src", ignore_errors=True)
            shutil.rmtree(staging / "build", ignore_errors=True)
            _move_into_place(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final / "bin"


# ---------------------------------------------------------------------------------------------
# Quantizer backends

# ftype name -> llama_ftype id (include/llama.h)
FTYPES: dict[str, int] = {
    "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13,
    "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21,
    "IQ3_XS": 22, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29,
    "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37, "MXFP4_MOE": 38, "F16": 1, "F32": 0,
}
# Tensor types that cannot be produced without importance data (src/llama-quant.cpp, tensor_requires_imatrix),
# and Q2_K inside a Q2_K_S file. token_embd/output never require it.
IMATRIX_TYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"})
IMATRIX_FTYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"})
QUANTIZE_BACKENDS = ("auto", "binary", "libllama")


def type_requires_imatrix(tensor_name: str, type_name: str, ftype: str) -> bool:
    """llama-quantize's tensor_requires_imatrix."""
    if tensor_name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    t = type_name.upper()
    return t in IMATRIX_TYPES or (t == "Q2_K" and ftype.upper() == "Q2_K_S")


@dataclass(frozen=True)
class QuantizeJob:
    """One llama-quantize invocation, backend-independent."""

    source: Path
    output: Path | None  # None for a dry run
    ftype: str  # llama-quantize ftype name, e.g. "Q4_K_M"
    imatrix: Path | None = None
    allow_requantize: bool = True
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    tensor_types: tuple[tuple[str, str], ...] = ()  # (regex, ggml type), first match wins
    pure: bool = False
    dry_run: bool = False
    nthreads: int | None = None

    def flags(self, flavour: str = "llama.cpp") -> list[str]:
        argv: list[str] = []
        if self.allow_requantize:
            argv.append("--allow-requantize")
        if self.pure:
            argv.append("--pure")
        if self.imatrix is not None:
            argv += ["--imatrix", str(self.imatrix)]
        if self.output_tensor_type:
            argv += ["--output-tensor-type", self.output_tensor_type.lower() if flavour == "ik_llama.cpp" else self.output_tensor_type]
        if self.token_embedding_type:
            argv += ["--token-embedding-type", self.token_embedding_type.lower() if flavour == "ik_llama.cpp" else self.token_embedding_type]
        if self.tensor_types:
            if flavour == "ik_llama.cpp":
                argv += ["--custom-q", ",".join(f"{p}={t.lower()}" for p, t in self.tensor_types)]
            else:
                for pattern, type_name in self.tensor_types:
                    argv += ["--tensor-type", f"{pattern}={type_name}"]
        if self.dry_run:
            argv.append("--dry-run")
        argv.append(str(self.source))
        if not self.dry_run:
            assert self.output is not None
            argv.append(str(self.output))
        argv.append(self.ftype.upper())
        if self.nthreads:
            argv.append(str(self.nthreads))
        return argv


@dataclass
class QuantizeRun:
    argv: list[str]
    returncode: int
    seconds: float
    tail: list[str]  # the last lines of the quantizer's output
    error: str | None  # the decisive error line, when it failed


# "[  12/ 733]                blk.0.attn_k.weight - [ 2048,   512,     1,     1], type =   q8_0, "
TENSOR_LINE = re.compile(r"^\[\s*(?P<index>\d+)/\s*(?P<total>\d+)\]\s+(?P<name>\S+)\s+-\s+\[(?P<shape>[^\]]*)\],\s+type =\s*(?P<type>\S+?),")
DRY_RUN_SIZE = re.compile(r"size =\s*(?P<before>[\d.]+) MiB(?: ->\s*(?P<after>[\d.]+) MiB \((?P<target>[^)]+)\))?")
QUANT_SIZE = re.compile(r"quant size\s*=\s*(?P<mib>[\d.]+) MiB \((?P<bpw>[\d.]+) BPW\)")
ERROR_PATTERNS = (
    re.compile(r"Missing importance matrix for tensor \S+.*"),
    re.compile(r"this quantization requires an imatrix!?"),
    re.compile(r"imatrix size \d+ is different from tensor size \d+ for \S+"),
    re.compile(r"requantizing from type \S+ is disabled"),
    re.compile(r"error loading model.*|failed to load model.*|llama_model_quantize: failed to quantize: .*"),
    re.compile(r"GGML_ASSERT.*"),
)


def find_error(lines: Sequence[str]) -> str | None:
    for pattern in ERROR_PATTERNS:
        for line in lines:
            if m := pattern.search(line):
                return m.group(0).strip()
    return None


class Quantizer(ABC):
    """A way of running llama.cpp's quantizer. Subclasses render argv; running is shared."""

    backend = ""

    @abstractmethod
    def argv(self, job: QuantizeJob) -> list[str]:
        """The exact command line that quantizes `job`."""

    @abstractmethod
    def describe(self) -> dict[str, object]:
        """backend, path, version/build, sha256: recorded in the manifest."""

    def run(self, job: QuantizeJob, on_line: Callable[[str], None] | None = None) -> QuantizeRun:
        argv = self.argv(job)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, errors="replace", text=True, bufsize=1, env=tool_env())
        except OSError as err:
            raise ToolMissing(f"cannot run {argv[0]}: {err.strerror or err}", "check the quantizer path (ggufcarve toolchain show)") from None
        tail: list[str] = []
        keep: list[str] = []  # lines that may carry the decisive error
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if len(tail) > 40:
                    del tail[0]
                if "rror" in line or "imatrix" in line or "GGML_ASSERT" in line or "failed" in line:
                    keep.append(line)
                if on_line is not None:
                    on_line(line)
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        seconds = time.monotonic() - start
        error = None if code == 0 else (find_error(keep + tail) or (f"killed by signal {-code}" if code < 0 else f"exit status {code}"))
        return QuantizeRun(argv, code, seconds, tail, error)

    def dry_run(self, job: QuantizeJob) -> "DryRun":
        """Target type and size of every tensor, as the quantizer would choose them; nothing written."""
        from dataclasses import replace

        lines: list[str] = []
        result = self.run(replace(job, dry_run=True, output=None, imatrix=None), lines.append)
        if result.returncode != 0:
            raise ToolFailed(f"{self.backend} quantizer dry run for {job.ftype} failed: {result.error}", "check that the source loads in llama.cpp and the rung's types are valid")
        return parse_dry_run(lines, job.ftype)


@dataclass
class DryRun:
    targets: dict[str, str]  # tensor -> target type (upper case); unchanged tensors keep their type
    quantized: set[str]  # tensors the quantizer converts
    size_bytes: int  # estimated tensor data of the output

    def needs_imatrix(self, ftype: str) -> list[str]:
        return sorted(n for n in self.quantized if type_requires_imatrix(n, self.targets[n], ftype))


def parse_dry_run(lines: Sequence[str], ftype: str) -> DryRun:
    targets: dict[str, str] = {}
    quantized: set[str] = set()
    size = 0.0
    for line in lines:
        m = TENSOR_LINE.match(line)
        if not m:
            continue
        s = DRY_RUN_SIZE.search(line, m.end())
        if s and s["after"]:
            targets[m["name"]] = s["target"].upper()
            quantized.add(m["name"])
            size += float(s["after"])
        else:
            targets[m["name"]] = m["type"].upper()
            size += float(s["before"]) if s else 0.0
    return DryRun(targets, quantized, int(size * 2**20))


class BinaryQuantizer(Quantizer):
    backend = "binary"

    def __init__(self, path: Path, info: ToolInfo | None = None) -> None:
        self.path = Path(path)
        self.tool = info or probe_tool(self.path, "llama-quantize", "given")
        if not self.tool.works:
            raise ToolMissing(f"{self.path} does not behave like llama-quantize ({self.tool.note})", "pass the llama-quantize binary, or --quantizer libllama")

    @property
    def flavour(self) -> str:
        return self.tool.flavour

    def argv(self, job: QuantizeJob) -> list[str]:
        return [str(self.path), *job.flags(self.tool.flavour)]

    def describe(self) -> dict[str, object]:
        t = self.tool
        return {"backend": self.backend, "path": t.path, "version": t.version, "build": t.build_number, "commit": t.commit, "flavour": t.flavour, "sha256": t.sha256}


class LibllamaQuantizer(Quantizer):
    backend = "libllama"
    flavour = "llama.cpp"

    def __init__(self) -> None:
        lib = libllama_info()
        if lib is None:
            raise ToolMissing("llama-cpp-python's libllama was not found", "pip install llama-cpp-python, or use --quantizer binary")
        self.lib = lib

    def argv(self, job: QuantizeJob) -> list[str]:
        return [sys.executable, "-m", "ggufcarve.quantize_child", *job.flags("llama.cpp")]

    def describe(self) -> dict[str, object]:
        version = llama_cpp_version()
        return {"backend": self.backend, "path": self.lib["path"], "version": version, "build": None, "commit": None, "flavour": "llama.cpp", "sha256": self.lib["sha256"], "python": sys.executable}


def make_quantizer(choice: str = "auto", llama_cpp_dir: str | os.PathLike[str] | None = None) -> Quantizer:
    """`auto` prefers a found llama-quantize binary, else libllama; `binary`, `libllama`, or a PATH to a binary."""
    if choice == "libllama":
        return LibllamaQuantizer()
    if choice in ("auto", "binary"):
        found = locate_tool("llama-quantize", llama_cpp_dir)
        if found is not None:
            return BinaryQuantizer(found[0], probe_tool(found[0], "llama-quantize", found[1]))
        if choice == "binary":
            require_tool("llama-quantize", llama_cpp_dir)
        return LibllamaQuantizer()
    path = Path(choice).expanduser()
    if not _is_executable(path):
        raise BadInput(f"--quantizer {choice}: not auto, binary, libllama or an executable file", "give one of auto|binary|libllama or the path of llama-quantize")
    return BinaryQuantizer(path.resolve(), probe_tool(path.resolve(), "llama-quantize", "--quantizer"))
