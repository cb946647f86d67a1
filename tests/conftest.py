"""Shared pytest fixtures: tiny GGUF models generated once per session."""

from __future__ import annotations

import os
import pathlib
import signal
import sys

import pytest

# tests/ holds helper modules (factory, llama_probe) imported by plain name.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import factory
from progress import terminal_progress

# A test run started in the background of a non-interactive shell inherits SIGINT ignored, and an
# ignored disposition survives exec: the commands the tests start would then ignore Ctrl-C, as
# ggufcarve keeps an ignored stop signal ignored (as nohup's SIGHUP). A handler installed here is
# reset to the default in every child, which is what a job started from a terminal sees.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped test fails: .ci/run provides every test's environment (the
    llama.cpp tools, the llama-cpp-python sdist, a mountable tmpfs), so a skip means it did not."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where .ci/run provides this test's environment: {reason}"


# Every llama.cpp child of the tests (probes, llama-imatrix, llama-gguf-split, quantizers) is
# started through ggufcarve.llama.launch, which sets GGML_NO_BACKTRACE and the no-repack setting.


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> pathlib.Path:
    """Session-wide directory for generated model files."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def make_model(models_dir):
    """``make_model(arch, dtype="F16", **write_model_kwargs) -> Path``, written once per session."""
    cache: dict[tuple, pathlib.Path] = {}

    def make(arch: str, dtype: str = "F16", **kwargs) -> pathlib.Path:
        key = (arch, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            suffix = "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
            cache[key] = factory.write_model(models_dir / f"{arch}-{dtype}{suffix}.gguf", arch, dtype=dtype, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def dense_model(models_dir) -> pathlib.Path:
    return factory.write_dense_model(models_dir / "dense-llama-F16.gguf")


# --- llama.cpp tools ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama_tools(request) -> pathlib.Path:
    """The bin dir holding llama.cpp's tools (llama-quantize, llama-imatrix, llama-perplexity, llama-gguf-split,
    llama-bench, llama-fit-params) and ggml-rpc-server, built with the RPC backend.

    Found through ggufcarve's own lookup (``GGUFCARVE_LLAMA_CPP``, PATH, ggufcarve's cache); when
    they are not all in one place, they are built once into the cache from the llama-cpp-python
    sdist (~10-13 min on 2 cores on a fresh machine; later runs reuse the cache).
    """
    from ggufcarve.llama.build import build_tools
    from ggufcarve.llama.tools import find_tool, tools_of

    found = [find_tool(name) for name in tools_of("rpc")]
    if all(found) and len({p.parent for p in found}) == 1:
        return found[0].parent
    return build_tools(terminal_progress(request.config), backend="rpc")


@pytest.fixture(scope="session")
def rpc_servers(llama_tools) -> tuple[str, ...]:
    """Two ggml-rpc-server processes on 127.0.0.1, each exporting this machine's CPU as a ggml device
    (RPC0, RPC1) whose buffers are not host memory: -ngl, per-device buffers, tensor get/set and splits
    run for real without a GPU. Their endpoints; the servers stop with the session."""
    import socket
    import subprocess
    import time

    procs, endpoints = [], []
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    try:
        for _ in range(2):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            argv = [str(llama_tools / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            for _attempt in range(300):  # hang guard: 30 s
                assert procs[-1].poll() is None, f"ggml-rpc-server exited {procs[-1].returncode}"
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                raise AssertionError(f"ggml-rpc-server on port {port} did not start")
            endpoints.append(f"127.0.0.1:{port}")
        yield tuple(endpoints)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


SMALL_DEVICE_BYTES = 6 * 2**30  # the memory of small_rpc_server's device
SMALL_DEVICE_SLACK = 64 * 2**20  # address space of the server process beyond its device's memory


@pytest.fixture(scope="session")
def small_rpc_server(llama_tools, tmp_path_factory) -> str:
    """A ggml-rpc-server whose device has SMALL_DEVICE_BYTES: it reports that much memory (an
    LD_PRELOAD shim, tests/native/small_device.c, answers ggml-cpu's sysconf(_SC_PHYS_PAGES)) and
    fails to allocate beyond it (the process's address space is capped, RLIMIT_AS), as a card of that
    size does. Its endpoint; the server stops with the session."""
    import resource
    import socket
    import subprocess
    import time

    built = tmp_path_factory.mktemp("small-device") / "small_device.so"
    source = pathlib.Path(__file__).parent / "native" / "small_device.c"
    compiled = subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(built), str(source), "-ldl"], capture_output=True, text=True
    )
    assert compiled.returncode == 0, compiled.stderr
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    limit = SMALL_DEVICE_BYTES + SMALL_DEVICE_SLACK
    env = {
        **os.environ,
        "GGML_NO_BACKTRACE": "1",
        "LD_PRELOAD": str(built),
        "GGUFCARVE_DEVICE_BYTES": str(SMALL_DEVICE_BYTES),
    }
    proc = subprocess.Popen(
        [str(llama_tools / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    try:
        for _attempt in range(300):  # hang guard: 30 s
            assert proc.poll() is None, f"ggml-rpc-server exited {proc.returncode}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError(f"ggml-rpc-server on port {port} did not start")
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


CALIBRATION_WORDS = (
    "the quick brown fox jumps over a lazy dog while experts route tokens through "
    "layers of matrices that quantize and prune weights"
).split()


def make_imatrix(bin_dir: pathlib.Path, model: pathlib.Path, out_dir: pathlib.Path, chunks: int = 4) -> pathlib.Path:
    """An imatrix of ``model`` made by llama.cpp's own collector (llama-imatrix) on generated text.

    ``--no-repack``: the natively built tools crash in ggml's AMX path (ggml_backend_amx_mul_mat,
    SIGSEGV) on CPUs with AMX for these tiny models; without weight repacking they run fine.
    """
    import random

    from ggufcarve.llama import launch

    rng = random.Random(0)
    text = out_dir / "calibration.txt"
    text.write_text(" ".join(rng.choice(CALIBRATION_WORDS) for _ in range(3000)) + "\n")
    out = out_dir / f"{model.stem}.imatrix.gguf"
    finished = launch.run(
        [
            bin_dir / "llama-imatrix",
            "-m",
            model,
            "-f",
            text,
            "-o",
            out,
            "-c",
            "128",
            "--chunks",
            str(chunks),
            "-t",
            "2",
            "--no-repack",
        ],
        timeout=300,
        tail_lines=60,
    )
    assert finished.ok and out.exists(), "\n".join(finished.tail)
    return out


@pytest.fixture(scope="session")
def q8_moe(make_model) -> pathlib.Path:
    """qwen3moe, Q8_0, n_embd = n_ff_exp = 256 (so K and IQ types apply), 8 experts, top-2."""
    return make_model("qwen3moe", dtype="Q8_0", n_embd=256, n_ff_exp=256)


@pytest.fixture(scope="session")
def q8_moe_imatrix(q8_moe, llama_tools, tmp_path_factory) -> pathlib.Path:
    """A GGUF imatrix of ``q8_moe`` written by llama-imatrix."""
    return make_imatrix(llama_tools, q8_moe, tmp_path_factory.mktemp("imatrix"))
