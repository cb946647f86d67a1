"""The caches keyed by what changes their numbers, bounded, shown and cleared."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ggufcarve.cli import app
from ggufcarve.llama.devices import AUTO, Compute, Device

GiB = 2**30


@pytest.fixture
def listed(monkeypatch):
    """The RPC servers' devices as the device listing answers them, without a server: endpoint ->
    (description, total, free) of its one device (a server not named describes itself by its
    address, as ggml-rpc does). The listing's calls, by the tuple of servers, are counted."""
    from ggufcarve.llama import device_list
    from ggufcarve.llama.devices import rpc_device_key

    servers: dict[str, tuple[str, int, int]] = {}
    calls: list[tuple[str, ...]] = []

    def devices(rpc=()):
        calls.append(tuple(rpc))
        found = [Device("CPU", "a CPU", "CPU", 16 * GiB, 32 * GiB, "CPU")]
        for number, endpoint in enumerate(rpc):
            description, total, free = servers.get(endpoint, (endpoint, 8 * GiB, 8 * GiB))
            found.append(Device(f"RPC{number}", description, "RPC", free, total, "RPC"))
        return found

    monkeypatch.setattr(device_list, "libllama_devices", devices)
    rpc_device_key.cache_clear()
    yield servers, calls
    rpc_device_key.cache_clear()


def test_the_table_cache_drops_the_least_recently_used_past_its_limit(tmp_path, monkeypatch):
    from ggufcarve.evaluate import tables

    table = np.zeros((128, 6))  # 6 KiB + the .npy header
    for i, key in enumerate("abcd"):
        tables.store(tmp_path, key, table)
        os.utime(tmp_path / f"{key}.npy", ns=(i * 10**9, i * 10**9))
    assert tables.load(tmp_path, "a") is not None  # a use renews it: b is now the oldest
    one = (tmp_path / "a.npy").stat().st_size
    monkeypatch.setenv(tables.LIMIT_ENV, str(3 * one))
    tables.store(tmp_path, "e", table)
    assert sorted(p.stem for p in tmp_path.glob("*.npy")) == ["a", "d", "e"]


def test_a_tables_key_holds_the_placement_and_the_threads(listed):
    from ggufcarve.evaluate.tables import unit_key

    keys = {
        unit_key("m", None, "r", 256, 0, 4, compute)
        for compute in (
            Compute(threads=2),
            Compute(threads=4),
            Compute(99, threads=2),
            Compute(99, ("h:1",), threads=2),
        )
    }
    assert len(keys) == 4
    assert unit_key("m", None, "r", 256, 0, 4, Compute(99, ("h:1",), threads=2)) == unit_key(
        "m", None, "r", 256, 0, 4, Compute(99, ("other:2",), threads=2)
    )  # where the server listens does not change a number


def test_a_compute_key_names_the_backend_and_the_rpc_devices_not_their_address(listed, monkeypatch):
    """The libllama's backend is in every key, nothing offloaded included (a CUDA build offloads large
    matmuls at -ngl 0); an RPC server adds its devices' name, description, backend and total memory,
    listed once per tuple of servers; its address, and its free memory, change nothing."""
    from ggufcarve.llama import tools

    servers, calls = listed
    servers.update(
        {
            "big:3": ("big:3", 24 * GiB, 24 * GiB),
            "busy:4": ("busy:4", 8 * GiB, 1 * GiB),
            "card:5": ("NVIDIA H100", 8 * GiB, 8 * GiB),  # a server that says what its device is
        }
    )
    keys = {}
    for backend in ("cpu", "cuda"):
        monkeypatch.setattr(tools, "libllama_backend", lambda backend=backend: backend)
        keys[backend] = [Compute(threads=2).key(), Compute(99, threads=2).key()]
    assert keys["cpu"][0] != keys["cuda"][0] and keys["cpu"][1] != keys["cuda"][1]
    assert keys["cuda"][0] == {"backend": "cuda", "gpu_layers": 0, "threads": 2}
    monkeypatch.setattr(tools, "libllama_backend", lambda: "rpc")
    on = {
        endpoint: Compute(99, (endpoint,), threads=2).key() for endpoint in ("a:1", "b:2", "big:3", "busy:4", "card:5")
    }
    assert on["a:1"]["rpc_devices"] == [{"name": "RPC0", "description": "", "backend": "RPC", "total": 8 * GiB}]
    assert on["a:1"] == on["b:2"] == on["busy:4"]  # where it listens, and what is free now, change no number
    assert on["a:1"] != on["big:3"] and on["a:1"] != on["card:5"]
    assert on["card:5"]["rpc_devices"][0]["description"] == "NVIDIA H100"
    assert all(endpoint not in json.dumps(key) for endpoint, key in on.items())
    assert Compute(99, ("a:1",), threads=2).key() == on["a:1"] and calls.count(("a:1",)) == 1  # listed once
    two = Compute(99, ("a:1", "big:3"), (1.0, 1.0), threads=2).key()
    assert [d["name"] for d in two["rpc_devices"]] == ["RPC0", "RPC1"] and two != on["a:1"]
    assert Compute(0, ("a:1",), threads=2).key() == Compute(threads=2).key()  # nothing on the device: the CPU's
    assert Compute(AUTO, threads=2).key()["gpu_layers"] == "auto"


