"""llama.cpp tools: finding, probing and building them; the two quantizer backends.

Where a tool is looked for, in order (`find_tool`):
    1. `--llama-cpp DIR` (or `GGUFCARVE_LLAMA_CPP`): DIR/NAME, DIR/bin/NAME, DIR/build/bin/NAME
    2. PATH
    3. ggufcarve's cache: ${GGUFCARVE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ggufcarve}/llama.cpp-<version>/bin

`build_tools` fills the cache: it compiles llama-quantize, llama-imatrix, llama-perplexity,
llama-gguf-split and llama-bench (and nothing else) with cmake from the llama.cpp source vendored in the
llama-cpp-python sdist of the installed version, in a temp directory that is renamed into place.

A cache entry is keyed by what makes it run: the llama-cpp-python version (its directory name) and
the CPU it was compiled for. ggml's default build is native (GGML_NATIVE, `-march=native`): the
compiler may use every instruction set extension of the build machine, so the binaries can die
with SIGILL on a CPU that lacks one. `build-info.json` records the machine and the extension flags
(`cpu_features`); a cache entry recorded for other features is not used and is rebuilt. An entry
made before the CPU was recorded is taken as built on this machine, and the record is added.

Quantizer backends (`make_quantizer`): `binary` runs llama-quantize; `libllama` runs
llama-cpp-python's `llama_model_quantize` in a child process (`python -m ggufcarve.llama.quantize_child`)
with the imatrix normalised exactly as llama-quantize does and the tensor-type overrides passed in
the C structs, so a ladder works right after `pip install`. Both render an exact argv, stream the
quantizer's log lines and report per-tensor progress.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from ggufcarve.errors import ToolMissing
from ggufcarve.fileio import cache_root, sha256_file_cached
from ggufcarve.llama import launch

TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity", "llama-gguf-split", "llama-bench", "llama-fit-params")
RPC_SERVER = "ggml-rpc-server"  # tools/rpc: serves one ggml device of this machine over a socket
ENV_LLAMA_CPP = "GGUFCARVE_LLAMA_CPP"
# The cmake flags of llama.cpp's own static CPU build, without network or server code.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
# ggml backends the tools can be built with, on top of the CPU backend (always built): their cmake
# flags (ggml/CMakeLists.txt options). "rpc" adds llama.cpp's RPC client (--rpc HOST:PORT: remote
# ggml devices) and the server that exports a device.
BACKEND_FLAGS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "rpc": ("-DGGML_RPC=ON",),
    "cuda": ("-DGGML_CUDA=ON",),
    "vulkan": ("-DGGML_VULKAN=ON",),
    "metal": ("-DGGML_METAL=ON",),
}
BACKENDS = tuple(BACKEND_FLAGS)
# libggml-<name> files of llama-cpp-python's lib/ that name a backend it was built with; the first found names it.
LIBRARY_BACKENDS = (("cuda", "cuda"), ("vulkan", "vulkan"), ("metal", "metal"), ("rpc", "rpc"))
PROBE_TIMEOUT = 30.0
BUILD_INFO = "build-info.json"
CPUINFO = Path("/proc/cpuinfo")
# x86 instruction set extensions, as /proc/cpuinfo's "flags" line names them, that -march=native
# can compile in (SSE3 is "pni"). Other flags of that line (bugs, power management, virtualisation)
# do not change the code and are left out; on other machines every "Features" word is an extension.
X86_EXTENSION = re.compile(
    r"^(?:mmx|sse\w*|ssse3|pni|avx\w*|amx\w*|fma4?|f16c|bmi\d|abm|lzcnt|popcnt|movbe|adx|aes|vaes|pclmulqdq|vpclmulqdq"
    r"|sha_ni|gfni|xop|tbm|rdrand|rdseed|xsave\w*|cx16|clflushopt|clwb|prefetchw|movdir\w*|serialize|waitpkg)$"
)
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")

# Strings only ik_llama.cpp's llama-quantize usage text contains (its extra quant types and flags).
IK_MARKERS = (
    "--custom-q",
    "--ignore-imatrix-rules",
    "--attn-q-type",
    "IQ4_KS",
    "IQ2_KT",
    "IQ3_K ",
    "Custom Quant Scheme",
)
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


def tools_of(backend: str) -> tuple[str, ...]:
    """The programs a build with `backend` holds: TOOLS, and the RPC server where RPC is built in."""
    return (*TOOLS, RPC_SERVER) if backend == "rpc" else TOOLS


def cmake_flags(backend: str, cuda_architectures: str | None = None) -> tuple[str, ...]:
    """The cmake flags of a build with `backend` (CUDA for `cuda_architectures` only, when given)."""
    extra = (f"-DCMAKE_CUDA_ARCHITECTURES={cuda_architectures}",) if backend == "cuda" and cuda_architectures else ()
    return (*CMAKE_FLAGS, *BACKEND_FLAGS[backend], *extra)


@cache
def libllama_backend() -> str:
    """The backend llama-cpp-python's libllama was built with, from the ggml libraries beside it:
    "cuda", "vulkan", "metal", "rpc" or "cpu" ("cpu" also when the package is not installed)."""
    lib = libllama_info()
    if lib is None:
        return "cpu"
    names = [p.name for p in Path(lib["path"]).parent.iterdir()]
    for backend, stem in LIBRARY_BACKENDS:
        if any(name.startswith(f"libggml-{stem}") or name.startswith(f"ggml-{stem}") for name in names):
            return backend
    return "cpu"


def tools_backend(directory: Path) -> str:
    """The backend a cache entry's tools were built with (build-info.json; "cpu" for an entry that
    does not record it, as builds before the backend was recorded were CPU builds)."""
    backend = read_build_info(directory).get("backend", "cpu")
    return backend if isinstance(backend, str) else "cpu"


def backend_of_tool(path: Path) -> str | None:
    """The backend a tool was built with, where its build says (a ggufcarve cache entry's
    build-info.json beside its bin dir); None for a tool of unknown origin (PATH, --llama-cpp)."""
    entry = Path(path).parent.parent
    return tools_backend(entry) if (entry / BUILD_INFO).exists() else None


def cache_dir(version: str | None = None) -> Path:
    return cache_root() / f"llama.cpp-{version or llama_cpp_version()}"


def cache_bin_dir(version: str | None = None) -> Path:
    return cache_dir(version) / "bin"


@dataclass(frozen=True)
class CpuFeatures:
    """The machine and the instruction set extensions a native build of ggml may use."""

    machine: str
    flags: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.machine}-{hashlib.sha256(' '.join(self.flags).encode()).hexdigest()[:12]}"

    def to_json(self) -> dict[str, object]:
        return {"machine": self.machine, "flags": list(self.flags), "key": self.key}


def cpu_features(cpuinfo: Path | None = None) -> CpuFeatures:
    """This CPU's features from /proc/cpuinfo (the first "flags" or "Features" line)."""
    machine = platform.machine().lower() or "unknown"
    try:
        text = (cpuinfo or CPUINFO).read_text(errors="replace")
    except OSError:
        text = ""
    words: list[str] = []
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in ("flags", "features"):
            words = value.split()
            break
    if machine in X86_MACHINES:
        words = [w for w in words if X86_EXTENSION.match(w)]
    return CpuFeatures(machine, tuple(sorted(set(words))))


