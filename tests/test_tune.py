"""`ggufcarve tune`: keep-sets scored by masking inside one loaded model equal `ggufcarve eval` of the
really pruned file; successive halving stops the losers early."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.llama.calibration import read_calibration
from ggufcarve.llama.devices import Compute
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.select import greedy
from ggufcarve.tune.report import cliff, knee, render_markdown
from ggufcarve.tune.run import ALL_METHODS, TuneSettings, fit_greedy
from tests.clirun import ggufcarve

DATA = Path(__file__).resolve().parent.parent / "ggufcarve" / "demo" / "data"
MODEL = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
CTX, CHUNKS = 256, 16  # the demo model's held-out measurement (ctx 256, 16 chunks)


def test_knee_is_where_the_slope_of_kld_against_k_rises_most():
    # flat from K=8 up, steep below: slopes -0.5, -0.05, -0.01 -> rises 0.45 at 4, 0.04 at 8
    assert knee([(2, 1.5), (4, 0.5), (8, 0.3), (16, 0.22)]) == 4
    assert knee([(16, 0.22), (4, 0.5), (2, 1.5), (8, 0.3)]) == 4  # order given does not matter
    # a straight line then a drop: the knee at the K after which the curve turns flat
    assert knee([(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.9), (5, 0.85)]) == 3
    assert knee([(4, 0.5), (8, 0.3)]) is None  # fewer than 3 K: no knee


def test_cliff_reports_each_method_and_the_best_per_k():
    candidates = [
        {"method": m, "K": k, "kld_mean": y}
        for m, k, y in [
            ("reap", 2, 1.0),
            ("reap", 4, 0.4),
            ("reap", 8, 0.3),
            ("weights", 2, 2.0),
            ("weights", 4, 1.8),
            ("weights", 8, 0.2),
        ]
    ]
    got = cliff(candidates, ("reap", "weights"), (2, 4, 8))
    assert got["methods"]["reap"] == {"K": 4, "curve": [[2, 1.0], [4, 0.4], [8, 0.3]]}
    assert got["methods"]["weights"]["K"] == 4 and got["best"]["curve"] == [[2, 1.0], [4, 0.4], [8, 0.2]]
    assert got["best"]["K"] == 4


@pytest.mark.slow
def test_tune_winner_equals_eval_of_the_pruned_file(tmp_path):
    out = tmp_path / "tune"
    run = ggufcarve(
        "tune",
        MODEL,
        "--calibration",
        DATA / "calibration.txt",
        "--heldout",
        DATA / "heldout.txt",
        "--keep",
        "8",
        "--methods",
        "reap,frequency,weights",
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "-o",
        out,
        "-q",
    )
    assert run.code == 0, run.stderr
    report = json.loads((out / "tune.json").read_text())
    assert report["kind"] == "tune" and report["left_out"] == {}
    candidates = {c["id"]: c for c in report["candidates"]}
    assert set(candidates) == {"reap-8", "frequency-8", "weights-8"}
    for cid in candidates:
        assert (out / "candidates" / f"{cid}.json").is_file()
    assert "## K = 8 of 16" in (out / "tune.md").read_text()
    assert report["cliff"]["methods"]["reap"] == {
        "K": None,
        "curve": [[8, candidates["reap-8"]["kld_mean"]]],
    }  # one K: no knee
    assert (out / "tune-kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    winner = candidates[report["winner"]]
    assert winner["winner"] and winner["chunks_scored"] == CHUNKS and not winner["stopped_early"]
    # three distinct keep-sets; a candidate leaves a round only when its paired KLD
    # difference to the round's leader exceeds two standard errors; the finalists get every chunk
    distinct = [c for c in candidates.values() if c["identical_to"] is None]
    assert len(distinct) == 3
    for c in distinct:
        if c["stopped_early"]:
            assert c["stopped_reason"] == "halving" and c["chunks_scored"] < CHUNKS
            assert c["delta_vs_leader"][-1] > 2 * c["delta_stderr"][-1] > 0
        else:
            assert c["chunks_scored"] == CHUNKS
    finalists = [c for c in distinct if not c["stopped_early"]]
    assert winner["kld_mean"] == min(c["kld_mean"] for c in finalists)
    rounds = report["halving"][0]["rounds"]
    assert rounds[0]["chunks"] < CHUNKS and rounds[-1]["chunks"] == CHUNKS
    # the winner's record is the selection written as expert-selection.json
    assert (
        json.loads((out / "expert-selection.json").read_text())["layers"]
        == json.loads((out / "candidates" / f"{winner['id']}.json").read_text())["layers"]
    )

    pruned = tmp_path / "pruned.gguf"
    run = ggufcarve("prune", MODEL, "--keep", out / "candidates" / f"{winner['id']}.json", "-o", pruned, "-q")
    assert run.code == 0, run.stderr
    run = ggufcarve(
        "eval",
        pruned,
        "--reference",
        MODEL,
        "--heldout",
        DATA / "heldout.txt",
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "--speed-runs",
        "0",
        "-o",
        tmp_path / "eval",
    )
    assert run.code == 0, run.stderr
    evaluated = json.loads((tmp_path / "eval" / "pruned.json").read_text())
    # masked and pruned logits are not bit-identical on the demo model: llama.cpp's softmax gating
    # sums exp() in SIMD lanes the -inf entries regroup, and a last-bit change of a routing weight
    # carries through the KV cache (182 of 508 scored rows differ at 4 chunks: 1.2e-4 relative in
    # the mean KLD; 1.2e-5 at 16 chunks)
    assert winner["kld_mean"] == pytest.approx(evaluated["kld_mean"], rel=1e-4)
    assert winner["tokens"] == CHUNKS * (CTX - 1 - CTX // 2)


def _halves(text: str) -> tuple[str, str]:
    """The calibration text cut at the line break nearest its middle character."""
    middle = len(text) // 2
    breaks = [i for i, ch in enumerate(text[:-1]) if ch == "\n"]
    cut = min(breaks, key=lambda i: abs(i - middle)) + 1
    return text[:cut], text[cut:]


@pytest.mark.slow
def test_tune_stability_equals_the_overlap_of_select_on_each_half(tmp_path):
    out = tmp_path / "tune"
    run = ggufcarve(
        "tune",
        MODEL,
        "--calibration",
        DATA / "calibration.txt",
        "--heldout",
        DATA / "heldout.txt",
        "--keep",
        "6",
        "--methods",
        "reap,frequency,weights",
        "--ctx",
        CTX,
        "--chunks",
        4,
        "--max-tokens",
        8 * CTX,
        "--stability",
        "-o",
        out,
        "-q",
    )
    assert run.code == 0, run.stderr
    candidates = {c["id"]: c for c in json.loads((out / "tune.json").read_text())["candidates"]}
    assert "stability" not in candidates["weights-6"]
    for cid in ("reap-6", "frequency-6"):
        assert 0.0 <= candidates[cid]["stability"]["overlap"] <= 1.0
    assert "halves overlap" in (out / "tune.md").read_text()
    # the oracle: `ggufcarve select` on each half written here, with half the token budget
    keeps = []
    for side, text in enumerate(_halves((DATA / "calibration.txt").read_text(encoding="utf-8"))):
        half = tmp_path / f"half{side}.txt"
        half.write_text(text, encoding="utf-8")
        selection = tmp_path / f"reap{side}.json"
        run = ggufcarve(
            "select",
            MODEL,
            "--method",
            "reap",
            "--keep",
            6,
            "--calibration",
            half,
            "--ctx",
            CTX,
            "--max-tokens",
            4 * CTX,
            "-o",
            selection,
            "-q",
            "--no-heatmap",
        )
        assert run.code == 0, run.stderr
        keeps.append(json.loads(selection.read_text())["layers"])
    a, b = keeps
    per_block = [len(set(a[blk]) & set(b[blk])) / 6 for blk in sorted(a, key=int)]
    assert candidates["reap-6"]["stability"]["per_block"] == pytest.approx(per_block)
    assert candidates["reap-6"]["stability"]["overlap"] == pytest.approx(sum(per_block) / len(per_block))


def _demo_dimensions() -> dict[str, int]:
    """The demo model's dimensions as gguf-py reads them: its keys and its router tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(MODEL)
    key = {
        name: int(field.parts[field.data[0]][0])
        for name, field in reader.fields.items()
        if name.startswith("qwen3moe.")
    }
    blocks = sum(1 for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight"))
    return {
        "B": blocks,
        "E": key["qwen3moe.expert_count"],
        "k": key["qwen3moe.expert_used_count"],
        "n_embd": key["qwen3moe.embedding_length"],
        "n_ff": key["qwen3moe.expert_feed_forward_length"],
    }


def test_greedy_memory_estimate_counts_the_arrays_of_the_pass():
    d = _demo_dimensions()
    layout = inspect_layout(read_model(MODEL))
    tokens = 4096
    got = greedy.memory_estimate(layout, tokens, threads=2)
    # the docstring's terms: every block's traced nodes (MoE input, probs, top-k, k expert outputs,
    # 4 bytes each) and one block's [T, E, n_embd] float32 expert outputs
    assert got.captures == d["B"] * tokens * (d["n_embd"] * (1 + d["k"]) + d["E"] + d["k"]) * 4
    assert got.values == tokens * d["E"] * d["n_embd"] * 4
    assert (
        got.evaluator == d["B"] * d["E"] * 3 * d["n_ff"] * d["n_embd"] * 4
    )  # every expert's gate, up, down in float32 (< 1 GiB)
    assert got.peak == got.captures + got.block + got.evaluator and got.block > got.values
    # linear in T: the tokens `fitting_tokens` offers fit, one chunk more does not
    budget = 0.8 * 2**30
    fits = greedy.fitting_tokens(layout, budget, CTX, threads=2)
    assert (
        fits % CTX == 0
        and greedy.memory_estimate(layout, fits, 2).peak <= budget < greedy.memory_estimate(layout, fits + CTX, 2).peak
    )
    # T: a token per byte of the text (+3 for BOS, EOS, a leading space), whole chunks, within --max-tokens
    text_bytes = len((DATA / "calibration.txt").read_bytes().removesuffix(b"\n"))
    files = read_calibration([DATA / "calibration.txt"])
    assert greedy.token_bound(files, CTX, None) == (text_bytes + 3) // CTX * CTX
    assert greedy.token_bound(files, CTX, 1000) == 768


def test_greedy_refused_before_the_pass_when_its_estimate_exceeds_the_memory(monkeypatch):
    from ggufcarve.select import calibrate

    model = read_model(MODEL)
    layout = inspect_layout(model)
    monkeypatch.setattr(calibrate, "decode", lambda *a, **k: pytest.fail("the decode pass ran"))
    available = 2**30
    with pytest.raises(BadInput) as err:
        calibrate.calibrate_all(
            model,
            layout,
            "greedy",
            [DATA / "calibration.txt"],
            ctx=CTX,
            compute=Compute(threads=2),
            available_memory=available,
        )
    tokens = greedy.token_bound(read_calibration([DATA / "calibration.txt"]), CTX, None)
    assert (
        "greedy needs up to" in err.value.message
        and f"{tokens:,} calibration tokens" in err.value.message
        and "1.00 GiB" in err.value.message
    )
    hinted = int(err.value.hint.split("--max-tokens ")[1].split()[0])
    assert (
        greedy.memory_estimate(layout, hinted, 2).peak
        <= 0.8 * available
        < greedy.memory_estimate(layout, hinted + CTX, 2).peak
    )
    # the tokens hinted pass the check
    greedy.check_memory(layout, read_calibration([DATA / "calibration.txt"]), CTX, hinted, 2, available)
    # tune with greedy listed: refused before its output directory is made
    settings = TuneSettings(
        keeps=(8,),
        methods=("reap", "greedy"),
        calibration=(DATA / "calibration.txt",),
        heldout=(DATA / "heldout.txt",),
        ctx=CTX,
        compute=Compute(threads=2),
        available_memory=available,
    )
    with pytest.raises(BadInput, match="greedy needs up to"):
        fit_greedy(layout, settings)


def test_greedy_refused_by_the_command_line_in_one_line(tmp_path):
    """The memory this machine has, against a calibration text whose bound needs twice of it."""
    layout = inspect_layout(read_model(MODEL))
    available = greedy.available_memory()
    if available is None:
        pytest.skip("no /proc/meminfo")
    per_token = (greedy.memory_estimate(layout, 2 * CTX, 2).peak - greedy.memory_estimate(layout, CTX, 2).peak) / CTX
    text = tmp_path / "long.txt"
    text.write_text("x" * int(2 * available / per_token) + "\n")
    assert (
        greedy.memory_estimate(layout, greedy.token_bound(read_calibration([text]), CTX, None), 2).peak
        > 1.5 * available
    )
    run = ggufcarve(
        "score",
        MODEL,
        "--method",
        "greedy",
        "--calibration",
        text,
        "--ctx",
        CTX,
        "--threads",
        2,
        "-o",
        tmp_path / "s.json",
    )
    assert run.code != 0 and not (tmp_path / "s.json").exists()
    assert (
        "greedy needs up to" in run.error_line
        and "memory available" in run.error_line
        and "hint: give --max-tokens" in run.error_line
    )


def test_all_holds_greedy_only_when_it_fits():
    layout = inspect_layout(read_model(MODEL))
    settings = TuneSettings(
        keeps=(8,),
        methods=ALL_METHODS,
        calibration=(DATA / "calibration.txt",),
        heldout=(DATA / "heldout.txt",),
        ctx=CTX,
        compute=Compute(threads=2),
    )
    peak = greedy.memory_estimate(
        layout, greedy.token_bound(read_calibration([DATA / "calibration.txt"]), CTX, None), 2
    ).peak
    ran, left_out = fit_greedy(layout, replace(settings, available_memory=2 * peak))  # half of it: fits
    assert "greedy" in ran.methods and left_out == {}
    ran, left_out = fit_greedy(layout, replace(settings, available_memory=2 * peak - 1))
    assert ran.methods == tuple(m for m in ALL_METHODS if m != "greedy")
    assert list(left_out) == ["greedy"] and "of memory available" in left_out["greedy"]
    report = {
        "model": {"name": "m.gguf", "expert_count": 16},
        "parameters": {"ctx": CTX},
        "heldout": [],
        "candidates": [],
        "keeps": [],
        "winner": "reap-8",
        "left_out": left_out,
    }
    assert f"greedy left out of all: {left_out['greedy']}." in render_markdown(report).splitlines()


def test_inputs_are_checked_before_any_pass(tmp_path):
    """Keeping every expert, an empty held-out file and K beyond the expert count are refused in
    one line before the calibration pass, and nothing is written."""
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    out = tmp_path / "tune"
    common = ["--calibration", DATA / "calibration.txt", "--methods", "weights", "--ctx", CTX, "-o", out]
    run = ggufcarve("tune", MODEL, "--heldout", DATA / "heldout.txt", "--keep", "16", *common)
    assert run.code == 1 and "keeps every one of the 16 experts: nothing to prune" in run.stderr, run.stderr
    assert run.stderr.startswith("error:"), run.stderr[:200]  # no empty progress display above the error
    run = ggufcarve("tune", MODEL, "--heldout", DATA / "heldout.txt", "--keep", "17", *common)
    assert run.code == 1 and "K=17 is outside 4..16" in run.stderr, (
        run.stderr
    )  # the demo model routes 4 of its 16 experts
    run = ggufcarve("tune", MODEL, "--heldout", empty, "--keep", "8", *common)
    assert run.code == 1 and "empty.txt: the text is empty" in run.stderr, run.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_run_owns_its_candidates_folder(tmp_path):
    out = tmp_path / "tune"
    stale = out / "candidates" / "reap-12.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    run = ggufcarve(
        "tune",
        MODEL,
        "--heldout",
        DATA / "heldout.txt",
        "--keep",
        "8",
        "--methods",
        "weights,random",
        "--ctx",
        CTX,
        "--chunks",
        2,
        "-o",
        out,
        "-q",
    )
    assert run.code == 0, run.stderr
    report = json.loads((out / "tune.json").read_text())
    assert sorted(p.name for p in (out / "candidates").iterdir()) == sorted(
        f"{c['id']}.json" for c in report["candidates"]
    )


