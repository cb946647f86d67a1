"""`ggufcarve score` and `ggufcarve select` as a user runs them; llama.cpp loads every pruned result."""

from __future__ import annotations

import json

import factory
import numpy as np
import pytest
from clirun import ggufcarve
from conftest import make_imatrix
from llama_probe import probe

from ggufcarve.select.criteria import ZERO_SHOT

PROMPT = [1] + [3 + (i * 37) % 256 for i in range(40)]
K = {"deepseek2": 8}  # 16 experts in 4 groups; the others have 8 experts, top-2


def select(*args):
    result = ggufcarve("select", *args, "-q")
    assert result.code == 0, result.stderr
    return result


def prune_and_load(model, selection, out):
    result = ggufcarve("prune", model, "--keep", selection, "-o", out, "-q")
    assert result.code == 0, result.stderr
    loaded = probe(out, PROMPT)
    assert loaded.ok and np.isfinite(loaded.logits).all(), loaded.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", factory.ARCHES)
def test_every_method_selects_a_keep_set_llama_cpp_loads(arch, make_model, llama_tools, tmp_path):
    model = make_model(arch, "F16")
    imatrix = make_imatrix(llama_tools, model, tmp_path, chunks=2)
    text = tmp_path / "calibration.txt"  # make_imatrix's text, traced in two chunks of 64 tokens
    k = K.get(arch, 4)
    for method in (
        "weights",
        "aimer",
        "router-norm",
        "random",
        "imatrix-counts",
        "imatrix-energy",
        "imatrix-msan",
        "frequency",
        "ean",
        "mone",
        "reap",
        "hope",
        "razor",
    ):
        extra = ["--imatrix", imatrix] if method.startswith("imatrix") else []
        if method in ("frequency", "ean", "mone", "reap", "hope", "razor"):
            extra = ["--calibration", text, "--ctx", 64, "--max-tokens", 128, "-t", 2]
        selection = tmp_path / f"{method}.json"
        select(model, "--method", method, "--keep", k, *extra, "-o", selection)
        record = json.loads(selection.read_text())
        assert (tmp_path / f"{method}.png").stat().st_size > 0
        assert record["method"] == method and record["kept_count"] == k
        for block, entry in record["per_block"].items():
            assert sorted(entry["retained"] + entry["pruned"]) == list(range(record["source_expert_count"]))
            assert entry["retained"] == record["layers"][block]
            if entry["mtp"] and method not in ZERO_SHOT:
                assert entry["rule"] == "weights" and "MTP" in entry["note"]
        if method == "imatrix-counts":
            assert all("routed" in e for e in record["per_block"].values() if not e["mtp"])
            assert record["inputs"][0]["name"] == imatrix.name and len(record["inputs"][0]["sha256"]) == 64
        prune_and_load(model, selection, tmp_path / method / "pruned.gguf")


@pytest.mark.slow
def test_one_pass_criteria_through_score_select_and_merge(make_model, tmp_path):
    """ean-sum, msan and mone as `score` and `select` take them: the record names the pass and the
    statistics it filled, each criterion's scores equal those another criterion's pass filled, and
    shards merge (ean-sum adds; mone's output sums add)."""
    model = make_model("gpt-oss", "F16")  # down biases: added to ffn_moe_down before every statistic
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(["experts route tokens through layers of matrices"] * 60))
    trace = ["--calibration", text, "--ctx", 64, "--max-tokens", 128, "-t", 2]
    for method in ("ean-sum", "msan", "mone"):
        assert ggufcarve("score", model, "--method", method, *trace, "-o", tmp_path / f"{method}.json", "-q").code == 0
    docs = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("ean-sum", "msan", "mone")}
    for method, doc in docs.items():
        assert doc["method"] == method
        assert doc["parameters"]["pass"] == {
            "decode": "calibration",
            "consumer": "statistics",
            "asked": method,
            "statistics": ["frequency", "ean", "ean-sum", "msan", "mone", "reap", "hope"],
        }
    # the msan pass and the mone pass fill the same Σ||f||²: one decode, every statistic
    assert docs["msan"]["blocks"]["0"]["sums_sq"] == docs["mone"]["blocks"]["0"]["sums_sq"]
    from gguf import GGUFReader

    n_embd = next(int(t.shape[0]) for t in GGUFReader(model).tensors if t.name == "token_embd.weight")
    assert np.asarray(docs["mone"]["blocks"]["0"]["output_sums"]).shape == (
        len(docs["mone"]["blocks"]["0"]["counts"]),
        n_embd,
    )
    merged = tmp_path / "merged.json"
    assert (
        ggufcarve("score", "--merge", tmp_path / "ean-sum.json", tmp_path / "ean-sum.json", "-o", merged, "-q").code
        == 0
    )
    np.testing.assert_allclose(
        json.loads(merged.read_text())["blocks"]["0"]["sums"], 2 * np.asarray(docs["ean-sum"]["blocks"]["0"]["sums"])
    )
    select(
        model,
        "--method",
        "msan",
        "--keep",
        4,
        *trace,
        "--protect-super-experts",
        "-o",
        tmp_path / "msan-sel.json",
        "--no-heatmap",
    )
    record = json.loads((tmp_path / "msan-sel.json").read_text())
    assert record["parameters"]["pass"]["asked"] == "msan" and record["per_block"]["0"]["statistic"] == "mean_square"
    select(tmp_path / "mone.json", "--keep", 4, "-o", tmp_path / "mone-sel.json", "--no-heatmap")
    mone = np.asarray(json.loads((tmp_path / "mone-sel.json").read_text())["per_block"]["0"]["score"])
    assert json.loads((tmp_path / "mone-sel.json").read_text())["per_block"]["0"]["retained"] == sorted(
        np.argsort(-mone, kind="stable")[:4].tolist()
    )


