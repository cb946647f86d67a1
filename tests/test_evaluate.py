"""ggufcarve eval: perplexity and KL divergence judged by direct numpy computations and by llama-perplexity itself.

Models are the tiny qwen3moe fixtures (259 byte tokens); the reference is the F16 model, its
Q8_0 / Q4_K_M / IQ2_XS versions and a pruned copy are evaluated against it with a context of
128 (63 scored tokens per chunk) on generated text.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import factory
import numpy as np
import pytest
from clirun import ggufcarve
from conftest import make_imatrix

from ggufcarve.evaluate import kld
from ggufcarve.evaluate.perplexity import Chunking, chunk_tokens, scored_targets
from ggufcarve.fileio import format_size

CTX = 128
CHUNKS = 4
WORDS = (
    "a model is worth publishing only once it is measured: perplexity on held-out text, the divergence of its "
    "next-token distribution from the reference, and whether it still answers the same questions"
).split()


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    rng = random.Random(7)
    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(140)) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(make_model) -> Path:
    return make_model("qwen3moe", dtype="F16")


@pytest.fixture(scope="module")
def first_run(reference, q8_moe, heldout, tmp_path_factory):
    """One eval of the reference itself and its Q8_0 version, with its cache directory and output directory."""
    base = tmp_path_factory.mktemp("eval")
    out, cache = base / "out", base / "cache"
    result = ggufcarve(
        "eval",
        reference,
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "--speed-runs",
        3,
        "--cache",
        cache,
        "-t",
        2,
        "-o",
        out,
    )
    assert result.code == 0, result.stderr[-3000:]
    return out, cache, result


def _load(out: Path, model: Path) -> dict:
    return json.loads((out / f"{model.stem}.json").read_text())


def _chunk_logits(model: Path, tokens: np.ndarray, chunking: Chunking) -> list[np.ndarray]:
    """Every position's logits of each chunk, from llama.cpp through the tests' own probe child."""
    import llama_probe

    rows = []
    for i in range(chunking.n_chunk):
        probe = llama_probe.probe(model, chunk_tokens(tokens, chunking, i, True, factory.BOS_ID).tolist())
        assert probe.ok, probe.stderr[-2000:]
        rows.append(probe.logits)
    return rows


def test_contract_keys_and_self_kld_is_zero(first_run, reference, q8_moe):
    out, _, result = first_run
    for model in (reference, q8_moe):
        doc = _load(out, model)
        for key in (
            "ppl",
            "ppl_stderr",
            "kld_mean",
            "kld_mean_stderr",
            "kld_median",
            "kld_p99",
            "kld_p999",
            "same_top_p",
            "rms_dp",
            "qa_passed",
            "qa_total",
            "qa_exact_vs_reference",
            "pp_tok_s",
            "tg_tok_s",
            "gate",
        ):
            assert key in doc, key
        assert doc["parameters"]["scored_tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
        assert doc["pp_tok_s"] > 0 and doc["tg_tok_s"] > 0 and doc["speed"]["threads"] == 2
        assert "/" not in json.dumps(doc["model"]["files"])  # names only, no local paths
    self_doc = _load(out, reference)
    # the reference against its own 16-bit log-probs (as llama-perplexity stores them): zero up to their rounding
    step = 16 / 65535  # the largest step of a base file's log-probs (they span at most 16 nats)
    assert (
        abs(self_doc["kld_mean"]) < step / 10
        and max(abs(self_doc["kld_max"]), abs(self_doc["kl_divergence"]["kld"]["min"])) < step
    )
    assert self_doc["same_top_p"] == 1.0 and self_doc["rms_dp"] < step
    assert self_doc["kld_method"] == "base-file" and self_doc["kld_tail_stderr"] == 0.0 and self_doc["kld_bound"] == 0.0
    assert self_doc["parameters"]["kld_full_vocabulary"] and self_doc["parameters"]["top_k"] is None
    assert self_doc["ppl"] == pytest.approx(self_doc["ppl_reference"], rel=BASE_STEP)
    q8 = _load(out, q8_moe)
    assert q8["kld_mean"] > 0 and q8["kld_p999"] >= q8["kld_p99"] >= q8["kld_median"] >= 0
    assert (
        f"{reference.stem} ({format_size(reference.stat().st_size)}): PPL" in result.stdout
        and "mean KLD" in result.stdout
    )
    assert format_size(reference.stat().st_size).endswith(" MiB")  # a small model in MiB, not 0.00 GiB


def test_perplexity_equals_numpy_on_the_same_logits(first_run, reference, q8_moe):
    out, cache, _ = first_run
    (cache_file,) = cache.glob("*.kld")
    opened = kld.open_reference(cache_file)
    assert opened.kind == "base" and opened.n_chunk == CHUNKS
    chunking = Chunking(CTX, CHUNKS)
    tokens = opened.tokens
    assert tokens[0] == factory.BOS_ID  # the vocab adds BOS: the text's first token
    for model in (reference, q8_moe):
        nll = []
        for i, logits in enumerate(_chunk_logits(model, tokens, chunking)):
            first = CTX // 2
            scored = logits[first : CTX - 1].astype(np.float64)
            logp = scored - scored.max(axis=1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
            targets = tokens[i * CTX + first + 1 : (i + 1) * CTX]
            nll.extend(-logp[np.arange(len(targets)), targets])
        nll = np.array(nll)
        ppl = math.exp(nll.mean())
        stderr = ppl * math.sqrt((np.mean(nll**2) - nll.mean() ** 2) / (len(nll) - 1))
        doc = _load(out, model)
        assert doc["ppl"] == pytest.approx(ppl, rel=1e-6)
        assert doc["ppl_stderr"] == pytest.approx(stderr, rel=1e-4)


def test_topk_estimate_is_unbiased_and_its_error_is_measured(first_run, reference, q8_moe, make_model):
    """Against the exact KLD of both models' full logits (from llama.cpp through the probe): the top-k
    cache's estimate is unbiased over independent draws, its stated sampling error is their spread,
    and without draws it is a lower bound."""
    _, cache, _ = first_run
    (cache_file,) = cache.glob("*.kld")
    tokens = kld.open_reference(cache_file).tokens
    chunking = Chunking(CTX, 2)
    other = make_model("qwen3moe", dtype="F16", seed=3)  # far from the reference: a large tail term
    reference_logits = _chunk_logits(reference, tokens, chunking)
    draws = 200
    for model in (q8_moe, other):
        rows = [
            (
                logits[chunking.first : CTX - 1],
                reference_logits[i][chunking.first : CTX - 1],
                scored_targets(tokens, chunking, i),
            )
            for i, logits in enumerate(_chunk_logits(model, tokens, chunking))
        ]
        exact = np.concatenate([kld.compare_full(q, t, p) for q, p, t in rows])
        count = exact.shape[0]
        for top_k in (4, 32):
            bound = np.concatenate(
                [kld.compare_topk(q, t, kld.topk_records(kld.log_softmax(p), t, top_k)) for q, p, t in rows]
            )
            assert (bound[:, kld.KLD] <= exact[:, kld.KLD] + 1e-12).all() and (bound[:, kld.TAIL_VARIANCE] == 0).all()
            means, stated = [], []
            for seed in range(draws):
                rng = np.random.default_rng(seed)
                table = np.concatenate(
                    [kld.compare_topk(q, t, kld.topk_records(kld.log_softmax(p), t, top_k, 8, rng)) for q, p, t in rows]
                )
                for column in (kld.NLL, kld.NLL_BASE, kld.P_DIFF, kld.SAME_TOP):
                    np.testing.assert_allclose(table[:, column], exact[:, column], rtol=1e-12, atol=1e-15)
                means.append(table[:, kld.KLD].mean())
                stated.append(kld.kld_statistics(table).kld_tail_stderr)
            spread = float(np.std(means, ddof=1))
            gap = exact[:, kld.KLD].mean() - bound[:, kld.KLD].mean()
            if model == other:
                assert gap > 10 * spread / math.sqrt(draws), (top_k, gap, spread)  # the lower bound is measurably low
            assert abs(np.mean(means) - exact[:, kld.KLD].mean()) < 4 * spread / math.sqrt(draws), (
                top_k,
                np.mean(means),
                exact[:, kld.KLD].mean(),
                spread,
            )
            assert 0.7 < np.mean(stated) / spread < 1.4, (np.mean(stated), spread)
        whole = np.concatenate(
            [kld.compare_topk(q, t, kld.topk_records(kld.log_softmax(p), t, factory.N_VOCAB, 8)) for q, p, t in rows]
        )
        np.testing.assert_allclose(whole[:, kld.KLD], exact[:, kld.KLD], atol=1e-12)
        assert (whole[:, kld.TAIL_VARIANCE] == 0).all() and count == 2 * chunking.scored_per_chunk
        # the base file's 16-bit log-probs: within its quantization step of the exact KLD
        based = np.concatenate([kld.compare_base(q, t, kld.base_records(p)) for q, p, t in rows])
        np.testing.assert_allclose(based[:, kld.KLD], exact[:, kld.KLD], atol=2e-3 * max(1.0, exact[:, kld.KLD].max()))


def test_topk_cache_on_request_prints_its_sampling_error(reference, q8_moe, heldout, tmp_path):
    cache = tmp_path / "cache"
    args = (
        "eval",
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        2,
        "--speed-runs",
        0,
        "--cache",
        cache,
        "-t",
        2,
    )
    result = ggufcarve(*args, "--top-k", 16, "--tail-samples", 8, "-o", tmp_path / "a")
    assert result.code == 0, result.stderr[-3000:]
    (cache_file,) = cache.glob("*.reflogp")
    header = kld.open_reference(cache_file).header
    assert (header.top_k, header.tail_samples, header.n_chunk) == (16, 8, 2)
    doc = _load(tmp_path / "a", q8_moe)
    assert doc["kld_method"] == "topk-sampled-tail" and doc["kld_bound"] is None and doc["kld_tail_stderr"] > 0
    assert (
        doc["parameters"]["top_k"] == 16
        and doc["parameters"]["tail_samples"] == 8
        and not doc["parameters"]["kld_full_vocabulary"]
    )
    assert f"(top-16 estimate; tail sampling adds ± {doc['kld_tail_stderr']:.6f})" in result.stdout
    assert "sampled tail tokens" in (tmp_path / "a" / "summary.md").read_text()
    exact = ggufcarve(*args, "-o", tmp_path / "b")
    assert exact.code == 0, exact.stderr[-3000:]
    full = _load(tmp_path / "b", q8_moe)
    assert full["kld_method"] == "base-file" and "estimate" not in exact.stdout
    assert abs(doc["kld_mean"] - full["kld_mean"]) < 4 * doc["kld_tail_stderr"] + 2e-3 * full["kld_mean"] + 1e-5
    bound = ggufcarve(*args, "--top-k", 16, "--tail-samples", 0, "-o", tmp_path / "c")
    assert bound.code == 0, bound.stderr[-3000:]
    assert _load(tmp_path / "c", q8_moe)["kld_method"] == "topk-lower-bound" and "(top-16 lower bound)" in bound.stdout
    assert _load(tmp_path / "c", q8_moe)["kld_mean"] < full["kld_mean"]


def test_cached_reference_is_reused(first_run, reference, heldout, q8_moe, tmp_path):
    from ggufcarve.evaluate.protocol import EvalSettings
    from ggufcarve.evaluate.reference import reference_disk_bytes

    _, cache, _ = first_run
    (cache_file,) = cache.glob("*.kld")
    mtime = cache_file.stat().st_mtime_ns
    assert reference_disk_bytes(reference, heldout, EvalSettings(ctx=CTX, chunks=CHUNKS, cache_dir=cache)) == 0
    fresh = reference_disk_bytes(reference, heldout, EvalSettings(ctx=CTX, chunks=CHUNKS, cache_dir=tmp_path / "empty"))
    assert fresh == cache_file.stat().st_size  # CHUNKS chunks fit in the text: the preview is exact
    whole = reference_disk_bytes(reference, heldout, EvalSettings(ctx=CTX, cache_dir=tmp_path / "empty"))
    assert whole >= kld.base_file_bytes(
        CTX, factory.N_VOCAB, len(heldout.read_bytes()) // CTX
    )  # at most: bytes bound the tokens
    saved = tmp_path / "saved.kld"
    result = ggufcarve(
        "eval",
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        2,
        "--save-kl-base",
        saved,
        "--speed-runs",
        0,
        "--cache",
        cache,
        "-t",
        2,
        "-o",
        tmp_path / "out",
    )
    assert result.code == 0, result.stderr[-3000:]
    assert cache_file.stat().st_mtime_ns == mtime and "cached log-probs" in result.stderr
    doc = json.loads((tmp_path / "out" / f"{q8_moe.stem}.json").read_text())
    assert doc["parameters"]["chunks"] == 2 and doc["pp_tok_s"] is None
    # --save-kl-base from the cache: its first 2 chunks as a base file of their own
    cached, copy = kld.open_reference(cache_file), kld.open_reference(saved)
    assert (copy.n_ctx, copy.n_vocab, copy.n_chunk) == (
        CTX,
        factory.N_VOCAB,
        2,
    ) and saved.stat().st_size == kld.base_file_bytes(CTX, factory.N_VOCAB, 2)
    assert np.array_equal(copy.tokens, cached.tokens[: 2 * CTX])
    assert all(np.array_equal(a, b) for a, b in zip(copy.chunks(), cached.chunks(2)))


def test_summary_tables_match_the_json(first_run, reference, q8_moe):
    out, _, _ = first_run
    summary = (out / "summary.md").read_text()
    assert "| Artifact | Size | Passed | Exact vs baseline | Median decode tok/s | Gate |" in summary
    assert "| Quant | Size | PPL | Δ vs reference | ± | mean KLD | 99% KLD | same top p |" in summary
    for model in (reference, q8_moe):
        doc = _load(out, model)
        assert (
            f"| {doc['model']['quant']} ({model.stem}) | {format_size(doc['model']['bytes'])} | {doc['ppl']:.4f} |"
            in summary
            and format_size(doc["model"]["bytes"]).endswith(" MiB")
        )
        assert f"{doc['kld_mean']:.6f} | {doc['kld_p99']:.6f} | {100 * doc['same_top_p']:.2f}% |" in summary
        assert f"| {model.name} | {format_size(doc['model']['bytes'])} | – | – |" in summary
    for chart in ("size-vs-kld.png", "size-vs-ppl.png"):
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speed_spread_is_recorded_and_a_noisy_one_is_flagged(first_run, reference, q8_moe):
    out, _, result = first_run
    summary = (out / "summary.md").read_text()
    for model in (reference, q8_moe):
        doc = _load(out, model)
        for test in ("pp", "tg"):
            runs = doc["speed"][f"{test}_runs"]
            assert len(runs) == 3 and doc[f"{test}_tok_s"] == sorted(runs)[1]
            wide = (max(runs) - min(runs)) / sorted(runs)[1]
            assert doc["speed"][f"{test}_spread"] == pytest.approx(wide) and doc[
                f"{test}_tok_s_spread"
            ] == pytest.approx(wide)
        tg = doc["speed"]["tg_runs"]
        tg_wide = (max(tg) - min(tg)) / sorted(tg)[1]
        row = next(line for line in summary.splitlines() if line.startswith(f"| {model.name} |"))
        if tg_wide > 0.10:  # the range of runs, not a figure
            assert "| noisy: " in row and f" {doc['tg_tok_s']:.1f} |" not in row and doc["speed_noisy"] is True
        else:
            assert f" {doc['tg_tok_s']:.1f} |" in row and "noisy" not in row
    assert "tok/s" in result.stdout


def test_a_noisy_speed_reads_as_its_range():
    from ggufcarve.evaluate.speed import speed_text

    noisy = {"tg_tok_s": 100.0, "speed": {"tg_runs": [7.9, 100.0, 711.0]}}
    steady = {"tg_tok_s": 100.0, "speed": {"tg_runs": [95.0, 100.0, 104.0]}}  # (104 - 95) / 100 = 9%
    assert speed_text(noisy, "tg") == "noisy: 7.9-711 tok/s"
    assert speed_text(steady, "tg") == "100.0 tok/s" and speed_text(steady, "tg", unit=False) == "100.0"
    assert speed_text({"tg_tok_s": None}, "tg") == "–"


def test_strict_exits_1_naming_the_models_that_failed_the_gate(first_run, reference, q8_moe, heldout, tmp_path):
    _, cache, _ = first_run
    strict_gate = tmp_path / "strict.toml"
    strict_gate.write_text(
        "max_kld_mean = 1e-6\n"
    )  # the reference against itself: 0 but for its base file's 16-bit rounding; its Q8_0: above
    common = (
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        2,
        "--speed-runs",
        0,
        "--cache",
        cache,
        "-t",
        2,
        "-q",
    )
    failing = ggufcarve(
        "eval", reference, q8_moe, *common, "--gate", strict_gate, "--strict", "-o", tmp_path / "strict"
    )
    docs = {m.stem: json.loads((tmp_path / "strict" / f"{m.stem}.json").read_text()) for m in (reference, q8_moe)}
    assert docs[reference.stem]["kld_mean"] < 1e-6 < docs[q8_moe.stem]["kld_mean"]
    assert failing.code == 1, failing.stderr[-2000:]
    line = next(x for x in failing.stderr.splitlines() if "failed the gate" in x)
    assert q8_moe.stem in line and "kld_mean" in line and f"{reference.stem} (" not in line and "1 of 2 models" in line
    lenient = ggufcarve("eval", reference, q8_moe, *common, "--gate", strict_gate, "-o", tmp_path / "lenient")
    assert lenient.code == 0 and "failed the gate" not in lenient.stderr
    strict_gate.write_text("max_kld_mean = 1.0\n")
    passing = ggufcarve(
        "eval", reference, q8_moe, *common, "--gate", strict_gate, "--strict", "-o", tmp_path / "passing"
    )
    assert passing.code == 0, passing.stderr[-2000:]


def test_equal_size_ranking_and_pareto_front():
    from ggufcarve.evaluate.summary import equal_size_pairs, pareto_front

    def result(name, family, gib, kld_mean):
        return {"model": {"name": name, "family": family, "bytes": int(gib * 2**30), "gib": gib}, "kld_mean": kld_mean}

    results = [
        result("full-Q2_K", "full", 10.0, 0.30),
        result("full-Q4_K_M", "full", 18.0, 0.05),
        result("pruned-Q4_K_M", "pruned", 10.5, 0.12),
        result("pruned-Q2_K", "pruned", 6.0, 0.50),
    ]
    results += [result("full-Q3_K_M", "full", 12.0, 0.20), result("full-IQ1_S", "full", 7.0, 0.90)]
    # full-Q3_K_M: pruned-Q4_K_M is smaller and better; full-IQ1_S: pruned-Q2_K is
    assert pareto_front(results) == {"pruned-Q2_K", "full-Q2_K", "pruned-Q4_K_M", "full-Q4_K_M"}
    pairs = {(a["model"]["name"], b["model"]["name"]) for a, b in equal_size_pairs(results)}
    assert ("pruned-Q4_K_M", "full-Q2_K") in pairs and ("full-Q2_K", "pruned-Q4_K_M") in pairs
    assert ("pruned-Q2_K", "full-IQ1_S") in pairs


def test_gate_names_failed_criteria(tmp_path):
    from ggufcarve.evaluate.gate import load_gate

    path = tmp_path / "gate.toml"
    path.write_text("max_kld_mean = 0.1\nmin_same_top_p = 0.9\nmin_qa_passed = 6\nmax_ppl_increase_percent = 5\n")
    gate = load_gate(path)
    good = {"kld_mean": 0.05, "same_top_p": 0.95, "ppl": 10.2, "ppl_reference": 10.0, "qa_total": 8, "qa_passed": 7}
    assert gate.judge(good).verdict == "PASS"
    bad = gate.judge({**good, "kld_mean": 0.2, "ppl": 11.0})
    assert bad.verdict == "FAIL" and bad.failed == ["kld_mean 0.2 > 0.1", "ppl_increase_percent 10 > 5"]
    unmeasured = gate.judge({**good, "qa_total": None, "qa_passed": None})
    assert unmeasured.verdict == "PASS" and unmeasured.not_measured == ["min_qa_passed"]
    (tmp_path / "table.toml").write_text("[gate]\nmax_kld_p99 = 0.5\n")
    assert load_gate(tmp_path / "table.toml").judge({"kld_p99": 0.7}).failed == ["kld_p99 0.7 > 0.5"]


def test_bad_inputs_are_one_line(reference, q8_moe, heldout, tmp_path, monkeypatch):
    common = ("--ctx", CTX, "--speed-runs", 0, "--cache", tmp_path / "cache", "-t", 2)
    gate = tmp_path / "gate.toml"
    gate.write_text("max_kld_mean = 0.1\nmax_klb_mean = 0.2\n")
    result = ggufcarve(
        "eval", q8_moe, "--reference", reference, "--heldout", heldout, "--gate", gate, *common, "-o", tmp_path / "a"
    )
    assert (
        result.code == 1 and "unknown gate key 'max_klb_mean'" in result.error_line and "Traceback" not in result.stderr
    )

    short = tmp_path / "short.txt"
    short.write_text("too short for one chunk\n")
    result = ggufcarve(
        "eval",
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        short,
        "--ctx",
        CTX,
        "--speed-runs",
        0,
        "-t",
        2,
        "--cache",
        tmp_path / "new-cache" / "logprobs",
        "-o",
        tmp_path / "b" / "evaluation",
    )
    assert result.code == 1 and "short.txt" in result.error_line and f"at least {2 * CTX}" in result.error_line
    assert (
        len([line for line in result.stderr.splitlines() if line.startswith("error")]) == 1
        and "Traceback" not in result.stderr
    )
    assert (
        not (tmp_path / "b").exists() and not (tmp_path / "new-cache").exists()
    )  # what the failed run created, left empty, is gone
    (tmp_path / "kept").mkdir()
    result = ggufcarve("eval", q8_moe, "--reference", reference, "--heldout", short, *common, "-o", tmp_path / "kept")
    assert result.code == 1 and (tmp_path / "kept").is_dir()  # an -o directory that was there stays

    tokens, scores, types = factory._vocab()
    monkeypatch.setattr(factory, "_vocab", lambda: (tokens[:-1] + ["<0xff>"], scores, types))
    other_vocab = factory.write_model(tmp_path / "other-vocab.gguf", "qwen3moe")
    monkeypatch.undo()
    result = ggufcarve(
        "eval", other_vocab, "--reference", reference, "--heldout", heldout, *common, "-o", tmp_path / "c"
    )
    assert (
        result.code == 1
        and "other-vocab.gguf: its vocabulary" in result.error_line
        and "differs from the reference" in result.error_line
    )
    assert not (tmp_path / "c" / "other-vocab.json").exists()


VALIDATOR_CASES = [
    ({"type": "exact", "expected": "OK"}, " OK\n", "OK."),
    (
        {"type": "regex", "pattern": r"def\s+add\(", "flags": "i"},
        "```python\nDEF add(a, b):\n```",
        "lambda a, b: a + b",
    ),
    (
        {
            "type": "json",
            "schema": {
                "type": "object",
                "required": ["age"],
                "properties": {"age": {"type": "integer", "maximum": 40}},
                "additionalProperties": False,
            },
        },
        'Sure: ```json\n{"age": 36}\n```',
        '{"age": 36, "name": "Ada"}',
    ),
    (
        {"type": "json", "schema": {"type": "array", "minItems": 2, "items": {"type": "string"}}},
        'colours: ["red", "green"] done',
        '["red"]',
    ),
    ({"type": "expression", "expected": "60 * 2.5"}, "60 km/h for 2.5 h.\nAnswer: 60 * 2.5", "Answer: 140"),
    ({"type": "expression", "expected": 391}, "17 * 23 = 391", "It is about 400."),
    (
        {
            "type": "tool_call",
            "name": "get_weather",
            "arguments": {"required": ["city"], "properties": {"city": {"type": "string"}}},
        },
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '{"name": "get_weather", "arguments": {"town": "Paris"}}',
    ),
    (
        {"type": "tool_call", "name": "get_weather"},
        '{"function": {"name": "get_weather", "arguments": "{}"}}',
        '{"name": "get_time", "arguments": {}}',
    ),
    # keywords beyond the common few, checked by the jsonschema library
    (
        {
            "type": "json",
            "schema": {
                "type": "object",
                "properties": {"date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
            },
        },
        '{"date": "2024-03-01"}',
        '{"date": "March 1st"}',
    ),
    ({"type": "json", "schema": {"const": {"ok": True}}}, 'done: {"ok": true}', '{"ok": false}'),
    (
        {
            "type": "json",
            "schema": {
                "type": "array",
                "items": {"oneOf": [{"type": "integer", "multipleOf": 3}, {"type": "integer", "multipleOf": 5}]},
            },
        },
        "[9, 10]",
        "[9, 15]",
    ),
    (
        {"type": "json", "schema": {"type": "array", "maxItems": 2, "items": {"type": "string", "minLength": 2}}},
        '["ab", "cd"]',
        '["ab", "c"]',
    ),
    ({"type": "json", "schema": {"type": "array", "maxItems": 2}}, '["a", "b"]', '["a", "b", "c"]'),
    (
        {
            "type": "tool_call",
            "name": "set_alarm",
            "arguments": {
                "required": ["time"],
                "properties": {"time": {"type": "string", "pattern": "^[0-2]\\d:[0-5]\\d$"}},
            },
        },
        '{"name": "set_alarm", "arguments": {"time": "07:30"}}',
        '{"name": "set_alarm", "arguments": {"time": "7.30am"}}',
    ),
]


@pytest.mark.parametrize(
    "validator,passing,failing", VALIDATOR_CASES, ids=[f"{c[0]['type']}-{i}" for i, c in enumerate(VALIDATOR_CASES)]
)
def test_validators_pass_and_fail(validator, passing, failing):
    from ggufcarve.evaluate.qa import Check, validate

    check = Check("c", "test", [{"role": "user", "content": "?"}], 16, validator)
    assert validate(check, passing) == (True, "")
    ok, reason = validate(check, failing)
    assert not ok and reason


def test_invalid_schema_in_a_suite_is_named_by_file_and_line(tmp_path):
    from ggufcarve.errors import BadInput
    from ggufcarve.evaluate.qa import load_suite

    good = {
        "id": "a",
        "messages": [{"role": "user", "content": "hi"}],
        "validator": {"type": "json", "schema": {"type": "object"}},
    }
    cases = [
        ({"type": "json", "schema": {"type": "obj"}}, "schema.type"),
        ({"type": "json", "schema": {"properties": {"a": {"pattern": "("}}}}, "schema.properties.a.pattern"),
        ({"type": "json", "schema": {"minLength": -1}}, "schema.minLength"),
        ({"type": "tool_call", "name": "f", "arguments": {"required": "city"}}, "arguments.required"),
    ]
    for validator, where in cases:
        suite = tmp_path / "suite.jsonl"
        suite.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "b", "validator": validator}) + "\n")
        with pytest.raises(BadInput) as raised:
            load_suite(suite)
        message = str(raised.value)
        assert message.startswith(f"suite.jsonl:2: invalid JSON schema at {where}: ") and "\n" not in message, message
    suite.write_text(json.dumps(good) + "\n")
    assert [c.id for c in load_suite(suite)] == ["a"]


def test_safe_expressions_never_run_code():
    from ggufcarve.evaluate.qa import safe_value

    assert safe_value("2 ** 10 - (3 + 4) * 2 / 7") == 1022
    for hostile in ("__import__('os').system('true')", "(1).__class__", "[1, 2]", "9 ** 9 ** 9", "x + 1"):
        with pytest.raises((ValueError, SyntaxError)):
            safe_value(hostile)


def test_shipped_suite_covers_the_categories():
    from ggufcarve.evaluate.qa import default_suite_path, load_suite

    checks = load_suite(default_suite_path())
    assert len(checks) >= 8
    assert {"code", "json", "math", "tool", "context"} <= {c.category for c in checks}
    assert {c.validator["type"] for c in checks} == {"exact", "regex", "json", "expression", "tool_call"}


def test_malformed_qa_line_is_named_by_number(reference, q8_moe, heldout, tmp_path):
    suite = tmp_path / "bad.jsonl"
    good = {
        "id": "a",
        "messages": [{"role": "user", "content": "hi"}],
        "validator": {"type": "exact", "expected": "hi"},
    }
    suite.write_text(json.dumps(good) + "\n\n" + '{"id": "b", "messages": [}\n')
    result = ggufcarve(
        "eval", q8_moe, "--reference", reference, "--heldout", heldout, "--qa", suite, "-o", tmp_path / "out"
    )
    assert result.code == 1 and "bad.jsonl:3: not valid JSON" in result.error_line and "Traceback" not in result.stderr
    suite.write_text(json.dumps({**good, "validator": {"type": "regex", "pattern": "("}}) + "\n")
    result = ggufcarve(
        "eval", q8_moe, "--reference", reference, "--heldout", heldout, "--qa", suite, "-o", tmp_path / "out"
    )
    assert result.code == 1 and "bad.jsonl:1: bad regex" in result.error_line


def test_qa_runs_are_deterministic(reference, q8_moe, heldout, tmp_path):
    suite = tmp_path / "small.jsonl"
    checks = [
        {
            "id": "exact",
            "category": "instruction",
            "max_tokens": 6,
            "messages": [{"role": "user", "content": "Say OK."}],
            "validator": {"type": "exact", "expected": "OK"},
        },
        {
            "id": "math",
            "category": "math",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "2+2?"}],
            "validator": {"type": "expression", "expected": 4},
        },
        {
            "id": "json",
            "category": "json",
            "max_tokens": 8,
            "messages": [{"role": "system", "content": "JSON only."}, {"role": "user", "content": "{}"}],
            "validator": {"type": "json", "schema": {"type": "object"}},
        },
    ]
    suite.write_text("".join(json.dumps(c) + "\n" for c in checks))
    runs = []
    for name in ("one", "two"):
        result = ggufcarve(
            "eval",
            reference,
            q8_moe,
            "--reference",
            reference,
            "--heldout",
            heldout,
            "--ctx",
            CTX,
            "--chunks",
            2,
            "--qa",
            suite,
            "--speed-runs",
            0,
            "--cache",
            tmp_path / "cache",
            "-t",
            2,
            "-o",
            tmp_path / name,
        )
        assert result.code == 0, result.stderr[-3000:]
        runs.append({m.stem: _load(tmp_path / name, m) for m in (reference, q8_moe)})
    for stem in runs[0]:
        first, second = runs[0][stem]["qa"], runs[1][stem]["qa"]
        assert [c["output"] for c in first["checks"]] == [c["output"] for c in second["checks"]]
        assert first["total"] == 3 and runs[0][stem]["qa_total"] == 3 and runs[0][stem]["qa_passed"] == first["passed"]
        assert all(c["output_tokens"] > 0 and not c["chat_template"] for c in first["checks"])
        assert first["decoding"] == {"temperature": 0.0, "top_k": 1, "seed": 0}
    assert runs[0][reference.stem]["qa_exact_vs_reference"] == 1.0
    q8 = runs[0][q8_moe.stem]["qa"]
    assert runs[0][q8_moe.stem]["qa_exact_vs_reference"] == sum(c["same_as_reference"] for c in q8["checks"]) / 3


# --- judged by llama.cpp's own tools ----------------------------------------------------------


@pytest.fixture(scope="module")
def release(q8_moe, llama_tools, tmp_path_factory) -> Path:
    """A ggufcarve release of Q4_K_M and IQ2_XS (with llama-imatrix's imatrix) from the Q8_0 fixture."""
    base = tmp_path_factory.mktemp("release")
    imatrix = make_imatrix(llama_tools, q8_moe, base)
    spec = base / "ladder.toml"
    spec.write_text(
        'name = "eval"\n[defaults]\nfile_pattern = "{model}-{quant}.gguf"\nallow_requantize = true\n'
        '[[rungs]]\nftype = "Q4_K_M"\n[[rungs]]\nftype = "IQ2_XS"\n'
    )
    out = base / "release"
    result = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        q8_moe,
        "--imatrix",
        imatrix,
        "-o",
        out,
        "--quantizer",
        "libllama",
        "-t",
        "2",
        "-q",
    )
    assert result.code == 0, result.stderr[-3000:]
    return out


