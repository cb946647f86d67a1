"""One `Compute` (--gpu-layers, --rpc, --tensor-split, --threads) reaches llama.cpp in every child
that loads a model.

The value is checked where ggufcarve hands it over: the request every child task receives,
llama-bench's argv and the llama_model_params the child sets; tests/test_devices.py runs the
children on RPC devices.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
from typer.testing import CliRunner

from ggufcarve.cli import app
from ggufcarve.demo import CALIBRATION, HELDOUT
from ggufcarve.demo import DEMO_MODEL as DEMO
from ggufcarve.errors import BadInput
from ggufcarve.llama.devices import AUTO, Compute

LAYERS = 7
DEVICES = [
    "--gpu-layers", str(LAYERS), "--rpc", "127.0.0.1:1,127.0.0.1:2", "--tensor-split", "3,1", "--threads", "3",
    "--n-cpu-moe", "2",
]  # fmt: skip
EXPECTED = Compute(LAYERS, ("127.0.0.1:1", "127.0.0.1:2"), (3.0, 1.0), 3, 2)


class Stop(Exception):
    pass


@pytest.fixture()
def requests(monkeypatch, tmp_path):
    """Every request handed to a child task; the first child ends the command. A listing of the RPC
    servers' devices (what a cache key holds of them, `Compute.key`) is answered: no device. The
    cache is empty: a table another test measured on the CPU would answer before any child starts."""
    from ggufcarve.llama import child
    from ggufcarve.llama.devices import rpc_device_key

    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))

    seen: list[object] = []

    def run(module, request, *args, **kwargs):
        if getattr(request, "TASK", None) == "devices":
            return {"devices": [], "offload": False}
        seen.append(request)
        raise Stop(module)

    monkeypatch.setattr(child, "run", run)
    rpc_device_key.cache_clear()
    yield seen
    rpc_device_key.cache_clear()


COMMANDS = [
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
]


def _command_id(argv: list[str]) -> str:
    return " ".join(argv[:2]) if argv[0] == "imatrix" else argv[0]


@pytest.mark.parametrize("argv", COMMANDS, ids=_command_id)
def test_every_child_gets_the_compute(requests, tmp_path, argv):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + [*DEVICES, "--quiet"]
    result = CliRunner().invoke(app, argv)
    assert isinstance(result.exception, Stop), result.output
    (request,) = requests
    if argv[0] == "best":  # its first child is the budget's dry load: the devices, not the scoring's layers
        assert request.settings.compute == Compute(rpc=EXPECTED.rpc), request
        return
    assert request.compute == EXPECTED, request


@pytest.mark.parametrize("argv", COMMANDS, ids=_command_id)
def test_the_default_placement_is_resolved_before_the_first_child(requests, tmp_path, argv):
    """Without --gpu-layers every command places the work itself (--gpu-layers auto): the first child
    gets a concrete placement, here 0 layers (this llama.cpp offloads to no device, no --rpc)."""
    from ggufcarve.llama.tools import libllama_backend

    assert libllama_backend() in ("cpu", "rpc")  # the machine this test describes: no GPU backend
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--threads", "1", "--quiet"]
    result = CliRunner().invoke(app, argv)
    assert isinstance(result.exception, Stop), result.output
    (request,) = requests
    compute = request.settings.compute if argv[0] == "best" else request.compute
    assert not compute.auto and compute.gpu_layers == 0, request


def _computes(value: object) -> list[Compute]:
    """Every `Compute` a request holds, however deep (dataclass fields, tuples, lists, dicts)."""
    if isinstance(value, Compute):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [c for f in dataclasses.fields(value) for c in _computes(getattr(value, f.name))]
    if isinstance(value, (tuple, list)):
        return [c for v in value for c in _computes(v)]
    if isinstance(value, dict):
        return [c for v in value.values() for c in _computes(v)]
    return []


def _on_the_cpu(value: object) -> object:
    """`value` with every `Compute` in it replaced by the CPU's (one thread): the devices of the
    command line are not there, the child runs for real on the CPU."""
    if isinstance(value, Compute):
        return Compute(0, threads=1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {f.name: _on_the_cpu(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changed)
    if type(value) is tuple:
        return tuple(_on_the_cpu(v) for v in value)
    if type(value) is list:
        return [_on_the_cpu(v) for v in value]
    if type(value) is dict:
        return {k: _on_the_cpu(v) for k, v in value.items()}
    return value


def _record_children(monkeypatch, tmp_path) -> list[object]:
    """The requests of every child the command starts, each run for real on the CPU (`_on_the_cpu`); a
    listing of the RPC servers' devices is answered: none. An empty cache: every measurement made, none
    read back."""
    from ggufcarve.llama import child
    from ggufcarve.llama.devices import rpc_device_key

    real_run, real_envelope = child.run, child._envelope
    seen: list[object] = []

    def run(module, request, *args, **kwargs):
        if getattr(request, "TASK", None) == "devices":
            return {"devices": [], "offload": False}
        return real_run(module, request, *args, **kwargs)

    def envelope(request, result):  # what every child is handed, by child.run and by a child.Session
        seen.append(request)
        return real_envelope(_on_the_cpu(request), result)

    monkeypatch.setattr(child, "run", run)
    monkeypatch.setattr(child, "_envelope", envelope)
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    rpc_device_key.cache_clear()
    return seen


FOLLOWED = [argv for argv in COMMANDS if argv[0] != "best"]  # best: its own test below (dry loads carry each
# placement's own)


@pytest.mark.slow
@pytest.mark.parametrize("argv", FOLLOWED, ids=_command_id)
def test_every_child_a_command_starts_gets_the_compute(monkeypatch, tmp_path, argv):
    """Each command runs to its end, every child it starts recorded: each one's request carries the
    command line's Compute (and no other), then runs for real on the CPU (the devices named are not
    there). At least two children for the commands that start several (tune: calibration,
    references, tournament)."""
    from ggufcarve.llama.devices import rpc_device_key

    seen = _record_children(monkeypatch, tmp_path)
    try:
        argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + [*DEVICES, "--quiet"]
        result = CliRunner().invoke(app, argv)
    finally:
        rpc_device_key.cache_clear()
    assert result.exit_code == 0, (result.output, result.exception)
    assert len(seen) >= (2 if argv[0] == "tune" else 1), seen
    for request in seen:
        computes = _computes(request)
        assert computes and all(c == EXPECTED for c in computes), (type(request).__name__, computes)


def test_fit_measures_on_the_devices_but_places_by_itself(requests):
    """fit's dry loads see the --rpc devices; where layers go is the placement's, not --gpu-layers
    (fit has none: scoring and budgets are two things)."""
    result = CliRunner().invoke(app, ["fit", str(DEMO), "--memory", "1GiB", "--ctx", "4096", "--rpc", "127.0.0.1:1"])
    assert isinstance(result.exception, Stop), result.output
    (request,) = requests
    assert request.settings.compute == Compute(rpc=("127.0.0.1:1",))
    refused = CliRunner().invoke(app, ["fit", str(DEMO), "--memory", "1GiB", "--gpu-layers", "9"])
    assert refused.exit_code != 0 and "--gpu-layers" in refused.output


def test_tools_get_the_same_placement():
    assert EXPECTED.tool_args() == [
        "-ngl", "7", "--rpc", "127.0.0.1:1,127.0.0.1:2", "-ts", "3,1", "-t", "3", "--n-cpu-moe", "2",
    ]  # fmt: skip
    assert EXPECTED.tool_args(bench=True)[5] == "3/1"  # llama-bench: one split's shares by "/"
    assert EXPECTED.tool_args(bench=True)[-2:] == ["-ncmoe", "2"]  # llama-bench's spelling
    assert Compute().tool_args() == ["-ngl", "0"]  # never llama.cpp's default -ngl auto (its --fit)


def test_the_plan_keys_and_the_run_options(tmp_path):
    from ggufcarve.pipeline.demo import demo_plan, write_demo_plan
    from ggufcarve.pipeline.plan import load_plan

    path = write_demo_plan(tmp_path / "demo")
    assert demo_plan(tmp_path / "demo").compute == Compute(AUTO)  # placed on the devices present
    text = path.read_text()
    path.write_text(
        'gpu_layers = 5\nrpc = ["127.0.0.1:50052"]\ntensor_split = [1, 2]\nthreads = 2\nn_cpu_moe = 3\n' + text
    )
    assert load_plan(path).compute == Compute(5, ("127.0.0.1:50052",), (1.0, 2.0), 2, 3)
    from ggufcarve.cli.run import _with_compute

    assert _with_compute(load_plan(path), None, 0, None, None).compute == Compute(
        0, ("127.0.0.1:50052",), (1.0, 2.0), 2, 3
    )
    assert _with_compute(load_plan(path), None, None, None, None, 0).compute.n_cpu_moe == 0
    path.write_text('rpc = "localhost"\n' + text)
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code != 0 and "rpc must be HOST:PORT" in str(result.exception)
    path.write_text("gpu_layers = -1\n" + text)
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code != 0 and "gpu_layers must be auto or an integer >= 0" in str(result.exception)
    path.write_text('gpu_layers = "auto"\n' + text)
    assert load_plan(path).compute == Compute(AUTO)


def test_llama_bench_gets_ngl(monkeypatch, tmp_path):
    from ggufcarve.errors import ToolFailed
    from ggufcarve.evaluate.speed import SpeedSettings, bench_speed
    from ggufcarve.llama import launch

    seen = []

    def run(argv, **kwargs):
        seen.append([str(a) for a in argv])
        raise ToolFailed("stop", "")

    from ggufcarve.llama import device_list, devices

    monkeypatch.setattr(launch, "run", run)
    # the tool's --list-devices (tests/test_devices.py runs it for real): one device seen
    monkeypatch.setattr(device_list, "tool_devices", lambda tool, rpc: [devices.Device("RPC0", rpc[0], "RPC", 1, 1)])
    with pytest.raises(ToolFailed):
        bench_speed(tmp_path / "llama-bench", DEMO, SpeedSettings(runs=1), EXPECTED)
    argv = seen[0]
    assert argv[argv.index("-ngl") + 1] == str(LAYERS)
    assert argv[argv.index("--rpc") + 1] == "127.0.0.1:1,127.0.0.1:2" and argv[argv.index("-ts") + 1] == "3/1"


def test_load_model_sets_the_placement():
    from ggufcarve.llama.libllama import load_model

    loaded = []
    fake = types.SimpleNamespace(
        llama_log_callback=lambda function: function,
        llama_log_set=lambda callback, user_data: None,
        llama_backend_init=lambda: None,
        llama_model_default_params=lambda: types.SimpleNamespace(n_gpu_layers=-1, use_extra_bufts=True),
        llama_model_load_from_file=lambda path, params: loaded.append((path, params)) or "model",
    )
    assert load_model(fake, "m.gguf") == "model"
    ((path, params),) = loaded
    assert (path, params.n_gpu_layers, params.use_extra_bufts) == (b"m.gguf", 0, False)


def test_an_rpc_server_that_does_not_answer_is_one_line():
    """ggml-rpc aborts the process on a server it cannot reach: the child refuses it first."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        from ggufcarve.llama.trace import trace_routing

        with pytest.raises(BadInput, match=f"--rpc 127.0.0.1:{port}: the RPC server does not answer"):
            trace_routing(DEMO, [1, 2, 3], compute=Compute(99, (f"127.0.0.1:{port}",)))


