"""`ggufcarve best` on the demo model, judged by llama.cpp and by `ggufcarve eval`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from clirun import ggufcarve
from llama_sources import ffn_exps_regexes, offload_oracle

from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT
from ggufcarve.llama import launch
from ggufcarve.pipeline.demo import FILES

CTX, EVAL_CTX, CHUNKS = 256, 128, 4
GPU_MEMORY = (
    2**30 + 10 * 2**20
)  # llama.cpp's 1 GiB margin and 10 MiB: with the compute buffers, some rungs fit whole, some with --n-cpu-moe N
# between the demo's rungs by llama.cpp's measured total (weights + cache + compute + output; the compute
# buffers are 4.1 MiB at ctx 256): unpruned Q2_K and IQ2_XS fit, unpruned Q3_K_M does not
MEMORY = 11 * 2**20

CONTEXT_CHILD = """
import sys
import llama_cpp
from ggufcarve.llama.libllama import forward_warnings, load_model
forward_warnings(llama_cpp, verbose=True)
model = load_model(llama_cpp, sys.argv[1])
params = llama_cpp.llama_context_default_params()
params.n_ctx, params.n_seq_max = int(sys.argv[2]), 1
sys.exit(0 if llama_cpp.llama_init_from_model(model, params) else 3)
"""
CACHE_SIZE = re.compile(r"^llama_kv_cache: size =\s*(?P<mib>[\d.]+) MiB")
COMPUTE_SIZE = re.compile(r"CPU compute buffer size =\s*(?P<mib>[\d.]+) MiB")


def llama_compute_mib(path: Path, n_ctx: int) -> float:
    """The compute buffer llama.cpp allocates when it creates a context of `n_ctx` for `path` on the CPU."""
    lines: list[str] = []
    finished = launch.run([sys.executable, "-c", CONTEXT_CHILD, path, str(n_ctx)], on_line=lines.append, timeout=120)
    assert finished.ok, "\n".join(finished.tail)
    sizes = [float(m["mib"]) for line in lines if (m := COMPUTE_SIZE.search(line))]
    assert len(sizes) == 1, lines[-20:]
    return sizes[0]


def llama_cache_mib(path: Path, n_ctx: int) -> float:
    """The KV cache llama.cpp reports when it creates a context of `n_ctx` for `path`."""
    lines: list[str] = []
    finished = launch.run([sys.executable, "-c", CONTEXT_CHILD, path, str(n_ctx)], on_line=lines.append, timeout=120)
    assert finished.ok, "\n".join(finished.tail)
    sizes = [float(m["mib"]) for line in lines if (m := CACHE_SIZE.match(line))]
    assert len(sizes) == 1, lines[-20:]
    return sizes[0]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("best")
    text = HELDOUT.read_text(encoding="utf-8")
    cut = text.find("\n", len(text) // 2) + 1
    first, second = tmp / "heldout-a.txt", tmp / "heldout-b.txt"
    first.write_text(text[:cut], encoding="utf-8")
    second.write_text(text[cut:], encoding="utf-8")
    out = tmp / "best"
    result = ggufcarve("best", *best_arguments(first, second, out), "--quiet")
    assert result.code == 0, result.stderr[-3000:]
    return out, (first, second), result


def best_arguments(first: Path, second: Path, out: Path, memory: int = MEMORY) -> list:
    return [
        DEMO_MODEL,
        "--memory",
        f"{memory}B",
        "--ctx",
        CTX,
        "--ladder",
        FILES / "ladder.toml",
        "--calibration",
        CALIBRATION,
        "--heldout",
        first,
        "--heldout",
        second,
        "--chunk-ctx",
        EVAL_CTX,
        "--chunks",
        CHUNKS,
        "--max-tokens",
        2048,
        "--methods",
        "frequency,weights",
        "--gpu-memory",
        f"{GPU_MEMORY}B",
        "--tier",
        "ram",
        "-o",
        out,
        "-t",
        2,
    ]


@pytest.mark.slow
def test_the_answer_fits_by_the_real_file_and_llama_cpps_cache(searched):
    out, _, result = searched
    report = json.loads((out / "best.json").read_text())
    winner = report["winner"]
    path = out / winner["path"]
    assert path.parent.parent == out / "models" and path.is_file()
    cache_mib = llama_cache_mib(path, CTX)
    assert cache_mib > 0.3
    assert abs(winner["cache_bytes"] / 2**20 - cache_mib) <= 0.005
    assert path.stat().st_size + cache_mib * 2**20 <= MEMORY
    memory = winner["memory"][0]
    assert memory["device"] == "host" and memory["total"] <= MEMORY and winner["memory_source"].startswith("measured")
    assert memory["total"] == memory["weights"] + memory["cache"] + memory["compute"] + memory["output"]
    assert abs(memory["cache"] / 2**20 - cache_mib) <= 0.005  # the dry load's cache is the allocating load's
    assert winner["file_bytes"] == path.stat().st_size
    assert f"answer: {winner['id']}" in result.stdout
    depth = winner["speed_method"]["depth"]
    assert winner["speed_computed_on"] == {"CPU": 5} and depth == CTX // 2  # the RAM tier's timing, on the CPU
    assert f"decode {winner['decode_tok_s']:.1f} tok/s at depth {depth} on the CPU (llama-bench)" in " ".join(
        result.stdout.split()
    )  # the answer line, as the console wraps it
    # the table holds both families, each scored
    families = {c["family"] for c in report["candidates"] if c.get("kld_mean") is not None}
    assert families == {"pruned", "unpruned"}
    table = (out / "best.md").read_text()
    assert "| pruned |" in table and "| unpruned |" in table
    for c in report["candidates"]:
        for key in (
            "kept_experts",
            "quant",
            "family",
            "file_bytes",
            "cache_bytes",
            "fits",
            "kld_mean",
            "kld_mean_stderr",
            "kld_p999",
            "same_top_p",
            "ppl",
            "chunks_scored",
            "stopped_early",
            "selection",
            "scored_by",
            "masked_on",
            "types_match",
        ):
            assert key in c, (c["id"], key)
        assert isinstance(c["selection"], str) and (c["family"] == "unpruned") == (c["keep_set"] is None), c["id"]
        if c.get("identical_to") is None:
            assert c["kld_mean"] is not None and c["chunks_scored"] > 0, c["id"]
    assert [s["name"] for s in winner["segments"]] == ["heldout-a.txt", "heldout-b.txt"]
    assert set(report["timings"]) >= {
        "calibration_seconds",
        "references_seconds",
        "builds_seconds",
        "tournament_seconds",
        "confirmation_seconds",
    }


@pytest.mark.slow
def test_pruned_candidates_are_masked_on_the_unpruned_rung_where_llama_quantize_chooses_the_same_types(searched):
    """llama-quantize's type rules depend on n_expert (src/llama-quant.cpp: n_expert == 8 raises
    attn_v and ffn_down types): at K = 8 of 16 the pruned rungs are scored as built files; at every
    other K on the unpruned rung of their quant with the dropped experts masked out of routing."""
    from ggufcarve.gguf.container import read_model

    out, _, _ = searched
    report = json.loads((out / "best.json").read_text())
    pruned = [c for c in report["candidates"] if c["family"] == "pruned" and c.get("identical_to") is None]
    assert {c["kept_experts"] for c in pruned} >= {8, 14}
    for c in pruned:
        if c["kept_experts"] == 8:
            assert c["scored_by"] == "file" and c["types_match"] is False and c["built"], c["id"]
            assert "llama-quantize gives" in c["scored_by_reason"]
            unpruned = next(
                (out / "models" / "unpruned").glob(f"*-{c['quant']}.gguf")
            )  # built for every candidate quant
            built = {t.name: t.type_id for t in read_model(out / c["path"]).tensors}
            full = {t.name: t.type_id for t in read_model(unpruned).tensors}
            assert any(built[n] != full[n] for n in built), c["id"]  # llama.cpp's own files: the types do differ
        else:
            assert c["scored_by"] == "mask" and c["types_match"] is True, c["id"]
            assert c["masked_on"] == next((out / "models" / "unpruned").glob(f"*-{c['quant']}.gguf")).name


@pytest.mark.slow
def test_the_masked_winner_is_confirmed_by_its_built_file(searched):
    """The winner scored by masking is built as a real file and scored again: the file's mean KLD
    lies within max(2 standard errors, 1%) of the masked score, and the built file has llama.cpp's
    types of the unpruned rung on every tensor."""
    out, _, _ = searched
    report = json.loads((out / "best.json").read_text())
    confirmed = [c for c in report["candidates"] if c.get("confirmed")]
    assert confirmed and all(c["scored_by"] == "mask" and c["built"] for c in confirmed)
    assert len(confirmed) <= 2  # the winner and --confirm 1 runner-up
    for c in confirmed:
        k = c["confirmed"]
        assert abs(k["file_kld_mean"] - k["masked_kld_mean"]) <= max(
            2 * k["file_kld_mean_stderr"], 0.01 * k["masked_kld_mean"]
        ), c["id"]
        assert k["types_mismatched"] == []
        assert (out / c["path"]).is_file()


@pytest.mark.slow
def test_each_run_command_places_the_file_by_llama_cpps_n_cpu_moe_rule(searched):
    """The GPU placement each built candidate's command reports (`gpu`): the smallest N whose blocks
    0..N-1's expert tensors (llama.cpp's regex from common/common.h on gguf-py's tensor sizes) leave
    the rest, the cache, the compute buffers (the graph's, as llama.cpp allocates them on the CPU, plus
    the largest expert block kept in system memory) and llama.cpp's 1 GiB margin within the GPU. The
    command line itself runs where the file was ranked: tier ram, every layer on the CPU."""
    out, _, _ = searched
    report = json.loads((out / "best.json").read_text())
    assert report["parameters"]["tier"] == "ram"
    placements = set()
    for c in report["candidates"]:
        if not c["built"]:
            continue
        main, _, gpu, _ = offload_oracle(out / c["path"], *ffn_exps_regexes())
        graph = round(llama_compute_mib(out / c["path"], CTX) * 2**20)
        blocks = [gpu[i] - gpu[i + 1] for i in range(main)]
        fitting = [
            n
            for n in range(main + 1)
            if gpu[n] + c["cache_bytes"] + graph + max(blocks[:n], default=0) + 2**30 <= GPU_MEMORY
        ]
        expected = fitting[0] if fitting else None
        argv = c["run_command"]["argv"]
        assert c["run_command"]["gpu"]["n_cpu_moe"] == expected, c["id"]
        # ranked in tier ram: the command runs where it was ranked and timed, every layer on the CPU
        assert c["placement"]["gpu_layers"] == 0 and argv[argv.index("-ngl") + 1] == "0", c["id"]
        assert "--n-cpu-moe" not in argv and "-ot" not in argv and "--rpc" not in argv, c["id"]
        placements.add("whole" if expected == 0 else "none" if expected is None else "n")
    assert "n" in placements, placements


@pytest.mark.slow
def test_the_winners_file_kld_is_evals_on_each_file(searched, tmp_path):
    out, files, _ = searched
    winner = json.loads((out / "best.json").read_text())["winner"]
    assert winner["chunks_scored"] == 2 * CHUNKS and not winner["stopped_early"]
    segments = winner["confirmed"]["file_segments"] if winner.get("confirmed") else winner["segments"]
    for segment, heldout in zip(segments, files):
        result = ggufcarve(
            "eval",
            out / winner["path"],
            "--reference",
            DEMO_MODEL,
            "--heldout",
            heldout,
            "--ctx",
            EVAL_CTX,
            "--chunks",
            CHUNKS,
            "--speed-runs",
            0,
            "-o",
            tmp_path / heldout.stem,
            "-t",
            2,
            "-q",
        )
        assert result.code == 0, result.stderr[-2000:]
        doc = json.loads(next((tmp_path / heldout.stem).glob(f"{Path(winner['path']).stem}*.json")).read_text())
        assert doc["kld_mean"] == pytest.approx(segment["kld_mean"], rel=1e-9, abs=1e-12)
        assert doc["kld_p999"] == pytest.approx(segment["kld_p999"], rel=1e-9, abs=1e-12)
        assert doc["same_top_p"] == pytest.approx(segment["same_top_p"], rel=1e-9)


@pytest.mark.slow
def test_the_plan_publishes_exactly_the_winner(searched):
    from ggufcarve.pipeline.plan import load_plan

    out, _, _ = searched
    report = json.loads((out / "best.json").read_text())
    winner = report["winner"]
    if winner["family"] == "pruned":
        plan = load_plan(out / "plan.toml")
        assert plan.ladder.only == (winner["quant"],) and plan.evaluation.unpruned == ()
        assert plan.selection.keepset == (out / winner["keep_set"]).resolve()
        assert report["publish"]["command"] == ["ggufcarve", "run", "plan.toml"]
        result = ggufcarve("run", out / "plan.toml", "--dry-run")
        assert result.code == 0, result.stderr[-2000:]
        assert winner["quant"] in result.stdout + result.stderr
    else:
        assert not (out / "plan.toml").exists()
        assert report["publish"]["command"][:3] == ["ggufcarve", "ladder", "run"]


def test_an_unpruned_winner_is_published_by_the_ladder_alone(tmp_path):
    """No prune stage: the unpruned winner's rung from the source, with best's imatrix; the command
    line is the real CLI's (its dry run accepts it)."""
    from types import SimpleNamespace

    from ggufcarve.best.render import plan_document, publish_command

    out = tmp_path / "best"
    out.mkdir()
    report = {"winner": {"family": "unpruned", "quant": "Q2_K", "keep_set": None}}
    settings = SimpleNamespace(ladder=FILES / "ladder.toml")
    argv = publish_command(report, DEMO_MODEL, settings, out, tmp_path / "absent.imatrix.gguf")
    assert (
        argv[:3] == ["ggufcarve", "ladder", "run"]
        and argv[argv.index("--only") + 1] == "Q2_K"
        and "--imatrix" not in argv
    )
    with pytest.raises(ValueError):
        plan_document(report, DEMO_MODEL, settings, out, tmp_path / "absent.imatrix.gguf")
    result = ggufcarve(*argv[1:-1], tmp_path / "release", "--dry-run", cwd=out)
    assert result.code == 0, result.stderr[-2000:]
    assert "Q2_K" in result.stdout + result.stderr and not (tmp_path / "release").exists()


