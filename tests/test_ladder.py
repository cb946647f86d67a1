"""Ladder specs and `ggufcarve ladder run` with the real quantizer on tiny fixtures (llama.cpp is the judge)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from clirun import ggufcarve, sha256, tensor_bytes

from ggufcarve.errors import BadInput
from ggufcarve.fileio import format_size
from ggufcarve.gguf.container import read_model
from ggufcarve.llama.trace import trace_routing
from ggufcarve.quant.ladder_plan import model_name_from, plan_ladder
from ggufcarve.quant.quantizer import BinaryQuantizer, QuantizeJob
from ggufcarve.quant.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "ladders" / "q8-to-iq1.toml"
SMALL_SPEC = """
name = "test-ladder"
[defaults]
imatrix_fallback_type = "Q4_K"
[[rungs]]
ftype = "Q6_K"
[[rungs]]
ftype = "Q4_K_M"
description = "the usual"
[[rungs]]
ftype = "IQ2_XS"
"""


# ---------------------------------------------------------------------------------------------
# specs (no llama.cpp)


def test_shipped_spec_has_the_nine_published_rungs():
    spec = load_spec(SHIPPED)
    assert [r.name for r in spec.rungs] == [
        "Q8_0",
        "Q6_K",
        "Q5_K_M",
        "Q4_K_M",
        "Q3_K_M",
        "Q2_K",
        "IQ2_XS",
        "IQ1_M",
        "IQ1_S",
    ]
    assert [r.name for r in spec.rungs if r.needs_imatrix] == ["IQ2_XS", "IQ1_M", "IQ1_S"]
    assert all(r.allow_requantize and r.imatrix_fallback_type == "Q4_K" and r.description for r in spec.rungs)
    assert spec.rungs[3].file_name("Qwen3.6-35B-A3B-128E") == "Qwen3.6-35B-A3B-128E-Q4_K_M.gguf"
    assert len(spec.sha256) == 64


def test_needs_imatrix_is_derived_from_ftype_and_overrides():
    spec = parse_spec(
        {
            "rungs": [
                {"ftype": "Q4_K_M", "tensor_types": [["ffn_down_exps", "IQ2_XXS"]], "name": "Q4_K_M-IQ"},
                {"ftype": "Q4_K_M", "tensor_types": ["attn_.*=Q8_0"]},
                {"ftype": "Q2_K_S"},
                {"ftype": "Q3_K_S", "tensor_types": {"ffn_up": "Q2_K"}},
            ]
        }
    )
    assert [r.needs_imatrix for r in spec.rungs] == [True, False, True, False]
    assert spec.rungs[1].tensor_types == (("attn_.*", "Q8_0"),)
    assert spec.select(["q4_k_m"]) == (spec.rungs[1],)
    with pytest.raises(BadInput, match="no such rung"):
        spec.select(["Q5_K_M"])


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"rungs": [{"ftype": "Q9_K"}]}, "unknown ftype"),
        ({"rungs": [{"ftype": "Q4_K_M", "colour": "red"}]}, "unknown key"),
        ({"rungs": [{"ftype": "Q4_K_M", "output_tensor_type": "Q7"}]}, "not a ggml tensor type"),
        ({"rungs": [{"ftype": "IQ1_S", "imatrix_fallback_type": "IQ2_XS"}]}, "itself needs an imatrix"),
        ({"rungs": [{"ftype": "Q4_K_M"}, {"ftype": "Q4_K_M"}]}, "appear twice"),
        ({"rungs": [{"ftype": "Q4_K_M", "tensor_types": [["(", "Q8_0"]]}]}, "regex"),
        ({"rungs": [{"ftype": "Q4_K_M", "file_pattern": "{model}.gguf"}]}, "must contain"),
        ({"name": "x"}, "no \\[\\[rungs\\]\\]"),
    ],
)
def test_bad_specs_are_refused(doc, message):
    with pytest.raises(BadInput, match=message):
        parse_spec(doc)


def test_model_name_from_source():
    assert model_name_from(Path("Qwen3.6-35B-A3B-pruned-Q8_0.gguf")) == "Qwen3.6-35B-A3B-pruned"
    assert model_name_from(Path("m-q8_0-00001-of-00003.gguf")) == "m"
    assert model_name_from(Path("plain.gguf")) == "plain"


# ---------------------------------------------------------------------------------------------
# real quantizer


@pytest.fixture(scope="module")
def small_spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "small.toml"
    path.write_text(SMALL_SPEC)
    return path


@pytest.fixture(scope="module")
def ladder(small_spec, q8_moe, q8_moe_imatrix, llama_tools, tmp_path_factory):
    """Q6_K, Q4_K_M, IQ2_XS from the Q8_0 fixture with the binary quantizer; built once per module."""
    out = tmp_path_factory.mktemp("ladder") / "out"
    result = ggufcarve(
        "ladder",
        "run",
        small_spec,
        "--source",
        q8_moe,
        "--imatrix",
        q8_moe_imatrix,
        "-o",
        out,
        "--quantizer",
        llama_tools / "llama-quantize",
        "-t",
        "2",
    )
    assert result.code == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.slow
def test_ladder_rungs_succeed_and_load(ladder, q8_moe, q8_moe_imatrix, llama_tools):
    import llama_probe

    out, result = ladder
    manifest = json.loads((out / "quant-manifest.json").read_text())
    names = [r["name"] for r in manifest["rungs"]]
    assert names == ["Q6_K", "Q4_K_M", "IQ2_XS"]
    stem = model_name_from(q8_moe)
    for rung in manifest["rungs"]:
        path = out / rung["files"][0]["name"]
        assert path.name == f"{stem}-{rung['name']}.gguf"
        assert rung["status"] == "built" and rung["exit_status"] == 0
        assert rung["sha256"] == sha256(path) == rung["files"][0]["sha256"]
        assert rung["bytes"] == path.stat().st_size and rung["gib"] == round(path.stat().st_size / 2**30, 4)
        assert 2 < rung["bits_per_weight"] < 7.5
        assert rung["source_sha256"] == [sha256(q8_moe)]
        cmd = rung["command"]  # as published: file names only, the final output name
        assert cmd[0] == "llama-quantize" and "--allow-requantize" in cmd
        assert cmd[cmd.index("--imatrix") + 1] == q8_moe_imatrix.name
        assert cmd[-4:] == [q8_moe.name, path.name, rung["ftype"], "2"]
        probe = llama_probe.probe(path, [1, 70, 80, 90, 100, 110])
        assert probe.ok, probe.stderr[-2000:]
        assert np.isfinite(probe.logits).all()
    types = {t.type_name for t in read_model(out / f"{stem}-IQ2_XS.gguf").tensors}
    assert "IQ2_XS" in types
    assert manifest["source"]["sha256"] == sha256(q8_moe) and manifest["source"]["expert_count"] == 8
    assert manifest["imatrix"]["sha256"] == sha256(q8_moe_imatrix)
    assert manifest["imatrix"]["chunk_count"] == 4 and manifest["imatrix"]["datasets"][0].endswith("calibration.txt")
    q = manifest["quantizer"]
    assert q["backend"] == "binary" and q["sha256"] == sha256(llama_tools / "llama-quantize") and q["build"] is not None
    # the final table
    for column in ("rung", "size", "bits/weight", "sha256", "seconds", "status"):
        assert column in result.stdout
    assert (
        format_size(manifest["rungs"][2]["bytes"]) in result.stdout and " MiB" in result.stdout
    )  # a small model's sizes in MiB
    assert "IQ2_XS" in result.stdout and manifest["rungs"][2]["sha256"][:12] in result.stdout
    # no temp or partial files left, no lock held; the whole ladder is built, so its rung fragments are merged
    # and removed
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
def test_sha256sums_pass_coreutils(ladder):
    out, _ = ladder
    text = (out / "SHA256SUMS").read_text()
    lines = text.splitlines()
    assert text.endswith("\n") and "\r" not in text
    assert [line.split("  ", 1)[1] for line in lines] == sorted(line.split("  ", 1)[1] for line in lines)
    assert "quant-manifest.json" in text
    proc = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": OK") == 4


@pytest.mark.slow
def test_iq_rung_without_imatrix_is_refused_before_anything_runs(small_spec, q8_moe, tmp_path):
    out = tmp_path / "out"
    result = ggufcarve("ladder", "run", small_spec, "--source", q8_moe, "-o", out)
    assert result.code == 1
    assert "IQ2_XS needs an imatrix" in result.error_line and "--imatrix" in result.error_line
    assert not out.exists()


@pytest.mark.slow
def test_unremapped_imatrix_is_refused(small_spec, q8_moe, q8_moe_imatrix, tmp_path):
    pruned = tmp_path / "pruned-Q8_0.gguf"
    assert ggufcarve("prune", q8_moe, "--keep-first", "4", "-o", pruned, "-q").code == 0
    result = ggufcarve(
        "ladder",
        "run",
        small_spec,
        "--source",
        pruned,
        "--imatrix",
        q8_moe_imatrix,
        "-o",
        tmp_path / "out",
        "--only",
        "Q4_K_M",
    )
    assert result.code == 1
    assert (
        "does not match pruned-Q8_0.gguf" in result.error_line and "is different from tensor size" in result.error_line
    )
    assert "imatrix remap" in result.error_line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_remapped_imatrix_on_pruned_model(small_spec, q8_moe, q8_moe_imatrix, tmp_path):
    """The real workflow: prune 8 -> 4 experts, remap the imatrix with ggufcarve imatrix remap, IQ2_XS rung."""
    import llama_probe

    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"layers": {"0": [0, 2, 5, 7], "1": [1, 2, 3, 6]}}))
    pruned = tmp_path / "pruned-Q8_0.gguf"
    assert ggufcarve("prune", q8_moe, "--keep", keep, "-o", pruned, "-q").code == 0
    remapped = tmp_path / "pruned.imatrix.gguf"
    remap = ggufcarve("imatrix", "remap", q8_moe_imatrix, "--keep", keep, "-o", remapped, "--model", pruned)
    assert remap.code == 0, remap.stderr
    out = tmp_path / "out"
    result = ggufcarve(
        "ladder",
        "run",
        small_spec,
        "--source",
        pruned,
        "--imatrix",
        remapped,
        "-o",
        out,
        "--only",
        "IQ2_XS",
        "--quantizer",
        "libllama",
        "-t",
        "2",
    )
    assert result.code == 0, result.stderr[-2000:]
    rung = out / "pruned-IQ2_XS.gguf"
    assert read_model(rung).get("qwen3moe.expert_count") == 4
    # the reports describing the ladder's inputs are published with it, under the release's names
    for name, beside in (
        ("pruning-report.json", "pruned-Q8_0.pruning-report.json"),
        ("imatrix-remap-report.json", "pruned.imatrix.imatrix-remap-report.json"),
    ):
        assert (out / "method" / name).read_bytes() == (tmp_path / "method" / beside).read_bytes()
        assert f"  method/{name}\n" in (out / "SHA256SUMS").read_text()
    assert ggufcarve("verify", out, "--partial").code == 0
    report = json.loads((out / "method" / "pruning-report.json").read_text())
    report["output"]["expert_count"] = 5
    (out / "method" / "pruning-report.json").write_text(json.dumps(report))
    tampered = ggufcarve("verify", out, "--partial")
    assert tampered.code == 1 and "pruning-report.json" in tampered.stderr and "expert_count" in tampered.stderr, (
        tampered.stderr
    )
    probe = llama_probe.probe(rung, [1, 70, 80, 90])
    assert probe.ok and np.isfinite(probe.logits).all(), probe.stderr[-2000:]


@pytest.mark.slow
def test_mtp_block_without_imatrix_gets_the_fallback_type(make_model, llama_tools, tmp_path):
    """qwen35moe: llama-imatrix never runs the MTP block; the IQ rung still succeeds, recorded."""
    from conftest import make_imatrix

    model = make_model("qwen35moe", dtype="Q8_0", n_embd=256, n_ff_exp=256)
    imatrix = make_imatrix(llama_tools, model, tmp_path)
    mtp = 2  # blk.2 is the MTP block of the fixture
    # the trap is real: llama-quantize alone aborts, and leaves a truncated file behind
    direct = BinaryQuantizer(llama_tools / "llama-quantize").run(
        QuantizeJob(model, tmp_path / "direct.gguf", "IQ2_XS", imatrix=imatrix, nthreads=2)
    )
    assert direct.returncode != 0 and direct.error.startswith(f"Missing importance matrix for tensor blk.{mtp}.")

    out = tmp_path / "out"
    spec = tmp_path / "spec.toml"
    spec.write_text(SMALL_SPEC.replace('"Q4_K"', '"Q5_K"'))
    result = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        model,
        "--imatrix",
        imatrix,
        "-o",
        out,
        "--only",
        "IQ2_XS",
        "--quantizer",
        llama_tools / "llama-quantize",
    )
    assert result.code == 0, result.stderr[-3000:]
    assert "need an imatrix but have no entry; quantized as Q5_K" in result.stderr
    rung = json.loads((out / "quant-manifest.json").read_text())["rungs"][0]
    fallback = rung["imatrix_fallback"]
    assert fallback["type"] == "Q5_K" and fallback["tensors"]
    assert all(name.startswith(f"blk.{mtp}.") for name in fallback["tensors"])
    assert f"blk.{mtp}.ffn_up_exps.weight" in fallback["tensors"]
    cmd = rung["command"]
    assert f"^blk\\.{mtp}\\.ffn_up_exps\\.weight$=Q5_K" in cmd
    types = {t.name: t.type_name for t in read_model(out / rung["files"][0]["name"]).tensors}
    assert types[f"blk.{mtp}.ffn_up_exps.weight"] == "Q5_K" and types["blk.1.ffn_up_exps.weight"] == "IQ2_XS"


@pytest.mark.slow
def test_resume_skips_and_rebuilds_corrupted(ladder, small_spec, q8_moe, q8_moe_imatrix, llama_tools, tmp_path):
    src, _ = ladder
    out = tmp_path / "out"
    shutil.copytree(src, out)
    files = sorted(out.glob("*.gguf"))
    before = {p.name: (p.stat().st_mtime_ns, sha256(p)) for p in files}
    args = (
        "ladder",
        "run",
        small_spec,
        "--source",
        q8_moe,
        "--imatrix",
        q8_moe_imatrix,
        "-o",
        out,
        "--quantizer",
        llama_tools / "llama-quantize",
        "-t",
        "2",
    )
    again = ggufcarve(*args)
    assert again.code == 0, again.stderr[-2000:]
    assert again.stdout.count("skipped (unchanged)") == 3
    assert {p.name: (p.stat().st_mtime_ns, sha256(p)) for p in files} == before

    q6 = next(p for p in files if p.name.endswith("-Q6_K.gguf"))
    with open(q6, "r+b") as f:
        f.seek(q6.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    rebuilt = ggufcarve(*args)
    assert rebuilt.code == 0, rebuilt.stderr[-2000:]
    assert rebuilt.stdout.count("skipped (unchanged)") == 2
    assert sha256(q6) == before[q6.name][1]  # rebuilt, deterministic
    assert ggufcarve("verify", out, "--partial").code == 0


@pytest.mark.slow
def test_failing_rung_leaves_no_partial_and_keep_going(q8_moe, q8_moe_imatrix, llama_tools, tmp_path):
    """A rung that really fails inside llama-quantize (IQ1_S token_embd without imatrix data aborts
    mid-write, exit 134, after writing part of the file)."""
    spec = tmp_path / "spec.toml"
    spec.write_text("""
