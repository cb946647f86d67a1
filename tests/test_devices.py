"""Every child on a device: llama.cpp's RPC devices (two ggml-rpc-server processes, conftest's
`rpc_servers`) stand in for GPUs. Their buffers are not host memory, so offloaded layers, the
routing mask and the trace (read and written through ggml_backend_tensor_get/set), and a split over
two devices run for real on the CPU.

Oracles: the CPU run of the same code (a device's kernels may round differently: relative 1e-4),
llama-bench's own --list-devices, and llama-perplexity run on the pruned file with the same
`--rpc -ngl 99`.
"""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT
from ggufcarve.llama.devices import Compute
from tests.clirun import ggufcarve
from tests.fit_params import fit_params

pytestmark = pytest.mark.slow
RELATIVE = 1e-4  # how far a device's figures may be from the CPU's
KEEP = {b: tuple(range(0, 16, 2)) for b in range(4)}  # 8 of the demo's 16 experts in every block


def _child_env() -> dict[str, str]:
    from ggufcarve.llama.launch import child_env

    return child_env()


def test_devices_lists_the_rpc_devices_as_the_tools_see_them(rpc_servers, llama_tools):
    result = ggufcarve("devices", "--rpc", ",".join(rpc_servers), "--json")
    assert result.code == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)
    listed = {d["name"]: d for d in doc["libllama"]["devices"]}
    assert {"RPC0", "RPC1"} <= set(listed) and listed["RPC0"]["type"] == listed["RPC1"]["type"] == "RPC"
    assert [listed[f"RPC{i}"]["description"] for i in range(2)] == list(rpc_servers)
    bench = subprocess.run(
        [str(llama_tools / "llama-bench"), "--rpc", ",".join(rpc_servers), "--list-devices"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_child_env(),
    )
    theirs = {
        m["name"]: int(m["total"])
        for m in re.finditer(r"^\s+(?P<name>RPC\d+): \S+ \((?P<total>\d+) MiB", bench.stdout, re.M)
    }
    assert theirs.keys() == {"RPC0", "RPC1"}, bench.stdout
    for name, mib in theirs.items():
        assert listed[name]["total"] // 2**20 == mib
    assert doc["tools"]["backend"] == "rpc" and {d["name"] for d in doc["tools"]["devices"]} == set(theirs)
    assert doc["host"]["name"] == "host" and doc["host"]["total"] > 0


@pytest.mark.parametrize(
    "split, n_cpu_moe",
    [(False, 0), (True, 0), (False, 2)],
    ids=["one device", "two devices", "experts of 2 on the CPU"],
)
def test_decode_and_trace_on_rpc_equal_the_cpu(rpc_servers, split, n_cpu_moe):
    from ggufcarve.llama.trace import trace_routing

    tokens = list(range(3, 300))
    nodes = ("ffn_moe_topk", "ffn_moe_probs", "ffn_moe_logits")
    cpu = trace_routing(DEMO_MODEL, tokens, nodes=nodes, context=128, compute=Compute(threads=2))
    placed = Compute(99, rpc_servers if split else rpc_servers[:1], (1, 1) if split else (), 2, n_cpu_moe)
    lines: list[str] = []
    device = trace_routing(
        DEMO_MODEL, tokens, nodes=nodes, context=128, compute=placed, verbose=True, on_line=lines.append
    )
    assigned = {m[1] for line in lines for m in [re.search(r"layer +\d+ assigned to device (\w+)", line)] if m}
    assert assigned == ({"RPC0", "RPC1"} if split else {"RPC0"}), assigned
    # llama.cpp's loader names every tensor a buffer type override moved (--n-cpu-moe's, per block)
    moved = {m[1] for line in lines for m in [re.search(r"tensor (\S+) \(.*buffer type overridden to CPU", line)] if m}
    expected = {f"blk.{b}.ffn_{w}_exps.weight" for b in range(n_cpu_moe) for w in ("gate", "up", "down")}
    assert moved == expected, moved
    np.testing.assert_allclose(device.logits, cpu.logits, rtol=RELATIVE, atol=RELATIVE)
    for node in nodes:
        for block, values in cpu.nodes[node].items():
            if node == "ffn_moe_topk":
                assert np.array_equal(device.nodes[node][block], values), (node, block)
            else:
                np.testing.assert_allclose(device.nodes[node][block], values, rtol=RELATIVE, atol=RELATIVE)


def test_calibration_statistics_on_rpc_equal_the_cpu(rpc_servers):
    """Every trace statistic of the one calibration pass (frequency, REAP, EAN, ... and the imatrix)."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout
    from ggufcarve.select.calibrate import calibrate_all

    model = read_model(DEMO_MODEL)
    layout = inspect_layout(model)
    runs = {}
    for where, compute in (("cpu", Compute(threads=2)), ("rpc", Compute(99, rpc_servers[:1], threads=2))):
        runs[where] = calibrate_all(model, layout, "reap", [CALIBRATION], ctx=128, max_tokens=1024, compute=compute)
    assert runs["cpu"].keys() == runs["rpc"].keys() and len(runs["cpu"]) > 1
    for method, scores in runs["cpu"].items():
        other = runs["rpc"][method]
        assert scores.blocks.keys() == other.blocks.keys()
        for block, stats in scores.blocks.items():
            for name, values in stats.arrays().items():
                np.testing.assert_allclose(
                    other.blocks[block].arrays()[name], values, rtol=RELATIVE, atol=1e-9, err_msg=f"{method} {name}"
                )


def test_masked_kld_on_rpc_equals_the_cpu_and_llama_perplexity_on_the_pruned_file(rpc_servers, llama_tools, tmp_path):
    from ggufcarve.evaluate import kld
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, prepare_segments

    means = {}
    for where, compute in (("cpu", Compute(threads=2)), ("rpc", Compute(99, rpc_servers[:1], threads=2))):
        work = tmp_path / where
        work.mkdir()
        segments = prepare_segments(
            DEMO_MODEL, [HELDOUT], chunk_ctx=256, chunks=4, compute=compute, work=work, cache_dir=work / "cache"
        )
        table = measure([Candidate("masked", DEMO_MODEL, keep=KEEP)], segments, MeasureSettings(compute), work).table(
            "masked"
        )
        means[where] = kld.kld_statistics(table).kld_mean
    assert means["rpc"] == pytest.approx(means["cpu"], rel=RELATIVE)

    pruned = tmp_path / "demo-8e.gguf"
    result = ggufcarve("prune", DEMO_MODEL, "--keep-ids", "0,2,4,6,8,10,12,14", "-o", pruned, "-q")
    assert result.code == 0, result.stderr[-2000:]
    device = ["--rpc", rpc_servers[0], "-ngl", "99", "-t", "2", "-c", "256", "--chunks", "4"]
    base = tmp_path / "demo.kld"
    made = subprocess.run(
        [str(llama_tools / "llama-perplexity"), "-m", str(DEMO_MODEL), "-f", str(HELDOUT), *device]
        + ["--kl-divergence-base", str(base)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_child_env(),
    )
    assert made.returncode == 0 and base.exists(), made.stderr[-2000:]
    for _attempt in range(6):  # its log thread can drop the closing lines at exit
        run = subprocess.run(
            [str(llama_tools / "llama-perplexity"), "-m", str(pruned), *device]
            + ["--kl-divergence-base", str(base), "--kl-divergence", "-lv", "4"],
            capture_output=True,
            text=True,
            timeout=600,
            env=_child_env(),
        )
        assert run.returncode == 0, run.stderr[-2000:]
        found = re.search(r"^Mean    KLD:\s*(-?[\d.]+)", run.stdout + run.stderr, re.M)
        if found:
            break
    assert found, (run.stdout + run.stderr)[-2000:]
    log = run.stdout + run.stderr
    assert "using device RPC0" in log and re.search(r"offloaded (\d+)/\1 layers to GPU", log), log[-2000:]
    # printed to 6 decimals; masked and pruned routing agree to 1.2e-5 relative (llama.masking)
    assert means["rpc"] == pytest.approx(float(found[1]), rel=RELATIVE, abs=2e-6)


def test_speed_under_an_offloading_placement_needs_a_device(rpc_servers, llama_tools, tmp_path):
    """A speed timed by a tool or a libllama that sees no device while layers are offloaded would be the
    CPU's under a GPU's name: refused. With the RPC device present llama-bench times it."""
    from ggufcarve.errors import BadInput
    from ggufcarve.evaluate.speed import SpeedSettings, bench_speed

    settings = SpeedSettings(runs=1, pp_tokens=32, tg_tokens=4)
    with pytest.raises(BadInput, match="sees no GPU or RPC device"):
        bench_speed(llama_tools / "llama-bench", DEMO_MODEL, settings, Compute(99, threads=2))
    timed = bench_speed(llama_tools / "llama-bench", DEMO_MODEL, settings, Compute(99, rpc_servers[:1], threads=2))
    assert timed.pp_tok_s > 0 and timed.tg_tok_s > 0 and timed.engine == "llama-bench"
    result = ggufcarve(
        "eval", DEMO_MODEL, "--reference", DEMO_MODEL, "--heldout", HELDOUT, "--ctx", 128, "--chunks", 1,
        "--speed-engine", "libllama", "--speed-runs", 1, "--gpu-layers", 99, "--cache", tmp_path / "cache",
        "-o", tmp_path / "eval",
    )  # fmt: skip
    assert result.code != 0 and "has no GPU or RPC device" in result.stderr and "Traceback" not in result.stderr
    placed = ggufcarve(
        "eval", DEMO_MODEL, "--reference", DEMO_MODEL, "--heldout", HELDOUT, "--ctx", 128, "--chunks", 1,
        "--speed-runs", 1, "--gpu-layers", 99, "--rpc", rpc_servers[0], "-t", 2, "--cache", tmp_path / "cache",
        "--llama-cpp", llama_tools, "-o", tmp_path / "on-rpc",
    )  # fmt: skip
    assert placed.code == 0, placed.stderr[-2000:]
    doc = json.loads(next((tmp_path / "on-rpc").glob("*.json")).read_text())
    assert doc["tg_tok_s"] > 0 and doc["speed"]["engine"] == "llama-bench"
    placement = doc["speed_placement"]
    assert {k: placement[k] for k in ("backend", "gpu_layers", "threads")} == {
        "backend": "rpc",
        "gpu_layers": 99,
        "threads": 2,
    }
    (device,) = placement["rpc_devices"]  # the server's device as it describes itself, not its address
    assert device == {"name": "RPC0", "description": "", "backend": "RPC", "total": device["total"]}
    assert device["total"] > 0 and rpc_servers[0] not in json.dumps(doc)
    from ggufcarve.fileio import format_size
    from ggufcarve.release.card_tables import placement_words

    words = f"-ngl 99 on RPC0 ({format_size(device['total'])} over RPC), 2 CPU threads"
    assert placement_words(placement) == words


def test_an_rpc_server_that_goes_away_is_one_line_naming_it_and_the_stage(tmp_path):
    """A server that accepts the connection and closes it at once: ggml-rpc aborts the child
    ("RPC handshake failed for HOST:PORT"); the error names the server and the stage, in one line."""
    import socket
    import threading

    from ggufcarve.errors import ToolFailed
    from ggufcarve.llama.trace import trace_routing

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        with pytest.raises(ToolFailed) as failed:
            trace_routing(DEMO_MODEL, list(range(3, 40)), compute=Compute(99, (endpoint,)))
    finally:
        listener.close()
    message = str(failed.value)
    assert message.startswith(f"tracing {DEMO_MODEL.name}: the decode child: the RPC server {endpoint} went away")
    assert "\n" not in message
    assert "kept" in failed.value.hint


LAYERS = 5  # the demo's 4 blocks and its output layer, as llama.cpp's loader counts them


def _on(computed_on: dict, device: str) -> None:
    """Every child of every stage put all its layers on `device` (llama.cpp's own loader lines); a
    memory measurement's dry loads keep their own stage and are not a computation."""
    from ggufcarve.llama.computed import DRY_LOAD

    for stage, seen in computed_on.items():
        if stage != DRY_LOAD:
            assert seen and all(s["layers"] == {device: LAYERS} for s in seen), (stage, seen)


def test_best_on_an_rpc_gpu_answers_with_a_placement_measured_memory_and_speed(
    rpc_servers, llama_tools, tmp_path, monkeypatch
):
    """best --gpu-memory --rpc on the demo model, without --gpu-layers: every stage computes on the RPC
    device (llama.cpp's loader lines of each child), the winner's memory per device is llama.cpp's dry
    load of the built file there (nothing estimated), its decode speed is llama-bench's in that very
    placement with the run line's cache and flash attention at half the context, and its llama-server
    line, pasted as it is into llama-fit-params, fits the budget. With --gpu-layers 0 the scoring
    computes on the CPU, the answer's timing still on the device it will run on. Its own cache: every
    stage decodes rather than take an earlier run's tables."""
    from ggufcarve.demo import CALIBRATION

    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "best"
    common = [
        "best", DEMO_MODEL, "--memory", "64GiB", "--gpu-memory", "2GiB", "--heldout", HELDOUT,
        "--calibration", CALIBRATION, "--ctx", 4096, "--kv-type", "q8_0", "--chunks", 4, "--methods", "reap,frequency",
        "--rpc", rpc_servers[0], "--llama-cpp", llama_tools, "-t", 2, "-q",
    ]  # fmt: skip
    result = ggufcarve(*common, "-o", out)
    assert result.code == 0, result.stderr[-2000:]
    doc = json.loads((out / "best.json").read_text())
    assert {"calibration", "tournament", "confirmation", "speed"} <= set(doc["computed_on"]), doc["computed_on"]
    _on(doc["computed_on"], "RPC0")
    cost = (out / "best.md").read_text().split("## Cost", 1)[1]
    assert "| calibration |" in cost and re.search(r"\| calibration \|.*\| RPC0 5/5 layers", cost), cost
    assert doc["scoring_placement"]["gpu_layers"] == 999 and doc["scoring_placement"]["rpc_servers"] == 1
    winner = doc["winner"]
    assert winner["tier"] == "gpu" and winner["fits"]
    assert winner["placement"] == {
        "gpu_layers": 999, "n_cpu_moe": 0, "override_tensor": None, "tensor_split": [], "blocks_on_cpu": 0,
    }  # fmt: skip
    devices = {m["device"]: m for m in winner["memory"]}
    assert set(devices) == {"RPC0", "host"} and not any(m.get("estimated") for m in devices.values()), devices
    assert winner["decode_tok_s"] > 0 and winner["prompt_tok_s"] > 0
    timed = [c for c in doc["candidates"] if c.get("decode_tok_s") is not None]
    assert timed and all(c["speed_placement"] == c["placement"] for c in timed)
    assert winner["speed_method"] == {
        "tool": "llama-bench", "tests": ["pp512", "tg128"], "repetitions": 5,
        "statistic": "mean of the repetitions' tok/s (llama-bench's avg_ts)", "depth": 2048,
    }  # fmt: skip
    assert winner["speed_computed_on"] == {"RPC0": LAYERS}
    argv = winner["run_command"]["argv"]
    assert argv[argv.index("--rpc") + 1] == rpc_servers[0] and argv[argv.index("-dev") + 1] == "RPC0"
    assert argv[argv.index("-ngl") + 1] == "999" and argv[argv.index("-fa") + 1] == "on"
    assert argv[argv.index("-ctk") + 1] == argv[argv.index("-ctv") + 1] == "q8_0"
    model = out / winner["path"]
    theirs = fit_params(llama_tools / "llama-fit-params", model, argv[3:])
    assert "RPC0" in theirs, theirs
    used = sum(theirs["RPC0"]) * 2**20
    assert (
        used + 2**30 <= 2 * 2**30 and abs(used - (devices["RPC0"]["total"] - devices["RPC0"]["output"])) <= 16 * 2**20
    )

    on_cpu = tmp_path / "on-cpu"
    result = ggufcarve(*common, "--gpu-layers", 0, "-o", on_cpu)
    assert result.code == 0, result.stderr[-2000:]
    cpu_doc = json.loads((on_cpu / "best.json").read_text())
    scoring = {k: v for k, v in cpu_doc["computed_on"].items() if k != "speed"}
    _on(scoring, "CPU")
    _on({"speed": cpu_doc["computed_on"]["speed"]}, "RPC0")  # the answer is timed where it will run
    rpc_kld = {c["id"]: c["kld_mean"] for c in doc["candidates"] if c["kld_mean"] is not None}
    cpu_kld = {c["id"]: c["kld_mean"] for c in cpu_doc["candidates"] if c["kld_mean"] is not None}
    assert rpc_kld.keys() == cpu_kld.keys() and rpc_kld
    for cid, value in rpc_kld.items():
        assert value == pytest.approx(cpu_kld[cid], rel=RELATIVE), cid


def test_tune_without_gpu_layers_computes_every_stage_on_the_rpc_device(rpc_servers, tmp_path, monkeypatch):
    """tune --rpc --search without --gpu-layers: the calibration pass, the references, the tournament and
    the search from its winner compute on RPC0 (each child's own loader lines); --gpu-layers 0 on the
    CPU; the masked KLDs agree. Its own cache: every stage decodes."""
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    common = [
        "tune", DEMO_MODEL, "--methods", "reap,frequency", "--keep", 8, "--calibration", CALIBRATION,
        "--heldout", HELDOUT, "--ctx", 128, "--chunks", 4, "--max-tokens", 1024, "--rpc", rpc_servers[0], "-t", 2,
        "--search", "--search-passes", 1, "-q",
    ]  # fmt: skip
    docs = {}
    for where, flags in (("RPC0", []), ("CPU", ["--gpu-layers", 0])):
        result = ggufcarve(*common, *flags, "-o", tmp_path / where)
        assert result.code == 0, result.stderr[-2000:]
        docs[where] = json.loads((tmp_path / where / "tune.json").read_text())
        assert {"calibration", "references", "tournament", "search"} <= set(docs[where]["computed_on"])
        _on(docs[where]["computed_on"], where)
    kld = {w: {c["id"]: c["kld_mean"] for c in d["candidates"]} for w, d in docs.items()}
    assert kld["RPC0"].keys() == kld["CPU"].keys()
    for cid, value in kld["RPC0"].items():
        assert value == pytest.approx(kld["CPU"][cid], rel=RELATIVE), cid


def test_one_budget_on_two_devices_uses_the_budgeted_device_alone(rpc_servers):
    """fit --gpu-memory 2GiB --rpc A,B: every row's bytes on RPC0 and the host, none on RPC1, and the run
    line names -dev RPC0; RPC1=2GiB puts them on RPC1 alone. A device named that is not here is one line."""
    for budget, device in (("2GiB", "RPC0"), ("RPC1=2GiB", "RPC1")):
        result = ggufcarve(
            "fit", DEMO_MODEL, "--memory", "64GiB", "--gpu-memory", budget, "--ctx", 512, "--k", 16,
            "--rpc", ",".join(rpc_servers), "--json",
        )  # fmt: skip
        assert result.code == 0, result.stderr[-2000:]
        rows = json.loads(result.stdout)["rows"]
        assert rows
        for row in rows:
            held = {m["device"] for m in row["memory"] if m["total"] > 0}
            assert held <= {device, "host"} and device in held, (budget, row["memory"])
            assert row["server"][row["server"].index("-dev") + 1] == device
    refused = ggufcarve("fit", DEMO_MODEL, "--memory", "64GiB", "--gpu-memory", "RPC7=2GiB", "--rpc", rpc_servers[0])
    assert refused.code == 1 and "RPC7" in refused.error_line and "not a device here" in refused.error_line


def test_best_on_two_rpc_gpus_places_the_answer_over_both_by_their_budgets(rpc_servers, llama_tools, tmp_path):
    """best --gpu-memory A,B --rpc S0,S1 on the demo model: the winner is split over both devices by
    the budgets (-ts), its memory rows are llama.cpp's dry load of the built file on them, its speed is
    measured in that split, and its llama-server flags, loaded by llama-fit-params on the same two
    devices, keep each one within its budget (and agree with its rows within 16 MiB)."""
    out = tmp_path / "best"
    budgets = (2 * 2**30, 3 * 2**30)
    result = ggufcarve(
        "best", DEMO_MODEL, "--memory", "64GiB", "--gpu-memory", "2GiB,3GiB", "--heldout", HELDOUT,
        "--calibration", CALIBRATION, "--ctx", 4096, "--chunks", 2, "--methods", "frequency",
        "--rpc", ",".join(rpc_servers), "-t", 2, "-o", out, "-q",
    )  # fmt: skip
    assert result.code == 0, result.stderr[-2000:]
    doc = json.loads((out / "best.json").read_text())
    assert doc["parameters"]["gpu_memory_bytes"] == list(budgets)
    winner = doc["winner"]
    assert winner["tier"] == "gpu" and winner["fits"]
    assert winner["placement"] == {
        "gpu_layers": 999, "n_cpu_moe": 0, "override_tensor": None, "tensor_split": [2, 3], "blocks_on_cpu": 0,
    }  # fmt: skip
    devices = {m["device"]: m for m in winner["memory"]}
    assert set(devices) == {"RPC0", "RPC1", "host"} and not any(m.get("estimated") for m in devices.values()), devices
    assert all(devices[d]["weights"] > 0 for d in ("RPC0", "RPC1"))
    assert winner["speed_placement"] == winner["placement"] and winner["decode_tok_s"] > 0
    assert winner["speed_computed_on"].keys() == {"RPC0", "RPC1"}
    argv = winner["run_command"]["argv"]
    assert argv[argv.index("-ts") + 1] == "2,3" and argv[argv.index("-ngl") + 1] == "999"
    assert argv[argv.index("-dev") + 1] == "RPC0,RPC1" and argv[argv.index("--rpc") + 1] == ",".join(rpc_servers)
    theirs = fit_params(llama_tools / "llama-fit-params", out / winner["path"], argv[3:])
    for device, budget in zip(("RPC0", "RPC1"), budgets):
        used = sum(theirs[device]) * 2**20
        assert used + 2**30 <= budget, (device, theirs)
        assert abs(used - (devices[device]["total"] - devices[device]["output"])) <= 16 * 2**20, (
            device,
            theirs,
            devices,
        )


def test_out_of_memory_at_load_is_answered_with_the_placement_that_fits(small_rpc_server, llama_tools, tmp_path):
    """A 35 GiB model (the Qwen3.6-35B-A3B replica) loaded whole on a 6 GiB device (tests/conftest.py's
    small_rpc_server: it reports 6 GiB and cannot allocate more): one line naming the stage and the
    device, answered with --gpu-layers 999 --n-cpu-moe N. Oracles: llama-fit-params with that
    placement keeps the device within its memory and llama.cpp's margin, and llama-bench loads it
    there and decodes, while a placement with fewer experts in system memory fails to load."""
    from tests import factory
    from tests.conftest import SMALL_DEVICE_BYTES

    replica = factory.write_qwen35moe_replica(tmp_path / "qwen35moe-replica-Q8_0.gguf")
    result = ggufcarve(
        "imatrix", "collect", replica, "--calibration", CALIBRATION, "--ctx", 64, "--chunks", 1,
        "--gpu-layers", 99, "--rpc", small_rpc_server, "-o", tmp_path / "replica.imatrix.gguf",
    )  # fmt: skip
    assert result.code != 0 and not (tmp_path / "replica.imatrix.gguf").exists()
    line = result.stderr.strip()
    assert "\n" not in line, line
    assert line.startswith("error: collecting the imatrix of qwen35moe-replica-Q8_0.gguf: the decode child: "), line
    assert "a device ran out of memory (failed to allocate RPC0" in line, line
    advised = re.search(r"it fits with --gpu-layers 999 --n-cpu-moe (\d+) \(RPC0 ", line)
    assert advised, line
    n = int(advised[1])
    assert 0 < n < 40
    theirs = fit_params(
        llama_tools / "llama-fit-params",
        replica,
        ["--rpc", small_rpc_server, "-ngl", "all", "--n-cpu-moe", str(n), "-c", "64"],
    )
    assert sum(theirs["RPC0"]) * 2**20 + 2**30 <= SMALL_DEVICE_BYTES, theirs

    def bench(n_cpu_moe: int) -> subprocess.CompletedProcess:
        argv = [str(llama_tools / "llama-bench"), "-m", str(replica), "--rpc", small_rpc_server, "-ngl", "999"]
        argv += ["-ncmoe", str(n_cpu_moe), "-p", "0", "-n", "1", "-r", "1", "-t", "2", "-o", "json"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_child_env())

    loaded = bench(n)
    assert loaded.returncode == 0 and json.loads(loaded.stdout)[0]["avg_ts"] > 0, loaded.stderr[-2000:]
    assert bench(n - 8).returncode != 0  # the device's limit is real: 8 more expert blocks do not fit


def test_a_tournament_on_an_rpc_device_holds_one_child_at_a_time(rpc_servers, tmp_path):
    """Two files on an RPC device, candidates on both in two rounds: ggml-rpc-server serves one client at
    a time, so one child is held at once (each file loaded again in the second round; two held open
    would wait on each other for ever), and the tables equal the CPU's (relative 1e-4)."""
    import shutil
    from pathlib import Path

    from ggufcarve.llama.devices import Device
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, loaded_budget, measure, prepare_segments

    other = tmp_path / "copy-of-the-demo.gguf"
    shutil.copyfile(DEMO_MODEL, other)
    placed = Compute(99, rpc_servers[:1], threads=2)
    assert loaded_budget(placed) == 0
    gpu = Device("CUDA0", "a 24 GiB card", "GPU", 23 * 2**30, 24 * 2**30, "CUDA")
    assert loaded_budget(Compute(99), [gpu, Device("CPU", "cpu", "CPU", 1, 1, "CPU")]) == 22 * 2**30
    segments = prepare_segments(DEMO_MODEL, [HELDOUT], chunk_ctx=1024, chunks=6, compute=placed, work=tmp_path)
    candidates = [
        Candidate("keep-15", DEMO_MODEL, keep={b: tuple(range(15)) for b in range(4)}),
        Candidate("keep-4", DEMO_MODEL, keep={b: tuple(range(4)) for b in range(4)}),
        Candidate("keep-12", Path(other), keep={b: tuple(range(12)) for b in range(4)}),
        Candidate("keep-8", Path(other), keep={b: tuple(range(8)) for b in range(4)}),
    ]
    settings = MeasureSettings(placed, never_leave=("keep-15", "keep-12"))  # one on each file in every round
    got = measure(candidates, segments, settings, tmp_path)
    rounds = got.groups[""]["rounds"]
    assert len(rounds) == 2
    assert min(len(got.tables["keep-15"]), len(got.tables["keep-12"])) > rounds[0]["units"]  # both files in round 2
    assert got.loads == {DEMO_MODEL.name: 2, other.name: 2}
    (tmp_path / "cpu").mkdir()
    cpu = measure(candidates[:1], segments, MeasureSettings(Compute(threads=2)), tmp_path / "cpu")
    n = len(got.tables["keep-15"])
    np.testing.assert_allclose(got.table("keep-15"), cpu.table("keep-15", n), rtol=RELATIVE, atol=1e-9)


def test_best_times_both_variants_of_a_winner_with_experts_in_system_memory(rpc_servers, llama_tools, tmp_path):
    """best --gpu-memory 1045MiB --rpc on the demo model at ctx 512: the built winner runs with the experts of
    some blocks in system memory; llama-bench times it as --n-cpu-moe N and as the last N blocks' -ot on the
    RPC device, the one recorded is the faster beyond noise (else --n-cpu-moe's), and its llama-server line,
    loaded by llama-fit-params on the same device, fits the budget with llama.cpp's margin."""
    out = tmp_path / "best"
    ladder = tmp_path / "q8.toml"  # one rung: every candidate is a Q8_0 that needs experts in system memory
    ladder.write_text('name = "q8"\n\n[defaults]\nfile_pattern = "{model}-{quant}.gguf"\n\n[[rungs]]\nftype = "Q8_0"\n')
    result = ggufcarve(
        "best", DEMO_MODEL, "--memory", "64GiB", "--gpu-memory", "1045MiB", "--ctx", 512, "--heldout", HELDOUT,
        "--calibration", CALIBRATION, "--chunks", 2, "--methods", "frequency", "--keep", 14, "--ladder", ladder,
        "--tier", "gpu+cpu",
        "--gpu-layers", 99, "--rpc", rpc_servers[0], "-t", 2, "-o", out, "-q",
    )  # fmt: skip
    assert result.code == 0, result.stderr[-2000:]
    winner = json.loads((out / "best.json").read_text())["winner"]
    assert winner["tier"] == "gpu+cpu" and winner["fits"], winner
    timed = {p["label"]: p for p in winner["speed_placements"]}
    assert len(timed) == 2 and all(p["decode_tok_s"] > 0 for p in timed.values())
    last = next(label for label in timed if label.startswith("last"))
    chosen = last if winner.get("placement_chosen_by") else next(label for label in timed if label != last)
    assert winner["decode_tok_s"] == timed[chosen]["decode_tok_s"]
    argv = winner["run_command"]["argv"]
    assert ("-ot" in argv) == (chosen == last) and ("--n-cpu-moe" in argv) == (chosen != last)
    assert winner["speed_placement"] == winner["placement"]
    theirs = fit_params(llama_tools / "llama-fit-params", out / winner["path"], argv[3:])
    assert sum(theirs["RPC0"]) * 2**20 + 2**30 <= 1045 * 2**20, theirs


def test_eval_with_qa_and_cross_check_computes_on_the_rpc_device(rpc_servers, llama_tools, tmp_path, monkeypatch):
    """eval --rpc without --gpu-layers: the evaluation (held-out text and the QA prompts) and
    llama-perplexity's cross-check compute on RPC0 by their own loader lines; --gpu-layers 0 on the
    CPU; the KLD and the perplexity agree."""
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    suite = tmp_path / "qa.jsonl"
    check = {
        "id": "a",
        "messages": [{"role": "user", "content": "def"}],
        "validator": {"type": "regex", "pattern": "."},
    }
    suite.write_text(json.dumps(check) + "\n")
    pruned = tmp_path / "pruned.gguf"
    made = ggufcarve("prune", DEMO_MODEL, "--keep-ids", "0,2,4,6,8,10,12,14", "-o", pruned, "-q")
    assert made.code == 0, made.stderr[-2000:]
    docs = {}
    for where, flags in (("RPC0", []), ("CPU", ["--gpu-layers", 0])):
        result = ggufcarve(
            "eval", pruned, "--reference", DEMO_MODEL, "--heldout", HELDOUT, "--ctx", 128, "--chunks", 2,
            "--qa", suite, "--cross-check", "--speed-runs", 0, "--llama-cpp", llama_tools, "--rpc", rpc_servers[0],
            "-t", 2, *flags, "-o", tmp_path / where, "-q",
        )  # fmt: skip
        assert result.code == 0, result.stderr[-2000:]
        docs[where] = json.loads((tmp_path / where / "pruned.json").read_text())
        computed = docs[where]["computed_on"]
        assert "evaluation" in computed and len(computed) >= 2, computed  # the cross-check's own stage too
        _on(computed, where)
    assert docs["RPC0"]["kld_mean"] == pytest.approx(docs["CPU"]["kld_mean"], rel=RELATIVE)
    assert docs["RPC0"]["ppl"] == pytest.approx(docs["CPU"]["ppl"], rel=RELATIVE)
