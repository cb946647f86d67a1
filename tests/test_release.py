"""A release directory cannot lie: one source per release, nothing published that the manifest
does not describe, no local paths, method reports matched by content. Run as a user would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from clirun import ggufcarve, sha256

from ggufcarve.gguf.container import read_model
from ggufcarve.imatrix_format import read_imatrix

SPEC = """
[[rungs]]
ftype = "Q6_K"
[[rungs]]
ftype = "Q4_K_M"
"""


@pytest.fixture
def spec(tmp_path) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    return path


def prune(source: Path, output: Path, *args: object) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    result = ggufcarve("prune", source, "-o", output, "-q", *args)
    assert result.code == 0, result.stderr
    return output


def ladder(spec: Path, source: Path, out: Path, llama_tools: Path, *args: object):
    return ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        source,
        "-o",
        out,
        "--quantizer",
        llama_tools / "llama-quantize",
        "-t",
        "2",
        "-q",
        *args,
    )


def failures_full(out: Path) -> set[tuple[str, str]]:
    """(file, problem) of every failure `verify --json` reports; it must fail."""
    result = ggufcarve("verify", out, "--json", "--partial")
    assert result.code == 1, result.stdout
    return {(f["path"], f["problem"]) for f in json.loads(result.stdout)["failures"]}


def failures(out: Path) -> set[tuple[str, str]]:
    """As failures_full, each problem up to its first colon."""
    return {(path, problem.split(":")[0]) for path, problem in failures_full(out)}


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.code == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and "(hint: " in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# the holes, each as a user meets it


@pytest.mark.slow
def test_a_release_of_one_source_refuses_another(spec, q8_moe, llama_tools, tmp_path):
    out = tmp_path / "release"
    assert ladder(spec, q8_moe, out, llama_tools, "--only", "Q4_K_M").code == 0
    other = prune(q8_moe, tmp_path / "b" / "other-Q8_0.gguf", "--keep-first", 4)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    refused = ladder(spec, other, out, llama_tools, "--only", "Q6_K")
    line = one_line_error(refused)
    assert f"holds the release of {q8_moe.name}" in line and other.name in line and "--force" in line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert ggufcarve("verify", out, "--partial").code == 0

    fresh = ladder(spec, other, out, llama_tools, "--only", "Q6_K", "--force")
    assert fresh.code == 0, fresh.stderr
    assert sorted(p.name for p in out.glob("*.gguf")) == ["other-Q6_K.gguf"]  # the old rung is gone
    manifest = json.loads((out / "quant-manifest.json").read_text())
    assert [r["source_sha256"] for r in manifest["rungs"]] == [[sha256(other)]]
    assert ggufcarve("verify", out, "--partial").code == 0

    # a rung recorded as made from another source fails verify
    manifest["rungs"][0]["source_sha256"] = [sha256(q8_moe)]
    (out / "quant-manifest.json").write_text(json.dumps(manifest))
    assert any(
        path == "quant-manifest.json"
        and problem.startswith(f"rung Q6_K was made from another source (sha256 {sha256(q8_moe)[:12]})")
        for path, problem in failures_full(out)
    )


@pytest.mark.slow
def test_a_gguf_the_manifest_does_not_describe_is_not_published(spec, q8_moe, llama_tools, tmp_path):
    out = tmp_path / "release"
    assert ladder(spec, q8_moe, out, llama_tools, "--only", "Q4_K_M").code == 0
    shutil.copy(next(out.glob("*-Q4_K_M.gguf")), out / "dropped-in-Q2_K.gguf")
    again = ladder(spec, q8_moe, out, llama_tools, "--only", "Q4_K_M")
    assert again.code == 0, again.stderr
    assert "dropped-in-Q2_K.gguf" not in (out / "SHA256SUMS").read_text()
    assert ("dropped-in-Q2_K.gguf", "not described by quant-manifest.json") in failures(out)
    (out / "dropped-in-Q2_K.gguf").unlink()
    assert ggufcarve("verify", out, "--partial").code == 0


@pytest.mark.slow
def test_published_files_hold_no_local_paths(spec, q8_moe, q8_moe_imatrix, llama_tools, tmp_path, tmp_path_factory):
    work = tmp_path / "models"
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"layers": {"0": [0, 2, 5, 7], "1": [1, 2, 3, 6]}}))
    pruned = prune(q8_moe, work / "pruned-Q8_0.gguf", "--keep", keep)
    remapped = work / "pruned.imatrix.gguf"
    assert (
        ggufcarve("imatrix", "remap", q8_moe_imatrix, "--keep", keep, "--model", pruned, "-o", remapped, "-q").code == 0
    )
    out = tmp_path / "release"
    result = ladder(spec, pruned, out, llama_tools, "--imatrix", remapped, "--only", "Q4_K_M")
    assert result.code == 0, result.stderr

    local = {str(tmp_path_factory.getbasetemp()), str(tmp_path_factory.getbasetemp().resolve()), str(Path.home()) + "/"}
    published = [
        p
        for p in out.rglob("*")
        if p.is_file() and p.suffix != ".gguf" and not any(part.startswith(".") for part in p.relative_to(out).parts)
    ]
    # the plain keep-set the model was pruned with travels with it (prune keeps a copy in method/) and is published
    assert {p.relative_to(out).as_posix() for p in published} == {
        "SHA256SUMS",
        "quant-manifest.json",
        "method/pruning-report.json",
        "method/imatrix-remap-report.json",
        "method/keep-set.json",
    }
    fragments = list((out / ".ggufcarve-fragments").iterdir())
    assert [p.name for p in fragments] == ["Q4_K_M.json"]
    for path in [*published, *fragments, *(work / "method").iterdir()]:
        text = path.read_text()
        assert not [d for d in local if d in text] and ".partial" not in text, path
    rung = json.loads((out / "quant-manifest.json").read_text())["rungs"][0]
    assert rung["command"] == [
        "llama-quantize",
        "--allow-requantize",
        "--imatrix",
        "pruned.imatrix.gguf",
        "pruned-Q8_0.gguf",
        "pruned-Q4_K_M.gguf",
        "Q4_K_M",
        "2",
    ]
    rung_file = read_model(out / "pruned-Q4_K_M.gguf")
    assert rung_file.get("quantize.imatrix.file") == "pruned.imatrix.gguf"
    # llama-imatrix recorded its calibration text by the path it was given; the rung names it bare
    assert "/" in read_imatrix(remapped).datasets[0]
    assert rung_file.get("quantize.imatrix.dataset") == Path(read_imatrix(remapped).datasets[0]).name
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # the quantizer's imatrix copy is gone
    assert ggufcarve("verify", out, "--partial").code == 0


@pytest.mark.slow
def test_a_stale_report_of_the_same_size_is_not_published(spec, q8_moe, llama_tools, tmp_path):
    work = tmp_path / "models"
    model = prune(q8_moe, work / "model-Q8_0.gguf", "--keep-first", 4)
    beside = work / "method" / "model-Q8_0.pruning-report.json"
    stale = beside.read_text()
    # the same output name and K, other experts; its report written elsewhere, so the one beside it is stale
    prune(q8_moe, model, "--keep-ids", "4,5,6,7", "--force", "--report", tmp_path / "elsewhere.json")
    assert beside.read_text() == stale and json.loads(stale)["output"]["files"][0]["bytes"] == model.stat().st_size

    out = tmp_path / "release"
    result = ladder(spec, model, out, llama_tools, "--only", "Q4_K_M")
    assert result.code == 0, result.stderr
    assert (
        "model-Q8_0.pruning-report.json not published: it does not describe model-Q8_0.gguf: its kept experts differ"
        in " ".join(result.stderr.split())
    )
    assert not (out / "method").exists() and json.loads((out / "quant-manifest.json").read_text())["method"] == []
    assert ggufcarve("verify", out, "--partial").code == 0

    # the report that describes the file is published, byte for byte, under the release's name
    prune(q8_moe, model, "--keep-ids", "4,5,6,7", "--force")
    again = ladder(spec, model, out, llama_tools, "--only", "Q4_K_M", "--force")
    assert again.code == 0, again.stderr
    assert (out / "method" / "pruning-report.json").read_bytes() == beside.read_bytes()
    method = json.loads((out / "quant-manifest.json").read_text())["method"]
    assert method == [
        {
            "name": "method/pruning-report.json",
            "kind": "pruning-report",
            "describes": model.name,
            "bytes": beside.stat().st_size,
            "sha256": sha256(beside),
        }
    ]
    assert ggufcarve("verify", out, "--partial").code == 0
    # a published report that describes another model fails verify
    doc = json.loads((out / "method" / "pruning-report.json").read_text())
    doc["output"]["files"][0]["bytes"] += 1
    (out / "method" / "pruning-report.json").write_text(json.dumps(doc))
    size = model.stat().st_size
    assert (
        "method/pruning-report.json",
        f"describes model-Q8_0.gguf ({size + 1} bytes), not the manifest's source (model-Q8_0.gguf ({size} bytes))",
    ) in failures_full(out)


@pytest.mark.slow
def test_a_renamed_model_keeps_its_report(spec, q8_moe, llama_tools, tmp_path):
    """Matched by content, not by name: model and report renamed together are still published."""
    work = tmp_path / "models"
    prune(q8_moe, work / "first-Q8_0.gguf", "--keep-first", 4)
    (work / "first-Q8_0.gguf").rename(work / "renamed-Q8_0.gguf")
    (work / "method" / "first-Q8_0.pruning-report.json").rename(work / "method" / "renamed-Q8_0.pruning-report.json")
    out = tmp_path / "release"
    result = ladder(spec, work / "renamed-Q8_0.gguf", out, llama_tools, "--only", "Q4_K_M")
    assert result.code == 0 and "not published" not in result.stderr, result.stderr
    assert (out / "method" / "pruning-report.json").read_bytes() == (
        work / "method" / "renamed-Q8_0.pruning-report.json"
    ).read_bytes()
    assert ggufcarve("verify", out, "--partial").code == 0


# ---------------------------------------------------------------------------------------------
# error paths: one line with a hint, exit 1, nothing written


@pytest.mark.parametrize(
    "report, message",
    [
        ("{not json", "is not valid JSON"),
        ("[]", "holds a JSON list, not an object"),
        (
            '{"schema_version": 2, "kind": "pruning-report", "output": {"files": 3}}',
            "output.files is missing or not a JSON list",
        ),
    ],
)
def test_malformed_pruning_report_beside_the_source(spec, q8_moe, tmp_path, report, message):
    model = prune(q8_moe, tmp_path / "models" / "model-Q8_0.gguf", "--keep-first", 4)
    (tmp_path / "models" / "method" / "model-Q8_0.pruning-report.json").write_text(report)
    out = tmp_path / "release"
    line = one_line_error(ggufcarve("ladder", "run", spec, "--source", model, "-o", out, "--quantizer", "libllama"))
    assert "model-Q8_0.pruning-report.json" in line and message in line
    assert not out.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        ("directory", "cannot read"),
        ("{not json", "is not valid JSON"),
        ('{"rungs": 3}', "is not a ladder manifest"),
    ],
)
def test_unreadable_manifest_stops_ladder_run(spec, q8_moe, tmp_path, damage, message):
    out = tmp_path / "release"
    out.mkdir()
    if damage == "directory":  # an I/O error even for root
        (out / "quant-manifest.json").mkdir()
    else:
        (out / "quant-manifest.json").write_text(damage)
    line = one_line_error(ggufcarve("ladder", "run", spec, "--source", q8_moe, "-o", out, "--quantizer", "libllama"))
    assert "quant-manifest.json" in line and message in line and "--force" in line
    assert sorted(p.name for p in out.iterdir()) == ["quant-manifest.json"]


def test_unreadable_manifest_stops_verify(tmp_path):
    out = tmp_path / "release"
    out.mkdir()
    (out / "SHA256SUMS").write_text("")
    (out / "quant-manifest.json").mkdir()
    line = one_line_error(ggufcarve("verify", out, "--partial"))
    assert "cannot read" in line and "quant-manifest.json" in line


@pytest.mark.slow
def test_force_replaces_a_damaged_manifest(spec, q8_moe, llama_tools, tmp_path):
    out = tmp_path / "release"
    out.mkdir()
    (out / "quant-manifest.json").write_text("{not json")
    result = ladder(spec, q8_moe, out, llama_tools, "--only", "Q4_K_M", "--force")
    assert result.code == 0, result.stderr
    assert ggufcarve("verify", out, "--partial").code == 0


def test_recorded_errors_drop_local_directories(tmp_path):
    from ggufcarve.quant.ladder_run import _without_dirs

    message = f"error loading model: cannot open {tmp_path}/release/.m-Q4_K_M.gguf.partial"
    assert (
        _without_dirs(message, [tmp_path / "release", tmp_path])
        == "error loading model: cannot open .m-Q4_K_M.gguf.partial"
    )
    assert _without_dirs(None, [tmp_path]) is None


# ---------------------------------------------------------------------------------------------
# the selection record is published


def select(model: Path, output: Path, keep: int = 4) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    result = ggufcarve("select", model, "--method", "weights", "--keep", keep, "-o", output, "-q")
    assert result.code == 0, result.stderr
    return output


def manifest_method(out: Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads((out / "quant-manifest.json").read_text())["method"]}


@pytest.mark.slow
def test_the_selection_record_is_published(spec, q8_moe, tmp_path):
    work = tmp_path / "models"
    selection = select(q8_moe, work / "SELECTION.json")
    model = prune(q8_moe, work / "model-4e-Q8_0.gguf", "--keep", selection)
    keep_input = json.loads((work / "method" / "model-4e-Q8_0.pruning-report.json").read_text())["inputs"][-1]
    assert keep_input == {
        "name": "SELECTION.json",
        "sha256": sha256(selection),
        "bytes": selection.stat().st_size,
        "kind": "keep-set",
    }
    out = tmp_path / "release"
    result = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        model,
        "-o",
        out,
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "-t",
        "2",
        "-q",
    )
    assert result.code == 0, result.stderr
    published = out / "method" / "expert-selection.json"
    assert (
        published.read_bytes() == selection.read_bytes()
    )  # the selection record is the keep-set too: no keep-set.json
    assert sorted(p.name for p in (out / "method").iterdir()) == ["expert-selection.json", "pruning-report.json"]
    record = manifest_method(out)["method/expert-selection.json"]
    assert record == {
        "name": "method/expert-selection.json",
        "kind": "expert-selection",
        "describes": model.name,
        "bytes": selection.stat().st_size,
        "sha256": sha256(selection),
    }
    assert "method/expert-selection.json" in (out / "SHA256SUMS").read_text()
    assert ggufcarve("verify", out, "--partial").code == 0
    # verify checks it: a published record of other experts fails
    doc = json.loads(published.read_text())
    doc["layers"]["0"] = [0, 1, 2, 3] if doc["layers"]["0"] != [0, 1, 2, 3] else [4, 5, 6, 7]
    published.write_text(json.dumps(doc))
    problems = failures(out)
    assert ("method/expert-selection.json", "sha256 mismatch") in problems
    assert ("method/expert-selection.json", "keeps other experts than method/pruning-report.json records") in problems


@pytest.mark.slow
def test_a_stale_selection_of_the_same_name_is_not_published(spec, q8_moe, tmp_path):
    work = tmp_path / "models"
    selection = select(q8_moe, work / "SELECTION.json")
    model = prune(q8_moe, work / "model-4e-Q8_0.gguf", "--keep", selection)
    original = selection.read_bytes()
    (work / "method" / "model-4e-Q8_0.SELECTION.json").unlink()  # prune's copy of it
    select(q8_moe, work / "SELECTION.json.new", keep=6).replace(selection)  # a later selection under the same name
    out = tmp_path / "release"
    result = ggufcarve(
        "ladder", "run", spec, "--source", model, "-o", out, "--only", "Q4_K_M", "--quantizer", "libllama", "-t", "2"
    )
    assert result.code == 0, result.stderr
    assert "SELECTION.json not published: it is not the keep-set model-4e-Q8_0.gguf was pruned with" in " ".join(
        result.stderr.split()
    )
    assert (
        "no selection record published: model-4e-Q8_0.gguf was pruned with SELECTION.json, "
        "not found beside it; add the one `ggufcarve select -o` wrote with --selection FILE"
        in " ".join(result.stderr.split())
    )
    assert not (
        out / "method" / "expert-selection.json"
    ).exists() and "method/expert-selection.json" not in manifest_method(out)
    assert ggufcarve("verify", out, "--partial").code == 0
    # an explicit --selection of other experts is refused; one in the model's method/ directory with the recorded
    # bytes is found
    refused = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        model,
        "-o",
        out,
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "--selection",
        selection,
        "-q",
    )
    assert "chose other experts than model-4e-Q8_0.gguf keeps" in one_line_error(refused)
    kept = work / "method" / "SELECTION.json"
    kept.write_bytes(original)
    again = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        model,
        "-o",
        out,
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "-t",
        "2",
        "-q",
    )
    assert again.code == 0, again.stderr
    assert (out / "method" / "expert-selection.json").read_bytes() == original
    assert (
        sha256(kept)
        == json.loads((work / "method" / "model-4e-Q8_0.pruning-report.json").read_text())["inputs"][-1]["sha256"]
    )
    assert ggufcarve("verify", out, "--partial").code == 0


@pytest.mark.slow
def test_the_readme_route_publishes_the_selection_and_a_prune_without_one_says_so(spec, q8_moe, tmp_path):
    # select -o selection/X.json, prune --keep selection/X.json -o out/M.gguf, ladder run --source out/M.gguf
    selection = select(q8_moe, tmp_path / "selection" / "weights.json")
    model = prune(q8_moe, tmp_path / "out" / "model-4e.gguf", "--keep", selection)
    assert not (tmp_path / "out" / "weights.json").exists()  # the selection is not beside the model
    result = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        model,
        "-o",
        tmp_path / "release",
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "-t",
        "2",
        "-q",
    )
    assert result.code == 0, result.stderr
    assert (tmp_path / "release" / "method" / "expert-selection.json").read_bytes() == selection.read_bytes()
    assert "selection record" not in result.stderr
    # pruned without a selection: one warning line naming the way to add it
    plain = prune(q8_moe, tmp_path / "out" / "model-first4.gguf", "--keep-first", "4")
    result = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        plain,
        "-o",
        tmp_path / "release-first4",
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "-t",
        "2",
        "-q",
    )
    assert result.code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "no selection record published" in line]
    assert len(lines) == 1 and lines[0].startswith("warning:") and lines[0].rstrip().endswith("--selection FILE"), (
        result.stderr
    )
    assert not (tmp_path / "release-first4" / "method" / "expert-selection.json").exists()


@pytest.mark.slow
def test_a_plain_keep_set_and_an_explicit_selection_are_both_published(spec, q8_moe, tmp_path):
    work = tmp_path / "models"
    selection = select(q8_moe, tmp_path / "elsewhere" / "SELECTION.json")
    keep = work / "keep.json"
    keep.parent.mkdir(parents=True)
    keep.write_text(json.dumps({"layers": json.loads(selection.read_text())["layers"]}))
    model = prune(q8_moe, work / "model-4e-Q8_0.gguf", "--keep", keep)
    out = tmp_path / "release"
    result = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        model,
        "-o",
        out,
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "-t",
        "2",
        "-q",
        "--selection",
        selection,
    )
    assert result.code == 0, result.stderr
    assert (out / "method" / "keep-set.json").read_bytes() == keep.read_bytes()
    assert (out / "method" / "expert-selection.json").read_bytes() == selection.read_bytes()
    assert {"method/keep-set.json", "method/expert-selection.json"} <= set(manifest_method(out))
    assert ggufcarve("verify", out, "--partial").code == 0
