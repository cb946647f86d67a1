"""The measurement layer's decision rules on tables of known statistics, and its units and rounds.

The tables are constructed so that the right answer is known without the code under test: a
candidate's per-token KLD is a fixed series plus an offset, so which one is better, and by how
many standard errors, follows from the construction."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ggufcarve.errors import BadInput
from ggufcarve.evaluate import kld
from ggufcarve.llama.devices import Compute
from ggufcarve.measure.statistics import Choice, choose_answer, paired_difference
from ggufcarve.measure.tournament import (
    Candidate,
    MeasureSettings,
    Segment,
    measure,
    schedule,
    spread_order,
    spread_units,
)

TOKENS = 127  # scored tokens per chunk at n_ctx 256 (the second half of each chunk, llama-perplexity's rule)


def segment(name: str, n_chunk: int, n_ctx: int = 256) -> Segment:
    return Segment(name, Path(f"/nonexistent/{name}.kld"), n_chunk, n_ctx, name)


def table(kld_values: np.ndarray) -> np.ndarray:
    rows = np.zeros((len(kld_values), kld.TOKEN_COLUMNS))
    rows[:, kld.KLD] = kld_values
    rows[:, kld.NLL] = 2.0 + kld_values
    rows[:, kld.NLL_BASE] = 2.0
    rows[:, kld.SAME_TOP] = 1.0
    return rows


def scorer(series: dict[str, list[np.ndarray]]):
    """score_unit from per-candidate per-chunk KLD series (unit = chunks first..first+count-1)."""

    def score_unit(candidate: Candidate, unit: tuple[int, int, int]) -> np.ndarray:
        seg, first, count = unit
        return table(np.concatenate([series[candidate.id][seg][i] for i in range(first, first + count)]))

    return score_unit


def test_spread_order_covers_the_range_and_each_prefix_is_spread():
    assert spread_order(1) == [0]
    assert spread_order(4) == [0, 2, 1, 3]
    assert spread_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]
    for n in range(1, 40):
        assert sorted(spread_order(n)) == list(range(n))
    order = spread_order(16)
    assert max(order[:2]) >= 8  # the first two units already lie in both halves


def test_units_are_evals_groups_spread_over_every_file_in_turn():
    segments = [segment("a", 10), segment("b", 3)]
    units = spread_units(segments, 4)  # n_ctx 512: 4 chunks side by side
    # a: groups at chunks 0, 4, 8 (the last of 2 chunks); b: one group of 3 chunks
    assert sorted(units) == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 3)]
    assert units[:2] == [(0, 0, 4), (1, 0, 3)]  # both files in the first two units
    assert sum(c for _, _, c in units) == 13


def test_schedule_doubles_to_every_unit_from_at_least_one_unit_per_file():
    assert schedule(1, 8) == [8]
    assert schedule(2, 8) == [8]
    assert schedule(3, 8) == [4, 8]
    assert schedule(11, 16) == [2, 4, 8, 16]
    assert schedule(11, 16, n_files=3) == [3, 6, 12, 16]
    assert schedule(5, 1) == [1]


def test_paired_difference_is_mean_and_standard_error_of_the_differences():
    rng = np.random.default_rng(0)
    a = rng.gamma(0.5, 0.2, 4000)
    d = paired_difference(a + 0.01, a)
    assert d.mean == pytest.approx(0.01) and d.stderr == pytest.approx(0.0, abs=1e-12) and d.worse_beyond(2.0)
    noise = rng.normal(0, 1, 4000)
    d = paired_difference(a + noise, a)
    assert d.stderr == pytest.approx(np.std(noise, ddof=1) / math.sqrt(4000))
    assert d.within(2.0) == (abs(noise.mean()) <= 2 * d.stderr)
    same = paired_difference(a, a)
    assert same.mean == 0.0 and same.within(2.0)


def test_the_answer_among_ties_is_the_smaller_file_or_what_prefer_says():
    choices = [
        Choice("unpruned-Q3_K_M", 0.0132, 683, 300),
        Choice("K14-Q3_K_M", 0.0136, 611, 300),
        Choice("K14-Q2_K", 0.0450, 479, 200),
    ]
    assert choose_answer(choices, ["K14-Q3_K_M"], "smaller") == "K14-Q3_K_M"
    assert choose_answer(choices, [], "smaller") == "unpruned-Q3_K_M"
    assert choose_answer(choices, ["K14-Q3_K_M"], "metric") == "unpruned-Q3_K_M"
    assert choose_answer(choices, ["K14-Q2_K", "K14-Q3_K_M"], "faster") == "K14-Q2_K"


def test_a_misleading_first_round_does_not_eliminate_the_true_winner(tmp_path):
    """'good' is 0.03 nats better than 'plain' on the chunks of the later rounds, but 0.004 worse on
    the first round's (the even chunks: n_ctx 2048 decodes one chunk per unit, and the spread order
    of 16 units starts with the 8 even ones), with noise whose standard error exceeds that. By point
    estimate the first round ranks it third of four (halving by rank would drop it); by the paired
    test it is within noise of the leader and stays, and wins on every chunk."""
    rng = np.random.default_rng(1)
    n_chunk, tokens = 16, 1023  # scored tokens per chunk at n_ctx 2048
    base = [rng.gamma(0.5, 0.4, tokens) for _ in range(n_chunk)]
    first_round = set(range(0, n_chunk, 2))
    noise = rng.normal(0, 0.5, (len(first_round), tokens))
    noise += 0.004 - noise.mean()  # exactly +0.004 on the first round's tokens
    good = [b + noise[i // 2] if i in first_round else b - 0.03 for i, b in enumerate(base)]
    lucky = [b - 0.002 if i in first_round else b + 0.01 for i, b in enumerate(base)]
    series = {"good": [good], "plain": [base], "lucky": [lucky], "bad": [[b + 0.5 for b in base]]}
    candidates = [Candidate(cid, Path(f"/nonexistent/{cid}.gguf"), file_bytes=100) for cid in series]
    got = measure(
        candidates,
        [segment("a", n_chunk, 2048)],
        MeasureSettings(Compute(threads=1)),
        tmp_path,
        score_unit=scorer(series),
    )
    first = got.groups[""]["rounds"][0]
    assert first["units"] == 8 and first["chunks"] == 8
    assert first["candidates"][:3] == ["lucky", "plain", "good"]  # the point estimates' order
    # 'plain' is 0.002 behind 'lucky' on every token (no noise): beyond noise, it leaves; 'good' stays
    assert first["left"] == {"bad": "halving", "plain": "halving"}
    assert got.groups[""]["winner"] == "good" and got.records["good"]["chunks_scored"] == n_chunk
    assert got.records["bad"]["stopped_early"] and got.records["bad"]["chunks_scored"] == 8
    assert got.records["bad"]["delta_vs_leader"][0] > 2 * got.records["bad"]["delta_stderr"][0]
    assert len(got.records["good"]["delta_vs_leader"]) == len(got.groups[""]["rounds"])


def test_a_candidate_over_the_budget_or_failing_the_gate_is_never_a_finalist(tmp_path):
    rng = np.random.default_rng(2)
    base = [rng.gamma(0.5, 0.4, TOKENS) for _ in range(8)]
    series = {
        "big": [[b - 0.05 for b in base]],
        "gated": [[b - 0.04 for b in base]],
        "small": [base],
        "smaller": [[b + 0.001 for b in base]],
    }
    candidates = [
        Candidate("big", Path("/x/big.gguf"), fits=False, file_bytes=900),
        Candidate("gated", Path("/x/g.gguf"), file_bytes=300),
        Candidate("small", Path("/x/s.gguf"), file_bytes=500),
        Candidate("smaller", Path("/x/t.gguf"), file_bytes=400),
    ]

    def gate(stats):
        return (
            (False, ["kld_mean"])
            if stats["kld_mean"] < base[0].mean() * 0 + np.concatenate(base).mean() - 0.03
            else (True, [])
        )

    got = measure(
        candidates,
        [segment("a", 8)],
        MeasureSettings(Compute(threads=1), gate=gate),
        tmp_path,
        score_unit=scorer(series),
    )
    decision = got.groups[""]
    assert "big" not in decision["finalists"] and got.records["big"]["stopped_reason"] == "budget"
    assert "gated" not in decision["finalists"] and got.records["gated"]["stopped_reason"] == "gate"
    # 'small' leads; 'smaller' is 0.001 worse on every token: no variance in the difference, so beyond noise
    assert decision["leader"] == "small" and decision["winner"] == "small" and decision["tie_with"] == []


def test_a_tie_within_noise_names_the_smaller_file(tmp_path):
    rng = np.random.default_rng(3)
    base = [rng.gamma(0.5, 0.4, TOKENS) for _ in range(8)]
    series = {
        "unpruned-Q3_K_M": [base],
        "K14-Q3_K_M": [[b + rng.normal(0, 0.05, TOKENS) for b in base]],
        "same-file": [base],
    }
    candidates = [
        Candidate("unpruned-Q3_K_M", Path("/x/u.gguf"), file_bytes=683),
        Candidate("K14-Q3_K_M", Path("/x/k.gguf"), file_bytes=611),
        Candidate("same-file", Path("/x/u.gguf"), file_bytes=683),
    ]
    got = measure(
        candidates,
        [segment("a", 8)],
        MeasureSettings(Compute(threads=1)),
        tmp_path,
        score_unit=scorer(series),
    )
    decision = got.groups[""]
    diff = paired_difference(np.concatenate(series["K14-Q3_K_M"][0]), np.concatenate(base))
    assert diff.within(2.0)  # the construction: the pruned candidate is within noise
    assert decision["winner"] == "K14-Q3_K_M"
    assert set(decision["tie_with"]) == {"unpruned-Q3_K_M", "same-file"}
    assert got.records["K14-Q3_K_M"]["tie_with"] == decision["tie_with"]
    got = measure(
        candidates,
        [segment("a", 8)],
        MeasureSettings(Compute(threads=1), prefer="metric"),
        tmp_path,
        score_unit=scorer(series),
    )
    means = {cid: np.concatenate(s[0]).mean() for cid, s in series.items()}
    assert got.groups[""]["winner"] == min(sorted(means), key=means.get)


@pytest.mark.slow
def test_two_candidates_on_the_same_file_tie_in_llama_cpp(tmp_path):
    """Scored by llama.cpp, the same file under two ids gives the same per-token tables: the paired
    difference is 0 with 0 standard error, the answer names a tie; the tables equal eval's."""
    import json

    from clirun import ggufcarve

    from ggufcarve.demo import DEMO_MODEL, HELDOUT
    from ggufcarve.measure.tournament import prepare_segments

    segments = prepare_segments(
        DEMO_MODEL, [HELDOUT], chunk_ctx=256, chunks=4, compute=Compute(threads=2), work=tmp_path
    )
    candidates = [
        Candidate("a", DEMO_MODEL, file_bytes=2),
        Candidate("b", DEMO_MODEL, file_bytes=1),
        Candidate("a-masked", DEMO_MODEL, keep={b: tuple(range(15)) for b in range(4)}, file_bytes=3),
    ]
    got = measure(candidates, segments, MeasureSettings(Compute(threads=2)), tmp_path)
    decision = got.groups[""]
    assert np.array_equal(got.table("a"), got.table("b"))
    assert got.records["a"]["kld_mean"] < 1e-6  # the reference scored against itself
    assert decision["winner"] == "b" and decision["tie_with"] == ["a"]  # within noise: the smaller file
    assert "a-masked" not in decision["tie_with"] and got.records["a-masked"]["kld_mean"] > 1e-3
    out = tmp_path / "eval"
    run = ggufcarve(
        "eval",
        DEMO_MODEL,
        "--reference",
        DEMO_MODEL,
        "--heldout",
        HELDOUT,
        "--ctx",
        256,
        "--chunks",
        4,
        "--speed-runs",
        0,
        "-o",
        out,
        "-t",
        2,
        "-q",
    )
    assert run.code == 0, run.stderr
    doc = json.loads(next(out.glob("*.json")).read_text())
    assert doc["kld_mean"] == pytest.approx(got.records["a"]["kld_mean"], rel=1e-9, abs=1e-15)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe", "deepseek2", "gpt-oss", "fused"])
