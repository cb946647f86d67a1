"""`ggufcarve tune`: keep-sets scored by masking inside one loaded model equal `ggufcarve eval` of the
really pruned file; successive halving stops the losers early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clirun import ggufcarve

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parent.parent / "ggufcarve" / "demo" / "data"
MODEL = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
CTX, CHUNKS = 256, 4


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
    assert (out / "tune-kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    winner = candidates[report["winner"]]
    assert winner["winner"] and winner["chunks_scored"] == CHUNKS and not winner["stopped_early"]
    # three distinct keep-sets: halving to one finalist leaves two losers scored on fewer chunks
    distinct = [c for c in candidates.values() if c["identical_to"] is None]
    losers = [c for c in distinct if c["id"] != winner["id"]]
    assert losers and all(c["stopped_early"] and c["chunks_scored"] < CHUNKS for c in losers)
    # the winner's record is the selection written as expert-selection.json
    assert json.loads((out / "expert-selection.json").read_text())["layers"] == json.loads((out / "candidates" / f"{winner['id']}.json").read_text())["layers"]

    pruned = tmp_path / "pruned.gguf"
    run = ggufcarve("prune", MODEL, "--keep", out / "candidates" / f"{winner['id']}.json", "-o", pruned, "-q")
    assert run.code == 0, run.stderr
    run = ggufcarve("eval", pruned, "--reference", MODEL, "--heldout", DATA / "heldout.txt", "--ctx", CTX, "--chunks", CHUNKS,
                    "--speed-runs", "0", "-o", tmp_path / "eval")
    assert run.code == 0, run.stderr
    evaluated = json.loads((tmp_path / "eval" / "pruned.json").read_text())
    assert winner["kld_mean"] == pytest.approx(evaluated["kld_mean"], rel=1e-4)
    assert winner["tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
