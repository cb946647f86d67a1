"""`ggufcarve tune`: keep-sets scored by masking inside one loaded model equal `ggufcarve eval` of the
really pruned file; successive halving stops the losers early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ggufcarve.tune.protocol import schedule
from ggufcarve.tune.run import cliff, knee
from tests.clirun import ggufcarve

DATA = Path(__file__).resolve().parent.parent / "ggufcarve" / "demo" / "data"
MODEL = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
CTX, CHUNKS = 256, 16  # the demo model's held-out measurement (ctx 256, 16 chunks)


def test_halving_schedule_ends_with_two_finalists_on_every_chunk():
    assert schedule(1, 4) == [(1, 4)]
    assert schedule(2, 4) == [(2, 4)]
    assert schedule(3, 4) == [(3, 2), (2, 4)]
    assert schedule(11, 16) == [(11, 2), (6, 4), (3, 8), (2, 16)]
    assert schedule(5, 2) == [(5, 1), (3, 2)]  # too few chunks to halve down to two


def test_knee_is_where_the_slope_of_kld_against_k_rises_most():
    # flat from K=8 up, steep below: slopes -0.5, -0.05, -0.01 -> rises 0.45 at 4, 0.04 at 8
    assert knee([(2, 1.5), (4, 0.5), (8, 0.3), (16, 0.22)]) == 4
    assert knee([(16, 0.22), (4, 0.5), (2, 1.5), (8, 0.3)]) == 4  # order given does not matter
    # a straight line then a drop: the knee at the K after which the curve turns flat
    assert knee([(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.9), (5, 0.85)]) == 3
    assert knee([(4, 0.5), (8, 0.3)]) is None  # fewer than 3 K: no knee


def test_cliff_reports_each_method_and_the_best_per_k():
    candidates = [{"method": m, "K": k, "kld_mean": y} for m, k, y in
                  [("reap", 2, 1.0), ("reap", 4, 0.4), ("reap", 8, 0.3), ("weights", 2, 2.0), ("weights", 4, 1.8), ("weights", 8, 0.2)]]
    got = cliff(candidates, ("reap", "weights"), (2, 4, 8))
    assert got["methods"]["reap"] == {"K": 4, "curve": [[2, 1.0], [4, 0.4], [8, 0.3]]}
    assert got["methods"]["weights"]["K"] == 4 and got["best"]["curve"] == [[2, 1.0], [4, 0.4], [8, 0.2]]
    assert got["best"]["K"] == 4


@pytest.mark.slow
def test_tune_winner_equals_eval_of_the_pruned_file(tmp_path):
    out = tmp_path / "tune"
    run = ggufcarve("tune", MODEL, "--calibration", DATA / "calibration.txt", "--heldout", DATA / "heldout.txt", "--keep", "8",
                    "--methods", "reap,frequency,weights", "--ctx", CTX, "--chunks", CHUNKS, "-o", out, "-q")
    assert run.code == 0, run.stderr
    report = json.loads((out / "tune.json").read_text())
    assert report["kind"] == "tune"
    candidates = {c["id"]: c for c in report["candidates"]}
    assert set(candidates) == {"reap-8", "frequency-8", "weights-8"}
    for cid in candidates:
        assert (out / "candidates" / f"{cid}.json").is_file()
    assert "## K = 8 of 16" in (out / "tune.md").read_text()
    assert report["cliff"]["methods"]["reap"] == {"K": None, "curve": [[8, candidates["reap-8"]["kld_mean"]]]}  # one K: no knee
    assert (out / "tune-kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    winner = candidates[report["winner"]]
    assert winner["winner"] and winner["chunks_scored"] == CHUNKS and not winner["stopped_early"]
    # three distinct keep-sets: the worst of the first round stops early, two finalists get every chunk
    distinct = [c for c in candidates.values() if c["identical_to"] is None]
    assert len(distinct) == 3
    stopped = [c for c in distinct if c["stopped_early"]]
    finalists = [c for c in distinct if not c["stopped_early"]]
    assert len(stopped) == 1 and stopped[0]["chunks_scored"] < CHUNKS
    assert len(finalists) == 2 and all(c["chunks_scored"] == CHUNKS for c in finalists)
    assert winner["kld_mean"] == min(c["kld_mean"] for c in finalists)
    assert stopped[0]["kld_mean"] > 0
    # the winner's record is the selection written as expert-selection.json
    assert json.loads((out / "expert-selection.json").read_text())["layers"] == json.loads((out / "candidates" / f"{winner['id']}.json").read_text())["layers"]

    pruned = tmp_path / "pruned.gguf"
    run = ggufcarve("prune", MODEL, "--keep", out / "candidates" / f"{winner['id']}.json", "-o", pruned, "-q")
    assert run.code == 0, run.stderr
    run = ggufcarve("eval", pruned, "--reference", MODEL, "--heldout", DATA / "heldout.txt", "--ctx", CTX, "--chunks", CHUNKS,
                    "--speed-runs", "0", "-o", tmp_path / "eval")
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
    run = ggufcarve("tune", MODEL, "--calibration", DATA / "calibration.txt", "--heldout", DATA / "heldout.txt", "--keep", "6",
                    "--methods", "reap,frequency,weights", "--ctx", CTX, "--chunks", 4, "--max-tokens", 8 * CTX, "--stability", "-o", out, "-q")
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
        run = ggufcarve("select", MODEL, "--method", "reap", "--keep", 6, "--calibration", half, "--ctx", CTX, "--max-tokens", 4 * CTX,
                        "-o", selection, "-q", "--no-heatmap")
        assert run.code == 0, run.stderr
        keeps.append(json.loads(selection.read_text())["layers"])
    a, b = keeps
    per_block = [len(set(a[blk]) & set(b[blk])) / 6 for blk in sorted(a, key=int)]
    assert candidates["reap-6"]["stability"]["per_block"] == pytest.approx(per_block)
    assert candidates["reap-6"]["stability"]["overlap"] == pytest.approx(sum(per_block) / len(per_block))
