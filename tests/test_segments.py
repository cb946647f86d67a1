"""Several held-out files, each its own segment: each one's statistics equal `eval` of that file
alone, the overall ones are those of every file's tokens together, the gate can require every
file to pass, and summary.md, the charts and the card show them.

Models are the tiny qwen3moe fixtures (259 byte tokens): the Q8_0 model against the F16 one, on
two different texts (words, and digits with punctuation), context 128, 2 chunks per file.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from clirun import ggufcarve

from ggufcarve.llama.devices import Compute

CTX, CHUNKS = 128, 2
WORDS = "experts route every token through a few of many feed forward blocks chosen by a router".split()


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("segments-text")
    rng = random.Random(11)
    words = base / "words.txt"
    words.write_text(" ".join(rng.choice(WORDS) for _ in range(140)) + "\n")
    digits = base / "digits.txt"
    digits.write_text("".join(rng.choice("0123456789,;{}()=") for _ in range(800)) + "\n")
    return [words, digits]


@pytest.fixture(scope="module")
def reference(make_model) -> Path:
    return make_model("qwen3moe", dtype="F16")


@pytest.fixture(scope="module")
def runs(reference, q8_moe, texts, tmp_path_factory) -> dict:
    """eval of the Q8_0 model on both files at once, and on each file alone (one reference cache)."""
    base = tmp_path_factory.mktemp("segments")
    common = (
        "--reference",
        reference,
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "--speed-runs",
        0,
        "--cache",
        base / "cache",
        "-t",
        2,
    )
    both = ggufcarve("eval", q8_moe, *common, *(a for t in texts for a in ("--heldout", t)), "-o", base / "both")
    assert both.code == 0, both.stderr[-3000:]
    alone = []
    for text in texts:
        result = ggufcarve("eval", q8_moe, *common, "--heldout", text, "-q", "-o", base / text.stem)
        assert result.code == 0, result.stderr[-3000:]
        alone.append(json.loads((base / text.stem / f"{q8_moe.stem}.json").read_text()))
    return {
        "base": base,
        "common": common,
        "stdout": both.stdout,
        "both": json.loads((base / "both" / f"{q8_moe.stem}.json").read_text()),
        "alone": alone,
    }


SEGMENT_FIGURES = (
    "kld_mean",
    "kld_mean_stderr",
    "kld_p999",
    "same_top_p",
    "ppl",
    "ppl_stderr",
    "ppl_reference",
    "ppl_delta_percent",
    "kld_median",
    "kld_p99",
    "kld_max",
    "kld_tail_stderr",
    "rms_dp",
)


def test_each_segment_equals_eval_of_its_file_alone(runs, texts):
    both, alone = runs["both"], runs["alone"]
    assert [s["name"] for s in both["segments"]] == [t.name for t in texts]
    assert [h["name"] for h in both["heldout"]] == [t.name for t in texts]
    for segment, single in zip(both["segments"], alone):
        for key in SEGMENT_FIGURES:
            assert segment[key] == pytest.approx(single[key], rel=1e-9, abs=1e-12), (segment["name"], key)
        assert segment["tokens"] == single["parameters"]["scored_tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
        assert segment["chunks"] == single["parameters"]["chunks"] == CHUNKS
        # one file: the result document as before, no segment keys
        assert "segments" not in single and "gate_segments" not in single and isinstance(single["heldout"], dict)
    # the two texts differ: their segments do too
    assert both["segments"][0]["kld_mean"] != both["segments"][1]["kld_mean"]
    lines = runs["stdout"].splitlines()
    assert any(line.startswith(f"  {texts[1].name}: PPL ") for line in lines)


def test_overall_is_the_statistics_of_every_files_tokens(runs):
    """The overall figures recomputed from each file's eval alone: token-weighted means, and the
    standard errors from the per-file sums of squares they imply (perplexity.cpp's formulas)."""
    both, alone = runs["both"], runs["alone"]
    n = [a["parameters"]["scored_tokens"] for a in alone]
    total = sum(n)
    assert both["parameters"]["scored_tokens"] == total and both["parameters"]["chunks"] == CHUNKS * len(alone)

    def mean(key: str) -> float:
        return sum(k * a[key] for k, a in zip(n, alone)) / total

    def stderr(means: list[float], stderrs: list[float]) -> float:
        # per file: stderr^2 (n - 1) = E[x^2] - E[x]^2
        second = sum(k * (s * s * (k - 1) + m * m) for k, m, s in zip(n, means, stderrs)) / total
        overall = sum(k * m for k, m in zip(n, means)) / total
        return math.sqrt((second - overall * overall) / (total - 1))

    assert both["kld_mean"] == pytest.approx(mean("kld_mean"), rel=1e-9)
    assert both["same_top_p"] == pytest.approx(mean("same_top_p"), rel=1e-9)
    assert both["kld_max"] == max(a["kld_max"] for a in alone)
    assert both["kld_mean_stderr"] == pytest.approx(
        stderr([a["kld_mean"] for a in alone], [a["kld_mean_stderr"] for a in alone]), rel=1e-6
    )
    log_ppl = [math.log(a["ppl"]) for a in alone]
    assert both["ppl"] == pytest.approx(math.exp(sum(k * x for k, x in zip(n, log_ppl)) / total), rel=1e-9)
    assert both["ppl_reference"] == pytest.approx(
        math.exp(sum(k * math.log(a["ppl_reference"]) for k, a in zip(n, alone)) / total), rel=1e-9
    )
    log_stderr = stderr(log_ppl, [a["ppl_stderr"] / a["ppl"] for a in alone])
    assert both["ppl_stderr"] == pytest.approx(log_stderr * both["ppl"], rel=1e-6)


def test_summary_and_chart_show_the_segments(runs, texts, q8_moe):
    out, both = runs["base"] / "both", runs["both"]
    summary = (out / "summary.md").read_text()
    assert "## Segments" in summary and "![size-vs-kld-segments.png](size-vs-kld-segments.png)" in summary
    for segment in both["segments"]:
        row = next(
            line
            for line in summary.splitlines()
            if line.startswith(f"| {q8_moe.stem} | ") and f"| {segment['name']} |" in line
        )
        assert (
            f"| {segment['tokens']} | {segment['ppl']:.4f} |" in row
            and f"| {segment['kld_mean']:.6f} | {segment['kld_mean_stderr']:.6f} | {segment['kld_p999']:.6f} |" in row
        )
    assert (out / "size-vs-kld-segments.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    single = runs["base"] / texts[0].stem
    assert (
        "## Segments" not in (single / "summary.md").read_text() and not (single / "size-vs-kld-segments.png").exists()
    )


def test_gate_every_fails_a_model_that_fails_on_one_file(runs, q8_moe, texts, tmp_path):
    both = runs["both"]
    worse = max(both["segments"], key=lambda s: s["kld_mean"])
    better = min(both["segments"], key=lambda s: s["kld_mean"])
    limit = (
        both["kld_mean"] + worse["kld_mean"]
    ) / 2  # the overall mean and the better file pass, the worse file fails
    assert better["kld_mean"] <= both["kld_mean"] < limit < worse["kld_mean"]
    gate = tmp_path / "gate.toml"
    gate.write_text(f"max_kld_mean = {limit!r}\n")
    heldout = [a for t in texts for a in ("--heldout", t)]
    lenient = ggufcarve(
        "eval", q8_moe, *runs["common"], *heldout, "--gate", gate, "--strict", "-q", "-o", tmp_path / "overall"
    )
    assert lenient.code == 0, lenient.stderr[-2000:]
    doc = json.loads((tmp_path / "overall" / f"{q8_moe.stem}.json").read_text())
    assert doc["gate"] == "PASS" and doc["gate_segments"] == "overall"
    assert {s["name"]: s["gate"] for s in doc["segments"]} == {worse["name"]: "FAIL", better["name"]: "PASS"}
    strict = ggufcarve(
        "eval",
        q8_moe,
        *runs["common"],
        *heldout,
        "--gate",
        gate,
        "--gate-segments",
        "every",
        "--strict",
        "-q",
        "-o",
        tmp_path / "every",
    )
    assert strict.code == 1, strict.stderr[-2000:]
    doc = json.loads((tmp_path / "every" / f"{q8_moe.stem}.json").read_text())
    assert doc["gate"] == "FAIL" and doc["gate_segments"] == "every"
    assert doc["gate_failed"] == [f"{worse['name']}: kld_mean {worse['kld_mean']:.4g} > {limit:g}"]
    assert worse["name"] in next(line for line in strict.stderr.splitlines() if "failed the gate" in line)
    assert "The gate requires every file to pass." in (tmp_path / "every" / "summary.md").read_text()


def test_gate_file_sets_the_segment_mode(tmp_path):
    from ggufcarve.errors import BadInput
    from ggufcarve.evaluate.gate import load_gate

    path = tmp_path / "gate.toml"
    path.write_text('segments = "every"\nmax_kld_mean = 0.1\n')
    gate = load_gate(path)
    assert gate.segments == "every" and gate.thresholds == {"max_kld_mean": 0.1}
    path.write_text("[gate]\nmax_kld_mean = 0.1\n")
    assert load_gate(path).segments == "overall"
    path.write_text('segments = "all"\n')
    with pytest.raises(BadInput, match="segments"):
        load_gate(path)


def test_several_files_need_a_gguf_reference_and_distinct_names(reference, q8_moe, texts, tmp_path):
    base_file = tmp_path / "reference.kld"
    base_file.write_bytes(b"_logits_" + bytes(64))
    result = ggufcarve(
        "eval",
        q8_moe,
        "--reference",
        base_file,
        "--heldout",
        texts[0],
        "--heldout",
        texts[1],
        "--speed-runs",
        0,
        "-o",
        tmp_path / "a",
    )
    assert result.code != 0 and "holds the log-probs of one text" in result.error_line
    (tmp_path / "other").mkdir()
    twin = tmp_path / "other" / texts[0].name
    twin.write_text("another text\n")
    result = ggufcarve(
        "eval",
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        texts[0],
        "--heldout",
        twin,
        "--speed-runs",
        0,
        "-o",
        tmp_path / "b",
    )
    assert result.code != 0 and "distinct names" in result.error_line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_card_shows_each_files_mean_kld(runs, q8_moe, texts):
    from ggufcarve.release.card import render_card
    from ggufcarve.release.card_inputs import CardInputs

    out = runs["base"] / "both"
    docs = {d["model"]["file"]: d for d in (json.loads(p.read_text()) for p in out.glob("*.json"))}
    both = docs[q8_moe.name]
    rung = {"name": "Q8_0", "files": [{"name": q8_moe.name, "bytes": both["model"]["bytes"]}], "sha256": "ab" * 32}
    keys = {"general.architecture": "qwen3moe", "qwen3moe.expert_used_count": 2, "qwen3moe.expert_count": 8}
    card = render_card(
        CardInputs(
            {"source": {"name": "source.gguf"}},
            [rung],
            keys,
            None,
            None,
            docs,
            "evaluation",
            frozenset({"evaluation/size-vs-kld-segments.png"}),
        )
    )
    assert (
        "## Held-out segments" in card and f"| Model | Size | All | {texts[0].name} | {texts[1].name} | Gate |" in card
    )
    cells = " | ".join(f"{s['kld_mean']:.6f}" for s in both["segments"])
    assert f"| **{q8_moe.name}** | " in card and f"| {both['kld_mean']:.6f} | {cells} | {both['gate'] or '–'} |" in card
    assert "![File size vs mean KLD on each held-out file](evaluation/size-vs-kld-segments.png)" in card
    for text, segment in zip(texts, both["segments"]):
        row = next(line for line in card.splitlines() if line.startswith(f"| evaluation (held out) | {text.name} |"))
        assert f"({CHUNKS} chunks of {CTX}; {segment['tokens']:,} scored)" in row


@pytest.mark.slow
def test_cross_check_runs_llama_perplexity_on_each_file(runs, q8_moe, texts, llama_tools, tmp_path):
    heldout = [a for t in texts for a in ("--heldout", t)]
    result = ggufcarve(
        "eval",
        q8_moe,
        *runs["common"],
        *heldout,
        "--cross-check",
        "--llama-cpp",
        llama_tools,
        "-q",
        "-o",
        tmp_path / "out",
    )
    assert result.code == 0, result.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / f"{q8_moe.stem}.json").read_text())
    for segment in doc["segments"]:
        check = segment["cross_check"]
        assert check["ppl_agrees"] and f"{segment['ppl']:.4g}" == f"{check['ppl_mode']['ppl']:.4g}", (
            segment["name"],
            check,
        )
        # llama-perplexity's KLD from its own base file of this file alone
        assert check["kld_mode"]["kld_mean"] == pytest.approx(
            segment["kld_mean"], abs=2e-6 * (1 + segment["kld_mean"])
        ), segment["name"]


