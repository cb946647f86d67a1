"""Building the llama.cpp tools from the llama-cpp-python sdist into ggufcarve's cache."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ggufcarve.errors import BadInput, ToolFailed, ToolMissing
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.fileio import (
    cache_root,
    make_temp_dir,
    remove_dead_temps,
    sha256_file_cached,
)
from ggufcarve.llama.launch import run, run_checked
from ggufcarve.llama.tools import (
    BACKENDS,
    _is_executable,
    cache_dir,
    cache_state,
    cmake_flags,
    cpu_features,
    libllama_backend,
    llama_cpp_version,
    read_build_info,
    tools_backend,
    tools_of,
    write_build_info,
)

# ---------------------------------------------------------------------------------------------
# Building


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


def sdist_path(version: str) -> Path:
    """Where the llama-cpp-python sdist of `version` lives in the cache (present or not)."""
    return cache_root() / "sdist" / sdist_name(version)


def fetch_sdist(version: str, on_event: Sink = ignore) -> Path:
    """The llama-cpp-python sdist of `version`, downloaded with pip into the cache once."""
    target = sdist_path(version)
    target_dir = target.parent
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    on_event(Event("download", 0, 0, "steps", f"pip download llama-cpp-python=={version} (sdist)"))
    remove_dead_temps(target_dir, target.name.__eq__)
    tmp = make_temp_dir(target)
    try:
        argv = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"llama-cpp-python=={version}",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--dest",
            str(tmp),
        ]
        finished = run(argv, timeout=DOWNLOAD_TIMEOUT, idle_timeout=DOWNLOAD_IDLE_TIMEOUT)
        files = sorted(tmp.glob("*.tar.gz"))
        if not finished.ok or not files:
            raise ToolFailed(
                f"pip could not download the llama-cpp-python {version} sdist: {finished.describe_failure()}",
                "check network access to PyPI, or pass --llama-cpp DIR with prebuilt tools",
            )
        os.replace(files[0], target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract `<top>/vendor/llama.cpp` of the sdist into dest; returns the llama.cpp source dir."""
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if "/vendor/llama.cpp/" in m.name + "/" and (m.isfile() or m.isdir() or m.issym())
        ]
        if not members:
            raise BadInput(f"{sdist} has no vendor/llama.cpp directory", "the file is not a llama-cpp-python sdist")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python without extraction filters: regular files and directories only, no links
            tar.extractall(
                dest,
                members=[
                    m
                    for m in members
                    if (m.isfile() or m.isdir()) and not Path(m.name).is_absolute() and ".." not in Path(m.name).parts
                ],
            )
    found = sorted(dest.glob("*/vendor/llama.cpp"))
    if not found or not (found[0] / "CMakeLists.txt").exists():
        raise BadInput(f"{sdist}: vendor/llama.cpp has no CMakeLists.txt", "the sdist is incomplete")
    return found[0]


DOWNLOAD_TIMEOUT = 900.0
DOWNLOAD_IDLE_TIMEOUT = 300.0
BUILD_TIMEOUT = 3 * 3600.0
BUILD_IDLE_TIMEOUT = 1800.0  # one translation unit of llama.cpp compiles in minutes, never half an hour
PERCENT = re.compile(r"^\[\s*(\d+)%\]")
NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def _stream(argv: list[str], stage: str, on_event: Sink) -> None:
    """Run a cmake step; its "[ 42%]" / "[12/345]" lines become percent events of `stage`."""
    state = {"done": 0}

    def on_line(line: str) -> None:
        if m := PERCENT.match(line):
            state["done"] = int(m[1])
        elif m := NINJA_STEP.match(line):
            state["done"] = 100 * int(m[1]) // max(int(m[2]), 1)
        on_event(Event(stage, state["done"], 100, "percent", line))

    run_checked(
        argv,
        f"{' '.join(argv[:3])} ...",
        "install a C++ compiler and cmake >= 3.14, or pass --llama-cpp DIR with prebuilt tools",
        on_line=on_line,
        timeout=BUILD_TIMEOUT,
        idle_timeout=BUILD_IDLE_TIMEOUT,
    )


