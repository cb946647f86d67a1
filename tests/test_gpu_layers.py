"""--gpu-layers reaches llama.cpp in every child that loads a model.

A CPU-only llama.cpp ignores n_gpu_layers (src/llama-model.cpp assigns layers to the CPU when no
GPU device exists and logs nothing about offloading), so the value is checked where ggufcarve
hands it over: the request every child task receives, llama-bench's argv, and the
llama_model_params the child sets. The children themselves then run with it on the CPU.
"""

from __future__ import annotations

import types

import pytest
from typer.testing import CliRunner

from ggufcarve.cli import app
from ggufcarve.demo import CALIBRATION, HELDOUT
from ggufcarve.demo import DEMO_MODEL as DEMO

LAYERS = 7


class Stop(Exception):
    pass


@pytest.fixture()
def requests(monkeypatch):
    """Every request handed to a child task; the first child ends the command."""
    from ggufcarve.llama import child

    seen: list[object] = []

    def run(module, request, *args, **kwargs):
        seen.append(request)
        raise Stop(module)

    monkeypatch.setattr(child, "run", run)
    return seen


@pytest.mark.parametrize(
    "argv",
    [
        ["score", str(DEMO), "--method", "frequency", "--calibration", str(CALIBRATION), "-o", "{tmp}/scores.json"],
        [
            "select",
            str(DEMO),
            "--method",
            "reap",
            "--keep",
            "8",
            "--calibration",
            str(CALIBRATION),
            "-o",
            "{tmp}/selection.json",
        ],
        ["imatrix", "collect", str(DEMO), "--calibration", str(CALIBRATION), "-o", "{tmp}/imatrix.gguf"],
        ["tune", str(DEMO), "--methods", "weights", "--keep", "8", "--heldout", str(HELDOUT), "-o", "{tmp}/tune"],
        [
            "eval",
            str(DEMO),
            "--reference",
            str(DEMO),
            "--heldout",
            str(HELDOUT),
            "--speed-runs",
            "0",
            "-o",
            "{tmp}/eval",
        ],
        [
            "best",
            str(DEMO),
            "--memory",
            "20MiB",
            "--heldout",
            str(HELDOUT),
            "--calibration",
            str(CALIBRATION),
            "-o",
            "{tmp}/best",
        ],
        ["fit", str(DEMO), "--memory", "1GiB", "--ctx", "4096"],
    ],
    ids=lambda argv: " ".join(argv[:2]) if argv[0] == "imatrix" else argv[0],
)
def test_every_child_gets_the_gpu_layers(requests, tmp_path, argv):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--gpu-layers", str(LAYERS), "--quiet"]
    result = CliRunner().invoke(app, argv)
    assert isinstance(result.exception, Stop), result.output
    (request,) = requests
    settings = getattr(request, "settings", request)  # the memory child carries its run settings
    assert settings.gpu_layers == LAYERS, request


def test_the_plan_key_and_the_run_option(tmp_path):
    from ggufcarve.pipeline.demo import demo_plan, write_demo_plan
    from ggufcarve.pipeline.plan import load_plan

    path = write_demo_plan(tmp_path / "demo")
    assert demo_plan(tmp_path / "demo").gpu_layers == 0
    text = path.read_text()
    path.write_text("gpu_layers = 5\n" + text)
    assert load_plan(path).gpu_layers == 5
    path.write_text("gpu_layers = -1\n" + text)
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code != 0 and "gpu_layers must be an integer >= 0" in str(result.exception)


def test_llama_bench_gets_ngl(monkeypatch, tmp_path):
    from ggufcarve.errors import ToolFailed
    from ggufcarve.evaluate.speed import SpeedSettings, bench_speed
    from ggufcarve.llama import launch

    seen = []

    def run(argv, **kwargs):
        seen.append([str(a) for a in argv])
        raise ToolFailed("stop", "")

    monkeypatch.setattr(launch, "run", run)
    with pytest.raises(ToolFailed):
        bench_speed(tmp_path / "llama-bench", DEMO, SpeedSettings(runs=1), threads=2, gpu_layers=LAYERS)
    argv = seen[0]
    assert argv[argv.index("-ngl") + 1] == str(LAYERS)


def test_load_model_sets_n_gpu_layers():
    from ggufcarve.llama.libllama import load_model

    loaded = []
    fake = types.SimpleNamespace(
        llama_backend_init=lambda: None,
        llama_model_default_params=lambda: types.SimpleNamespace(n_gpu_layers=-1, use_extra_bufts=True),
        llama_model_load_from_file=lambda path, params: loaded.append((path, params)) or "model",
    )
    assert load_model(fake, "m.gguf", LAYERS) == "model"
    ((path, params),) = loaded
    assert (path, params.n_gpu_layers, params.use_extra_bufts) == (b"m.gguf", LAYERS, False)
    load_model(fake, "m.gguf")
    assert loaded[-1][1].n_gpu_layers == 0


def test_a_cpu_llama_cpp_decodes_the_same_with_gpu_layers():
    """With no GPU backend the layers stay on the CPU: the trace is the one of --gpu-layers 0."""
    import numpy as np

    from ggufcarve.llama.trace import trace_routing

    tokens = list(range(1, 40))
    cpu = trace_routing(DEMO, tokens, threads=1)
    offloaded = trace_routing(DEMO, tokens, threads=1, gpu_layers=99)
    assert np.array_equal(cpu.logits, offloaded.logits)
