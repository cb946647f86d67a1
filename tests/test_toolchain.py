"""Toolchain: finding, probing, building llama.cpp tools; the binary and libllama quantizer backends.

Fake executables are used only for lookup order, argv rendering and flavour detection; the
quantizers themselves run for real (marked slow).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.fileio import cache_root
from ggufcarve.gguf.container import read_model
from ggufcarve.llama import build
from ggufcarve.llama.build import build_tools
from ggufcarve.llama.launch import Finished
from ggufcarve.llama.tools import (
    TOOLS,
    cache_bin_dir,
    find_tool,
    locate_tool,
    parse_build,
    probe_tool,
)
from ggufcarve.quant.quantizer import (
    BinaryQuantizer,
    LibllamaQuantizer,
    QuantizeJob,
    make_quantizer,
)

MAINLINE_USAGE = """usage: llama-quantize [--help] [--allow-requantize] [--leave-output-tensor] [--pure] [--imatrix] \
[--include-weights]
       [--tensor-type] [--dry-run]
  --allow-requantize
  --imatrix file_name
"""
IK_USAGE = """usage: ./llama-quantize [--help] [--allow-requantize] [--leave-output-tensor] [--pure] [--imatrix] \
[--attn-q-type] [--custom-q]
  --ignore-imatrix-rules
  136  or  IQ4_KS  : 4.25 bpw non-linear quantization
"""


def fake_tool(
    directory: Path,
    name: str,
    usage: str = MAINLINE_USAGE,
    build_line: str = "version: 0.5.0-dev (build 42, commit abc1234)",
) -> Path:
    """A shell script that behaves like the tool for --help/--version/--dry-run probing."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--help" ]; then cat <<\'EOF\'\n{usage}EOF\nexit 1; fi\n'
        f"echo '{build_line}' >&2\n"
        "exit 1\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Empty cache, empty PATH (but the shell), no GGUFCARVE_LLAMA_CPP."""
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGUFCARVE_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    return tmp_path


def test_find_tool_order(isolated, monkeypatch):
    cache_bin = cache_bin_dir()
    on_path = isolated / "onpath"
    explicit = isolated / "explicit"
    env_dir = isolated / "envdir"
    assert find_tool("llama-quantize") is None

    fake_tool(cache_bin, "llama-quantize")
    assert locate_tool("llama-quantize") == (cache_bin / "llama-quantize", "cache")

    fake_tool(on_path, "llama-quantize")
    monkeypatch.setenv("PATH", f"{on_path}:/usr/bin:/bin")
    assert locate_tool("llama-quantize") == ((on_path / "llama-quantize").resolve(), "PATH")

    fake_tool(env_dir / "build" / "bin", "llama-quantize")
    monkeypatch.setenv("GGUFCARVE_LLAMA_CPP", str(env_dir))
    assert locate_tool("llama-quantize") == (
        (env_dir / "build" / "bin" / "llama-quantize").resolve(),
        "GGUFCARVE_LLAMA_CPP",
    )

    fake_tool(explicit / "bin", "llama-quantize")
    assert find_tool("llama-quantize", explicit) == (explicit / "bin" / "llama-quantize").resolve()
    # a directory without the tool falls through to the next place
    assert find_tool("llama-imatrix", explicit) is None


def test_probe_mainline_and_ik_flavour(tmp_path):
    main = probe_tool(fake_tool(tmp_path / "main", "llama-quantize"))
    assert main.works and main.flavour == "llama.cpp"
    assert (main.version, main.build_number, main.commit) == ("0.5.0-dev", 42, "abc1234")
    assert main.imatrix_formats == ("gguf", "dat")
    assert len(main.sha256) == 64

    ik = probe_tool(fake_tool(tmp_path / "ik", "llama-quantize", IK_USAGE, "main: build = 3712 (6e1ac5a1)"))
    assert ik.works and ik.flavour == "ik_llama.cpp"
    assert (ik.build_number, ik.commit) == (3712, "6e1ac5a1")
    assert ik.imatrix_formats == ("dat",)

    broken = tmp_path / "broken" / "llama-quantize"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\necho hello\nexit 0\n")
    broken.chmod(0o755)
    assert not probe_tool(broken).works


def test_parse_build_formats():
    assert parse_build("version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU") == ("0.5.0-dev", 1, "0c1e570")
    assert parse_build("version: 4589 (a1b2c3d)") == (None, 4589, "a1b2c3d")
    assert parse_build("llama_quantize: build = 3000 (deadbee)") == (None, 3000, "deadbee")
    assert parse_build("nothing here") == (None, None, None)