def test_candidates_are_the_largest_fitting_k_per_rung_the_next_smaller_and_the_unpruned_rungs():
    from types import SimpleNamespace

    from ggufcarve.best.candidates import choose_candidates
    from ggufcarve.quant.fit import FitRow, RungSize

    sizes = {"Q8_0": 1.0, "Q4_K_M": 0.5}  # bytes per expert kept, per rung
    rows = [
        FitRow(k, RungSize(rung, rung, int(100 * k * per), (), False), 900, 100)
        for k in (4, 8, 12, 16)
        for rung, per in sizes.items()
    ]
    report = SimpleNamespace(
        layout=SimpleNamespace(expert_count=16),
        spec=SimpleNamespace(rungs=[SimpleNamespace(name=n) for n in sizes]),
        rows=rows,
        memory=900,
    )
    chosen = {c.id: c for c in choose_candidates(report)}
    # Q8_0: 800 + 100 fits at K=8, not K=12; Q4_K_M: every K fits, 16 is the unpruned model
    assert set(chosen) == {"K8-Q8_0", "K4-Q8_0", "unpruned-Q4_K_M", "K12-Q4_K_M"}
    assert chosen["unpruned-Q4_K_M"].family == "unpruned" and chosen["K12-Q4_K_M"].family == "pruned"
    assert all(c.fits for c in chosen.values())