def test_a_placement_in_words_names_the_rpc_devices_and_the_build(listed, monkeypatch):
    from ggufcarve.llama import tools
    from ggufcarve.release.card_tables import placement_words

    monkeypatch.setattr(tools, "libllama_backend", lambda: "cuda")
    assert placement_words(Compute(threads=16).key()) == "16 CPU threads (a cuda build)"
    assert placement_words(Compute(99, n_cpu_moe=2).key()) == "-ngl 99 on cuda, --n-cpu-moe 2, CPU"
    monkeypatch.setattr(tools, "libllama_backend", lambda: "rpc")
    assert placement_words(Compute(threads=2).key()) == "2 CPU threads"
    assert (
        placement_words(Compute(99, ("a:1", "b:2"), (3.0, 1.0), threads=2).key())
        == "-ngl 99 on RPC0 (8.00 GiB over RPC), RPC1 (8.00 GiB over RPC), split 3:1, 2 CPU threads"
    )
    old = {"backend": "rpc", "gpu_layers": 99, "rpc_servers": 1, "tensor_split": [], "threads": 2}
    assert placement_words(old) == "-ngl 99 on 1 RPC server(s), 2 CPU threads"  # a record of an earlier version


def test_the_keep_set_pass_is_reused_only_by_its_llama_cpp_placement_and_imatrix(tmp_path, monkeypatch):
    """best's calibration pass (scores and imatrix) is taken again only when the llama.cpp version,
    where it computed (`Compute.key`) and the imatrix's content are the ones it recorded."""
    from types import SimpleNamespace

    from ggufcarve.best import builds
    from ggufcarve.best.plan import BestSettings
    from ggufcarve.llama import tools
    from ggufcarve.select import scores as scores_module
    from ggufcarve.tune import run as tune_run

    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tools, "libllama_backend", lambda: "cpu")
    monkeypatch.setattr(tools, "llama_cpp_version", lambda: "0.3.36")
    passes = []

    def calibration_scores(model, layout, settings, work, on_event):
        passes.append(settings.compute)
        settings.imatrix_out.write_text(f"imatrix of pass {len(passes)}\n")
        return {"frequency": SimpleNamespace(dumps=lambda: "{}\n")}, None, {}

    monkeypatch.setattr(tune_run, "calibration_scores", calibration_scores)
    monkeypatch.setattr(scores_module, "read_scores", lambda path: "read")
    source, text = tmp_path / "model.gguf", tmp_path / "calibration.txt"
    source.write_bytes(b"a model")
    text.write_text("some text\n")
    plan = SimpleNamespace(model=SimpleNamespace(paths=[source]), kept_counts=[], layout=None)
    imatrix = tmp_path / "imatrix.gguf"

    def reused(compute: Compute | None = None) -> bool:
        settings = BestSettings(
            memory=GiB, ladder=tmp_path / "l.toml", heldout=(text,), calibration=(text,), methods=("frequency",)
        )
        settings = replace(settings, compute=compute or Compute(threads=2))
        return builds.keep_sets(source, plan, settings, tmp_path / "work", imatrix, lambda event: None)[2]

    assert not reused() and reused() and len(passes) == 1
    imatrix.write_text("another run's imatrix, of other text\n")  # there, but not the pass's
    assert not reused() and reused() and len(passes) == 2
    assert not reused(Compute(99, threads=2)) and len(passes) == 3  # on a device
    assert not reused(Compute(threads=2)) and reused() and len(passes) == 4
    monkeypatch.setattr(tools, "libllama_backend", lambda: "cuda")
    assert not reused() and len(passes) == 5  # a build of another backend, at -ngl 0 too
    monkeypatch.setattr(tools, "llama_cpp_version", lambda: "0.3.37")
    assert not reused() and reused() and len(passes) == 6
    imatrix.unlink()
    assert not reused() and len(passes) == 7


