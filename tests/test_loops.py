"""Repetition loops: the detector on made-up token streams, and eval --loops on the demo model,
judged by a brute-force reading of the detector's definition on continuations llama-cpp-python's
own greedy generator writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from clirun import ggufcarve

from ggufcarve.errors import BadInput
from ggufcarve.evaluate.loops import find_loop, load_loop_prompts, periodic_suffix


def _lead_in(n: int, seed: int = 1) -> list[int]:
    """n tokens without any period (distinct values, none of them used by the cycles below)."""
    return [int(x) for x in np.random.default_rng(seed).permutation(np.arange(1000, 5000))[:n]]


def test_cycle_of_one_token():
    stream = _lead_in(20) + [7] * 40
    loop = find_loop(stream)
    assert loop is not None and (loop.period, loop.start, loop.length) == (1, 20, 40)
    assert find_loop(_lead_in(20) + [7] * 31) is None  # fewer than 32 tokens


def test_cycle_of_seven_tokens():
    block = [11, 12, 13, 14, 15, 16, 17]
    loop = find_loop(_lead_in(30) + block * 5)
    assert loop is not None and (loop.period, loop.start, loop.repeats) == (7, 30, 5.0)
    assert find_loop(_lead_in(30) + block * 4 + block[:3]) is None  # 31 tokens of period 7
    ending_mid_block = find_loop(_lead_in(30) + block * 4 + block[:4])  # 32 tokens: a loop, ending mid-block
    assert ending_mid_block is not None and (ending_mid_block.period, ending_mid_block.length) == (7, 32)


def test_cycle_of_fifty_tokens():
    block = list(range(100, 150))
    loop = find_loop(_lead_in(10) + block * 3)
    assert loop is not None and (loop.period, loop.start, loop.repeats) == (50, 10, 3.0)
    assert find_loop(_lead_in(10) + block * 2 + block[:49]) is None  # 2.98 repeats: not 3
    assert find_loop(block * 3, max_period=49) is None  # beyond the longest period looked for


def test_a_near_cycle_is_not_a_loop():
    # a numbered list: the same 6 tokens and a counter, 30 times; no period covers the counter
    numbered = [t for i in range(30) for t in (21, 22, 23, 24, 25, 26, 300 + i)]
    assert find_loop(_lead_in(10) + numbered) is None
    # a cycle of 7 broken 20 tokens before the end: only 20 periodic tokens remain
    block = [31, 32, 33, 34, 35, 36, 37]
    broken = _lead_in(10) + block * 10
    broken[-20] = 99
    assert periodic_suffix(broken, 7) == 19  # the 12 tokens after the changed one's repeat, and the 7 they repeat
    assert find_loop(broken) is None
    # a repeat in the middle that the model left again
    assert find_loop(_lead_in(10) + block * 8 + _lead_in(40, seed=2)) is None


def test_no_cycle():
    assert find_loop(_lead_in(256)) is None
    assert find_loop([]) is None and find_loop([5] * 10) is None  # a continuation that ended early


def test_periodic_suffix_by_definition():
    rng = np.random.default_rng(0)
    for _ in range(300):
        stream = [int(x) for x in rng.integers(0, 3, size=int(rng.integers(0, 40)))]
        for p in range(1, 8):
            by_definition = max(
                (
                    n
                    for n in range(p, len(stream) + 1)
                    if all(stream[i] == stream[i - p] for i in range(len(stream) - n + p, len(stream)))
                ),
                default=0,
            )
            assert periodic_suffix(stream, p) == by_definition, (stream, p)


def test_loop_prompt_files(tmp_path):
    lines = tmp_path / "prompts.txt"
    lines.write_text("Tell me a story\n\nCount to ten\n")
    assert load_loop_prompts(lines) == [
        {"id": "line-1", "messages": [{"role": "user", "content": "Tell me a story"}]},
        {"id": "line-3", "messages": [{"role": "user", "content": "Count to ten"}]},
    ]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"id": "raw", "prompt": "def main():"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert [p["id"] for p in load_loop_prompts(jsonl)] == ["raw", "line-2"]
    jsonl.write_text('{"prompt": "a", "messages": []}\n')
    with pytest.raises(BadInput, match="prompts.jsonl:1"):
        load_loop_prompts(jsonl)


def _brute_force_loop(tokens: list[int]) -> int | None:
    """The smallest p <= 64 whose last max(32, 3p) tokens all repeat p tokens back, by the definition."""
    for p in range(1, 65):
        need = max(32, 3 * p)
        if need <= len(tokens) and all(tokens[i] == tokens[i - p] for i in range(len(tokens) - need + p, len(tokens))):
            return p
    return None


def _greedy_by_llama_cpp_python(model, rows: list[dict]) -> None:
    """Every continuation is llama-cpp-python's greedy choice at each step, up to near-ties: the
    chosen token's logit is within 0.5 of the largest. llama-cpp-python's Llama and the evaluation
    child run llama.cpp with other context settings, whose logits on this model differ by up to
    0.4 at some positions, enough to flip a near-tie; a token that is not the arg-max (sampling,
    a shifted position) lies several logits below it."""
    import llama_cpp
    import llama_cpp.llama_cpp as low_level

    # llama-cpp-python's Llama takes no use_extra_bufts; without it llama.cpp 0.3.36 repacks the
    # weights into the CPU's extra buffer types, and on CPUs with AMX the decode crashes
    # (ggufcarve's children load with use_extra_bufts = False, llama.libllama)
    defaults = low_level.llama_model_default_params

    def without_extra_buffer_types():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extra_buffer_types
    try:
        llm = llama_cpp.Llama(str(model), n_ctx=512, n_threads=2, verbose=False, logits_all=True)
    finally:
        low_level.llama_model_default_params = defaults
    try:
        for row in rows:
            prefix = llm.tokenize(row["prompt"].encode(), add_bos=True, special=False)
            assert len(prefix) == row["prompt_tokens"]
            llm.reset()
            llm.eval(prefix + row["tokens"])
            scores = np.asarray(llm.scores[len(prefix) - 1 : len(prefix) - 1 + len(row["tokens"])])
            chosen = scores[np.arange(len(row["tokens"])), row["tokens"]]
            assert np.all(chosen >= scores.max(axis=1) - 0.5), (
                row["id"],
                np.flatnonzero(chosen < scores.max(axis=1) - 0.5),
            )
    finally:
        llm.close()


@pytest.mark.slow
def test_eval_loops_on_the_demo_model(tmp_path):
    from ggufcarve.demo import DEMO_MODEL, HELDOUT

    pruned = tmp_path / "demo-4e-Q8_0.gguf"
    assert ggufcarve("prune", DEMO_MODEL, "--keep-first", 4, "-o", pruned, "-q").code == 0
    prompts = tmp_path / "loops.jsonl"
    raw = ["import os\n", "def main(", "class Config:\n    ", "    for i in range("]
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(raw))
        + json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Write a loop"}]})
        + "\n"
    )
    gate = tmp_path / "gate.toml"
    gate.write_text("max_loop_share_increase = 0.0\nmax_loop_share = 1.0\n")
    out = tmp_path / "out"
    result = ggufcarve(
        "eval",
        DEMO_MODEL,
        pruned,
        "--reference",
        DEMO_MODEL,
        "--heldout",
        HELDOUT,
        "--ctx",
        256,
        "--chunks",
        2,
        "--speed-runs",
        0,
        "--loop-prompts",
        prompts,
        "--gate",
        gate,
        "--cache",
        tmp_path / "cache",
        "-t",
        2,
        "-o",
        out,
    )
    assert result.code == 0, result.stderr[-3000:]
    itself, carved = (json.loads((out / f"{m.stem}.json").read_text()) for m in (DEMO_MODEL, pruned))
    for doc in (itself, carved):
        loops = doc["loops"]
        assert loops["total"] == 5 and loops["tokens"] == 256 and loops["prompts_from"] == "loops.jsonl"
        assert (
            doc["loop_share"] == loops["looped"] / 5
            and doc["loop_share_reference"] == loops["reference_share"] is not None
        )
        increase = doc["loop_share"] - doc["loop_share_reference"]
        assert (doc["gate"] == "FAIL") == (increase > 0), doc["gate_failed"]
        assert any(f.startswith("loop_share_increase") for f in doc["gate_failed"]) == (increase > 0)
    # the reference against itself: the same continuations, the same verdicts
    assert itself["loop_share"] == itself["loop_share_reference"] and itself["gate"] == "PASS"
    assert sorted(itself["loops"]["reference_looped_ids"]) == sorted(
        p["id"] for p in itself["loops"]["prompts"] if p["looped"]
    )
    # every continuation judged by the definition; the raw prompts' continuations are greedy by
    # llama-cpp-python's logits
    for model, doc in ((DEMO_MODEL, itself), (pruned, carved)):
        rows = doc["loops"]["prompts"]
        for row in rows:
            assert row["output_tokens"] == len(row["tokens"]) and (row["ended"] or len(row["tokens"]) == 256)
            assert row["period"] == _brute_force_loop(row["tokens"]) and row["looped"] == (row["period"] is not None), (
                model.name,
                row["id"],
            )
        _greedy_by_llama_cpp_python(
            model, [{**row, "prompt": raw[int(row["id"][1:])]} for row in rows if row["id"] != "chat"]
        )
    assert any(row["looped"] for row in carved["loops"]["prompts"]) and not all(
        row["looped"] for row in carved["loops"]["prompts"] + itself["loops"]["prompts"]
    )
    summary = (out / "summary.md").read_text()
    assert (
        "Loops |" in summary
        and f"{carved['loops']['looped']}/5 (ref {carved['loops']['reference_looped']}/5)" in summary
    )
    assert "loops" in result.stdout


def test_loops_column_in_the_card_and_the_gate_text():
    from types import SimpleNamespace

    from ggufcarve.evaluate.gate import Gate
    from ggufcarve.release.card_tables import GATE_TEXT, quant_table

    loops = {
        "looped": 2,
        "total": 10,
        "reference_looped": 1,
        "tokens": 256,
        "prompts_from": "QA suite",
        "detector": {"max_period": 64, "min_tokens": 32, "min_repeats": 3},
    }
    doc = {
        "ppl": 5.0,
        "ppl_delta_percent": 1.0,
        "kld_mean": 0.01,
        "same_top_p": 0.9,
        "qa_passed": 8,
        "qa_total": 10,
        "gate": "FAIL",
        "loops": loops,
        "loop_share": 0.2,
        "loop_share_reference": 0.1,
    }
    rungs = [
        {"name": "Q4_K_M", "files": [{"name": "m-Q4_K_M.gguf", "bytes": 2**20}], "sha256": "ab" * 32},
        {"name": "Q2_K", "files": [{"name": "m-Q2_K.gguf", "bytes": 2**19}], "sha256": "cd" * 32},
    ]
    rows = quant_table(SimpleNamespace(rungs=rungs, evaluation={"m-Q4_K_M.gguf": doc}))
    assert rows[0].endswith("| sha256 | Loops |") and rows[1].endswith("|---|")
    assert rows[2].endswith("| 2/10 (ref 1/10) |") and rows[3].endswith("| – |")  # the second rung was not evaluated
    assert "ends in a block of p <= 64 tokens repeated over at least max(32 tokens, 3 repeats)" in rows[-1]
    without = quant_table(SimpleNamespace(rungs=rungs, evaluation={"m-Q4_K_M.gguf": {**doc, "loops": None}}))
    assert not any("Loops" in row for row in without)
    verdict = Gate({"max_loop_share_increase": 0.05, "max_loop_share": 0.5}, "gate.toml").judge(doc)
    assert verdict.failed == ["loop_share_increase 0.1 > 0.05"] and verdict.passed == ["max_loop_share"]
    assert Gate({"max_loop_share_increase": 0.05}, "g").judge({**doc, "loop_share_reference": None}).not_measured == [
        "max_loop_share_increase"
    ]
    assert GATE_TEXT["max_loop_share_increase"].format(v=0.05, p=5.0).startswith("at most 5 percentage points")


def test_loop_settings_from_the_options(tmp_path):
    from ggufcarve.evaluate.qa import default_suite_path, load_suite
    from ggufcarve.evaluate.release import eval_settings

    settings, _ = eval_settings(loops=True)
    suite = load_suite(default_suite_path())
    assert [p["id"] for p in settings.loops.prompts] == [c.id for c in suite] and settings.loops.tokens == 256
    assert settings.loops.prompts[0]["messages"] == suite[0].messages and settings.loops.source == "QA suite"
    assert eval_settings()[0].loops is None
    prompts = tmp_path / "p.txt"
    prompts.write_text("once upon a time\n")
    given, _ = eval_settings(loop_prompts=prompts, loop_tokens=512)  # --loop-prompts implies --loops
    assert given.loops.tokens == 512 and given.loops.source == "p.txt" and len(given.loops.prompts) == 1
    with pytest.raises(BadInput, match="add --loops"):
        eval_settings(loop_tokens=300)
    with pytest.raises(BadInput, match="--loop-tokens 100"):
        eval_settings(loops=True, loop_tokens=100)