def test_llama_perplexitys_cross_check_gets_the_placement(monkeypatch, tmp_path):
    from ggufcarve.errors import ToolFailed
    from ggufcarve.evaluate.crosscheck import CrossCheck
    from ggufcarve.evaluate.protocol import EvalSettings
    from ggufcarve.llama import launch

    seen = []

    def run(argv, **kwargs):
        seen.append([str(a) for a in argv])
        raise ToolFailed("stop", "")

    monkeypatch.setattr(launch, "run", run)
    check = CrossCheck(tmp_path / "llama-perplexity", EvalSettings(compute=EXPECTED), None, None, tmp_path)
    with pytest.raises(ToolFailed):
        check._run(["-m", "x.gguf"], "a test")
    argv = seen[0]
    assert argv[argv.index("-ngl") + 1] == "7" and argv[argv.index("--rpc") + 1] == "127.0.0.1:1,127.0.0.1:2"
    assert argv[argv.index("-t") + 1] == "3" and argv[argv.index("-ts") + 1] == "3,1"


@pytest.mark.parametrize(
    "argv, margin",
    [([], 2**30), (["--gpu-margin", "0"], 0), (["--gpu-margin=512MiB"], 512 * 2**20), (["--gpu-margin", "x"], 2**30)],
)
def test_the_out_of_memory_answer_keeps_the_commands_gpu_margin(argv, margin, monkeypatch):
    """The command line's --gpu-margin reaches the advice's placement search (a value it cannot read:
    llama.cpp's --fit margin), with a progress sink."""
    from ggufcarve import cli
    from ggufcarve.errors import DeviceOutOfMemory
    from ggufcarve.placement import advice

    seen = []
    monkeypatch.setattr(advice, "fitting_answer", lambda error, margin, on_event: seen.append(margin) or error)
    error = DeviceOutOfMemory("out of memory", "hint", model="m.gguf", compute=Compute(), n_ctx=512)
    assert cli._answered(error, ["m.gguf", *argv, "-q"]) is error and seen == [margin]


