"""The one report envelope and the per-output report names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ggufcarve.reports import (
    PRUNING_REPORT,
    dumps,
    envelope,
    output_stem,
    public_name,
    release_report_name,
    report_path_for,
)


def test_envelope_fields_and_deterministic_bytes():
    doc = envelope(
        "pruning-report",
        inputs=[{"name": "m.gguf", "sha256": "0" * 64, "bytes": 3}],
        parameters={"k": 1},
        results={"zeta": [3, 1, 2], "alpha": {"b": 1, "a": 2}},
        timings={"total_seconds": 1.23456},
    )
    assert {"schema_version", "kind", "tool", "created", "inputs", "parameters", "timings", "zeta", "alpha"} == set(doc)
    assert doc["timings"] == {"total_seconds": 1.235} and doc["zeta"] == [3, 1, 2]  # lists keep the caller's order
    text = dumps(doc)
    assert text.endswith("}\n") and list(json.loads(text)) == sorted(doc) and text == dumps(json.loads(text))
    with pytest.raises(ValueError, match="inputs"):
        envelope("x", inputs=[], parameters={}, results={"inputs": 1}, timings={})


@pytest.mark.parametrize(
    "output, stem",
    [
        ("out/model-4e.gguf", "model-4e"),
        ("out/model-4e-00001-of-00003.gguf", "model-4e"),
        ("out/model.imatrix.gguf", "model.imatrix"),
        ("out/model.dat", "model"),
    ],
)
def test_per_output_report_names(output, stem):
    assert output_stem(Path(output)) == stem
    assert report_path_for(Path(output), PRUNING_REPORT) == Path("out") / "method" / f"{stem}.pruning-report.json"
    assert release_report_name(PRUNING_REPORT) == "method/pruning-report.json"


def test_public_names_drop_directories():
    assert public_name("/home/me/data/calibration.txt") == "calibration.txt"
    assert public_name("C:\\data\\wiki.txt") == "wiki.txt"
    assert public_name("runs/calibration/") == "calibration"
    assert public_name("wiki.train.raw") == "wiki.train.raw"
