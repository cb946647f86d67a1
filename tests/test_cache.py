"""The caches keyed by what changes their numbers, bounded, shown and cleared."""

from __future__ import annotations

import json
import os

import numpy as np
from typer.testing import CliRunner

from ggufcarve.cli import app
from ggufcarve.llama.devices import Compute


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


def test_a_tables_key_holds_the_placement_and_the_threads():
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