@pytest.mark.slow
def test_every_child_best_starts_gets_the_compute_or_its_placement(monkeypatch, tmp_path):
    """best runs to its answer, every child it starts recorded: each scoring child (calibration, references,
    tournament, confirmation) carries the command line's Compute; each dry load (memory) carries only the
    --rpc servers, its placement being the candidate's own. All of them run for real on the CPU. llama-bench,
    which would time the finalists on the devices named (not there), is answered: not measured."""
    from ggufcarve.errors import BadInput
    from ggufcarve.evaluate import speed
    from ggufcarve.llama.devices import rpc_device_key

    def no_bench(*args, **kwargs):
        raise BadInput("llama-bench sees none of the devices named", "a test")

    seen = _record_children(monkeypatch, tmp_path)
    monkeypatch.setattr(speed, "bench_speed", no_bench)
    from ggufcarve.pipeline.demo import FILES

    argv = [
        "best", str(DEMO), "--memory", "11MiB", "--ctx", "256", "--ladder", str(FILES / "ladder.toml"), "--heldout",
        str(HELDOUT), "--calibration", str(CALIBRATION), "--chunk-ctx", "128", "--chunks", "4", "--max-tokens", "1024",
        "--methods", "weights", "--keep", "12", "--tier", "ram", "-o", str(tmp_path / "best"), *DEVICES, "-q",
    ]  # fmt: skip
    try:
        result = CliRunner().invoke(app, argv)
    finally:
        rpc_device_key.cache_clear()
    assert result.exit_code == 0, (result.output, result.exception)
    tasks = [getattr(r, "TASK", type(r).__name__) for r in seen]
    assert {"memory", "decode", "evaluate", "measure"} <= set(tasks), tasks  # dry loads, calibration, references,
    # the tournament and the confirmation
    for request in seen:
        computes = _computes(request)
        if getattr(request, "TASK", None) == "memory":
            assert computes and all(c.rpc == EXPECTED.rpc for c in computes), computes
        else:
            assert computes and all(c == EXPECTED for c in computes), (type(request).__name__, computes)
