"""ggufcarve run: a plan validated before any work, executed as stages, resumed after a kill, and a
release that `verify` passes with nothing local in it.

The model is the tiny qwen3moe Q8_0 fixture (8 experts, top-2); selection by routed frequency on
generated text with the imatrix collected in the same pass, two rungs through the embedded
llama.cpp, evaluation against the unpruned model with one unpruned rung for the equal-size table.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import ggufcarve, sha256

WORDS = (
    "experts that the router rarely picks can be cut out of a mixture of experts model byte for byte while the "
    "rest of the file stays untouched and every rung of the ladder is measured against the unpruned model"
).split()

SPEC = """name = "two"
[defaults]
file_pattern = "{model}-{quant}.gguf"
allow_requantize = true
imatrix_fallback_type = "Q4_K"
[[rungs]]
ftype = "Q8_0"
[[rungs]]
ftype = "Q4_K_M"
[[rungs]]
ftype = "IQ2_XS"
"""


def _text(path: Path, words: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(words)) + "\n")
    return path


def _plan(directory: Path, source: Path, *, keep: int = 4, extra: str = "", evaluation: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    named = directory / "qwen3moe-Q8_0.gguf"  # a user's file name: {model} is the name without its quant tag
    if not named.exists():
        shutil.copyfile(source, named)
    source = named
    _text(directory / "calibration.txt", 700, 1)
    _text(directory / "heldout.txt", 500, 2)
    (directory / "ladder.toml").write_text(SPEC)
    text = f'''source = "{source.name}"
output = "release"
threads = 2
{extra}
[selection]
method = "frequency"
keep = {keep}

[calibration]
files = ["calibration.txt"]
ctx = 128

[imatrix]
collect = true

[ladder]
spec = "ladder.toml"
quantizer = "libllama"
'''
    if evaluation:
        text += """