def test_dry_run_lists_the_candidates_and_writes_nothing(tmp_path):
    out = tmp_path / "best"
    result = ggufcarve(
        "best",
        DEMO_MODEL,
        "--memory",
        "11MiB",
        "--ctx",
        CTX,
        "--ladder",
        FILES / "ladder.toml",
        "--calibration",
        CALIBRATION,
        "--heldout",
        HELDOUT,
        "--chunk-ctx",
        EVAL_CTX,
        "--chunks",
        CHUNKS,
        "-o",
        out,
        "-t",
        2,
        "--dry-run",
    )
    assert result.code == 0, result.stderr[-2000:]
    assert (
        "unpruned-Q2_K" in result.stdout and "K14-Q2_K" in result.stdout and "unpruned-Q3_K_M" not in result.stdout
    )  # 11.40 MiB measured > 11 MiB
    assert (
        "disk needed" in result.stdout
        and "estimate: calibration" in result.stdout
        and "nothing was written" in result.stdout
    )
    assert "by masking on those rungs" in result.stdout
    assert not out.exists()


def test_only_an_unknown_candidate_is_one_line_before_anything_is_written(tmp_path):
    out = tmp_path / "best"
    result = ggufcarve(
        "best",
        DEMO_MODEL,
        "--memory",
        "11MiB",
        "--ctx",
        CTX,
        "--ladder",
        FILES / "ladder.toml",
        "--calibration",
        CALIBRATION,
        "--heldout",
        HELDOUT,
        "--eval-ctx",
        EVAL_CTX,
        "--chunks",
        CHUNKS,
        "-o",
        out,
        "-t",
        2,
        "--only",
        "K99-Q8_0",
        "--quiet",
    )
    assert result.code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and lines[0].startswith("error: --only K99-Q8_0: not a candidate")
        and "unpruned-Q2_K" in lines[0]
    ), result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_rerun_with_a_larger_budget_scores_only_the_new_candidates(searched, tmp_path):
    """Work is reused by content: the keep-sets and the imatrix (sha256 of the source and the
    texts), the rungs (the ladder's resume), and every candidate's per-unit tables (the model
    file's sha256 and its keep-set): a second run into a copy of the folder with a larger budget
    decodes only for candidates the first run did not score."""
    import shutil

    out, (first, second), _ = searched
    again = tmp_path / "again"
    shutil.copytree(out, again)
    before = json.loads((out / "best.json").read_text())
    result = ggufcarve("best", *best_arguments(first, second, again, memory=MEMORY + 2 * 2**20), "--quiet", "--force")
    assert result.code == 0, result.stderr[-3000:]
    report = json.loads((again / "best.json").read_text())
    assert report["keep_sets_reused"] and report["previous_run_timings"] == before["timings"]
    old_ids = {c["id"] for c in before["candidates"] if c.get("scored_by")}
    new_ids = {c["id"] for c in report["candidates"] if c.get("scored_by")} - old_ids
    assert new_ids  # the larger budget brings candidates the first run did not have
    assert report["chunks_cached"] >= sum(
        c["chunks_scored"] for c in report["candidates"] if c["id"] in old_ids and c.get("scored_by")
    )
    assert (
        report["chunks_decoded"]
        <= sum(c["chunks_scored"] for c in report["candidates"] if c["id"] in new_ids) + 2 * CHUNKS
    )