def test_the_measurement_layer_records_each_files_statistics(tmp_path):
    """tune's and best's per-file records (the measurement layer's `segments`) from the tables of each held-out file."""
    from ggufcarve.evaluate import kld
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, Segment, measure

    rng = np.random.default_rng(5)
    tables = []
    for f, rows in enumerate((40, 25)):
        table = np.zeros((rows, kld.TOKEN_COLUMNS))
        table[:, kld.NLL] = rng.uniform(0.5, 4.0, rows)
        table[:, kld.NLL_BASE] = table[:, kld.NLL] - rng.uniform(0, 0.1, rows)
        table[:, kld.KLD] = rng.exponential(0.01 * (f + 1), rows)
        table[:, kld.SAME_TOP] = rng.random(rows) < 0.9
        tables.append(table)
    segments = [Segment(name, tmp_path / f"{name}.kld", 1, 256, name) for name in ("a.txt", "b.txt")]
    measured = measure(
        [Candidate("cand", tmp_path / "m.gguf")],
        segments,
        MeasureSettings(Compute(threads=1)),
        tmp_path,
        score_unit=lambda _candidate, unit: tables[unit[0]],
    )
    got = measured.records["cand"]
    assert [s["name"] for s in got["segments"]] == ["a.txt", "b.txt"]
    for segment, table in zip(got["segments"], tables):
        assert set(segment) == {"name", *kld.SEGMENT_KEYS}
        assert segment["tokens"] == len(table)
        assert segment["kld_mean"] == pytest.approx(table[:, kld.KLD].mean(), rel=1e-12)
        assert segment["same_top_p"] == pytest.approx(table[:, kld.SAME_TOP].mean(), rel=1e-12)
        assert segment["ppl"] == pytest.approx(math.exp(table[:, kld.NLL].mean()), rel=1e-12)
        assert segment["kld_mean_stderr"] == pytest.approx(
            table[:, kld.KLD].std(ddof=0) / math.sqrt(len(table) - 1), rel=1e-9
        )
    assert (
        got["chunks_scored"] == 2
        and got["tokens"] == 65
        and got["kld_mean"] == pytest.approx(np.concatenate(tables)[:, kld.KLD].mean(), rel=1e-12)
    )