[evaluation]
heldout = "heldout.txt"
ctx = 128
chunks = 6
speed_runs = 0
unpruned = ["Q4_K_M"]
"""
    path = directory / "plan.toml"
    path.write_text(text)
    return path


def _published(release: Path) -> dict[str, str]:
    return {
        rel: sha256(release / rel)
        for rel in (p.relative_to(release).as_posix() for p in sorted(release.rglob("*")) if p.is_file())
        if not any(part.startswith(".") for part in rel.split("/"))
    }


# ---------------------------------------------------------------------------------------------
# the plan is checked before anything runs


@pytest.mark.parametrize(
    "change, expect",
    [
        ("unknown_key = 1\n", "unknown key 'unknown_key'"),
        ('[selection]\nmethod = "frequency"\nkeep = 4\nkeepset = "x.json"\n', "no such file"),
        ('[selection]\nmethod = "frequency"\nkeep = 4\n', "traces calibration text"),
        ('[selection]\nmethod = "weights"\n', "needs exactly one of keep"),
        ('[selection]\nmethod = "telepathy"\nkeep = 4\n', "telepathy"),
        (
            '[selection]\nmethod = "weights"\nkeep = 4\n[ladder]\nspec = "ladder.toml"\nonly = ["Q9_9"]\n',
            "Q9_9 is not a rung",
        ),
        ('[selection]\nmethod = "weights"\nkeep = 4\n[ladder]\nspec = "nonexistent-ladder"\n', "no such spec file"),
    ],
)
def test_a_bad_plan_is_one_line_before_any_work(q8_moe, tmp_path, change, expect):
    (tmp_path / "ladder.toml").write_text(SPEC)
    has_ladder = "[ladder]" in change
    plan = tmp_path / "plan.toml"
    plan.write_text(
        f'source = "{q8_moe}"\noutput = "release"\n'
        + change
        + ("" if has_ladder else '[ladder]\nspec = "ladder.toml"\n')
    )
    result = ggufcarve("run", plan)
    assert result.code != 0
    assert expect in result.error_line, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "release").exists() and not (tmp_path / "release.work").exists()


def test_dry_run_lists_the_stages_and_writes_nothing(q8_moe, tmp_path):
    plan = _plan(tmp_path, q8_moe)
    result = ggufcarve("run", plan, "--dry-run", "--json")
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [s["name"] for s in doc["stages"]] == [
        "select",
        "prune",
        "imatrix",
        "ladder",
        "unpruned",
        "evaluate",
        "card",
        "verify",
    ]
    assert "imatrix in the same pass" in doc["stages"][0]["does"]
    from ggufcarve.gguf.container import read_model  # the pruned size is the prune plan's, exact

    assert doc["stages"][1]["bytes"] < read_model(q8_moe).total_bytes
    assert doc["bytes_needed"] > doc["stages"][1]["bytes"]
    assert not (tmp_path / "release").exists() and not (tmp_path / "release.work").exists()


def test_short_disk_is_refused_before_writing(q8_moe, tmp_path, monkeypatch):
    import shutil as real_shutil

    from ggufcarve.errors import OutputError
    from ggufcarve.pipeline import run as pipeline_run
    from ggufcarve.pipeline.plan import load_plan

    plan = load_plan(_plan(tmp_path, q8_moe))
    monkeypatch.setattr(
        pipeline_run.shutil,
        "disk_usage",
        lambda p: real_shutil._ntuple_diskusage(10 * 2**30, 10 * 2**30 - 2**20, 2**20),
    )
    assert pipeline_run.preview_run(plan).short
    with pytest.raises(OutputError, match="needs about"):
        pipeline_run.execute_run(plan)
    assert not plan.work.exists() and not plan.output.exists()


# ---------------------------------------------------------------------------------------------
# the whole run


@pytest.fixture(scope="module")
def finished(q8_moe, tmp_path_factory):
    directory = tmp_path_factory.mktemp("run")
    plan = _plan(directory, q8_moe)
    result = ggufcarve("run", plan, "-q")
    assert result.code == 0, result.stderr[-3000:]
    return directory, plan, result


@pytest.mark.slow
def test_the_release_tree_verifies_and_holds_nothing_local(finished, q8_moe):
    directory, _plan_path, result = finished
    release = directory / "release"
    names = set(_published(release))
    base = "qwen3moe-4e"  # the source's name without its quant tag, and the kept count
    assert {
        f"{base}-Q8_0.gguf",
        f"{base}-Q4_K_M.gguf",
        f"{base}-IQ2_XS.gguf",
        "SHA256SUMS",
        "quant-manifest.json",
        "README.md",
        "method/pruning-report.json",
        "method/imatrix-remap-report.json",
        "method/run-plan.json",
        f"evaluation/{base}-Q8_0.json",
        "evaluation/qwen3moe-Q4_K_M.json",
        "evaluation/summary.md",
    } <= names, sorted(names)
    assert not any(
        n.startswith("qwen3moe-Q8_0") or n.endswith(".imatrix.gguf") for n in names
    )  # intermediates stay in the work directory
    assert ggufcarve("verify", release).code == 0
    for rel in names:
        data = (release / rel).read_bytes()
        assert str(directory).encode() not in data and os.path.expanduser("~").encode() + b"/" not in data, (
            f"{rel} holds a local path"
        )
    doc = json.loads((release / "method/run-plan.json").read_text())
    assert doc["parameters"]["source"] == "qwen3moe-Q8_0.gguf" and doc["parameters"]["imatrix"] == {
        "collect": True,
        "file": None,
    }
    assert [s["name"] for s in doc["stages"]] == [
        "select",
        "prune",
        "imatrix",
        "ladder",
        "unpruned",
        "evaluate",
        "card",
    ]
    rung = json.loads((release / f"evaluation/{base}-Q4_K_M.json").read_text())
    assert rung["model"]["expert_count"] == 4 and rung["kld_mean"] > 0 and rung["gate"] in ("PASS", "FAIL")
    assert "ggufcarve run" in result.stdout and "verify passed" in result.stdout


@pytest.mark.slow
def test_a_rerun_skips_every_stage_and_changes_nothing(finished):
    directory, plan, _ = finished
    before = _published(directory / "release")
    result = ggufcarve("run", plan, "-q", "--json")
    assert result.code == 0, result.stderr[-2000:]
    stages = {s["name"]: s["status"] for s in json.loads(result.stdout)["stages"]}
    assert set(stages.values()) == {"skipped", "ran"} and [n for n, s in stages.items() if s == "ran"] == ["verify"], (
        stages
    )
    assert _published(directory / "release") == before


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_run_stopped_in_the_middle_resumes_and_verifies(q8_moe, tmp_path, signum):
    plan = _plan(tmp_path, q8_moe, keep=6)
    state = tmp_path / "release.work" / "run-state.json"
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggufcarve", "run", str(plan), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while (
        time.monotonic() < deadline and proc.poll() is None
    ):  # kill once the ladder has finished: during the evaluation
        if state.exists() and "ladder" in json.loads(state.read_text()).get("stages", {}):
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    if signum == signal.SIGKILL:
        os.killpg(proc.pid, signal.SIGKILL)  # ggufcarve and its llama.cpp child at once
        proc.wait()
    else:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: ggufcarve stops its child itself
        assert proc.wait(timeout=30) == 130, proc.stderr.read().decode()[-3000:]
        lines = [line for line in proc.stderr.read().decode().splitlines() if line.strip()]
        assert "stopped by Ctrl-C" in lines[-1] and "Traceback" not in "\n".join(lines)
    result = ggufcarve("run", plan, "-q", "--json")
    assert result.code == 0, result.stderr[-3000:]
    stages = {s["name"]: s["status"] for s in json.loads(result.stdout)["stages"]}
    assert stages["select"] == stages["prune"] == stages["ladder"] == "skipped" and stages["evaluate"] == "ran", stages
    assert ggufcarve("verify", tmp_path / "release").code == 0
    leftovers = [p for p in tmp_path.rglob("*.tmp")]
    assert not leftovers, leftovers


@pytest.mark.slow
def test_a_changed_plan_reruns_from_the_changed_stage(finished, tmp_path):
    directory = tmp_path / "copy"  # the module's finished run stays as the other tests read it
    shutil.copytree(finished[0], directory, symlinks=True)
    plan = directory / finished[1].name
    text = plan.read_text().replace("keep = 4", "keep = 6").replace("[evaluation]", "[evaluation_off]")
    changed = directory / "changed.toml"
    changed.write_text(text.split("[evaluation_off]")[0])
    result = ggufcarve("run", changed, "-q", "--json")
    assert result.code == 0, result.stderr[-3000:]
    stages = {s["name"]: s["status"] for s in json.loads(result.stdout)["stages"]}
    assert stages["select"] == stages["prune"] == stages["ladder"] == "ran", stages
    names = set(_published(directory / "release"))
    assert "qwen3moe-6e-Q8_0.gguf" in names and not any(
        n.startswith("qwen3moe-4e") for n in names
    )  # the old release is replaced, not mixed in
    assert not (directory / "release.work" / "qwen3moe-4e-Q8_0.gguf").exists()
    assert ggufcarve("verify", directory / "release", "--partial").code == 0  # no [evaluation]: no evaluation results


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "plans").glob("*.toml")))
def test_the_example_plans_are_valid(name, q8_moe, tmp_path):
    plans = Path(__file__).resolve().parents[1] / "plans"
    text = (plans / name).read_text().replace('"../evaluation/qa"', f'"{plans.parent / "evaluation" / "qa"}"')
    shutil.copyfile(q8_moe, tmp_path / "Qwen3.6-35B-A3B-Q8_0.gguf")
    _text(tmp_path / "calibration.jsonl", 10, 3)
    _text(tmp_path / "heldout.txt", 10, 4)
    _text(tmp_path / "tune-heldout.txt", 10, 5)
    (tmp_path / name).write_text(
        text.replace("keep = 160", "keep = 6")
        .replace("keep = 128", "keep = 4")
        .replace("keep = [128, 96, 64]", "keep = [4, 6, 2]")
    )
    result = ggufcarve("run", tmp_path / name, "--dry-run", "--json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["stages"][-1]["name"] == "verify"


# ---------------------------------------------------------------------------------------------
# paths are relative to the plan file, checked when it is parsed, and every file read is an input


def _bare_plan(directory: Path, source: Path, selection: str, ladder: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, directory / "model-Q8_0.gguf")
    (directory / "ladder.toml").write_text(SPEC)
    plan = directory / "plan.toml"
    plan.write_text(
        'source = "model-Q8_0.gguf"\noutput = '
        f'"release"\n[selection]\n{selection}\n[ladder]\nspec = "ladder.toml"\n{ladder}'
    )
    return plan


def test_protect_and_quantizer_paths_are_relative_to_the_plan(q8_moe, tmp_path, monkeypatch):
    from ggufcarve.errors import BadInput
    from ggufcarve.pipeline.plan import load_plan

    directory = tmp_path / "plans"
    (directory / "bin").mkdir(parents=True)
    quantizer = directory / "bin" / "llama-quantize"
    quantizer.write_text("#!/bin/sh\n")
    quantizer.chmod(0o755)
    (directory / "protect.json").write_text(json.dumps({"layers": {"0": [1], "1": [1]}}))
    plan = _bare_plan(
        directory,
        q8_moe,
        'method = "weights"\nkeep = 4\nprotect = "protect.json"',
        'quantizer = "bin/llama-quantize"\n',
    )
    monkeypatch.chdir(tmp_path)  # another directory than the plan's
    parsed = load_plan(plan)
    assert parsed.selection.protect_file == directory / "protect.json" and parsed.ladder.quantizer == str(
        quantizer.resolve()
    )
    assert (
        parsed.to_json()["selection"]["protect"] == "protect.json"
        and parsed.to_json()["ladder"]["quantizer"] == "llama-quantize"
    )
    assert (
        load_plan(
            _bare_plan(tmp_path / "ids", q8_moe, 'method = "weights"\nkeep = 4\nprotect = "0,5-6"')
        ).selection.protect
        == "0,5-6"
    )
    for selection, ladder, message in [
        ('method = "weights"\nkeep = 4\nprotect = "missing.json"', "", "protect 'missing.json': no such file"),
        ('method = "weights"\nkeep = 4\nprotect = "zz"', "", "neither expert ids"),
        ('method = "weights"\nkeep = 4', 'quantizer = "bin/nothing"\n', "quantizer 'bin/nothing': no such file"),
        ('method = "weights"\nkeep = 4', 'quantizer = "protect.json"\n', "is not an executable file"),
    ]:
        with pytest.raises(BadInput, match=message):
            load_plan(_bare_plan(directory, q8_moe, selection, ladder))


def test_a_protect_file_is_an_input_of_the_selection(q8_moe, tmp_path):
    from ggufcarve.pipeline.plan import load_plan
    from ggufcarve.pipeline.run import _context, _inputs
    from ggufcarve.pipeline.stages import build_stages
    from ggufcarve.pipeline.state import stage_digest

    protect = tmp_path / "protect.json"
    protect.write_text(json.dumps({"layers": {"0": [1], "1": [1]}}))
    plan = load_plan(_bare_plan(tmp_path, q8_moe, 'method = "weights"\nkeep = 4\nprotect = "protect.json"'))

    def select_digest() -> str:
        ctx = _context(plan)
        stage = next(s for s in build_stages(ctx, sizes=False) if s.name == "select")
        return stage_digest(stage.name, stage.parameters, _inputs(ctx, stage))

    before = select_digest()
    assert select_digest() == before
    protect.write_text(json.dumps({"layers": {"0": [2], "1": [2]}}))
    assert select_digest() != before


def test_a_second_run_in_the_same_work_directory_is_refused(q8_moe, tmp_path):
    """The work lock is the release lock's kind of file (O_EXCL, owner record, heartbeat): a run
    finding it held by a live process refuses in one line and writes nothing."""
    plan = _bare_plan(tmp_path, q8_moe, 'method = "weights"\nkeep = 4')
    work = tmp_path / "release.work"
    work.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\nfrom pathlib import Path\nfrom ggufcarve.release.lock import lock_release\n"
                f"with lock_release(Path({str(work)!r}), name='.ggufcarve-run.lock'):\n "
                "   print('held', flush=True)\n    time.sleep(120)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        env={**os.environ},
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        result = ggufcarve("run", plan, "-q")
        assert (
            result.code != 0 and f"pid {holder.pid} on" in result.error_line and "holds the lock" in result.error_line
        ), result.stderr
        assert "Traceback" not in result.stderr and sorted(p.name for p in work.iterdir()) == [".ggufcarve-run.lock"]
        assert not (tmp_path / "release").exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_the_card_takes_the_plans_card_table_and_an_edited_card_is_never_overwritten(finished, tmp_path):
    directory = tmp_path / "copy"  # the module's finished run stays as the other tests read it
    shutil.copytree(finished[0], directory, symlinks=True)
    card = directory / "release" / "README.md"
    assert "license:" not in card.read_text().split("---")[1]  # the fixture's GGUF names no license: none is invented
    edited = card.read_text() + "\nA paragraph the author wrote by hand.\n"
    card.write_text(edited)
    plan = directory / finished[1].name
    plan.write_text(plan.read_text() + '\n[card]\nbase_model = "Qwen/Qwen3-30B-A3B"\nlicense = "apache-2.0"\n')
    refused = ggufcarve("run", plan, "-q")
    assert refused.code == 1, refused.stderr[-2000:]
    assert "README.md was edited since ggufcarve wrote it" in refused.error_line and "--force" in refused.error_line
    assert card.read_text() == edited
    forced = ggufcarve("run", plan, "-q", "--force")
    assert forced.code == 0, forced.stderr[-3000:]
    front = card.read_text().split("---")[1]
    assert 'base_model: "Qwen/Qwen3-30B-A3B"' in front and 'license: "apache-2.0"' in front
    assert ggufcarve("verify", directory / "release").code == 0


def test_plans_take_the_one_pass_criteria_and_imatrix_msan(q8_moe, tmp_path):
    from ggufcarve.pipeline.plan import load_plan
    from ggufcarve.pipeline.stages import one_pass, traces

    for method in ("ean-sum", "msan", "mone", "imatrix-msan"):
        plan = _plan(tmp_path / method, q8_moe)
        plan.write_text(plan.read_text().replace('method = "frequency"', f'method = "{method}"'))
        parsed = load_plan(plan)
        assert parsed.selection.method == method
        assert traces(parsed) == one_pass(parsed) == (method != "imatrix-msan"), method


@pytest.mark.slow
def test_each_rung_row_shows_its_own_files_hash_and_ends_complete(q8_moe, tmp_path):
    """The progress rows drawn from a real run's events: the pruned and the unpruned Q4_K_M are
    separate rows, each row's sha256 is that of its own file, and every rung row ends at n/n."""
    import io
    import re

    from rich.console import Console

    from ggufcarve.cli import render
    from ggufcarve.pipeline.plan import load_plan
    from ggufcarve.pipeline.run import execute_run

    events = []
    execute_run(load_plan(_plan(tmp_path, q8_moe)), on_event=events.append)
    screen = io.StringIO()
    console = Console(file=screen, width=200, force_terminal=False, color_system=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(render.err, "_console", console)
        with render.progress() as sink:
            for event in events:
                sink(event)
    rows = {
        m["row"].strip(): m
        for m in re.finditer(
            r"^(?P<row>\S+(?: \S+)?)\s+.*?(?P<done>[\d,]+)/(?P<total>[\d,]+) "
            r"tensors.*?(?:sha256 (?P<sha>[0-9a-f]{12}))?\s*$",
            screen.getvalue(),
            re.MULTILINE,
        )
    }
    release, unpruned = tmp_path / "release", next((tmp_path / "release.work").rglob("qwen3moe-Q4_K_M.gguf"))
    files = {
        "Q8_0": release / "qwen3moe-4e-Q8_0.gguf",
        "Q4_K_M": release / "qwen3moe-4e-Q4_K_M.gguf",
        "IQ2_XS": release / "qwen3moe-4e-IQ2_XS.gguf",
        "unpruned Q4_K_M": unpruned,
    }
    assert set(files) <= set(rows), screen.getvalue()
    for name, path in files.items():
        row = rows[name]
        assert row["done"] == row["total"], row.group(0)
        assert row["sha"] == sha256(path)[:12], (name, row.group(0))