def test_first_contact_errors_are_one_line_in_units_and_before_any_work(tmp_path):
    """A budget in MiB is answered in MiB, a zero budget suggests a positive one, -o naming a file is
    refused (the dry run too), and no blank line stands above an error."""
    common = [
        "--ctx",
        CTX,
        "--ladder",
        FILES / "ladder.toml",
        "--calibration",
        CALIBRATION,
        "--heldout",
        HELDOUT,
        "--eval-ctx",
        EVAL_CTX,
    ]
    small = ggufcarve("best", DEMO_MODEL, "--memory", "2MiB", *common, "-o", tmp_path / "b", "-q")
    assert (
        small.code == 1
        and "nothing fits in 2.00 MiB: the smallest rung takes" in small.error_line
        and " MiB as llama.cpp allocates" in small.error_line
    )
    assert small.stderr.startswith("error:"), small.stderr[:200]
    zero = ggufcarve("best", DEMO_MODEL, "--memory", "0", *common, "-o", tmp_path / "b")
    assert (
        zero.code == 1
        and "a budget of nothing" in zero.error_line
        and "24GiB" in zero.error_line
        and "0GiB" not in zero.error_line
    )
    a_file = tmp_path / "taken"
    a_file.write_text("")
    for extra in ([], ["--dry-run"]):
        run = ggufcarve("best", DEMO_MODEL, "--memory", "12MiB", *common, "-o", a_file, *extra)
        assert run.code == 1 and f"-o {a_file} is a file" in run.error_line and "folder" in run.error_line, run.stderr
    assert a_file.read_text() == "" and not (tmp_path / "b").exists()


