"""`best --topk`: the experts used per token as a candidate axis, scored by masking with the count
overridden at load, the finalists timed on files rewritten to N.

Oracles: the built, rewritten file of a masked variant scored by `measure` (the same per-token
comparison `ggufcarve eval` makes, held to llama-perplexity elsewhere) and the file's own header
read by gguf-py; the decision rules on records of known speeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import ggufcarve
from gguf import GGUFReader

from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT
from ggufcarve.pipeline.demo import FILES

USED = "qwen3moe.expert_used_count"


def _layout():
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(DEMO_MODEL)
    return model, inspect_layout(model)


def test_auto_weighs_the_trained_count_less_one_down_to_half_of_it():
    import dataclasses

    from ggufcarve.best.plan import weighed_used_counts
    from ggufcarve.errors import BadInput

    model, layout = _layout()
    assert weighed_used_counts(model, layout, None) == ()
    assert weighed_used_counts(model, layout, "auto") == (3, 2)  # the demo is trained at top-4
    assert weighed_used_counts(model, dataclasses.replace(layout, expert_used_count=8), "auto") == (7, 6, 5, 4)
    assert weighed_used_counts(model, dataclasses.replace(layout, expert_used_count=1), "auto") == ()
    assert weighed_used_counts(model, layout, (2, 4, 3)) == (3, 2)  # the trained count is the base candidate
    with pytest.raises(BadInput, match="N=17 is above qwen3moe.expert_count=16"):
        weighed_used_counts(model, layout, (17,))


def test_the_one_count_options_refuse_auto_and_lists(tmp_path):
    for args in (["prune", DEMO_MODEL, "--keep-first", "8", "--topk", "auto"], ["ladder", "run", "q8-to-iq1",
                 "--source", DEMO_MODEL, "--topk", "2,3"]):  # fmt: skip
        result = ggufcarve(*args, "-o", tmp_path / "out")
        assert result.code == 1, result.stderr
        assert "a written file is routed to one count of experts per token" in result.error_line, result.error_line
        assert not (tmp_path / "out").exists()


def test_min_decode_takes_the_best_finalist_that_reaches_it_and_says_when_none_does():
    from ggufcarve.best.finalists import rechecked
    from ggufcarve.best.plan import BestSettings

    def record(cid, kld, speed, used=4):
        return {"id": cid, "kld_mean": kld, "built": True, "fits": True, "decode_tok_s": speed, "experts_used": used,
                **({"topk_of": cid.rsplit("-", 1)[0]} if used != 4 else {})}  # fmt: skip

    def records():
        return {
            "K14-Q4_K_M": record("K14-Q4_K_M", 0.010, 30.0),
            "unpruned-Q2_K": record("unpruned-Q2_K", 0.020, 34.0),
            "K14-Q4_K_M-top3": record("K14-Q4_K_M-top3", 0.018, 38.0, used=3),
            "K14-Q4_K_M-top2": record("K14-Q4_K_M-top2", 0.050, 45.0, used=2),
        }

    decision = {"winner": "K14-Q4_K_M", "finalists": list(records())}
    for target, answer in ((36, "K14-Q4_K_M-top3"), (40, "K14-Q4_K_M-top2")):
        found = records()
        settings = BestSettings(memory=2**34, ladder=Path("q8-to-iq1"), heldout=(), min_decode=target)
        assert rechecked(found, decision, settings)["id"] == answer, target
    found = records()
    settings = BestSettings(memory=2**34, ladder=Path("q8-to-iq1"), heldout=(), min_decode=60)
    assert rechecked(found, decision, settings)["id"] == "K14-Q4_K_M"
    assert found["K14-Q4_K_M"]["answer_note"] == (
        "no finalist reaches --min-decode 60 tok/s: the fastest of the 4 timed, K14-Q4_K_M-top2, decodes at 45.0 tok/s"
    )


def test_the_frontier_keeps_the_finalists_no_faster_one_beats():
    from ggufcarve.evaluate.summary import speed_frontier

    points = [
        {"id": "a", "decode_tok_s": 10.0, "kld_mean": 0.01},
        {"id": "b", "decode_tok_s": 20.0, "kld_mean": 0.05},
        {"id": "c", "decode_tok_s": 15.0, "kld_mean": 0.06},  # slower and worse than b
        {"id": "d", "decode_tok_s": 30.0, "kld_mean": 0.20},
    ]
    assert [c["id"] for c in speed_frontier(points, "decode_tok_s", "kld_mean")] == ["d", "b", "a"]


@pytest.mark.slow
def test_best_weighs_used_counts_by_masking_and_times_them_on_rewritten_files(tmp_path):
    """--topk auto on the demo (top-4): candidates at 3 and 2 experts per token, scored by masking on the
    unpruned rungs (or on a built file with the count overridden); with a --min-decode no file reaches, every
    finalist is built and timed: each masked variant's rewritten file carries N in its header and scores as its
    mask did, and the answer says none reaches the target."""
    out = tmp_path / "best"
    result = ggufcarve(
        "best", DEMO_MODEL, "--memory", "11MiB", "--ctx", 256, "--ladder", FILES / "ladder.toml",
        "--calibration", CALIBRATION, "--heldout", HELDOUT, "--chunk-ctx", 128, "--chunks", 8, "--max-tokens", 2048,
        "--methods", "weights", "--keep", "14", "--tier", "ram", "-o", out, "-t", 2, "--topk", "auto",
        "--min-decode", "1000000",
    )  # fmt: skip
    assert result.code == 0, result.stderr[-3000:]
    report = json.loads((out / "best.json").read_text())
    candidates = {c["id"]: c for c in report["candidates"]}
    variants = [c for c in candidates.values() if c.get("topk_of")]
    assert {c["experts_used"] for c in variants} == {2, 3} and report["parameters"]["used_counts_weighed"] == [3, 2]
    assert {c["experts_used"] for c in candidates.values() if not c.get("topk_of")} == {4}
    masked = [c for c in variants if c["scored_by"] == "mask"]
    assert masked and all(c["masked_on"] == candidates[c["topk_of"]]["masked_on"] for c in masked)
    finalists = [c for c in candidates.values() if c["finalist"]]
    assert all(c["decode_tok_s"] > 0 for c in finalists)
    confirmed = [c for c in masked if c.get("confirmed")]
    assert confirmed
    for c in confirmed:
        path = out / c["path"]
        assert path.parent.name.endswith(f"-top{c['experts_used']}")
        assert GGUFReader(path).fields[USED].contents() == c["experts_used"]
        assert c["confirmed"]["file_kld_mean"] == pytest.approx(c["confirmed"]["masked_kld_mean"], rel=1e-3)
        trained = GGUFReader(out / c["routed_from"]).fields[USED].contents()
        assert trained == 4 and c["run_command_override"]["argv"][-2:] == [
            "--override-kv",
            f"{USED}=int:{c['experts_used']}",
        ]
    assert "no finalist reaches --min-decode 1e+06 tok/s" in report["winner"]["answer_note"]
    assert (out / "best-speed.png").is_file() and "](best-speed.png)" in (out / "best.md").read_text()