def test_tune_md_shows_each_files_kld():
    from ggufcarve.tune.report import render_markdown

    def candidate(method, kld_mean, per_file, winner=False):
        return {
            "id": f"{method}-8",
            "method": method,
            "K": 8,
            "identical_to": None,
            "winner": winner,
            "kld_mean": kld_mean,
            "kld_mean_stderr": 0.001,
            "kld_p999": 1.0,
            "same_top_p": 0.9,
            "ppl": 10.0,
            "chunks_scored": 4,
            "stopped_early": False,
            "segments": [{"name": n, "kld_mean": v} for n, v in per_file],
        }

    report = {
        "model": {"name": "m.gguf", "expert_count": 16},
        "parameters": {"ctx": 128},
        "heldout": [{"path": "/x/wiki.txt"}, {"path": "/x/code.txt"}],
        "keeps": [8],
        "winner": "reap-8",
        "candidates": [
            candidate("reap", 0.1, [("wiki.txt", 0.05), ("code.txt", 0.2)], True),
            candidate("frequency", 0.3, [("wiki.txt", 0.25), ("code.txt", None)]),
        ],
    }
    text = render_markdown(report)
    assert "| method | wiki.txt | code.txt |" in text
    assert "| reap | 0.0500 | 0.2000 |" in text and "| frequency | 0.2500 | – |" in text