[[rungs]]
ftype = "Q4_K_M"
name = "BROKEN"
tensor_types = [["token_embd", "IQ1_S"]]
[[rungs]]
ftype = "Q4_K_M"
""")
    base = (
        "ladder",
        "run",
        spec,
        "--source",
        q8_moe,
        "--imatrix",
        q8_moe_imatrix,
        "--quantizer",
        llama_tools / "llama-quantize",
        "-t",
        "2",
        "-q",
    )
    out = tmp_path / "stop"
    stop = ggufcarve(*base, "-o", out)
    assert stop.code == 1
    assert "rung BROKEN failed" in stop.error_line
    assert sorted(p.name for p in out.iterdir()) == [".ggufcarve-fragments", "SHA256SUMS", "quant-manifest.json"]
    rungs = {r["name"]: r for r in json.loads((out / "quant-manifest.json").read_text())["rungs"]}
    assert (
        rungs["BROKEN"]["status"] == "failed" and rungs["BROKEN"]["exit_status"] != 0 and rungs["BROKEN"]["files"] == []
    )
    assert (
        rungs["BROKEN"]["error"] and str(tmp_path) not in (out / "quant-manifest.json").read_text()
    )  # the error as published: no local paths
    assert rungs["Q4_K_M"]["status"] == "not run" and rungs["Q4_K_M"]["command"] == []

    out = tmp_path / "going"
    going = ggufcarve(*base, "-o", out, "--keep-going")
    assert going.code == 1
    assert "FAILED" in going.stdout and "built" in going.stdout
    assert sorted(p.name for p in out.glob("*.gguf")) == [f"{model_name_from(q8_moe)}-Q4_K_M.gguf"]
    assert not list(out.glob(".*.tmp"))
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True).returncode == 0


@pytest.mark.slow
def test_libllama_backend_ladder_and_dry_run(small_spec, q8_moe, ladder, llama_tools, tmp_path):
    src, _ = ladder
    out = tmp_path / "out"
    dry = ggufcarve(
        "ladder",
        "run",
        small_spec,
        "--source",
        q8_moe,
        "-o",
        out,
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "--dry-run",
    )
    assert dry.code == 0 and "quantize_child" in dry.stdout and not out.exists()
    run = ggufcarve(
        "ladder",
        "run",
        small_spec,
        "--source",
        q8_moe,
        "-o",
        out,
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "-t",
        "2",
    )
    assert run.code == 0, run.stderr[-2000:]
    manifest = json.loads((out / "quant-manifest.json").read_text())
    assert manifest["quantizer"]["backend"] == "libllama" and manifest["rungs"][0]["command"][1:3] == [
        "-m",
        "ggufcarve.llama.quantize_child",
    ]
    rung = out / manifest["rungs"][0]["files"][0]["name"]
    assert read_model(rung).get("general.file_type") == 15
    # llama.cpp loads the rung and computes finite logits, routing every token to top-2 experts
    trace = trace_routing(rung, [1, 70, 80, 90, 100, 110])
    assert np.isfinite(trace.logits).all() and trace.logits.std() > 0
    assert {block: ids.shape for block, ids in trace.topk.items()} == {0: (6, 2), 1: (6, 2)}
    # and it is what llama-quantize itself writes for the same job (one llama.cpp source)
    binary = BinaryQuantizer(llama_tools / "llama-quantize").run(
        QuantizeJob(q8_moe, tmp_path / "binary.gguf", "Q4_K_M", nthreads=2)
    )
    assert binary.returncode == 0, binary.error
    assert all(
        tensor_bytes(rung, t.name) == tensor_bytes(tmp_path / "binary.gguf", t.name) for t in read_model(rung).tensors
    )


@pytest.mark.slow
def test_dry_run_does_not_hash_the_source(small_spec, q8_moe, tmp_path, monkeypatch):
    from ggufcarve.fileio import cached_sha256

    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    dry = ggufcarve(
        "ladder",
        "run",
        small_spec,
        "--source",
        q8_moe,
        "-o",
        tmp_path / "out",
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "--dry-run",
    )
    assert dry.code == 0, dry.stderr
    assert cached_sha256(q8_moe) is None
    run = ggufcarve(
        "ladder",
        "run",
        small_spec,
        "--source",
        q8_moe,
        "-o",
        tmp_path / "out",
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "-t",
        "2",
        "-q",
    )
    assert run.code == 0 and cached_sha256(q8_moe) is not None, run.stderr[-2000:]


def test_plan_refuses_output_next_to_source(q8_moe_copy_dir):
    from ggufcarve.errors import OutputError
    from ggufcarve.quant.quantizer import LibllamaQuantizer

    spec = parse_spec({"rungs": [{"ftype": "Q4_K_M"}]})
    with pytest.raises(OutputError, match="holds the source"):
        plan_ladder(spec, q8_moe_copy_dir / "m-Q8_0.gguf", q8_moe_copy_dir, quantizer=LibllamaQuantizer())


@pytest.fixture
def q8_moe_copy_dir(q8_moe, tmp_path):
    shutil.copy(q8_moe, tmp_path / "m-Q8_0.gguf")
    return tmp_path


def test_ladder_run_takes_the_name_of_a_shipped_spec(q8_moe, tmp_path):
    """`ladder run q8-to-iq1` as a plan's `[ladder] spec = "q8-to-iq1"`; an unknown name lists the known ones."""
    dry = ggufcarve(
        "ladder",
        "run",
        "q8-to-iq1",
        "--source",
        q8_moe,
        "-o",
        tmp_path / "out",
        "--only",
        "Q4_K_M",
        "--quantizer",
        "libllama",
        "--dry-run",
    )
    assert dry.code == 0, dry.stderr
    assert "Q4_K_M" in dry.stdout
    unknown = ggufcarve("ladder", "run", "q9-to-iq0", "--source", q8_moe, "-o", tmp_path / "out", "--dry-run")
    assert unknown.code == 1
    assert "no such spec file" in unknown.error_line and "q8-to-iq1" in unknown.error_line