@pytest.mark.slow
def test_tune_search_writes_a_keep_set_scored_on_heldout_text_it_never_chose_by(tmp_path):
    """tune --search: from the K's winner, moves scored on the calibration text only; its keep-set file prunes,
    and the pruned file's KLD on the held-out text (ggufcarve eval) equals the search candidate's; another
    held-out file gives the same search from the same start (one criterion: the winner either way), move for
    move."""
    heldout_b = tmp_path / "heldout-b.txt"
    heldout_b.write_text((DATA / "heldout.txt").read_text()[::-1][:6000])
    reports = {}
    for name, heldout in (("a", DATA / "heldout.txt"), ("b", heldout_b)):
        out = tmp_path / name
        run = ggufcarve(
            "tune", MODEL, "--calibration", DATA / "calibration.txt", "--heldout", heldout, "--keep", "8",
            "--methods", "reap", "--ctx", CTX, "--chunks", CHUNKS, "--search", "--search-passes", "2",
            "-o", out, "-q",
        )  # fmt: skip
        assert run.code == 0, run.stderr
        reports[name] = json.loads((out / "tune.json").read_text())
    report = reports["a"]
    found = next(c for c in report["candidates"] if c["method"] == "search")
    assert found["id"] == "search-8" and found["chunks_scored"] == CHUNKS
    search = found["search"]
    start = report["halving"][0]["winner"]
    assert search["start"] == start and search["passes"] == 2 and search["steps"] >= 1
    assert (
        search["start_calibration_kld_mean"] > 0
        and search["calibration_kld_mean"] <= search["start_calibration_kld_mean"]
    )
    other = next(c for c in reports["b"]["candidates"] if c["method"] == "search")["search"]
    assert (other["path"], other["calibration_kld_mean"]) == (search["path"], search["calibration_kld_mean"])
    keep_file = tmp_path / "a" / "candidates" / "search-8.json"
    pruned = tmp_path / "pruned.gguf"
    assert ggufcarve("prune", MODEL, "--keep", keep_file, "-o", pruned, "-q").code == 0
    run = ggufcarve(
        "eval", pruned, "--reference", MODEL, "--heldout", DATA / "heldout.txt", "--ctx", CTX, "--chunks", CHUNKS,
        "--speed-runs", "0", "-o", tmp_path / "eval",
    )  # fmt: skip
    assert run.code == 0, run.stderr
    evaluated = json.loads((tmp_path / "eval" / "pruned.json").read_text())
    assert found["kld_mean"] == pytest.approx(evaluated["kld_mean"], rel=1e-4)


@pytest.mark.parametrize("flags, z", [([], 2.0), (["--z", "3.5"], 3.5)])
def test_tune_takes_z_from_the_command_line(flags, z, monkeypatch, tmp_path):
    """--z is the same setting as best's: it reaches TuneSettings.z (the tournament's threshold); 0 is
    refused in one line before anything runs."""
    from typer.testing import CliRunner

    from ggufcarve.cli import app
    from ggufcarve.demo import DEMO_MODEL, HELDOUT
    from ggufcarve.tune import run as tune_run

    seen = []

    def tune(model, settings, output, on_event):
        seen.append(settings)
        raise BadInput("stopped here", "the settings were seen")

    monkeypatch.setattr(tune_run, "tune", tune)
    args = ["tune", str(DEMO_MODEL), "--methods", "frequency", "--keep", "8", "--heldout", str(HELDOUT)]
    result = CliRunner().invoke(app, [*args, *flags, "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1 and [s.z for s in seen] == [z], result.output
    refused = CliRunner().invoke(app, [*args, "--z", "0", "-o", str(tmp_path / "out")])
    assert isinstance(refused.exception, BadInput) and "--z must be a number > 0" in str(refused.exception)
    assert len(seen) == 1