def test_keep_and_chunk_ctx_speak_the_shared_vocabulary(tmp_path):
    """best --keep weighs the given K values (the unpruned rungs beside them), or a keep-set file at
    its K beside the criteria's; --chunk-ctx is the scoring chunk (--eval-ctx its older spelling)."""
    import json as _json

    from ggufcarve.demo import CALIBRATION as demo_calibration

    keepset = tmp_path / "given.json"
    keepset.write_text(_json.dumps({str(b): list(range(0, 16, 2)) for b in range(4)}))
    common = [
        DEMO_MODEL,
        "--memory",
        "64MiB",
        "--ctx",
        "256",
        "--heldout",
        HELDOUT,
        "--calibration",
        demo_calibration,
        "-o",
        tmp_path / "b",
        "--dry-run",
        "--json",
    ]
    counts = ggufcarve("best", *common, "--keep", "12", "--chunk-ctx", "128")
    assert counts.code == 0, counts.stderr
    kept = {c["kept_experts"] for c in _json.loads(counts.stdout)["candidates"]}
    assert kept == {12, 16}
    given = ggufcarve("best", *common, "--keep", keepset, "--eval-ctx", "128")
    assert given.code == 0, given.stderr
    assert {c["kept_experts"] for c in _json.loads(given.stdout)["candidates"]} == {8, 16}
    both = ggufcarve("best", *common, "--chunk-ctx", "128", "--eval-ctx", "128")
    assert both.code != 0 and "--chunk-ctx and --eval-ctx name the same thing" in both.stderr


