"""ggufcarve run on a model with grouped routing (the deepseek2 fixture: MoE blocks 1 and 2, 16
experts in 4 groups, 2 groups used, top-4): REAP keeps 8, the same 2 from every group; the dry
run, the run and a run killed midway and resumed all go through, and llama.cpp loads and routes
the pruned rungs."""

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
from gguf import GGUFReader, Keys

WORDS = (
    "a mixture of experts routes every token to a few experts chosen group by group and the groups that score "
    "best keep their experts while the others are masked before the top k is taken"
).split()

SPEC = """name = "two"
[defaults]
file_pattern = "{model}-{quant}.gguf"
allow_requantize = true
[[rungs]]
ftype = "Q8_0"
[[rungs]]
ftype = "Q4_K_M"
"""
RUNGS = ("Q8_0", "Q4_K_M")


@pytest.fixture(scope="module")
def deepseek2(make_model) -> Path:
    return make_model("deepseek2", dtype="Q8_0", n_embd=256, n_ff_exp=256)


def _plan(directory: Path, source: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, directory / "deepseek2-Q8_0.gguf")
    rng = random.Random(5)
    (directory / "calibration.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(600)) + "\n")
    (directory / "heldout.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)) + "\n")
    (directory / "ladder.toml").write_text(SPEC)
    plan = directory / "plan.toml"
    plan.write_text("""source = "deepseek2-Q8_0.gguf"
output = "release"
threads = 2

[selection]
method = "reap"
keep = 8

[calibration]
files = ["calibration.txt"]
ctx = 128

[imatrix]
collect = true

[ladder]
spec = "ladder.toml"
quantizer = "libllama"

[evaluation]
heldout = "heldout.txt"
ctx = 128
chunks = 2
speed_runs = 0
""")
    return plan


def _published(release: Path) -> dict[str, str]:
    return {
        p.relative_to(release).as_posix(): sha256(p)
        for p in sorted(release.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(release).parts)
    }


@pytest.fixture(scope="module")
def finished(deepseek2, tmp_path_factory):
    directory = tmp_path_factory.mktemp("grouped")
    plan = _plan(directory, deepseek2)
    dry = ggufcarve("run", plan, "--dry-run", "--json")
    assert dry.code == 0, dry.stderr
    result = ggufcarve("run", plan, "-q", "--json")
    assert result.code == 0, result.stderr[-3000:]
    return directory, json.loads(dry.stdout), json.loads(result.stdout)


def test_the_dry_run_previews_a_group_balanced_prune(finished, deepseek2):
    _, dry, _ = finished
    assert [s["name"] for s in dry["stages"]] == ["select", "prune", "imatrix", "ladder", "evaluate", "card", "verify"]
    source = GGUFReader(deepseek2)
    assert 0 < dry["stages"][1]["bytes"] < sum(int(t.n_bytes) for t in source.tensors)  # the prune of 8 of 16 experts


@pytest.mark.slow
def test_the_plan_runs_and_llama_cpp_loads_the_pruned_rungs(finished):
    from llama_probe import probe

    directory, _, result = finished
    assert [s["status"] for s in result["stages"]] == ["ran"] * len(result["stages"])
    release = directory / "release"
    assert ggufcarve("verify", release).code == 0
    selection = json.loads((directory / "release.work" / "expert-selection.json").read_text())
    for ids in selection["layers"].values():  # the same 2 of every group of 4, group by group
        assert [i // 4 for i in ids] == [0, 0, 1, 1, 2, 2, 3, 3]
    for rung in RUNGS:
        path = release / f"deepseek2-8e-{rung}.gguf"
        fields = GGUFReader(path).fields
        assert fields[Keys.LLM.EXPERT_COUNT.format(arch="deepseek2")].contents() == 8
        assert fields[Keys.LLM.EXPERT_GROUP_COUNT.format(arch="deepseek2")].contents() == 4
        loaded = probe(path, list(range(3, 40)), trace_routing=True)
        assert loaded.ok, loaded.stderr[-2000:]
        for block, routed in loaded.routed.items():
            assert routed.shape[1] == 4 and routed.min() >= 0 and routed.max() < 8, (rung, block)
    results = [json.loads(p.read_text()) for p in sorted((release / "evaluation").glob("*.json"))]
    assert {r["model"]["quant"] for r in results} == set(RUNGS) and all(r["kld_mean"] >= 0 for r in results)


@pytest.mark.slow
def test_a_run_killed_midway_resumes_and_verifies(finished, deepseek2, tmp_path):
    clean, _, _ = finished
    plan = _plan(tmp_path, deepseek2)
    state = tmp_path / "release.work" / "run-state.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggufcarve", "run", str(plan), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while (
        time.monotonic() < deadline and proc.poll() is None
    ):  # kill once the prune is recorded: during the remap or the ladder
        if state.exists() and "prune" in json.loads(state.read_text()).get("stages", {}):
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)  # ggufcarve and its llama.cpp child at once
    proc.wait()
    result = ggufcarve("run", plan, "-q", "--json")
    assert result.code == 0, result.stderr[-3000:]
    stages = {s["name"]: s["status"] for s in json.loads(result.stdout)["stages"]}
    assert stages["select"] == stages["prune"] == "skipped" and stages["ladder"] == stages["verify"] == "ran", stages
    assert ggufcarve("verify", tmp_path / "release").code == 0
    resumed, reference = _published(tmp_path / "release"), _published(clean / "release")
    for rung in RUNGS:  # the same rungs, byte for byte, as the run that was never stopped
        name = f"deepseek2-8e-{rung}.gguf"
        assert resumed[name] == reference[name]
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize(
    "keep, message", [(10, "K=10 is not a multiple of the 4 expert groups"), (4, "K=4 keeps 1 expert(s) per group")]
)
def test_a_k_the_groups_refuse_is_named_as_the_plans(deepseek2, tmp_path, keep, message):
    plan = _plan(tmp_path, deepseek2)
    plan.write_text(plan.read_text().replace("keep = 8", f"keep = {keep}"))
    result = ggufcarve("run", plan, "--dry-run")
    assert result.code != 0 and result.error_line.startswith(f"error: [selection]: {message}"), result.stderr
    assert "keep-set" not in result.error_line and "Traceback" not in result.stderr
