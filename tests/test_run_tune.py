"""A plan with `[selection] method = "tune"`: the tournament runs as the plan's selection stage, the
release carves its winner and publishes method/tune.md; a bad tune plan is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import ggufcarve

DATA = Path(__file__).resolve().parent.parent / "ggufcarve" / "demo" / "data"
MODEL = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
SPEC = (
    'name = "one"\n[defaults]\nfile_pattern = '
    '"{model}-{quant}.gguf"\nallow_requantize = true\n[[rungs]]\nftype = "Q8_0"\n'
)

SELECTION = """[selection]
method = "tune"
methods = ["reap", "frequency", "weights"]
keep = [6, 8]
heldout = "{heldout}"
chunks = 2
"""


def _plan(directory: Path, selection: str = SELECTION, calibration: bool = True, evaluation: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = f'source = "{MODEL}"\noutput = "release"\nthreads = 2\n\n' + selection.format(heldout=DATA / "heldout.txt")
    if calibration:
        text += f'\n[calibration]\nfiles = ["{DATA / "calibration.txt"}"]\nctx = 256\nmax_tokens = 1024\n'
    (directory / "ladder.toml").write_text(SPEC)
    text += '\n[ladder]\nspec = "ladder.toml"\nquantizer = "libllama"\n'
    text += (
        ""
        if not evaluation
        else f'\n[evaluation]\nheldout = "{DATA / "heldout.txt"}"\nctx = '
        '256\nchunks = 2\nspeed_runs = 0\n\n[card]\nlicense = "mit"\n'
    )
    path = directory / "plan.toml"
    path.write_text(text)
    return path


def _read_expert_count(path: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields["qwen3moe.expert_count"]
    return int(field.parts[field.data[0]][0])


@pytest.mark.slow
def test_a_tune_plan_carves_the_winner_and_publishes_the_tournament(tmp_path):
    plan = _plan(tmp_path)
    dry = ggufcarve("run", plan, "--dry-run", "--json")
    assert dry.code == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert [s["name"] for s in doc["stages"]] == ["tune", "prune", "ladder", "evaluate", "card", "verify"]
    assert "carve the winner at K = 6" in doc["stages"][0]["does"] and doc["stages"][0]["bytes"] > 0
    assert doc["plan"]["selection"]["keep"] == [6, 8] and doc["plan"]["selection"]["methods"] == [
        "reap",
        "frequency",
        "weights",
    ]
    assert not (tmp_path / "release").exists()

    run = ggufcarve("run", plan, "--json", "-q")
    assert run.code == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert [s["name"] for s in result["stages"]] == ["tune", "prune", "ladder", "evaluate", "card", "verify"]
    release, work = tmp_path / "release", tmp_path / "release.work"
    tuned = json.loads((work / "tune" / "tune.json").read_text())
    assert result["tune"]["winner"] == tuned["winner"] and tuned["winner"].endswith("-6")
    assert {c["K"] for c in tuned["candidates"]} == {6, 8}
    chosen = json.loads((work / "tune" / "expert-selection.json").read_text())["layers"]
    # the carved keep-set: the pruning report's and the rung's own expert count (gguf-py)
    assert json.loads((release / "method" / "pruning-report.json").read_text())["keep_set"]["layers"] == chosen
    assert json.loads((release / "method" / "expert-selection.json").read_text())["layers"] == chosen
    assert _read_expert_count(next(release.glob("*-Q8_0.gguf"))) == 6
    assert (release / "method" / "tune.md").read_bytes() == (work / "tune" / "tune.md").read_bytes()
    assert "## K = 6 of 16" in (release / "method" / "tune.md").read_text()
    assert (release / "method" / "tune-kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sums = (release / "SHA256SUMS").read_text()
    assert "method/tune.md" in sums and "method/tune-kld.png" in sums
    assert "`method/tune.md`" in (release / "README.md").read_text()  # the card links the tournament
    assert ggufcarve("verify", release).code == 0

    again = ggufcarve("run", plan, "--json", "-q")  # resumes: the tournament is not run again
    assert again.code == 0, again.stderr[-2000:]
    assert [s["name"] for s in json.loads(again.stdout)["stages"] if s["status"] == "ran"] == ["verify"]

    plain = plan.read_text().replace(
        SELECTION.format(heldout=DATA / "heldout.txt"), '[selection]\nmethod = "frequency"\nkeep = 6\n'
    )
    plan.write_text(plain)  # the plan no longer tunes: the release drops the tournament
    third = ggufcarve("run", plan, "--json", "-q")
    assert third.code == 0, third.stderr[-2000:]
    assert not (release / "method" / "tune.md").exists() and "tune.md" not in (release / "SHA256SUMS").read_text()
    assert "tune.md" not in (release / "README.md").read_text()
    assert ggufcarve("verify", release).code == 0


@pytest.mark.parametrize(
    "selection, calibration, expect",
    [
        (
            '[selection]\nmethod = "tune"\nmethods = ["weights"]\nkeep = [8]\n',
            None,
            "scores the keep-sets on held-out text",
        ),
        (SELECTION.replace("keep = [6, 8]", 'keep = "eight"'), True, "[selection] keep must be a count (8), a list"),
        (SELECTION.replace("keep = [6, 8]", "keep = [8, 2.5]"), True, "[selection] keep must be a count (8), a list"),
        (SELECTION.replace("keep = [6, 8]", "keep = []"), True, "[selection] keep must be a count (8), a list"),
        (SELECTION.replace('"weights"]', '"telepathy"]'), True, "methods: unknown method 'telepathy'"),
        (
            SELECTION.replace('methods = ["reap", "frequency", "weights"]', 'methods = "some"'),
            True,
            "methods: unknown method 'some'",
        ),
        (SELECTION + "ratio = 0.5\n", True, "takes keep = [K, ...], not ratio"),
        (SELECTION, False, "method tune with reap traces calibration text"),
        (
            '[selection]\nmethod = "weights"\nkeep = 8\nmethods = ["reap"]\n',
            False,
            'methods applies to method = "tune" only',
        ),
        (SELECTION.replace("keep = [6, 8]", "keep = [6, 99]"), True, "[selection]:"),
    ],
)
def test_a_bad_tune_plan_is_one_line(tmp_path, selection, calibration, expect):
    plan = _plan(
        tmp_path, selection, bool(calibration), evaluation=calibration is not None
    )  # None: no [calibration], no [evaluation]
    result = ggufcarve("run", plan, "--dry-run")
    assert result.code != 0
    assert expect in result.error_line, result.stderr
    assert "hint:" in result.error_line and len([line for line in result.stderr.splitlines() if line.strip()]) == 1, (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "release").exists() and not (tmp_path / "release.work").exists()


def test_tune_checks_the_disk_before_writing_the_reference_records(tmp_path, monkeypatch, llama_tools):
    import shutil
    import subprocess
    from collections import namedtuple

    from ggufcarve.errors import OutputError
    from ggufcarve.llama.launch import child_env
    from ggufcarve.tune.run import TuneSettings, reference_bytes, tune

    settings = TuneSettings(keeps=(8,), methods=("weights",), heldout=(DATA / "heldout.txt",), ctx=256, chunks=4)
    # the bound: the size of llama-perplexity's own base file of the same text, ctx and chunks
    base = tmp_path / "demo.kld"
    made = subprocess.run(
        [
            str(llama_tools / "llama-perplexity"),
            "-m",
            str(MODEL),
            "-f",
            str(DATA / "heldout.txt"),
            "-c",
            "256",
            "--chunks",
            "4",
            "--kl-divergence-base",
            str(base),
            "-t",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert made.returncode == 0, made.stderr[-3000:]
    assert reference_bytes(MODEL, settings) == base.stat().st_size

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 2**20, 2**20))  # 1 MiB free
    with pytest.raises(OutputError) as err:
        tune(MODEL, settings, tmp_path / "tune")
    assert "MiB free" in err.value.message and err.value.hint
    assert not (tmp_path / "tune" / "tune.json").exists() and not (tmp_path / "tune" / "work").exists()