@pytest.mark.slow
@pytest.mark.parametrize("method, split", [("weights", True), ("frequency", False)])
def test_best_search_starts_from_the_winner_and_answers_only_when_better_on_heldout_text(tmp_path, method, split):
    """best --search: a search from the tournament's masked winner on the calibration text; its keep-set is
    a candidate of its own that prunes; it is the answer exactly when the winner is worse than it beyond noise
    on the held-out text, and an answer scored by mask is confirmed by its built file (llama.cpp's judgement).
    The two cases take both ways here: weights' search loses on the held-out text, frequency's wins (by a
    margin near the threshold, so neither way is asserted)."""
    out = tmp_path / "best"
    if split:
        text = HELDOUT.read_text(encoding="utf-8")
        cut = text.find("\n", len(text) // 2) + 1
        first, second = tmp_path / "heldout-a.txt", tmp_path / "heldout-b.txt"
        first.write_text(text[:cut], encoding="utf-8")
        second.write_text(text[cut:], encoding="utf-8")
        arguments = best_arguments(first, second, out)
        arguments[arguments.index("frequency,weights")] = method
    else:
        arguments = [
            DEMO_MODEL, "--memory", f"{MEMORY}B", "--ctx", CTX, "--ladder", FILES / "ladder.toml",
            "--calibration", CALIBRATION, "--heldout", HELDOUT, "--chunk-ctx", EVAL_CTX, "--chunks", 2 * CHUNKS,
            "--max-tokens", 2048, "--methods", method, "--tier", "ram", "-o", out, "-t", 2,
        ]  # fmt: skip
    result = ggufcarve("best", *arguments, "--search", "--search-passes", 3, "--z", 0.25, "--quiet")
    assert result.code == 0, result.stderr[-3000:]
    report = json.loads((out / "best.json").read_text())
    found = report["search"]
    assert found["searched"] and found["passes"] == 3
    candidate = next(c for c in report["candidates"] if c["id"] == found["candidate"])
    assert candidate["selection"] == "search" and found["start"] == candidate["id"].removesuffix("-search")
    assert (report["winner"]["id"] == found["candidate"]) == found["beats_start"]
    if report["winner"]["scored_by"] == "mask":
        assert report["winner"]["confirmed"]["chunks"] == 2 * CHUNKS
    pruned = tmp_path / "searched.gguf"
    assert ggufcarve("prune", DEMO_MODEL, "--keep", out / candidate["keep_set"], "-o", pruned, "-q").code == 0


OVER_BUDGET_CHILD = """
import sys
from ggufcarve.best import finalists, run
from ggufcarve.console import main

over = set(sys.argv[1].split(","))
real = run.built_record


def built_record(path, settings, tier):
    record = real(path, settings, tier)
    if path.name in over:
        record["fits"] = False
    return record


run.built_record = finalists.built_record = built_record
sys.argv = ["ggufcarve", *sys.argv[2:]]
main()
"""


@pytest.mark.slow
def test_a_winner_over_budget_once_built_gives_way_to_the_next_finalist_by_metric_built_then(searched, tmp_path):
    """Built files measured over their budget (a dry load's verdict, made false here for the first
    run's winner and every built finalist ahead of the first one not built): the rerun walks the
    finalists by metric, builds the first unbuilt one, confirms and times it, and answers with it."""
    import shutil
    import subprocess

    out, (first, second), _ = searched
    before = json.loads((out / "best.json").read_text())
    finalists = sorted((c for c in before["candidates"] if c.get("finalist")), key=lambda c: (c["kld_mean"], c["id"]))
    old = before["winner"]
    target = next(c for c in finalists if not c.get("built") and c["scored_by"] == "mask")
    ahead = [c for c in finalists[: finalists.index(target)] if c.get("built")]
    over = {Path(c["path"]).name for c in [old, *ahead]}
    again = tmp_path / "again"
    shutil.copytree(out, again)
    argv = [str(a) for a in ("best", *best_arguments(first, second, again), "--quiet", "--force")]
    proc = subprocess.run(
        [sys.executable, "-c", OVER_BUDGET_CHILD, ",".join(sorted(over)), *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((again / "best.json").read_text())
    winner = report["winner"]
    assert winner["id"] == target["id"], (winner["id"], target["id"], sorted(over))
    assert winner["built"] and winner["fits"] and (again / winner["path"]).is_file()
    assert winner["replaces"]["id"] == old["id"] and "does not fit" in winner["replaces"]["because"]
    assert winner["confirmed"]["chunks"] == target["chunks_scored"]
    assert winner["decode_tok_s"] > 0 and winner["prompt_tok_s"] > 0
    by_id = {c["id"]: c for c in report["candidates"]}
    assert by_id[old["id"]]["winner"] is False and "does not fit" in by_id[old["id"]]["replaced_because"]