@pytest.mark.slow
def test_topk_routes_every_rung_and_the_manifest_records_the_trained_value(small_spec, q8_moe, tmp_path):
    """--topk 1 on the top-2 fixture: the rung differs from the same rung built without it in the used count
    alone (every tensor and every other key equal), llama.cpp routes each token to one expert, the manifest says
    trained 2, written 1, and a run without --topk rebuilds the rung rather than resuming it."""
    out = tmp_path / "out"
    common = ["ladder", "run", small_spec, "--source", q8_moe, "-o", out, "--only", "Q4_K_M", "-t", "2"]
    routed = ggufcarve(*common, "--quantizer", "libllama", "--topk", "1")
    assert routed.code == 0, routed.stderr[-2000:]
    assert "experts per token: 1 in every rung (trained: 2)" in routed.stderr
    manifest = json.loads((out / "quant-manifest.json").read_text())
    assert manifest["expert_used_count"] == {"trained": 2, "written": 1}
    rung = out / manifest["rungs"][0]["files"][0]["name"]
    assert manifest["rungs"][0]["sha256"] == sha256(rung)
    assert [p.name for p in out.rglob("*.tmp")] == []  # no unrouted temp left
    trace = trace_routing(rung, [1, 70, 80, 90, 100, 110])
    assert {block: ids.shape for block, ids in trace.topk.items()} == {0: (6, 1), 1: (6, 1)}
    kept = tmp_path / "routed.gguf"
    rung.rename(kept)  # the run without --topk must rebuild it, not find it unchanged
    plain = ggufcarve(*common, "--quantizer", "libllama")
    assert plain.code == 0, plain.stderr[-2000:]
    assert json.loads((out / "quant-manifest.json").read_text())["expert_used_count"] == {"trained": 2, "written": 2}
    routed_model, plain_model = read_model(kept), read_model(rung)
    used = "qwen3moe.expert_used_count"
    assert (routed_model.get(used), plain_model.get(used)) == (1, 2)
    assert {k.key: k.raw for k in routed_model.metadata.kvs if k.key != used} == {
        k.key: k.raw for k in plain_model.metadata.kvs if k.key != used
    }
    assert all(tensor_bytes(kept, t.name) == tensor_bytes(rung, t.name) for t in plain_model.tensors)