def test_score_then_select_and_merge(make_model, tmp_path):
    model = make_model("qwen35moe", "F16")
    scores = tmp_path / "scores.json"
    assert ggufcarve("score", model, "--method", "weights", "-o", scores, "-q").code == 0
    select(scores, "--ratio", 0.5, "-o", tmp_path / "from-scores.json", "--no-heatmap")
    quiet = select(model, "--method", "weights", "--keep", 4, "-o", tmp_path / "direct.json", "--no-heatmap")
    assert quiet.stdout.splitlines() == [f"selection: {tmp_path / 'direct.json'}"]  # -q: the result line alone
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("from-scores.json", "direct.json"))
    assert a["layers"] == b["layers"] and set(a["layers"]) == {"0", "1", "2"}  # blk.2 is the MTP block
    assert a["inputs"][-1]["kind"] == "scores"
    merged = ggufcarve("score", "--merge", scores, scores, "-o", tmp_path / "m.json")
    assert merged.code == 1 and "nothing to merge" in merged.error_line
    compared = ggufcarve("select", "--compare", tmp_path / "from-scores.json", tmp_path / "direct.json")
    assert compared.code == 0 and "mean overlap 1.000 over 3 blocks" in compared.stdout


def assert_refused(result, message, *unwritten):
    assert result.code == 1, result.stderr
    assert message in result.error_line and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr
    for path in unwritten:
        assert not path.exists() and not path.with_suffix(".png").exists()


def test_bad_input_is_one_line_and_writes_nothing(make_model, dense_model, tmp_path):
    model = make_model("qwen3moe", "F16")
    out = tmp_path / "sel.json"
    assert_refused(
        ggufcarve("select", dense_model, "--method", "weights", "--keep", 2, "-o", out), "no routed experts", out
    )
    assert_refused(
        ggufcarve("select", model, "--method", "weights", "--keep", 1, "-o", out), "below the 2 experts", out
    )
    assert_refused(ggufcarve("select", model, "--method", "weights", "--keep", 9, "-o", out), "outside 2..8", out)
    assert_refused(
        ggufcarve("select", model, "--method", "imatrix-counts", "--keep", 4, "-o", out), "reads an imatrix", out
    )
    assert_refused(ggufcarve("select", model, "--method", "nope", "--keep", 4, "-o", out), "unknown method", out)


@pytest.mark.slow
def test_imatrix_of_another_model_or_a_dat_is_refused(make_model, llama_tools, tmp_path):
    model = make_model("qwen3moe", "F16")
    other = make_model("qwen3moe", "F16", n_expert=16, n_expert_used=2)
    foreign = make_imatrix(llama_tools, other, tmp_path, chunks=1)
    out = tmp_path / "sel.json"
    result = ggufcarve("select", model, "--method", "imatrix-counts", "--imatrix", foreign, "--keep", 4, "-o", out)
    assert_refused(result, "is not an imatrix of", out)
    own = make_imatrix(llama_tools, model, tmp_path, chunks=1)
    dat = tmp_path / "own.dat"
    assert ggufcarve("imatrix", "convert", own, "-o", dat, "-q").code == 0
    result = ggufcarve("select", model, "--method", "imatrix-counts", "--imatrix", dat, "--keep", 4, "-o", out)
    assert_refused(result, "no per-expert routing counts", out)
    select(model, "--method", "imatrix-energy", "--imatrix", dat, "--keep", 4, "-o", out)


@pytest.mark.slow
def test_calibrating_commands_run_from_a_directory_holding_an_empty_ggufcarve_folder(tmp_path):
    """A folder named ggufcarve in the working directory (the clone's parent, say) must not shadow
    the installed package in the children (`python -m ggufcarve.llama.decode`): select and imatrix
    collect trace through one. The command is started as the installed console script is, without
    the working directory on sys.path."""
    import os
    import subprocess
    import sys

    from ggufcarve.demo import CALIBRATION, DEMO_MODEL

    (tmp_path / "ggufcarve").mkdir()
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop("PYTHONPATH", None)
    commands = (
        (
            "select",
            DEMO_MODEL,
            "--method",
            "frequency",
            "--calibration",
            CALIBRATION,
            "--ctx",
            256,
            "--max-tokens",
            512,
            "--keep",
            8,
            "-t",
            2,
            "-o",
            "selection.json",
            "--no-heatmap",
            "-q",
        ),
        (
            "imatrix",
            "collect",
            DEMO_MODEL,
            "--calibration",
            CALIBRATION,
            "--ctx",
            256,
            "--chunks",
            2,
            "-t",
            2,
            "-o",
            "demo.imatrix.gguf",
        ),
    )
    for argv in commands:
        done = subprocess.run(
            [sys.executable, "-P", "-m", "ggufcarve", *map(str, argv)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "selection.json").read_text())["kept_count"] == 8
    assert (tmp_path / "demo.imatrix.gguf").is_file()
