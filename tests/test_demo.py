"""ggufcarve demo: the whole plan on the trained demo MoE shipped with the package, with only the
embedded llama.cpp; a re-run finds every stage done."""

from __future__ import annotations

import json

import pytest
from clirun import ggufcarve


def test_demo_dry_run_lists_the_plan(tmp_path):
    result = ggufcarve("demo", tmp_path / "demo", "--dry-run", "--json")
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [s["name"] for s in doc["stages"]] == [
        "imatrix-collect",
        "tune",
        "prune",
        "imatrix",
        "ladder",
        "unpruned",
        "evaluate",
        "card",
        "verify",
    ]
    assert doc["plan"]["ladder"]["quantizer"] == "libllama" and doc["plan"]["imatrix"]["collect"] is True
    assert doc["plan"]["selection"]["method"] == "tune" and doc["plan"]["selection"]["keep"] == [8]
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_demo_runs_end_to_end_and_resumes(tmp_path):
    directory = tmp_path / "demo"
    result = ggufcarve("demo", directory)
    assert result.code == 0, result.stderr[-3000:]
    release = directory / "release"
    assert "verify passed" in result.stdout and "evaluation against the unpruned model" in result.stdout
    # the answer for a budget between the rungs, counted as llama.cpp allocates each model (eval's report,
    # held to an allocating load by tests/test_memory.py)
    assert "best in 10.5 MiB (llama.cpp's memory at 256 tokens)" in result.stdout
    reports = [json.loads(p.read_text()) for p in (release / "evaluation").glob("*.json")]
    fitting = [r for r in reports if r.get("memory") and r["memory"][0]["total"] <= 10.5 * 2**20]
    assert f"of the {len(fitting)} measured models that fit" in result.stdout
    assert 0 < len(fitting) < len(reports)
    assert "tune: K = 8 of 16" in result.stdout and "(winner)" in result.stdout  # the tournament's table
    assert (directory / "plan.toml").is_file()
    names = sorted(p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file())
    rungs = [n for n in names if n.endswith(".gguf")]
    assert len(rungs) == 6, names
    for expected in (
        "SHA256SUMS",
        "quant-manifest.json",
        "README.md",
        "method/expert-selection.json",
        "method/pruning-report.json",
        "method/imatrix-remap-report.json",
        "method/run-plan.json",
        "method/tune.md",
        "method/tune-kld.png",
        "evaluation/summary.md",
    ):
        assert expected in names, names
    chosen = json.loads((directory / "work" / "tune" / "expert-selection.json").read_text())["layers"]
    assert (
        json.loads((release / "method" / "pruning-report.json").read_text())["keep_set"]["layers"] == chosen
    )  # the winner was carved
    results = [
        json.loads((release / n).read_text()) for n in names if n.startswith("evaluation/") and n.endswith(".json")
    ]
    assert len(results) == 8  # six pruned rungs and two quants of the unpruned model
    assert {r["model"]["pruned"] for r in results} == {True, False}
    verified = ggufcarve("verify", release)
    assert verified.code == 0
    from hub import hub_problems

    front, problems = hub_problems(release)
    assert problems == ["no base_model"], (
        problems
    )  # trained from scratch: no base model, and the card does not invent one
    assert front["license"] == "mit"
    assert "no base_model" in verified.stderr  # verify warns about it
    again = ggufcarve("demo", directory, "--json", "-q")
    assert again.code == 0, again.stderr[-2000:]
    assert [s["name"] for s in json.loads(again.stdout)["stages"] if s["status"] == "ran"] == ["verify"]