def physical_cores() -> int:
    """The physical cores this process may run on: llama.cpp's default thread count, since a
    second hyper-thread of a core adds little to matrix products and slows the others down.

    Counted from the kernel's topology (one core per distinct `core_cpus_list` among the CPUs of
    this process's affinity); the CPU count where the topology is not readable."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            siblings = (topology / "core_cpus_list").read_text().strip()
        except OSError:
            try:
                siblings = (topology / "thread_siblings_list").read_text().strip()
            except OSError:
                return max(1, len(allowed))
        cores.add(siblings)
    return max(1, len(cores))


def read_build_info(directory: Path) -> dict[str, object]:
    """A cache entry's build-info.json ({} when absent or unreadable)."""
    try:
        info = json.loads((directory / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def write_build_info(directory: Path, info: dict[str, object]) -> None:
    """Replace build-info.json atomically (readers see the old or the new file, never half)."""
    handle, temp = tempfile.mkstemp(prefix=f".{BUILD_INFO}.", dir=directory)
    try:
        os.fchmod(handle, 0o644)  # readable by everyone who shares the cache, as the tools are
        with os.fdopen(handle, "w") as f:
            f.write(json.dumps(info, indent=1, sort_keys=True) + "\n")
        os.replace(temp, directory / BUILD_INFO)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def built_for_this_cpu(directory: Path) -> bool:
    """Whether a cache entry's build-info records this CPU's features.

    An entry whose build-info has no CPU record was made by a ggufcarve that did not record it,
    on the machine that shares its cache: this CPU is recorded in it and it counts as built here.
    """
    info = read_build_info(directory)
    here = cpu_features()
    recorded = info.get("cpu")
    if not isinstance(recorded, dict):
        try:
            write_build_info(directory, {**info, "cpu": here.to_json(), "cpu_recorded": "on first use"})
        except OSError:
            pass  # a read-only cache: usable, the record is added by whoever can write
        return True
    return recorded.get("key") == here.key


def cache_state(directory: Path, backend: str | None = None) -> str:
    """\"ready" (all tools, built for this CPU, with `backend` when one is asked for), "missing"
    (not all tools), "other cpu" (built for another CPU) or "other backend"."""
    if not all(_is_executable(directory / "bin" / t) for t in TOOLS):
        return "missing"
    if not built_for_this_cpu(directory):
        return "other cpu"
    if backend is not None and tools_backend(directory) != backend:
        return "other backend"
    if not all(_is_executable(directory / "bin" / t) for t in tools_of(tools_backend(directory))):
        return "missing"
    return "ready"


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
        entry = cache_dir()
    except ToolMissing:
        return None
    if _is_executable(entry / "bin" / name) and built_for_this_cpu(entry):
        return entry / "bin" / name, "cache"
    return None


def find_tool(name: str, llama_cpp_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The path of llama.cpp tool `name`: --llama-cpp DIR / GGUFCARVE_LLAMA_CPP, then PATH, then the cache."""
    found = locate_tool(name, llama_cpp_dir)
    return found[0] if found else None


def require_tool(name: str, llama_cpp_dir: str | os.PathLike[str] | None = None) -> Path:
    path = find_tool(name, llama_cpp_dir)
    if path is None:
        other_cpu = cache_state(cache_dir()) == "other cpu"
        raise ToolMissing(
            f"{name} not found (looked in --llama-cpp/{ENV_LLAMA_CPP}, PATH and {cache_bin_dir()}"
            + (", whose tools were built for another CPU" if other_cpu else "")
            + ")",
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
    return ToolInfo(
        name,
        str(path),
        origin,
        sha,
        version,
        build,
        commit,
        flavour,
        works,
        (),
        "" if works else f"--version exited {code}",
    )


@dataclass(frozen=True)
class Toolchain:
    tools: dict[str, ToolInfo | None]
    cache_bin: str
    cache_state: str  # cache_state() of the cache entry: "ready", "missing" or "other cpu"
    cpu: CpuFeatures
    llama_cpp_python: str | None
    libllama: dict[str, str] | None  # path and sha256 of the libllama the libllama backend uses

    def to_json(self) -> dict[str, object]:
        return {
            "tools": {k: (v.to_json() if v else None) for k, v in self.tools.items()},
            "cache_bin": self.cache_bin,
            "cache_state": self.cache_state,
            "cpu": self.cpu.to_json(),
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
        state = cache_state(cache_dir(version))
    except ToolMissing:
        version, bin_dir, state = None, str(cache_root() / "llama.cpp-?" / "bin"), "missing"
    return Toolchain(tools, bin_dir, state, cpu_features(), version, libllama_info())