def test_a_reference_cache_name_holds_where_it_was_computed(tmp_path):
    from ggufcarve.evaluate.protocol import EvalSettings
    from ggufcarve.evaluate.reference import _cache_path

    cpu = _cache_path(tmp_path, "a" * 64, "b" * 64, EvalSettings(compute=Compute(threads=2)))
    gpu = _cache_path(tmp_path, "a" * 64, "b" * 64, EvalSettings(compute=Compute(99, threads=2)))
    assert cpu != gpu and cpu.parent == gpu.parent and cpu.suffix == gpu.suffix == ".kld"


def test_the_resume_key_holds_every_quantizer_field_of_the_rung_spec():
    from dataclasses import fields, replace

    from ggufcarve.quant.ladder_plan import NAMING_FIELDS, rung_quantizer_fields
    from ggufcarve.quant.spec import Rung

    rung = Rung("Q4_K_M", "Q4_K_M")
    assert set(rung_quantizer_fields(rung)) == {f.name for f in fields(Rung)} - NAMING_FIELDS
    assert rung_quantizer_fields(replace(rung, name="X", description="y")) == rung_quantizer_fields(rung)
    assert rung_quantizer_fields(replace(rung, pure=True)) != rung_quantizer_fields(rung)


def test_cache_show_and_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path))
    (tmp_path / "measure-tables").mkdir()
    (tmp_path / "measure-tables" / "x.npy").write_bytes(b"0" * 1000)
    (tmp_path / "reference-logprobs").mkdir()
    (tmp_path / "reference-logprobs" / "y.kld").write_bytes(b"0" * 500)
    shown = CliRunner().invoke(app, ["cache", "show", "--json"])
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    assert (doc["tables"]["files"], doc["tables"]["bytes"], doc["references"]["bytes"]) == (1, 1000, 500)
    cleared = CliRunner().invoke(app, ["cache", "clear", "--tables"])
    assert cleared.exit_code == 0 and "cleared tables: 1 files" in cleared.output
    assert not (tmp_path / "measure-tables").exists() and (tmp_path / "reference-logprobs" / "y.kld").exists()


@pytest.mark.slow
def test_tables_computed_on_the_cpu_and_on_an_rpc_device_are_not_taken_for_each_other(
    rpc_servers, small_rpc_server, tmp_path
):
    """The same masked scoring (one keep-set on the demo model, against the same reference
    log-probs) at -ngl 0 and with every layer on an RPC device, into one table cache: each placement
    decodes and writes its own table rather than take the other's, whichever ran first. A server
    with the same device at another address takes the table; a device with other memory
    (small_rpc_server's) decodes its own."""
    from ggufcarve.demo import DEMO_MODEL, HELDOUT
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, prepare_segments

    cpu = Compute(threads=2)
    segments = prepare_segments(
        DEMO_MODEL, [HELDOUT], chunk_ctx=256, chunks=2, compute=cpu, work=tmp_path, cache_dir=tmp_path / "references"
    )
    candidates = [Candidate("keep-8", DEMO_MODEL, keep={b: tuple(range(0, 16, 2)) for b in range(4)})]
    runs = []

    def run(compute: Compute, tables: Path) -> tuple[int, int, int]:
        """(chunks decoded, chunks taken from the cache, tables in the cache) of one measurement."""
        work = tmp_path / f"work-{len(runs)}"
        work.mkdir()
        got = measure(candidates, segments, MeasureSettings(compute, tables=tables), work)
        runs.append(got)
        return got.decoded_chunks, got.cached_chunks, len(list(tables.glob("*.npy")))

    on_rpc = Compute(99, rpc_servers[:1], threads=2)
    assert run(cpu, tmp_path / "a") == (2, 0, 1)
    assert run(on_rpc, tmp_path / "a") == (2, 0, 2)  # not the CPU's table
    assert run(on_rpc, tmp_path / "b") == (2, 0, 1)
    assert run(cpu, tmp_path / "b") == (2, 0, 2)  # not the device's table
    assert run(Compute(99, rpc_servers[1:], threads=2), tmp_path / "b") == (0, 2, 2)  # the same device elsewhere
    assert run(Compute(99, (small_rpc_server,), threads=2), tmp_path / "b") == (2, 0, 3)  # another device
    assert run(cpu, tmp_path / "a") == (0, 2, 2)  # each takes its own