def test_masked_on_the_unpruned_rung_equals_the_pruned_rungs_file(make_model, tmp_path, arch):
    """best's confirmation on a fixture of every architecture: the unpruned model and the pruned one
    quantized to Q8_0 by llama.cpp (the same type for every tensor), the keep-set masked on the
    unpruned rung scores the pruned rung's file within max(2 standard errors, 1%) of its mean KLD."""
    import json

    import factory
    from clirun import ggufcarve

    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.measure.tournament import prepare_segments
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.moe.layout import inspect_layout

    src = make_model(arch, "F16")
    layout = inspect_layout(read_model(src))
    groups = max(layout.group_count, 1)
    size = layout.expert_count // groups
    keepset = KeepSet({b: tuple(g * size + i for g in range(groups) for i in range(size // 2)) for b in layout.blocks})
    keep_file = tmp_path / "keep.json"
    keep_file.write_text(json.dumps(keepset.to_json()))
    pruned = tmp_path / "pruned.gguf"
    run = ggufcarve("prune", src, "--keep", keep_file, "-o", pruned, "-q")
    assert run.code == 0, run.stderr
    rung = factory.quantize_with_llama(src, tmp_path / "unpruned-Q8_0.gguf", "Q8_0")
    pruned_rung = factory.quantize_with_llama(pruned, tmp_path / "pruned-Q8_0.gguf", "Q8_0")
    full_types = {t.name: t.type_id for t in read_model(rung).tensors}
    assert all(
        full_types[t.name] == t.type_id for t in read_model(pruned_rung).tensors
    )  # the types agree: masking stands for the file
    words = "the quick brown fox jumps over a lazy dog while experts route tokens through layers".split()
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(" ".join(words[i % len(words)] for i in range(600)) + "\n")
    segments = prepare_segments(src, [heldout], chunk_ctx=64, chunks=8, compute=Compute(threads=2), work=tmp_path)
    nodes = tuple(f"{node}:{block}" for node, block in required_nodes(layout, keepset))
    got = measure(
        [Candidate("masked", rung, keep=keepset.layers, required_nodes=nodes), Candidate("file", pruned_rung)],
        segments,
        MeasureSettings(Compute(threads=2)),
        tmp_path,
    )
    masked, file = got.records["masked"], got.records["file"]
    assert masked["chunks_scored"] == file["chunks_scored"] == 8
    assert file["kld_mean"] > 1e-4  # pruning half the experts moves the model: the comparison can fail
    assert abs(masked["kld_mean"] - file["kld_mean"]) <= max(2 * file["kld_mean_stderr"], 0.01 * file["kld_mean"])


@pytest.mark.slow
def test_the_device_copy_path_gives_the_in_place_results_bit_for_bit(monkeypatch, tmp_path):
    """GGUFCARVE_TENSOR_COPY=1 makes every eval-callback consumer read graph tensors through
    ggml_backend_tensor_get and write the routing mask through ggml_backend_tensor_set (the path of
    a tensor in a device buffer); on the CPU both paths must give the same bits: a masked
    candidate's per-token table, traced routing and expert inputs, and a collected imatrix."""
    from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT
    from ggufcarve.gguf.container import read_model
    from ggufcarve.imatrix.collect import collect_imatrix
    from ggufcarve.llama.ggml import FORCE_COPY_ENV
    from ggufcarve.llama.trace import trace_routing
    from ggufcarve.measure.tournament import prepare_segments

    segments = prepare_segments(
        DEMO_MODEL, [HELDOUT], chunk_ctx=256, chunks=2, compute=Compute(threads=2), work=tmp_path
    )
    keep = {b: tuple(range(0, 16, 2)) for b in range(4)}
    tokens = list(range(3, 300))
    outputs = {}
    for forced in (False, True):
        if forced:
            monkeypatch.setenv(FORCE_COPY_ENV, "1")
        work = tmp_path / str(forced)
        work.mkdir()
        table = measure(
            [Candidate("masked", DEMO_MODEL, keep=keep)],
            segments,
            MeasureSettings(Compute(threads=2)),
            work,
        ).table("masked")
        traced = trace_routing(DEMO_MODEL, tokens, nodes=("ffn_moe_topk", "ffn_moe_logits"), context=128, batch=64)
        imatrix = collect_imatrix(
            read_model(DEMO_MODEL),
            [CALIBRATION],
            work / "im.gguf",
            ctx=128,
            chunks=2,
            compute=Compute(threads=2),
            force=True,
        )
        outputs[forced] = (table, traced, (work / "im.gguf").read_bytes(), imatrix)
    (table_a, traced_a, im_a, _), (table_b, traced_b, im_b, _) = outputs[False], outputs[True]
    assert np.array_equal(table_a, table_b) and len(table_a) > 0
    assert np.array_equal(traced_a.logits, traced_b.logits)
    assert traced_a.nodes.keys() == traced_b.nodes.keys() == {"ffn_moe_topk", "ffn_moe_logits"}
    for node, per_block in traced_a.nodes.items():
        assert per_block.keys() == traced_b.nodes[node].keys() and per_block
        for block, values in per_block.items():
            assert np.array_equal(values, traced_b.nodes[node][block]), (node, block)
    assert im_a == im_b


@pytest.mark.slow
def test_every_round_on_one_file_is_scored_by_the_child_that_loaded_it_once(tmp_path):
    """Four candidates on one file over two rounds: one load of the file in all (the child kept between the
    rounds), and each candidate's table equals the one a fresh child scores for it alone."""
    from ggufcarve.demo import DEMO_MODEL, HELDOUT
    from ggufcarve.measure.tournament import prepare_segments

    segments = prepare_segments(
        DEMO_MODEL, [HELDOUT], chunk_ctx=1024, chunks=6, compute=Compute(threads=2), work=tmp_path
    )
    keeps = {
        "keep-15": {b: tuple(range(15)) for b in range(4)},
        "keep-12": {b: tuple(range(12)) for b in range(4)},
        "keep-8": {b: tuple(range(8)) for b in range(4)},
        "keep-4": {b: tuple(range(4)) for b in range(4)},
    }
    settings = MeasureSettings(Compute(threads=2), keep_loaded=0)  # one file held at most: this one
    got = measure([Candidate(cid, DEMO_MODEL, keep=keep) for cid, keep in keeps.items()], segments, settings, tmp_path)
    rounds = got.groups[""]["rounds"]
    assert len(rounds) == 2 and rounds[0]["units"] < rounds[1]["units"] == 3
    assert got.loads == {DEMO_MODEL.name: 1}
    for cid, keep in keeps.items():
        (tmp_path / cid).mkdir()
        alone = measure([Candidate(cid, DEMO_MODEL, keep=keep)], segments, settings, tmp_path / cid)
        n = len(got.tables[cid])
        assert np.array_equal(got.table(cid), alone.table(cid, n)) and n >= rounds[0]["units"]


def test_chunk_standard_errors_match_a_bootstrap_over_chunks_where_the_token_formula_is_too_small():
    """Per-token differences with a shared offset per chunk (tokens of one chunk share their context): the
    per-token formula sd/sqrt(n) is smaller than the spread of the mean by about sqrt(tokens per chunk); the
    chunk standard error matches the spread of the mean over many draws of the data, and a bootstrap over
    chunks of one draw."""
    from ggufcarve.measure.statistics import chunk_stderr, token_stderr

    rng = np.random.default_rng(7)
    chunks, per_chunk = 40, 127

    def draw() -> np.ndarray:
        return (rng.normal(0, 0.05, chunks)[:, None] + rng.normal(0, 0.05, (chunks, per_chunk))).reshape(-1)

    means = [draw().mean() for _ in range(2000)]
    truth = float(np.std(means))  # the spread of the mean itself
    one = draw()
    picks = rng.integers(0, chunks, size=(2000, chunks))
    bootstrap = float(np.std([one.reshape(chunks, per_chunk)[p].mean() for p in picks]))
    chunked, tokens = chunk_stderr(one, per_chunk), token_stderr(one)
    assert abs(chunked - bootstrap) < 0.1 * bootstrap and abs(chunked - truth) < 0.25 * truth
    assert tokens < 0.2 * truth  # sqrt(1 + per_chunk / 2) / 1 = 8x too small here
    pair = paired_difference(one, np.zeros_like(one), per_chunk)
    assert pair.stderr == pytest.approx(chunked) and pair.chunks == chunks and pair.tokens == chunks * per_chunk


def test_kld_p999_decides_by_the_percentile_and_the_gate_judges_all_chunks(tmp_path):
    """'spiky' has the lower mean but rare large KLDs; 'even' the lower 99.9th percentile. Ranked by kld_p999,
    'even' wins beyond noise (the percentile's own bootstrap standard error), ranked by kld_mean 'spiky'. A
    gate that the first round's chunks fail and all chunks pass does not stop a candidate early."""
    rng = np.random.default_rng(5)
    n_chunk = 16
    even = [np.full(TOKENS, 0.05) + rng.normal(0, 0.002, TOKENS) for _ in range(n_chunk)]
    spiky = []
    for _ in range(n_chunk):
        chunk = np.full(TOKENS, 0.03) + rng.normal(0, 0.002, TOKENS)
        chunk[rng.integers(0, TOKENS)] = 1.0  # mean 0.038, below even's 0.05; 99.9th percentile 1.0
        spiky.append(chunk)
    series = {"even": [even], "spiky": [spiky], "worse": [[c + 0.2 for c in even]]}
    candidates = [Candidate(cid, Path(f"/x/{cid}.gguf"), file_bytes=1) for cid in series]
    for metric, winner in (("kld_p999", "even"), ("kld_mean", "spiky")):
        got = measure(
            candidates,
            [segment("a", n_chunk)],
            MeasureSettings(Compute(threads=1), metric=metric),
            tmp_path,
            score_unit=scorer(series),
        )
        assert got.groups[""]["winner"] == winner and got.groups[""]["tie_with"] == [], metric
    # 32 chunks at n_ctx 256: 4 units of 8 chunks, the first round's units 0 and 2 (chunks 0-7 and 16-23)
    first_round = {*range(0, 8), *range(16, 24)}
    even32 = even + even
    late = {
        "late": [[c + (0.5 if i in first_round else -0.3) + rng.normal(0, 1, TOKENS) for i, c in enumerate(even32)]],
        "other": [even32],
        "third": [[c + rng.normal(0, 1, TOKENS) for c in even32]],
    }

    def gate(stats):
        return (stats["kld_mean"] < 0.3, [] if stats["kld_mean"] < 0.3 else ["kld_mean"])

    got = measure(
        [Candidate(cid, Path(f"/x/{cid}.gguf"), file_bytes=1) for cid in late],
        [segment("a", 32)],
        MeasureSettings(Compute(threads=1), gate=gate, z=50.0),
        tmp_path,
        score_unit=scorer(late),
    )
    first = got.groups[""]["rounds"][0]
    assert first["units"] == 2 and first["kld_mean"]["late"] > 0.3  # the first round's chunks fail the gate
    assert "late" in got.groups[""]["finalists"] and got.records["late"]["gate_passed"]
    with pytest.raises(BadInput, match="--z 0 must be > 0"):
        measure(candidates, [segment("a", n_chunk)], MeasureSettings(Compute(threads=1), z=0.0), tmp_path)


def _search_problem(costs: dict[int, np.ndarray], noise: float, seed: int):
    """score_unit of a keep-set problem whose answer is known: a token's KLD is a base plus, per block, the
    summed cost of the experts the block drops, plus noise of its own for every keep-set."""

    def score_unit(candidate: Candidate, unit: tuple[int, int, int]) -> np.ndarray:
        _, first, count = unit
        loss = sum(float(c.sum() - c[list(candidate.keep[b])].sum()) for b, c in costs.items())
        key = hash((tuple(sorted((b, tuple(ids)) for b, ids in candidate.keep.items())), first, seed)) % 2**32
        rng = np.random.default_rng(key)
        return table(0.05 + loss + rng.normal(0, noise, count * TOKENS))

    return score_unit


def test_the_search_reaches_the_best_keep_set_and_takes_no_move_within_noise(tmp_path):
    """Two blocks of 6 experts keeping 3, each dropped expert adding its cost to every token's KLD: from the
    worst keep-set the search takes moves until each block keeps its 3 costliest experts (the proxy: the costs
    on the diagonal of the pair sums), every taken move better beyond noise on all the calibration units. With
    costs far below the noise, no move is taken."""
    from ggufcarve.measure.search import SearchSettings, local_search, pairwise_moves

    costs = {0: np.array([0.01, 0.02, 0.03, 0.04, 0.05, 0.06]), 1: np.array([0.06, 0.01, 0.05, 0.02, 0.04, 0.03])}
    start = {0: (0, 1, 2), 1: (1, 3, 5)}
    segments = [segment("calibration", 32)]
    found = local_search(
        Path("/x/model.gguf"),
        start,
        pairwise_moves({b: np.diag(c) for b, c in costs.items()}),
        segments,
        MeasureSettings(Compute(threads=1)),
        SearchSettings(passes=200, moves=4),
        tmp_path,
        score_unit=_search_problem(costs, 0.01, 1),
    )
    assert found.keep == {0: (3, 4, 5), 1: (0, 2, 4)}
    assert found.path and all(step["improvement"] > 2 * step["stderr"] for step in found.path)
    assert found.kld < found.start_kld and found.stopped
    flat = {b: c * 1e-4 for b, c in costs.items()}
    still = local_search(
        Path("/x/model.gguf"),
        start,
        pairwise_moves({b: np.diag(c) for b, c in flat.items()}),
        segments,
        MeasureSettings(Compute(threads=1)),
        SearchSettings(passes=3, moves=4),
        tmp_path,
        score_unit=_search_problem(flat, 0.5, 2),
    )
    assert still.keep == start and still.path == [] and still.kld == still.start_kld


def test_a_round_of_one_chunk_decides_nothing_and_its_records_are_json(tmp_path):
    """At n_ctx 2048 a unit is one chunk: a first round of one unit has no spread of chunk means, so no
    candidate leaves on it (an infinite standard error, written as null), and every record is plain JSON."""
    import json

    rng = np.random.default_rng(9)
    tokens = 1023
    series = {f"c{i}": [[rng.gamma(0.5, 0.4, tokens) + 0.01 * i for _ in range(4)]] for i in range(8)}
    got = measure(
        [Candidate(cid, Path(f"/x/{cid}.gguf"), file_bytes=1) for cid in series],
        [segment("a", 4, 2048)],
        MeasureSettings(Compute(threads=1)),
        tmp_path,
        score_unit=scorer(series),
    )
    first = got.groups[""]["rounds"][0]
    assert first["units"] == 1 and first["left"] == {}
    assert all(d["stderr"] is None for d in first["delta_vs_leader"].values())
    json.dumps({"records": got.records, "groups": got.groups}, allow_nan=False)


def test_a_device_out_of_memory_with_other_models_held_ends_them_and_loads_again_alone():
    """The scorer holds other files' children on the device: a load that runs the device out of memory
    ends them, and the same request is made again to a child of its own; alone, the error stands."""
    from ggufcarve.errors import DeviceOutOfMemory
    from ggufcarve.measure.tournament import _Scorer

    closed, asked = [], []

    class Held:
        alive = True

        def close(self) -> None:
            closed.append(self)

        def kill(self) -> None:
            closed.append(self)

    class Loading:
        def __init__(self, fails: int) -> None:
            self.fails = fails

        def run(self, request, *args, **kwargs):
            asked.append(request)
            if len(asked) <= self.fails:
                raise DeviceOutOfMemory("out of memory", "", model="m.gguf", compute=Compute(99), n_ctx=512)
            return {"loaded": True, "jobs": {}}

    scorer = object.__new__(_Scorer)
    scorer.on_event = lambda event: None
    scorer.sessions = {Path("other.gguf"): Held()}
    scorer.budget = 10**12
    loading = Loading(fails=1)
    scorer._session = lambda model: loading
    import types

    request = types.SimpleNamespace(result_out="measure.result.json")
    assert scorer._scored(Path("m.gguf"), request, "1 candidate") == {"loaded": True, "jobs": {}}
    assert asked == [request, request] and len(closed) == 1 and scorer.sessions == {} and scorer.budget == 0
    asked.clear()
    loading.fails = 1
    with pytest.raises(DeviceOutOfMemory):  # nothing else held: the model does not fit alone
        scorer._scored(Path("m.gguf"), request, "1 candidate")
    assert asked == [request]


def test_expand_adds_candidates_for_the_survivors_of_the_first_round(tmp_path):
    """'bad' leaves in the first round, so only 'good' gets its variant; the variant is scored from the first
    unit up, on every unit by the end, and competes in the rounds left."""
    rng = np.random.default_rng(5)
    base = [rng.gamma(0.5, 0.4, TOKENS) for _ in range(16)]
    series = {
        "good": [base],
        "plain": [[b + 0.0005 * rng.normal(size=TOKENS) for b in base]],
        "bad": [[b + 0.5 for b in base]],
        "good-top3": [[b + 0.2 for b in base]],
        "bad-top3": [[b + 0.9 for b in base]],
    }
    asked: list[list[str]] = []

    def expand(survivors):
        asked.append(sorted(survivors))
        return [Candidate(f"{cid}-top3", Path(f"/x/{cid}.gguf"), file_bytes=100) for cid in survivors if cid == "good"]

    candidates = [Candidate(cid, Path(f"/x/{cid}.gguf"), file_bytes=100) for cid in ("good", "plain", "bad")]
    got = measure(
        candidates, [segment("a", 16)], MeasureSettings(Compute(threads=1)), tmp_path,
        score_unit=scorer(series), expand=expand,
    )  # fmt: skip
    rounds = got.groups[""]["rounds"]
    assert asked == [["good", "plain"]] and rounds[0]["left"] == {"bad": "halving"}
    assert "good-top3" not in rounds[0]["candidates"] and "good-top3" in rounds[1]["candidates"]
    assert "bad-top3" not in got.records
    variant = got.records["good-top3"]
    assert variant["finalist"] and variant["chunks_scored"] == 16
    assert variant["kld_mean"] == pytest.approx(float(np.concatenate(series["good-top3"][0]).mean()))
    assert got.groups[""]["winner"] in ("good", "plain")


def test_keep_faster_keeps_a_worse_candidate_that_reads_fewer_bytes(tmp_path):
    """'fast' is 0.05 worse than 'slow' on every token but reads half the bytes per token: halving keeps it
    with keep_faster (nothing at least as fast beats it) and drops it without; 'dominated' reads as many bytes
    as 'fast' and is worse than it, so it leaves either way."""
    rng = np.random.default_rng(6)
    base = [rng.gamma(0.5, 0.4, TOKENS) for _ in range(16)]
    series = {
        "slow": [base],
        "fast": [[b + 0.05 for b in base]],
        "dominated": [[b + 0.08 for b in base]],
        "other": [[b + 0.0002 * rng.normal(size=TOKENS) for b in base]],
    }
    read = {"slow": 200, "fast": 100, "dominated": 100, "other": 200}
    candidates = [Candidate(cid, Path(f"/x/{cid}.gguf"), file_bytes=100, read_bytes=read[cid]) for cid in series]
    for keep_faster, finalists in ((True, {"slow", "fast", "other"}), (False, {"slow", "other"})):
        got = measure(
            candidates, [segment("a", 16)], MeasureSettings(Compute(threads=1), keep_faster=keep_faster), tmp_path,
            score_unit=scorer(series),
        )  # fmt: skip
        assert set(got.groups[""]["finalists"]) == finalists, keep_faster
        assert got.records["dominated"]["stopped_reason"] == "halving"