def test_argv_rendering(tmp_path):
    job = QuantizeJob(
        Path("/m/in.gguf"),
        Path("/o/.x.partial"),
        "iq2_xs",
        imatrix=Path("/m/im.gguf"),
        output_tensor_type="Q6_K",
        tensor_types=((r"^blk\.40\.", "Q4_K"), ("ffn_down_exps", "Q3_K")),
        nthreads=2,
    )
    main = BinaryQuantizer(fake_tool(tmp_path / "main", "llama-quantize"))
    # run in the imatrix's directory, so the quantizer stores its bare name in quantize.imatrix.file
    assert job.cwd == Path("/m")
    assert main.argv(job)[1:] == [
        "--allow-requantize",
        "--imatrix",
        "im.gguf",
        "--output-tensor-type",
        "Q6_K",
        "--tensor-type",
        r"^blk\.40\.=Q4_K",
        "--tensor-type",
        "ffn_down_exps=Q3_K",
        "/m/in.gguf",
        "/o/.x.partial",
        "IQ2_XS",
        "2",
    ]
    # what a release records: names only, and the final output name
    assert main.recorded_argv(job, Path("/o/x.gguf")) == [
        "llama-quantize",
        *main.argv(job)[1:-4],
        "in.gguf",
        "x.gguf",
        "IQ2_XS",
        "2",
    ]
    ik = BinaryQuantizer(fake_tool(tmp_path / "ik", "llama-quantize", IK_USAGE))
    assert ik.argv(job)[1:] == [
        "--allow-requantize",
        "--imatrix",
        "im.gguf",
        "--output-tensor-type",
        "q6_k",
        "--custom-q",
        r"^blk\.40\.=q4_k,ffn_down_exps=q3_k",
        "/m/in.gguf",
        "/o/.x.partial",
        "IQ2_XS",
        "2",
    ]
    dry = QuantizeJob(Path("in.gguf"), None, "Q4_K_M", dry_run=True)
    assert dry.cwd is None and main.argv(dry)[1:] == [
        "--allow-requantize",
        "--dry-run",
        os.path.abspath("in.gguf"),
        "Q4_K_M",
    ]
    lib = LibllamaQuantizer()
    assert lib.argv(dry)[1:3] == ["-m", "ggufcarve.llama.quantize_child"] and lib.argv(dry)[3:] == main.argv(dry)[1:]


def test_make_quantizer_choices(isolated, monkeypatch):
    assert make_quantizer("auto").backend == "libllama"  # nothing found: no compiler needed
    fake_tool(isolated / "bin", "llama-quantize")
    monkeypatch.setenv("GGUFCARVE_LLAMA_CPP", str(isolated))
    chosen = make_quantizer("auto")
    assert chosen.backend == "binary" and chosen.describe()["build"] == 42
    assert make_quantizer("libllama").backend == "libllama"
    assert make_quantizer(str(isolated / "bin" / "llama-quantize")).backend == "binary"
    with pytest.raises(BadInput):
        make_quantizer(str(isolated / "nope"))


# ---------------------------------------------------------------------------------------------
# build_tools, with a stand-in cmake project instead of llama.cpp (the real build runs in CI via
# the llama_tools fixture)

FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake_llama C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
foreach(tool llama-quantize llama-imatrix llama-perplexity llama-gguf-split llama-bench llama-fit-params llama-cli)
  add_executable(${tool} tool.c)
endforeach()
if(GGML_RPC)
  add_executable(ggml-rpc-server tool.c)
