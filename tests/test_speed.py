"""Speed through llama-bench: its median tok/s are llama-bench's own samples, and the in-process
measure agrees with it in order of magnitude on the same model and threads."""

from __future__ import annotations

import json
import statistics

import pytest

from ggufcarve.evaluate.speed import SpeedSettings, bench_speed
from ggufcarve.llama.devices import Compute


@pytest.mark.slow
def test_bench_speed_reports_llama_benchs_own_samples(q8_moe, llama_tools):
    from ggufcarve.llama import launch

    settings = SpeedSettings(pp_tokens=64, tg_tokens=16, runs=3)
    speed = bench_speed(llama_tools / "llama-bench", q8_moe, settings, Compute(threads=2))
    assert speed.engine == "llama-bench" and speed.threads == 2 and (speed.pp_tokens, speed.tg_tokens) == (64, 16)
    assert len(speed.pp_runs) == len(speed.tg_runs) == 3
    assert (
        speed.pp_tok_s == statistics.median(speed.pp_runs) > 0
        and speed.tg_tok_s == statistics.median(speed.tg_runs) > 0
    )
    # the same command by hand prints the same kind of record: one pp and one tg test in jsonl
    lines: list[str] = []
    finished = launch.run(
        [
            llama_tools / "llama-bench",
            "-m",
            q8_moe,
            "-p",
            "64",
            "-n",
            "16",
            "-r",
            "1",
            "-t",
            "2",
            "--repack",
            "0",
            "-o",
            "jsonl",
        ],
        on_line=lines.append,
    )
    assert finished.ok
    tests = [json.loads(line) for line in lines if line.startswith("{")]
    assert sorted((t["n_prompt"], t["n_gen"]) for t in tests) == [(0, 16), (64, 0)]


@pytest.mark.slow
def test_eval_uses_llama_bench_when_asked_and_libllama_when_told(q8_moe, llama_tools, tmp_path):
    from clirun import ggufcarve

    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(["experts are cut out byte for byte and every rung is measured"] * 40) + "\n")
    for engine in ("llama-bench", "libllama"):
        out = tmp_path / engine
        result = ggufcarve(
            "eval",
            q8_moe,
            "--reference",
            q8_moe,
            "--heldout",
            text,
            "--ctx",
            128,
            "--chunks",
            2,
            "--speed-runs",
            1,
            "--speed-engine",
            engine,
            "--llama-cpp",
            llama_tools,
            "-t",
            2,
            "-o",
            out,
        )
        assert result.code == 0, result.stderr[-2000:]
        doc = json.loads(next(out.glob("*.json")).read_text())
        assert doc["speed"]["engine"] == engine and doc["tg_tok_s"] > 0