def _llama_perplexity(bin_dir: Path, *args, expect: str = "") -> str:
    """Run llama-perplexity until its output holds `expect`: its log thread can drop the last lines at exit
    (crosscheck.ATTEMPTS)."""
    from ggufcarve.evaluate.crosscheck import ATTEMPTS

    for _ in range(ATTEMPTS):
        proc = subprocess.run(
            [str(bin_dir / "llama-perplexity"), *map(str, args), "-t", "2", "--no-repack"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        if expect in proc.stdout + proc.stderr:
            break
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def release_eval(release, reference, q8_moe, heldout, llama_tools, tmp_path_factory):
    """eval --cross-check of the Q8_0 fixture, a 6-expert prune of it and the release's rungs against the F16
    reference."""
    base = tmp_path_factory.mktemp("release-eval")
    pruned = base / "qwen3moe-6e-Q8_0.gguf"
    result = ggufcarve("prune", q8_moe, "--keep-first", 6, "-o", pruned, "-q")
    assert result.code == 0, result.stderr[-3000:]
    out = base / "out"
    result = ggufcarve(
        "eval",
        q8_moe,
        pruned,
        release,
        "--reference",
        reference,
        "--heldout",
        heldout,
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
        "--cross-check",
        "--llama-cpp",
        llama_tools,
        "-o",
        out,
    )
    assert result.code == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.slow
def test_kld_grows_as_bits_fall_and_cross_check_agrees(release_eval):
    out, result = release_eval
    docs = {json.loads(p.read_text())["model"]["name"]: json.loads(p.read_text()) for p in out.glob("*.json")}
    by_quant = {d["model"]["quant"]: d for d in docs.values() if not d["model"]["pruned"]}
    assert set(by_quant) == {"Q8_0", "Q4_K_M", "IQ2_XS"}
    kl = [by_quant[q]["kld_mean"] for q in ("Q8_0", "Q4_K_M", "IQ2_XS")]
    assert 0 < kl[0] < kl[1] < kl[2], kl
    assert by_quant["Q8_0"]["same_top_p"] >= by_quant["IQ2_XS"]["same_top_p"]
    (pruned,) = [d for d in docs.values() if d["model"]["pruned"]]
    assert pruned["model"]["family"] == "qwen3moe 6 of 8 experts" and pruned["kld_mean"] > by_quant["Q8_0"]["kld_mean"]
    for doc in docs.values():
        check = doc["cross_check"]
        assert check["ppl_agrees"], (doc["ppl"], check)
        assert f"{doc['ppl']:.4g}" == f"{check['ppl_mode']['ppl']:.4g}"
        assert "kld_mean" in check["kld_mode"], check
        # llama-perplexity's KLD from its own base file; ours from ggufcarve's: the same logits rounded to 16 bits
        assert doc["kld_method"] == "base-file" and doc["kld_bound"] == 0.0
        assert check["kld_mode"]["kld_mean"] == pytest.approx(doc["kld_mean"], abs=2e-6 * (1 + doc["kld_mean"]))
        assert check["kld_mode"]["same_top_p"] == pytest.approx(doc["same_top_p"], abs=0.01)
    assert "agrees" in result.stdout
    summary = (out / "summary.md").read_text()
    assert "qwen3moe 6 of 8 experts" in summary and "qwen3moe 8 experts" in summary
    assert "✓ vs " in summary or "✗ vs " in summary


# --- the default KLD is llama-perplexity's: its printed figures as the oracle -------------------

ORACLE_ROWS = {
    "Mean    KLD": "kld_mean",
    "Median  KLD": "kld_median",
    "99.0%   KLD": "kld_p99",
    "99.9%   KLD": "kld_p999",
    "Same top p": "same_top_p",
}
BASE_STEP = 16 / 65535  # the largest step of a base file's 16-bit log-probs (they span at most 16 nats)


def _oracle(bin_dir: Path, model: Path, base: Path, ctx: int) -> dict[str, float]:
    """llama-perplexity -m MODEL --kl-divergence-base BASE --kl-divergence, in the launcher's environment: its
    printed figures.

    Its log thread can drop the last lines at exit (crosscheck.ATTEMPTS): run until "Same top p" is printed.
    """
    import re

    for _ in range(6):
        proc = subprocess.run(
            [
                str(bin_dir / "llama-perplexity"),
                "-m",
                str(model),
                "-c",
                str(ctx),
                "--kl-divergence-base",
                str(base),
                "--kl-divergence",
                "-t",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=_child_env(),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = {}
        for line in (proc.stdout + proc.stderr).splitlines():
            m = re.match(r"^(Mean    KLD|Median  KLD|99\.0%   KLD|99\.9%   KLD|Same top p)\s*:\s*(-?[\d.]+)", line)
            if m:
                found[ORACLE_ROWS[m[1]]] = float(m[2]) / (100 if m[1] == "Same top p" else 1)
        if len(found) == len(ORACLE_ROWS):
            return found
    raise AssertionError(
        "llama-perplexity printed no final statistics in 6 runs: " + (proc.stdout + proc.stderr)[-2000:]
    )


def _assert_equals_llama_perplexity(
    bin_dir: Path, out: Path, models: list[Path], base: Path, ctx: int, chunks: int
) -> None:
    """eval's figures equal llama-perplexity's printed ones (KLD to the 16-bit storage of the reference, same top p
    to its 3 printed decimals)."""
    for model in models:
        doc = _load(out, model)
        theirs = _oracle(bin_dir, model, base, ctx)
        assert (
            doc["kld_method"] == "base-file"
            and doc["parameters"]["chunks"] == chunks
            and doc["parameters"]["ctx"] == ctx
        )
        for key in ("kld_mean", "kld_median", "kld_p99", "kld_p999"):
            # printed to 6 decimals; the two base files round the same logits to 16 bits, a few values one step
            # (<= BASE_STEP) apart, which moves a figure by far less than a unit of its 6th decimal (measured: <= 1e-6)
            assert doc[key] == pytest.approx(theirs[key], abs=2e-6 * (1 + theirs[key])), (
                model.name,
                key,
                doc[key],
                theirs[key],
            )
        count = doc["parameters"]["scored_tokens"]
        assert abs(doc["same_top_p"] - theirs["same_top_p"]) <= 5e-6 + 1 / count, (
            model.name,
            doc["same_top_p"],
            theirs["same_top_p"],
        )


@pytest.mark.slow
def test_demo_pruned_rungs_kld_equals_llama_perplexity(llama_tools, tmp_path):
    """The demo model pruned to 8 of 16 experts (Q8_0) and its Q4_K_M against the unpruned demo: held-out text, ctx
    256, 16 chunks."""
    from ggufcarve.demo import DEMO_MODEL, HELDOUT

    pruned = tmp_path / "demo-8e-Q8_0.gguf"
    result = ggufcarve("prune", DEMO_MODEL, "--keep-first", 8, "-o", pruned, "-q")
    assert result.code == 0, result.stderr[-3000:]
    q4 = factory.quantize_with_llama(pruned, tmp_path / "demo-8e-Q4_K_M.gguf", "Q4_K_M", allow_requantize=True)
    out = tmp_path / "out"
    result = ggufcarve(
        "eval",
        pruned,
        q4,
        "--reference",
        DEMO_MODEL,
        "--heldout",
        HELDOUT,
        "--ctx",
        256,
        "--chunks",
        16,
        "--speed-runs",
        0,
        "--cache",
        tmp_path / "cache",
        "-t",
        2,
        "-o",
        out,
    )
    assert result.code == 0, result.stderr[-3000:]
    base = tmp_path / "demo.kld"  # written by llama-perplexity itself from the unpruned demo model
    made = subprocess.run(
        [
            str(llama_tools / "llama-perplexity"),
            "-m",
            str(DEMO_MODEL),
            "-f",
            str(HELDOUT),
            "-c",
            "256",
            "--chunks",
            "16",
            "--kl-divergence-base",
            str(base),
            "-t",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_child_env(),
    )
    assert made.returncode == 0 and base.exists(), made.stderr[-3000:]
    _assert_equals_llama_perplexity(llama_tools, out, [pruned, q4], base, 256, 16)
    assert _load(out, pruned)["kld_mean"] < _load(out, q4)["kld_mean"]


@pytest.mark.slow
def test_iq2_xs_kld_equals_llama_perplexity(release, make_model, heldout, llama_tools, tmp_path):
    """An IQ2_XS (llama-quantize with llama-imatrix's imatrix) of the qwen3moe fixture against the F16 it was made
    from."""
    f16 = make_model("qwen3moe", dtype="F16", n_embd=256, n_ff_exp=256)
    (iq2,) = release.glob("*IQ2_XS*.gguf")
    out = tmp_path / "out"
    result = ggufcarve(
        "eval",
        iq2,
        "--reference",
        f16,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "--speed-runs",
        0,
        "--cache",
        tmp_path / "cache",
        "-t",
        2,
        "-o",
        out,
    )
    assert result.code == 0, result.stderr[-3000:]
    base = tmp_path / "f16.kld"
    made = subprocess.run(
        [
            str(llama_tools / "llama-perplexity"),
            "-m",
            str(f16),
            "-f",
            str(heldout),
            "-c",
            str(CTX),
            "--chunks",
            str(CHUNKS),
            "--kl-divergence-base",
            str(base),
            "-t",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_child_env(),
    )
    assert made.returncode == 0 and base.exists(), made.stderr[-3000:]
    _assert_equals_llama_perplexity(llama_tools, out, [iq2], base, CTX, CHUNKS)
    assert _load(out, iq2)["kld_mean"] > 0.05  # a far model: a large tail a top-k cache would have cut


def _child_env() -> dict[str, str]:
    from ggufcarve.llama.launch import child_env

    return child_env()


@pytest.mark.slow
def test_card_front_matter_and_tables_match_manifest_and_evaluation(release, release_eval, tmp_path):
    import shutil

    import yaml

    out, _ = release_eval
    copy = tmp_path / "release"
    shutil.copytree(release, copy)
    result = ggufcarve("card", copy, "--evaluation", out)
    assert result.code == 0, result.stderr[-3000:]
    card = (copy / "README.md").read_text()
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "gguf" and front["pipeline_tag"] == "text-generation"
    assert {"gguf", "mixture-of-experts", "expert-pruning"} <= set(front["tags"])
    assert (
        "license" not in front and "base_model" not in front and "base_model_relation" not in front
    )  # the fixture's GGUF records neither: none is invented
    manifest = json.loads((copy / "quant-manifest.json").read_text())
    for rung in manifest["rungs"]:
        name = rung["files"][0]["name"]
        doc = json.loads((out / f"{Path(name).stem}.json").read_text())
        row = next(line for line in card.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        size, unit = cells[2].split()
        assert (
            cells[1] == rung["name"]
            and unit == "MiB"
            and abs(float(size) - rung["files"][0]["bytes"] / 2**20) < 0.05
            and cells[3] == f"{rung['bits_per_weight']:.2f}"
        )
        assert (
            cells[4] == f"{doc['ppl']:.4f}"
            and cells[6] == f"{doc['kld_mean']:.6f}"
            and cells[-1] == f"`{rung['sha256'][:16]}`"
        )
    assert "sha256sum -c SHA256SUMS" in card and f"llama-cli -m {manifest['rungs'][0]['files'][0]['name']}" in card
    assert "/tmp" not in card and str(tmp_path) not in card
    assert ggufcarve("card", copy, "--evaluation", out).code == 1  # exists: --force needed


def test_card_describes_a_prune():
    from ggufcarve.release.card import render_card
    from ggufcarve.release.card_inputs import CardInputs

    keys = {
        "general.architecture": "qwen3moe",
        "general.license": "apache-2.0",
        "general.name": "Tiny",
        "general.base_model.0.organization": "Org",
        "general.base_model.0.name": "Tiny-MoE",
        "ggufcarve.kept_expert_count": 4,
        "ggufcarve.source.expert_count": 8,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_count": 4,
    }
    rung = {
        "name": "Q4_K_M",
        "files": [{"name": "tiny-4e-Q4_K_M.gguf", "bytes": 512 * 2**20}],
        "gib": 0.5,
        "bits_per_weight": 4.9,
        "sha256": "ab" * 32,
        "command": ["q", "--allow-requantize"],
    }
    pruning = {
        "keep_set": {"selection": "routed frequency", "calibration": "512 tokens of code", "layers": {}},
        "source": {"mtp_blocks": [2]},
        "verification": {"ok": True, "tensors_checked": 30, "hash": "xxh3_128"},
    }
    card = render_card(CardInputs({"source": {"name": "tiny-4e-Q8_0.gguf"}}, [rung], keys, pruning, None, {}))
    assert 'base_model: "Org/Tiny-MoE"' in card and "from 8 to 4 per MoE layer (50% removed)" in card
    assert "- Selection: routed frequency" in card and "512 tokens of code" in card and "MTP block(s) 2" in card
    assert (
        "top-k routing is unchanged (2 experts per token)" in card.lower()
        and "requantized from tiny-4e-Q8_0.gguf" in card
    )
    assert "| tiny-4e-Q4_K_M.gguf | Q4_K_M | 512 MiB | 4.90 | – | – | – | – | – | not evaluated |" in card


@pytest.mark.slow
def test_base_file_written_by_llama_perplexity_gives_its_own_numbers(reference, q8_moe, heldout, llama_tools, tmp_path):
    from ggufcarve.evaluate.crosscheck import parse_kld_output

    base = tmp_path / "reference.kld"
    _llama_perplexity(
        llama_tools, "-m", reference, "-f", heldout, "-c", CTX, "--chunks", CHUNKS, "--kl-divergence-base", base
    )
    theirs = parse_kld_output(
        _llama_perplexity(
            llama_tools, "-m", q8_moe, "-c", CTX, "--kl-divergence-base", base, "--kl-divergence", expect="Same top p:"
        ).splitlines()
    )
    result = ggufcarve("eval", q8_moe, "--reference", base, "--speed-runs", 0, "-t", 2, "-o", tmp_path / "out")
    assert result.code == 0, result.stderr[-3000:]
    ours = json.loads((tmp_path / "out" / f"{q8_moe.stem}.json").read_text())
    assert (
        ours["parameters"]["kld_full_vocabulary"]
        and ours["parameters"]["ctx"] == CTX
        and ours["parameters"]["chunks"] == CHUNKS
    )
    # same engine, same tokens, same float32 arithmetic: equal up to the last printed digit
    assert ours["kl_divergence"]["ppl"] == pytest.approx(theirs["ppl"], rel=1e-7)
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-6)
    assert ours["kld_mean"] == pytest.approx(theirs["kld_mean"], abs=2e-6)
    assert ours["kld_mean_stderr"] == pytest.approx(theirs["kld_mean_stderr"], abs=2e-6)
    for name in ("max", "p999", "p99", "median", "p1", "min"):
        assert ours["kl_divergence"]["kld"][name] == pytest.approx(theirs["kld"][name], abs=2e-6), name
    assert ours["same_top_p"] == pytest.approx(theirs["same_top_p"], abs=1e-5)
    assert ours["rms_dp"] == pytest.approx(theirs["rms_dp"], abs=1e-5)


@pytest.mark.slow
def test_base_file_written_by_ggufcarve_is_llama_perplexitys(reference, q8_moe, heldout, llama_tools, tmp_path):
    from ggufcarve.evaluate.crosscheck import parse_kld_output

    theirs_base, ours_base = tmp_path / "theirs.kld", tmp_path / "ours.kld"
    _llama_perplexity(
        llama_tools, "-m", reference, "-f", heldout, "-c", CTX, "--chunks", CHUNKS, "--kl-divergence-base", theirs_base
    )
    result = ggufcarve(
        "eval",
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "--save-kl-base",
        ours_base,
        "--speed-runs",
        0,
        "--cache",
        tmp_path / "cache",
        "-t",
        2,
        "-o",
        tmp_path / "out",
    )
    assert result.code == 0, result.stderr[-3000:]
    theirs, ours = kld.open_reference(theirs_base), kld.open_reference(ours_base)
    assert (
        (ours.n_ctx, ours.n_vocab, ours.n_chunk)
        == (theirs.n_ctx, theirs.n_vocab, theirs.n_chunk)
        == (CTX, factory.N_VOCAB, CHUNKS)
    )
    assert np.array_equal(ours.tokens, theirs.tokens) and ours_base.stat().st_size == theirs_base.stat().st_size
    a, b = (
        np.concatenate([c.astype(np.int64) for c in ours.chunks()]),
        np.concatenate([c.astype(np.int64) for c in theirs.chunks()]),
    )
    assert np.abs(a[:, 4:] - b[:, 4:]).max() <= 1  # the same logits, rounded alike (at most one 16-bit step apart)
    stats = [
        parse_kld_output(
            _llama_perplexity(
                llama_tools,
                "-m",
                q8_moe,
                "-c",
                CTX,
                "--kl-divergence-base",
                path,
                "--kl-divergence",
                expect="Same top p:",
            ).splitlines()
        )
        for path in (theirs_base, ours_base)
    ]
    assert stats[0]["kld_mean"] == pytest.approx(stats[1]["kld_mean"], abs=2e-6) and stats[0]["ppl"] == pytest.approx(
        stats[1]["ppl"], rel=1e-6
    )


@pytest.mark.slow
def test_split_set_is_one_model(reference, q8_moe, heldout, llama_tools, tmp_path):
    proc = subprocess.run(
        [
            str(llama_tools / "llama-gguf-split"),
            "--split",
            "--split-max-tensors",
            "12",
            str(q8_moe),
            str(tmp_path / "split"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) > 1
    result = ggufcarve(
        "eval",
        shards[0],
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        2,
        "--speed-runs",
        0,
        "--cache",
        tmp_path / "cache",
        "-t",
        2,
        "-o",
        tmp_path / "out",
    )
    assert result.code == 0, result.stderr[-3000:]
    split = json.loads((tmp_path / "out" / "split.json").read_text())
    whole = _load(tmp_path / "out", q8_moe)
    assert [f["name"] for f in split["model"]["files"]] == [s.name for s in shards]
    assert split["model"]["bytes"] == sum(s.stat().st_size for s in shards)
    assert split["ppl"] == pytest.approx(whole["ppl"], rel=1e-9) and split["kld_mean"] == pytest.approx(
        whole["kld_mean"], rel=1e-9, abs=1e-12
    )


def test_qa_prompt_is_the_models_chat_template(reference, q8_moe, heldout, tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content "
        "}}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    chat = tmp_path / "chat.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gguf.scripts.gguf_new_metadata",
            str(q8_moe),
            str(chat),
            "--chat-template",
            template,
            "--force",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    suite = tmp_path / "one.jsonl"
    suite.write_text(
        json.dumps(
            {
                "id": "hi",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "validator": {"type": "regex", "pattern": "."},
            }
        )
        + "\n"
    )
    result = ggufcarve(
        "eval",
        chat,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        2,
        "--qa",
        suite,
        "--speed-runs",
        0,
        "--cache",
        tmp_path / "cache",
        "-t",
        2,
        "-o",
        tmp_path / "out",
    )
    assert result.code == 0, result.stderr[-3000:]
    (check,) = json.loads((tmp_path / "out" / "chat.json").read_text())["qa"]["checks"]
    # "<s>" rendered by the template is parsed as BOS (added once), then the vocab's space prefix (3 bytes of "▁")
    # and the text's bytes
    assert check["chat_template"] and check["prompt_tokens"] == 1 + 3 + len("<|user|>hi\n<|assistant|>")


@pytest.mark.slow
def test_evaluation_and_card_become_part_of_the_release(release, reference, heldout, tmp_path):
    """eval -o RELEASE/evaluation and card RELEASE are recorded in the manifest and SHA256SUMS, so verify covers
    them."""
    import shutil

    copy = tmp_path / "release"
    shutil.copytree(release, copy)
    evaluation = copy / "evaluation"
    result = ggufcarve(
        "eval",
        copy,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "--speed-runs",
        0,
        "--cache",
        tmp_path / "cache",
        "-t",
        2,
        "-o",
        evaluation,
        "-q",
    )
    assert result.code == 0, result.stderr[-3000:]
    assert ggufcarve("card", copy).code == 0
    manifest = json.loads((copy / "quant-manifest.json").read_text())
    recorded = {f["name"] for kind in ("evaluation", "card") for f in manifest["published"][kind]}
    on_disk = {p.relative_to(copy).as_posix() for p in evaluation.rglob("*") if p.is_file()} | {"README.md"}
    assert recorded == on_disk and "evaluation/summary.md" in recorded
    sums = (copy / "SHA256SUMS").read_text()
    assert "  README.md\n" in sums and "  evaluation/summary.md\n" in sums
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=copy).returncode == 0
    verified = ggufcarve("verify", copy, "-q")
    assert verified.code == 0, verified.stdout + verified.stderr
    (copy / "README.md").write_text("edited by hand\n")
    tampered = ggufcarve("verify", copy, "-q")
    assert tampered.code == 1 and "README.md" in tampered.stdout + tampered.stderr


def test_published_records_are_dropped_when_a_rung_is_rebuilt(tmp_path):
    import hashlib

    from ggufcarve.release.fragments import assemble, read_fragments, write_fragment
    from ggufcarve.release.manifest import MANIFEST_NAME, described_files

    rung_file = tmp_path / "m-Q4_K_M.gguf"
    rung_file.write_bytes(b"rung")
    source = {"files": [{"name": "m.gguf", "bytes": 1, "sha256": "1" * 64}]}

    def record(data: bytes) -> dict:
        rung_file.write_bytes(data)
        return {
            "name": "Q4_K_M",
            "status": "built",
            "files": [{"name": rung_file.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
        }

    write_fragment(tmp_path, record(b"rung"), {"source": source}, inputs=[], parameters={}, timings={})
    doc = {
        **assemble(tmp_path, read_fragments(tmp_path), drop_missing=True),
        "published": {"card": [{"name": "README.md", "bytes": 3, "sha256": "0" * 64}]},
    }
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(doc))
    assert "README.md" in described_files(doc)
    assert (
        assemble(tmp_path, read_fragments(tmp_path), drop_missing=True)["published"] == doc["published"]
    )  # the same rung files: still true
    write_fragment(tmp_path, record(b"rebuilt"), {"source": source}, inputs=[], parameters={}, timings={})
    assert (
        assemble(tmp_path, read_fragments(tmp_path), drop_missing=True)["published"] == {}
    )  # they describe the old rung