def compile_tools(
    source_dir: Path,
    build_dir: Path,
    bin_out: Path,
    on_event: Sink = ignore,
    jobs: int | None = None,
    backend: str = "cpu",
    cuda_architectures: str | None = None,
) -> None:
    """Configure and build only the tools of `backend` (`tools_of`) from a llama.cpp source tree;
    copy them into bin_out."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise ToolMissing(
            "cmake not found on PATH", "install cmake (and a C++ compiler), or pass --llama-cpp DIR with prebuilt tools"
        )
    jobs = jobs or os.cpu_count() or 2
    on_event(Event("configure", 0, 100, "percent", f"cmake -S {source_dir} -B {build_dir}"))
    flags = cmake_flags(backend, cuda_architectures)
    programs = tools_of(backend)
    _stream([cmake, "-S", str(source_dir), "-B", str(build_dir), *flags], "configure", on_event)
    _stream(
        [cmake, "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *programs],
        "build",
        on_event,
    )
    bin_out.mkdir(parents=True, exist_ok=True)
    for tool in programs:
        built = next(
            (
                p
                for p in (build_dir / "bin" / tool, build_dir / "bin" / "Release" / tool, build_dir / tool)
                if _is_executable(p)
            ),
            None,
        )
        if built is None:
            raise ToolFailed(
                f"the build finished but {tool} was not produced in {build_dir / 'bin'}",
                "see the build output above; run `ggufcarve toolchain build` again",
            )
        shutil.copy2(built, bin_out / tool)
    on_event(Event("install", 100, 100, "percent", f"copied {', '.join(programs)}"))


def install_prebuilt(
    bin_dir: Path,
    version: str | None = None,
    origin: str = "prebuilt",
    force: bool = False,
    backend: str = "cpu",
) -> tuple[Path, bool]:
    """Put already built tools (e.g. from a llama.cpp build of the same source, with `backend`)
    into the cache layout.

    Returns the cache's bin dir and whether anything was copied (False: the cache had them, no force).
    """
    version = version or llama_cpp_version()
    final = cache_dir(version)
    programs = tools_of(backend)
    with _lock(cache_root() / f".llama.cpp-{version}.lock"):
        if not force and cache_state(final, backend) == "ready":
            return final / "bin", False
        missing = [t for t in programs if not _is_executable(bin_dir / t)]
        if missing:
            raise BadInput(
                f"{bin_dir} lacks {', '.join(missing)}",
                "give the bin directory of a llama.cpp build that has all of them",
            )
        remove_dead_temps(final.parent, final.name.__eq__)
        staging = make_temp_dir(final)
        try:
            (staging / "bin").mkdir()
            for tool in programs:
                shutil.copy2(bin_dir / tool, staging / "bin" / tool)
            _write_build_info(staging, version, backend, origin=origin)
            _move_into_place(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final / "bin", True


def _write_build_info(
    staging: Path, version: str, backend: str, cuda_architectures: str | None = None, **extra: object
) -> None:
    """What the entry is: version, backend, tool hashes, cmake flags, and the CPU it was built on."""
    write_build_info(
        staging,
        {
            "llama_cpp_python": version,
            "backend": backend,
            "tools": {t: sha256_file_cached(staging / "bin" / t) for t in tools_of(backend)},
            "cmake_flags": list(cmake_flags(backend, cuda_architectures)),
            "cpu": cpu_features().to_json(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **extra,
        },
    )


def _move_into_place(staging: Path, final: Path) -> None:
    if final.exists():  # an incomplete earlier attempt: replace it
        shutil.rmtree(final)
    os.rename(staging, final)


def build_tools(
    on_event: Sink = ignore,
    *,
    version: str | None = None,
    sdist: Path | None = None,
    jobs: int | None = None,
    force: bool = False,
    backend: str | None = None,
    cuda_architectures: str | None = None,
) -> Path:
    """Build the tools of `backend` (default: the installed libllama's, `libllama_backend`) for the
    installed llama-cpp-python version into the cache; returns the bin dir.

    Never rebuilds what is cached for this CPU and backend (unless force); an entry built for
    another CPU or with another backend is rebuilt. Concurrent callers wait on a lock. The build
    runs in a temp directory beside the cache entry, which is renamed into place only when complete.
    """
    sink = on_event
    backend = backend or libllama_backend()
    if backend not in BACKENDS:
        raise BadInput(f"backend {backend!r} is not one of {', '.join(BACKENDS)}", "give --backend cpu or rpc, ...")
    version = version or llama_cpp_version()
    final = cache_dir(version)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".llama.cpp-{version}.lock"):
        state = cache_state(final, backend)
        if not force and state == "ready":
            sink(
                Event(
                    "cached",
                    100,
                    100,
                    "percent",
                    f"{final / 'bin'} already has {', '.join(tools_of(backend))} ({backend})",
                )
            )
            return final / "bin"
        if state == "other backend":
            built_with = tools_backend(final)
            sink(
                Event(
                    "rebuild",
                    0,
                    0,
                    "steps",
                    f"the cached tools were built with {built_with}: rebuilding with {backend}",
                )
            )
        if state == "other cpu":
            recorded = read_build_info(final).get("cpu")
            built_for = recorded.get("key") if isinstance(recorded, dict) else "?"
            sink(
                Event(
                    "rebuild",
                    0,
                    0,
                    "steps",
                    f"the cached tools were built for CPU {built_for}, this one is {cpu_features().key}: rebuilding",
                )
            )
        sdist = sdist or fetch_sdist(version, sink)
        remove_dead_temps(final.parent, final.name.__eq__)
        staging = make_temp_dir(final)
        try:
            sink(Event("extract", 0, 100, "percent", f"extracting vendor/llama.cpp from {sdist.name}"))
            source = extract_llama_cpp(sdist, staging / "src")
            compile_tools(source, staging / "build", staging / "bin", sink, jobs, backend, cuda_architectures)
            _write_build_info(
                staging,
                version,
                backend,
                cuda_architectures,
                sdist=sdist.name,
                sdist_sha256=sha256_file_cached(sdist),
            )
            shutil.rmtree(staging / "src", ignore_errors=True)
            shutil.rmtree(staging / "build", ignore_errors=True)
            _move_into_place(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final / "bin"