def test_plan_takes_a_list_of_heldout_files(tmp_path):
    from ggufcarve.pipeline.plan import parse_plan

    for name in ("model-Q8_0.gguf", "a.txt", "b.txt"):
        (tmp_path / name).write_text("x\n")
    doc = {
        "source": "model-Q8_0.gguf",
        "output": "release",
        "selection": {"method": "weights", "keep": 4},
        "ladder": {"spec": "q8-to-iq1"},
    }
    one = parse_plan({**doc, "evaluation": {"heldout": "a.txt"}}, tmp_path)
    assert one.evaluation.heldout == tmp_path / "a.txt" and one.evaluation.heldout_files == (tmp_path / "a.txt",)
    assert one.to_json()["evaluation"]["heldout"] == "a.txt"
    two = parse_plan({**doc, "evaluation": {"heldout": ["a.txt", "b.txt"]}}, tmp_path)
    assert two.evaluation.heldout_files == (tmp_path / "a.txt", tmp_path / "b.txt")
    assert two.to_json()["evaluation"]["heldout"] == ["a.txt", "b.txt"]


def test_plan_evaluation_takes_the_segment_gate_and_loops(tmp_path):
    from ggufcarve.errors import BadInput
    from ggufcarve.pipeline.plan import parse_plan

    for name in ("model-Q8_0.gguf", "a.txt", "b.txt", "prompts.txt"):
        (tmp_path / name).write_text("x\n")
    doc = {
        "source": "model-Q8_0.gguf",
        "output": "release",
        "selection": {"method": "weights", "keep": 4},
        "ladder": {"spec": "q8-to-iq1"},
    }
    plan = parse_plan(
        {
            **doc,
            "evaluation": {
                "heldout": ["a.txt", "b.txt"],
                "gate_segments": "every",
                "loop_prompts": "prompts.txt",
                "loop_tokens": 300,
            },
        },
        tmp_path,
    )
    ev = plan.evaluation
    assert (ev.gate_segments, ev.loop_prompts, ev.loop_tokens) == ("every", tmp_path / "prompts.txt", 300)
    assert (
        plan.to_json()["evaluation"]["loop_prompts"] == "prompts.txt"
        and plan.to_json()["evaluation"]["gate_segments"] == "every"
    )
    plain = parse_plan({**doc, "evaluation": {"heldout": "a.txt"}}, tmp_path).to_json()["evaluation"]
    assert "loops" not in plain and "gate_segments" not in plain
    with pytest.raises(BadInput, match="loop_prompts"):
        parse_plan({**doc, "evaluation": {"heldout": "a.txt", "loop_prompts": "missing.txt"}}, tmp_path)