endif()
"""
FAKE_TOOL_C = '#include <stdio.h>\nint main(void) { puts("version: 9.9 (build 7, commit fake123)"); return 0; }\n'


def fake_sdist(path: Path, version: str) -> Path:
    top = f"llama_cpp_python-{version}"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in (
            (f"{top}/vendor/llama.cpp/CMakeLists.txt", FAKE_CMAKE),
            (f"{top}/vendor/llama.cpp/tool.c", FAKE_TOOL_C),
            (f"{top}/setup.py", ""),
        ):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None, reason="needs cmake and a C compiler")
def test_build_tools_builds_only_its_targets_once(isolated):
    version = "0.0.1-test"
    sdist_dir = cache_root() / "sdist"
    sdist_dir.mkdir(parents=True)
    fake_sdist(sdist_dir / build.sdist_name(version), version)  # cached sdist: no pip download
    events = []
    bin_dir = build_tools(events.append, version=version, backend="cpu")
    assert bin_dir == cache_root() / f"llama.cpp-{version}" / "bin"
    assert sorted(p.name for p in bin_dir.iterdir()) == sorted(TOOLS)  # llama-cli not built/copied
    assert subprocess.run([bin_dir / "llama-imatrix"], capture_output=True, text=True).stdout.startswith("version: 9.9")
    stages = {e.stage for e in events}
    assert {"extract", "configure", "build", "install"} <= stages
    assert any(e.unit == "percent" and 0 < e.done <= e.total == 100 for e in events if e.stage == "build")
    # only the finished entry remains: the staging dir was renamed into place, sources removed
    entries = sorted(
        p.name for p in cache_root().iterdir() if not p.name.endswith(".lock") and p.name != "sha256-cache.json"
    )
    assert entries == [f"llama.cpp-{version}", "sdist"]
    assert not (bin_dir.parent / "src").exists() and (bin_dir.parent / "build-info.json").exists()

    mtime = (bin_dir / "llama-quantize").stat().st_mtime_ns
    again = []
    assert build_tools(again.append, version=version, backend="cpu") == bin_dir
    assert [e.stage for e in again] == ["cached"]
    assert (bin_dir / "llama-quantize").stat().st_mtime_ns == mtime
    assert json.loads((bin_dir.parent / "build-info.json").read_text())["backend"] == "cpu"


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None, reason="needs cmake and a C compiler")
def test_the_rpc_backend_builds_its_server_and_replaces_a_cpu_build(isolated):
    """--backend rpc configures with -DGGML_RPC=ON (the fake source adds the server only then) and
    the entry of another backend is rebuilt, not taken."""
    version = "0.0.4-test"
    (cache_root() / "sdist").mkdir(parents=True)
    fake_sdist(cache_root() / "sdist" / build.sdist_name(version), version)
    bin_dir = build_tools(version=version, backend="cpu")
    assert not (bin_dir / "ggml-rpc-server").exists()
    events = []
    assert build_tools(events.append, version=version, backend="rpc") == bin_dir
    assert any(e.stage == "rebuild" and "built with cpu" in e.message for e in events)
    assert sorted(p.name for p in bin_dir.iterdir()) == sorted((*TOOLS, "ggml-rpc-server"))
    info = json.loads((bin_dir.parent / "build-info.json").read_text())
    assert info["backend"] == "rpc" and "-DGGML_RPC=ON" in info["cmake_flags"] and "ggml-rpc-server" in info["tools"]
    again = []
    build_tools(again.append, version=version, backend="rpc")
    assert [e.stage for e in again] == ["cached"]


def test_build_tools_failure_leaves_nothing(isolated):
    version = "0.0.2-test"
    sdist_dir = cache_root() / "sdist"
    sdist_dir.mkdir(parents=True)
    bad = sdist_dir / build.sdist_name(version)
    with tarfile.open(bad, "w:gz") as tar:
        info = tarfile.TarInfo("x/setup.py")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(BadInput, match="vendor/llama.cpp"):
        build_tools(version=version)
    assert not (cache_root() / f"llama.cpp-{version}").exists()
    assert [
        p.name for p in cache_root().iterdir() if p.name.startswith(".llama.cpp-") and not p.name.endswith(".lock")
    ] == []


def test_fetch_sdist_uses_pip_download_of_the_sdist(isolated, monkeypatch):
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        dest = Path(argv[argv.index("--dest") + 1])
        (dest / "llama_cpp_python-1.2.3.tar.gz").write_bytes(b"sdist")
        return Finished(list(argv), 0, 0.1, [])

    monkeypatch.setattr(build, "run", fake_run)
    path = build.fetch_sdist("1.2.3")
    assert path == cache_root() / "sdist" / "llama_cpp_python-1.2.3.tar.gz" and path.read_bytes() == b"sdist"
    argv = calls[0]
    assert argv[1:4] == ["-m", "pip", "download"] and "llama-cpp-python==1.2.3" in argv
    assert "--no-deps" in argv and argv[argv.index("--no-binary") + 1] == ":all:"
    build.fetch_sdist("1.2.3")
    assert len(calls) == 1  # cached

    def failing_run(argv, **kwargs):
        return Finished(list(argv), 1, 0.1, ["ERROR: No matching distribution found"])

    monkeypatch.setattr(build, "run", failing_run)
    with pytest.raises(ToolFailed, match="No matching distribution"):
        build.fetch_sdist("9.9.9")


# ---------------------------------------------------------------------------------------------
# real tools


@pytest.mark.slow
def test_real_tools_probe(llama_tools):
    for name in TOOLS:
        info = probe_tool(llama_tools / name)
        assert info.works, (name, info.note)
        assert info.flavour == "llama.cpp"
        assert info.build_number is not None and info.commit


def tensor_bytes(path: Path) -> dict[str, bytes]:
    model = read_model(path)
    out = {}
    with open(path, "rb") as f:
        for t in model.tensors:
            start, end = model.shards[0].data_range(t)
            f.seek(start)
            out[t.name] = (t.type_name, t.shape, f.read(end - start))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ftype, imatrix_format", [("Q4_K_M", "gguf"), ("IQ2_XS", "gguf"), ("IQ2_XS", "dat")])
def test_backends_produce_identical_tensor_data(ftype, imatrix_format, q8_moe, q8_moe_imatrix, llama_tools, tmp_path):
    from clirun import ggufcarve

    imatrix = q8_moe_imatrix
    if imatrix_format == "dat":
        imatrix = tmp_path / "imatrix.dat"
        converted = ggufcarve("imatrix", "convert", q8_moe_imatrix, "-o", imatrix, "--format", "dat")
        assert converted.code == 0, converted.stderr
    binary = BinaryQuantizer(llama_tools / "llama-quantize")
    lib = LibllamaQuantizer()
    outputs = {}
    for q in (binary, lib):
        out = tmp_path / f"{q.backend}.gguf"
        job = QuantizeJob(q8_moe, out, ftype, imatrix=imatrix, tensor_types=(("attn_v", "Q8_0"),), nthreads=2)
        run = q.run(job)
        assert run.returncode == 0, run.tail
        outputs[q.backend] = tensor_bytes(out)
    assert outputs["binary"].keys() == outputs["libllama"].keys()
    for name, value in outputs["binary"].items():
        assert outputs["libllama"][name] == value, name
    types = {t for t, _, _ in outputs["binary"].values()}
    assert ("IQ2_XS" if ftype == "IQ2_XS" else "Q4_K") in types and "Q8_0" in types  # the override applied
    assert (tmp_path / "binary.gguf").read_bytes() == (tmp_path / "libllama.gguf").read_bytes()  # even the metadata


@pytest.mark.slow
def test_dry_run_reports_targets(q8_moe, llama_tools):
    for q in (BinaryQuantizer(llama_tools / "llama-quantize"), LibllamaQuantizer()):
        dry = q.dry_run(QuantizeJob(q8_moe, None, "IQ2_XS"))
        assert dry.targets["blk.0.ffn_up_exps.weight"] == "IQ2_XS"
        assert dry.targets["blk.0.ffn_gate_inp.weight"] == "F32" and "blk.0.ffn_gate_inp.weight" not in dry.quantized
        assert "blk.0.ffn_down_exps.weight" in dry.needs_imatrix_entries()
        assert "token_embd.weight" not in dry.refused_without_imatrix() and dry.warned_imatrix_required
        assert 0 < dry.size_bytes < os.path.getsize(q8_moe)


def test_install_prebuilt_copies_once_unless_forced(tmp_path, monkeypatch):
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "build" / "bin"
    built.mkdir(parents=True)
    for tool in TOOLS:
        (built / tool).write_text("#!/bin/sh\necho built\n")
        (built / tool).chmod(0o755)
    bin_dir, copied = build.install_prebuilt(built, version="9.9.9")
    assert copied and sorted(p.name for p in bin_dir.iterdir()) == sorted(TOOLS)
    assert build.install_prebuilt(built, version="9.9.9") == (bin_dir, False)
    (built / "llama-quantize").write_text("#!/bin/sh\necho rebuilt\n")
    assert build.install_prebuilt(built, version="9.9.9", force=True) == (bin_dir, True)
    assert "rebuilt" in (bin_dir / "llama-quantize").read_text()
    (built / "llama-imatrix").unlink()
    with pytest.raises(BadInput, match="lacks llama-imatrix"):
        build.install_prebuilt(built, version="9.9.10")


def test_quantizer_children_never_fork_gdb_on_abort(tmp_path, monkeypatch):
    """ggml forks gdb on an abort unless GGML_NO_BACKTRACE is set; gdb can hang the run for minutes."""
    monkeypatch.delenv("GGML_NO_BACKTRACE", raising=False)  # conftest sets it for every test child
    tool = fake_tool(tmp_path, "llama-quantize")
    quantizer = BinaryQuantizer(tool)
    tool.write_text('#!/bin/sh\necho "GGML_NO_BACKTRACE=$GGML_NO_BACKTRACE"\nexit 134\n')
    run = quantizer.run(QuantizeJob(Path("in.gguf"), tmp_path / "out.gguf", "Q4_K_M"))
    assert run.returncode == 134 and "GGML_NO_BACKTRACE=1" in run.tail
