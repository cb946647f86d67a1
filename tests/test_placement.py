"""Memory per device of a placement, judged by llama-fit-params on the same RPC devices.

A placement (placement.search.Placement: every layer offloaded, the experts of N blocks in system
memory, a split over the devices) is loaded by llama.cpp's dry load on two ggml-rpc-server devices
(conftest's `rpc_servers`); each device's weights, cache and compute buffers must equal what
llama-fit-params --fit-print on prints for the same flags on the same devices, within
max(1%, 16 MiB) (it prints whole MiB). The estimate for devices that are not present (llama.cpp's
layer split rule, no load) must give the measured weights and cache. On the demo model and on the
256-expert Qwen3.6-35B-A3B replica (a sparse header of 35 GiB; a dry load reads no tensor data).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from ggufcarve.demo import DEMO_MODEL
from ggufcarve.gguf.container import read_model
from ggufcarve.llama.memory import HOST, MemorySettings, dry_load
from ggufcarve.placement.memory import device_memory
from ggufcarve.placement.offload import weight_placement
from ggufcarve.placement.run_line import placement_args
from ggufcarve.placement.search import Placement, estimate, measured_rows, pipelined
from tests import factory
from tests.clirun import ggufcarve
from tests.fit_params import fit_params

pytestmark = pytest.mark.slow
MIB = 2**20
CTX = 4096


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return factory.write_qwen35moe_replica(tmp_path_factory.mktemp("replica") / "qwen35moe-replica-Q8_0.gguf")


def _within(ours: int, theirs_mib: int) -> bool:
    return abs(ours / MIB - theirs_mib) <= max(0.01 * theirs_mib, 16)


PLACEMENTS = {
    "whole": (Placement(), 1),
    "n-cpu-moe": (Placement(n_cpu_moe=2), 1),
    "two devices": (Placement(tensor_split=(1, 1)), 2),
    "two devices, last experts": (Placement(n_cpu_moe=1, from_last=True, tensor_split=(3, 1)), 2),
}


@pytest.mark.parametrize("which", ["demo", "replica"])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_memory_per_device_equals_llamafit_params(which, name, replica, rpc_servers, llama_tools):
    path = DEMO_MODEL if which == "demo" else replica
    model = read_model(path)
    weights = weight_placement(model)
    main = len(weights.expert_bytes)
    placement, devices = PLACEMENTS[name]
    if which == "replica" and placement.n_cpu_moe:
        placement = Placement(n_cpu_moe=20 if not placement.from_last else 10, from_last=placement.from_last,
                              tensor_split=placement.tensor_split)  # fmt: skip
    rpc = rpc_servers[:devices]
    load = dry_load(path, MemorySettings(CTX, compute=placement.compute(rpc), cpu_tensors=placement.cpu_tensors(main)))
    ours = {row.device: row for row in device_memory(model, load)}
    flags = placement_args(placement, main)
    theirs = fit_params(llama_tools / "llama-fit-params", path, ["--rpc", ",".join(rpc), *flags, "-c", str(CTX)])
    assert set(theirs) == {*(f"RPC{i}" for i in range(devices)), HOST} <= set(ours), (theirs, ours)
    for device, (model_mib, context_mib, compute_mib) in theirs.items():
        row = ours[device]
        assert _within(row.weights, model_mib), (device, "model", row.weights / MIB, model_mib)
        assert _within(row.cache, context_mib), (device, "context", row.cache / MIB, context_mib)
        assert _within(row.compute, compute_mib), (device, "compute", row.compute / MIB, compute_mib)
    # the same rows from the placement's tensor bytes (what fit uses for a rung not yet written)
    by_rule = {row.device: row for row in measured_rows(weights, placement, load)}
    assert {d: (r.weights, r.cache) for d, r in by_rule.items()} == {
        d: (ours[d].weights, ours[d].cache) for d in by_rule
    }
    # and estimated for devices that are not present: llama.cpp's layer split rule, the same weights and cache
    host = dry_load(path, MemorySettings(CTX))
    guessed = {row.device: row for row in estimate(weights, host, placement, [f"RPC{i}" for i in range(devices)])}
    for device, row in guessed.items():
        assert (row.weights, abs(row.cache - ours[device].cache) <= MIB) == (ours[device].weights, True), device
        assert row.estimated == ("compute",)
    if pipelined(placement, list(guessed)[:-1], main + weights.nextn_blocks):  # the inputs' copies estimated
        last = f"RPC{devices - 1}"  # the device of the output layer: the CPU graph's logits are its own
        theirs_mib = theirs[last][2]
        low = guessed[last].compute / MIB - theirs_mib
        # the demo's inputs are its masks and embeddings; the replica's recurrent blocks add some (3.7% low)
        assert _within(guessed[last].compute, theirs_mib) if which == "demo" else abs(low) <= 0.05 * theirs_mib, low
        for d in (d for d in theirs if d != HOST):  # never much below what llama.cpp allocates
            assert guessed[d].compute / MIB >= theirs[d][2] - max(0.05 * theirs[d][2], 16), (d, guessed[d], theirs)


def test_fit_places_on_several_gpus_measured_on_the_devices(rpc_servers, llama_tools, tmp_path):
    """fit --gpu-memory A,B --rpc: each row's placement is measured on the devices; its llama-server
    line's flags load within the budgets in llama-fit-params' own figures."""
    budgets = (1100 * MIB, 1060 * MIB)
    result = ggufcarve(
        "fit", DEMO_MODEL, "--memory", "64GiB", "--ctx", CTX, "--keep", "8,16", "--only", "Q8_0",
        "--gpu-memory", ",".join(f"{b // MIB}MiB" for b in budgets), "--rpc", ",".join(rpc_servers), "--json",
    )  # fmt: skip
    assert result.code == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)
    assert doc["parameters"]["gpu_memory_bytes"] == list(budgets)
    rows = doc["rows"]
    assert rows and all(r["placement_measured"] and r["tier"] == "gpu" for r in rows), rows
    for row in rows:
        memory = {m["device"]: m for m in row["memory"]}
        assert set(memory) == {"RPC0", "RPC1", HOST} and not any(m.get("estimated") for m in memory.values())
        assert row["placement"]["tensor_split"] == [round(b / 2**30, 2) for b in budgets]
        server = row["server"]
        assert server[:2] == ["llama-server", "-m"] and server[server.index("-ts") + 1] == "1.07,1.04"
        path = DEMO_MODEL if row["kept"] == 16 else None
        if path is None:
            continue  # the pruned rung is not written by fit
        theirs = fit_params(llama_tools / "llama-fit-params", path, ["--rpc", ",".join(rpc_servers), *server[3:]])
        for i, budget in enumerate(budgets):
            assert sum(theirs[f"RPC{i}"]) * MIB + 2**30 <= budget + 2 * MIB, (i, theirs)
            assert _within(memory[f"RPC{i}"]["total"] - memory[f"RPC{i}"]["output"], sum(theirs[f"RPC{i}"]))


def test_the_placement_loads_and_offloads_no_fewer_layers_than_llama_cpps_fit(replica, rpc_servers, llama_tools):
    """llama.cpp's own --fit for a card of 6 GiB (emulated on the RPC device by its -fitt margin):
    fit's answer for the same budget offloads every layer, as --fit does, and its per-device
    figures in llama-fit-params' own dry load stay within the budget."""
    from ggufcarve.llama.launch import child_env

    card = 6 * 2**30
    free = _free_of(llama_tools, rpc_servers[0])
    run = subprocess.run(
        [str(llama_tools / "llama-fit-params"), "-m", str(replica), "--rpc", rpc_servers[0], "-c", "16384"]
        + ["-fitt", str((free - card) // MIB)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    picked = re.search(r"-ngl (\d+)", run.stdout)
    assert picked, run.stdout[-2000:]
    result = ggufcarve(
        "fit", replica, "--memory", "120GiB", "--ctx", 16384, "--keep", 256, "--only", "Q8_0",
        "--gpu-memory", "6GiB", "--rpc", rpc_servers[0], "--json",
    )  # fmt: skip
    assert result.code == 0, result.stderr[-2000:]
    (row,) = json.loads(result.stdout)["rows"]
    server = row["server"]
    ngl = server[server.index("-ngl") + 1]
    assert ngl == "all" or int(ngl) >= int(picked[1]), (server, picked[1])
    theirs = fit_params(llama_tools / "llama-fit-params", replica, ["--rpc", rpc_servers[0], *server[3:]])
    assert sum(theirs["RPC0"]) * MIB + 2**30 <= card + 16 * MIB, theirs


def _free_of(llama_tools, endpoint: str) -> int:
    from ggufcarve.llama.device_list import tool_devices

    (device,) = tool_devices(llama_tools / "llama-bench", (endpoint,))
    return device.free


def test_a_built_winner_over_its_budget_gives_way_to_the_next_finalist_that_fits():
    from ggufcarve.best.finalists import rechecked
    from ggufcarve.best.plan import BestSettings

    def record(cid, kld, fits, built=True):
        memory = [{"device": "RPC0", "total": 9 * 2**30}, {"device": HOST, "total": 2**30}]
        return {"id": cid, "kld_mean": kld, "built": built, "fits": fits, "memory": memory, "winner": cid == "a"}

    records = {"a": record("a", 0.01, False), "b": record("b", 0.02, True), "c": record("c", 0.015, True, built=False)}
    settings = BestSettings(memory=2**34, ladder=Path("q8-to-iq1"), heldout=())
    winner = rechecked(records, {"winner": "a", "finalists": ["a", "b", "c"]}, settings)
    assert winner["id"] == "b" and records["a"]["winner"] is False and records["b"]["winner"] is True
    assert "RPC0 9663676416 B" in records["a"]["replaced_because"] and records["b"]["replaces"]["id"] == "a"
    fitting = {"a": record("a", 0.01, True)}
    assert rechecked(fitting, {"winner": "a", "finalists": ["a"]}, settings) is fitting["a"]

    # with a builder, the finalists are built in turn by metric: c (0.015) before b (0.02); d (0.012) is
    # built first and measures over its budget too
    built: list[str] = []

    def build(cid):
        built.append(cid)
        records[cid].update(built=True, fits=cid != "d")

    records = {
        "a": record("a", 0.01, False),
        "b": record("b", 0.02, True),
        "c": record("c", 0.015, True, built=False),
        "d": record("d", 0.012, True, built=False),
    }
    winner = rechecked(records, {"winner": "a", "finalists": ["b", "a", "c", "d"]}, settings, build)
    assert winner["id"] == "c" and built == ["d", "c"], (winner["id"], built)
    assert records["c"]["replaces"]["id"] == "a" and records["d"].get("winner") is not True
    none_fit = {"a": record("a", 0.01, False), "d": record("d", 0.012, True, built=False)}
    records = none_fit
    assert rechecked(none_fit, {"winner": "a", "finalists": ["a", "d"]}, settings, build) is none_fit["a"]
    assert none_fit["a"]["answer_note"].startswith("no finalist passes once built")


def test_min_decode_and_prefer_faster_use_the_measured_speed():
    from ggufcarve.best.finalists import rechecked
    from ggufcarve.best.plan import BestSettings

    def record(cid, kld, speed, ties=()):
        return {"id": cid, "kld_mean": kld, "built": True, "fits": True, "decode_tok_s": speed, "tie_with": list(ties)}

    slow = {"a": record("a", 0.01, 5.0, ties=["b"]), "b": record("b", 0.011, 50.0)}
    settings = BestSettings(memory=2**34, ladder=Path("q8-to-iq1"), heldout=(), min_decode=20)
    assert rechecked(slow, {"winner": "a", "finalists": ["a", "b"]}, settings)["id"] == "b"
    assert "below --min-decode 20" in slow["a"]["replaced_because"]
    tied = {"a": record("a", 0.01, 5.0, ties=["b"]), "b": record("b", 0.011, 50.0)}
    faster = BestSettings(memory=2**34, ladder=Path("q8-to-iq1"), heldout=(), prefer="faster")
    assert rechecked(tied, {"winner": "a", "finalists": ["a", "b"]}, faster)["id"] == "b"
    assert "decodes faster" in tied["b"]["replaces"]["because"]
    smaller = BestSettings(memory=2**34, ladder=Path("q8-to-iq1"), heldout=())
    kept = {"a": record("a", 0.01, 5.0, ties=["b"]), "b": record("b", 0.011, 50.0)}
    assert rechecked(kept, {"winner": "a", "finalists": ["a", "b"]}, smaller)["id"] == "a"


def test_a_faster_last_n_variant_is_the_run_line_and_it_fits(rpc_servers, llama_tools):
    """best's run line for a built file whose record holds the last N blocks' -ot (the variant timed
    faster): -ngl 99 -ot PATTERN=CPU instead of --n-cpu-moe N, and llama-fit-params with it on an RPC
    device keeps the budget with llama.cpp's margin."""
    from ggufcarve.best.builds import run_command
    from ggufcarve.best.plan import BestSettings

    budget = 1045 * MIB
    settings = BestSettings(memory=2**34, ladder=Path("q8-to-iq1"), heldout=(), gpu_memory=(budget,), ctx=512)
    plain = run_command(DEMO_MODEL, settings)["argv"]
    n = int(plain[plain.index("--n-cpu-moe") + 1])
    last = Placement(99, n, True).to_json(4)
    argv = run_command(DEMO_MODEL, settings, last)["argv"]
    assert argv[argv.index("-ngl") + 1] == "99" and "--n-cpu-moe" not in argv
    assert (
        argv[argv.index("-ot") + 1]
        == last["override_tensor"]
        == r"blk\.(2|3)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
    )
    theirs = fit_params(llama_tools / "llama-fit-params", DEMO_MODEL, ["--rpc", rpc_servers[0], *argv[3:]])
    assert sum(theirs["RPC0"]) * MIB + 2**30 <= budget, theirs
    # the variant's own memory, as best records it once the variant is taken: its dry load on the device
    from dataclasses import replace

    from ggufcarve.best.plan import placement_memory
    from ggufcarve.llama.devices import Compute

    on_rpc = replace(settings, compute=Compute(rpc=(rpc_servers[0],)))
    placed = placement_memory(DEMO_MODEL, on_rpc, Placement(99, n, True))
    assert placed is not None and placed.measured and placed.fits, placed
    rpc0 = next(row for row in placed.devices if row.device == "RPC0")
    assert abs(rpc0.total - sum(theirs["RPC0"]) * MIB) <= max(0.01 * rpc0.total, 16 * MIB), (rpc0, theirs)
    assert placement_memory(DEMO_MODEL, settings, Placement(99, n, True)) is None  # no device here: not measured
    tight = replace(on_rpc, gpu_memory=(rpc0.total + 2**30 - MIB,))
    assert placement_memory(DEMO_MODEL, tight, Placement(99, n, True)).over() == ["RPC0"]


def _fitted(llama_tools, model, rpc: str, margins_mib: tuple[int, ...], ctx: int) -> tuple[list[int], str]:
    """llama-fit-params' own --fit on for `margins_mib` (-fitt per device): the target it placed each
    device against (MiB, its "id=N, target=T MiB" lines) and its fitted arguments."""
    from ggufcarve.llama.launch import child_env

    argv = [str(llama_tools / "llama-fit-params"), "-m", str(model), "--rpc", rpc, "-c", str(ctx)]
    argv += ["-fitt", ",".join(map(str, margins_mib)), "-v"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=child_env())
    assert run.returncode == 0, run.stderr[-2000:]
    targets = [int(t) for t in re.findall(r"id=\d+, target=(\d+) MiB", run.stderr + run.stdout)]
    fitted = next(line for line in run.stdout.splitlines() if line.startswith("-c "))
    return targets, fitted


def _expert_blocks_on_devices(fitted: str, blocks: int) -> int:
    """The blocks whose routed experts llama-fit-params' arguments leave on the devices: every block
    offloaded (-ngl counts the output layer too) less those an -ot pattern sends to the CPU."""
    ngl = int(re.search(r"-ngl (-?\d+)", fitted)[1])
    offloaded = blocks if ngl < 0 else min(blocks, max(ngl - 1, 0))
    on_cpu = {int(b) for b in re.findall(r"blk\\\.(\d+)\\\.ffn_[^=,]*=CPU", fitted)}
    return sum(1 for b in range(blocks - offloaded, blocks) if b not in on_cpu)


@pytest.mark.parametrize("headroom_mib", [(10, 25), (25, 15)], ids=["RPC0-small", "RPC1-small"])
def test_a_split_with_experts_on_the_cpu_offloads_as_much_as_llama_cpps_fit(rpc_servers, llama_tools, headroom_mib):
    """Two RPC devices whose budgets force a split *and* experts in system memory: fit's placement
    (a -ts shift relieving the device that is over, --n-cpu-moe N by bisection) keeps no fewer blocks'
    experts on the devices than llama.cpp's own --fit on against the same per-device targets (what
    llama-fit-params -fitt placed against), within one block; its llama-server line, loaded by
    llama-fit-params, agrees with fit's rows per device within max(1%, 16 MiB) and keeps each device
    within its budget."""
    from ggufcarve.llama.launch import child_env
    from ggufcarve.moe.layout import inspect_layout

    ctx = 4096
    rpc = ",".join(rpc_servers)
    layout = inspect_layout(read_model(DEMO_MODEL))
    blocks = len(layout.blocks)
    total = subprocess.run(
        [str(llama_tools / "llama-fit-params"), "-m", str(DEMO_MODEL), "--rpc", rpc, "-c", str(ctx), "-v"],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    free = [int(m) for m in re.findall(r"RPC\d \([^)]*\):\s+(\d+) total", total.stderr + total.stdout)][:2]
    assert len(free) == 2, total.stderr[-2000:]
    targets, fitted = _fitted(llama_tools, DEMO_MODEL, rpc, tuple(f - h for f, h in zip(free, headroom_mib)), ctx)
    assert len(targets) == 2 and all(t > 0 for t in targets), (targets, fitted)
    theirs = _expert_blocks_on_devices(fitted, blocks)
    assert theirs < blocks, fitted  # the targets force experts into system memory

    budgets = ",".join(f"RPC{i}={t}MiB" for i, t in enumerate(targets))
    result = ggufcarve(
        "fit", DEMO_MODEL, "--memory", "64GiB", "--gpu-memory", budgets, "--gpu-margin", 0, "--rpc", rpc,
        "--ctx", ctx, "--keep", 16, "--only", "Q8_0", "--json",
    )  # fmt: skip
    assert result.code == 0, result.stderr[-2000:]
    (row,) = json.loads(result.stdout)["rows"]
    placement = row["placement"]
    assert row["fits"] and row["tier"] == "gpu+cpu", row
    assert len(placement["tensor_split"]) == 2 and placement["blocks_on_cpu"] > 0, (
        placement
    )  # a split, experts on the CPU
    ours = blocks - placement["blocks_on_cpu"]
    assert ours >= theirs - 1, (placement, fitted)
    assert placement["walk"].startswith("bisection over N"), placement
    rows = {m["device"]: m for m in row["memory"]}
    loaded = fit_params(llama_tools / "llama-fit-params", DEMO_MODEL, row["server"][3:])
    for device, target in zip(("RPC0", "RPC1"), targets):
        used = sum(loaded[device]) * 2**20
        assert rows[device]["total"] <= target * 2**20, (device, rows[device], target)
        assert used <= target * 2**20 + 2**20, (device, loaded, target)  # llama-fit-params rounds to MiB
        expected = rows[device]["total"] - rows[device]["output"]
        assert abs(used - expected) <= max(0.01 * expected, 16 * 2**20), (device, loaded, rows[device])