def test_a_plan_with_several_heldout_files_counts_a_reference_cache_per_file(q8_moe, texts, tmp_path):
    import shutil

    from ggufcarve.evaluate import kld

    shutil.copyfile(q8_moe, tmp_path / "model-Q8_0.gguf")
    (tmp_path / "ladder.toml").write_text('[[rungs]]\nftype = "Q8_0"\n')
    names = []
    for text in texts:
        shutil.copyfile(text, tmp_path / text.name)
        names.append(f'"{text.name}"')
    (tmp_path / "plan.toml").write_text(
        'source = "model-Q8_0.gguf"\noutput = "release"\n[selection]\nmethod '
        '= "weights"\nkeep = 4\n[ladder]\nspec = "ladder.toml"\n'
        f"[evaluation]\nheldout = [{', '.join(names)}]\nctx = {CTX}\nchunks = {CHUNKS}\nspeed_runs = 0\n"
    )
    result = ggufcarve("run", tmp_path / "plan.toml", "--dry-run", "--json")
    assert result.code == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)
    # a base file of CHUNKS chunks per held-out text (each holds more than CHUNKS * CTX bytes), none cached
    assert doc["reference_bytes"] == len(texts) * kld.base_file_bytes(CTX, 259, CHUNKS)
    assert doc["plan"]["evaluation"]["heldout"] == [t.name for t in texts]
    assert not (tmp_path / "release").exists()
