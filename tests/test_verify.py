"""`ggufcarve verify DIR`: catches what a publisher must not upload."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from clirun import ggufcarve

from ggufcarve.llama import launch
from ggufcarve.release.sums import write_sums
from ggufcarve.release.verify import parse_sums, verify_dir

pytestmark = pytest.mark.slow  # every test starts from a ladder made by llama-quantize

SPEC = """
[[rungs]]
ftype = "Q8_0"
[[rungs]]
ftype = "Q4_K_M"
"""


@pytest.fixture(scope="module")
def ladder_dir(q8_moe, llama_tools, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("verify")
    spec = base / "spec.toml"
    spec.write_text(SPEC)
    out = base / "out"
    result = ggufcarve(
        "ladder",
        "run",
        spec,
        "--source",
        q8_moe,
        "-o",
        out,
        "--model-name",
        "tiny",
        "--quantizer",
        llama_tools / "llama-quantize",
        "-q",
        "-t",
        "2",
    )
    assert result.code == 0, result.stderr[-2000:]
    return out


@pytest.fixture
def copy(ladder_dir, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(ladder_dir, out, copy_function=shutil.copy2)
    return out


def problems(result) -> str:
    return result.stderr + result.stdout


def describe_as_rung(release: Path, name: str, files: list[Path]) -> dict:
    """Record `files` as one more rung of the release's manifest (as a ladder run would), and re-list the sums."""
    manifest = json.loads((release / "quant-manifest.json").read_text())
    source = [f["sha256"] for f in manifest["source"]["files"]]
    records = [
        {"name": p.name, "bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files
    ]
    manifest["rungs"].append({"name": name, "status": "built", "files": records, "source_sha256": source})
    (release / "quant-manifest.json").write_text(json.dumps(manifest))
    write_sums(release, manifest)
    return manifest


def test_clean_directory_passes_both_checkers(ladder_dir):
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=ladder_dir, capture_output=True).returncode == 0
    result = ggufcarve("verify", ladder_dir, "--partial")
    assert result.code == 0, problems(result)
    assert (
        result.stdout.startswith("OK: 3 files")
        and "expert_count 8" in result.stdout
        and "2 part(s) missing" in result.stdout
    )
    # a ladder release promises its rungs: every one is built, so it passes, and what a published
    # release usually holds more is listed as notes; --strict requires the evaluation and the card
    plain = ggufcarve("verify", ladder_dir)
    assert plain.code == 0, problems(plain)
    assert (
        "note: no evaluation results recorded" in plain.stderr
        and "note: the model card is not recorded" in plain.stderr
    )
    strict = ggufcarve("verify", ladder_dir, "--strict", "--json")
    assert strict.code == 1 and {
        (f["path"], f["problem"].split(":")[0]) for f in json.loads(strict.stdout)["failures"]
    } == {("evaluation/", "missing"), ("README.md", "missing")}
    both = ggufcarve("verify", ladder_dir, "--strict", "--partial")
    assert both.code == 1 and "opposite" in both.error_line
    report = verify_dir(ladder_dir, workers=2)
    assert report.ok and sorted(report.files_ok) == ["quant-manifest.json", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]


def test_flipped_byte(copy):
    path = copy / "tiny-Q8_0.gguf"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    result = ggufcarve("verify", copy, "--partial")
    assert result.code == 1
    assert "tiny-Q8_0.gguf" in problems(result) and "sha256 mismatch" in problems(result)
    assert (
        subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=copy, capture_output=True).returncode != 0
    )  # coreutils agrees


def test_missing_file_and_ignore_missing(copy):
    (copy / "tiny-Q4_K_M.gguf").unlink()
    result = ggufcarve("verify", copy, "--partial")
    assert result.code == 1 and "missing (listed in SHA256SUMS)" in problems(result)
    assert ggufcarve("verify", copy, "--partial", "--ignore-missing").code == 0


def test_files_the_manifest_does_not_describe(copy):
    (copy / "README.md").write_text("model card\n")
    (copy / "method").mkdir()
    (copy / "method" / "notes.json").write_text("{}\n")
    result = ggufcarve("verify", copy, "--partial", "--json")
    assert result.code == 1
    report = json.loads(result.stdout)
    assert {(f["path"], f["problem"].split(":")[0]) for f in report["failures"]} == {
        ("method/notes.json", "not described by quant-manifest.json")
    }
    assert [(n["path"], n["problem"].split(":")[0]) for n in report["notes"]] == [
        ("README.md", "not recorded")
    ]  # documentation: noted, not refused
    # SHA256SUMS lists only what the manifest describes: re-writing it does not make them part of the release
    write_sums(copy, json.loads((copy / "quant-manifest.json").read_text()))
    assert [rel for _, rel in parse_sums(copy / "SHA256SUMS")[0]] == [
        "quant-manifest.json",
        "tiny-Q4_K_M.gguf",
        "tiny-Q8_0.gguf",
    ]
    assert ggufcarve("verify", copy, "--partial").code == 1
    # a file the manifest describes but SHA256SUMS does not list
    (copy / "README.md").unlink()
    (copy / "method" / "notes.json").unlink()
    with open(copy / "SHA256SUMS") as f:
        kept = [line for line in f if not line.endswith("  tiny-Q8_0.gguf\n")]
    (copy / "SHA256SUMS").write_text("".join(kept))
    unlisted = ggufcarve("verify", copy, "--partial", "--json")
    assert unlisted.code == 1
    assert {(f["path"], f["problem"]) for f in json.loads(unlisted.stdout)["failures"]} >= {
        ("tiny-Q8_0.gguf", "not listed in SHA256SUMS")
    }
    write_sums(copy)
    assert ggufcarve("verify", copy, "--partial").code == 0


def test_truncated_shard(copy, llama_tools):
    # split one rung with llama.cpp's own tool, list the shards, then cut the second shard short
    finished = launch.run(
        [
            llama_tools / "llama-gguf-split",
            "--split",
            "--split-max-tensors",
            "10",
            copy / "tiny-Q4_K_M.gguf",
            copy / "tiny-Q4_K_M-split",
        ],
        timeout=120,
    )
    assert finished.ok, "\n".join(finished.tail)
    shards = sorted(copy.glob("tiny-Q4_K_M-split-*.gguf"))
    assert len(shards) == 3
    describe_as_rung(copy, "Q4_K_M-split", shards)
    assert ggufcarve("verify", copy, "--partial").code == 0
    with open(shards[1], "r+b") as f:
        f.truncate(shards[1].stat().st_size - 1000)
    result = ggufcarve("verify", copy, "--partial", "--json")
    assert result.code == 1
    failures = {(f["path"], f["problem"].split(":")[0]) for f in json.loads(result.stdout)["failures"]}
    assert (shards[1].name, "sha256 mismatch") in failures
    assert (shards[0].name, "does not parse") in failures  # the set, read from its first shard, is broken
    shards[2].unlink()
    shards[1].unlink()
    write_sums(copy, json.loads((copy / "quant-manifest.json").read_text()))
    incomplete = ggufcarve("verify", copy, "--partial", "--json")
    assert incomplete.code == 1
    assert any("shard 2 of 3 is missing" in f["problem"] for f in json.loads(incomplete.stdout)["failures"])


def test_manifest_disagrees_with_sums(copy):
    manifest = json.loads((copy / "quant-manifest.json").read_text())
    manifest["rungs"][1]["files"][0]["sha256"] = "0" * 64
    manifest["rungs"][0]["files"][0]["bytes"] += 1
    (copy / "quant-manifest.json").write_text(json.dumps(manifest))
    write_sums(copy)  # sums themselves are consistent with the files
    result = ggufcarve("verify", copy, "--partial", "--json")
    assert result.code == 1
    failures = [f["problem"] for f in json.loads(result.stdout)["failures"]]
    assert any("disagrees with SHA256SUMS" in p for p in failures)
    assert any("the manifest records" in p for p in failures)


def test_expert_count_must_match_the_pruning_report(copy):
    (copy / "method").mkdir()
    (copy / "method" / "pruning-report.json").write_text(json.dumps({"output": {"expert_count": 4}}))
    write_sums(copy, json.loads((copy / "quant-manifest.json").read_text()))
    result = ggufcarve("verify", copy, "--partial", "--json")
    assert result.code == 1
    failures = [f["problem"] for f in json.loads(result.stdout)["failures"]]
    assert "expert_count 8, but method/pruning-report.json says 4" in failures


def test_not_a_ladder_directory(tmp_path):
    result = ggufcarve("verify", tmp_path, "--partial")
    assert result.code == 1 and "has no SHA256SUMS" in result.error_line


@pytest.mark.parametrize(
    "manifest, report, expected",
    [
        ("[1, 2]", None, "quant-manifest.json holds a JSON list, not an object"),
        ('{"rungs": [{"name": "Q8_0", "files": [{"bytes": 3}]}]}', None, "rung Q8_0 lists a file without a name"),
        (None, "[]", "method/pruning-report.json holds a JSON list, not an object"),
        (None, "{not json", "method/pruning-report.json not valid JSON"),
    ],
)
def test_malformed_manifest_or_report_is_a_failure_not_a_traceback(copy, manifest, report, expected):
    if manifest is not None:
        (copy / "quant-manifest.json").write_text(manifest)
    if report is not None:
        (copy / "method").mkdir()
        (copy / "method" / "pruning-report.json").write_text(report)
    write_sums(copy)
    result = ggufcarve("verify", copy, "--partial", "--json")
    assert result.code == 1 and "Traceback" not in result.stderr, result.stderr
    failures = [f"{f['path']} {f['problem']}" for f in json.loads(result.stdout)["failures"]]
    assert any(expected in f for f in failures), failures


def test_sums_naming_paths_outside_the_directory(copy, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the release\n")
    import hashlib

    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    with open(copy / "SHA256SUMS", "a") as f:
        f.write(f"{digest}  ../outside.txt\n{digest}  {outside}\n")
    result = ggufcarve("verify", copy, "--partial", "--json")
    assert result.code == 1
    failures = json.loads(result.stdout)["failures"]
    assert {f["path"] for f in failures if "outside the directory" in f["problem"]} == {"../outside.txt", str(outside)}


def test_what_a_release_promises_follows_its_recorded_run_plan(tmp_path):
    """A ladder run alone promises its rungs; a run plan's release its rungs (unless it builds some
    only), and the evaluation and the card when its recorded stages make them."""
    from ggufcarve.release.verify import promised_parts

    assert promised_parts(tmp_path, {"rungs": []}) == ("rungs",)
    (tmp_path / "method").mkdir()

    def recorded(stages: list[str], only: list[str]) -> dict:
        (tmp_path / "method" / "run-plan.json").write_text(
            json.dumps({"stages": [{"name": n} for n in stages], "parameters": {"ladder": {"only": only}}})
        )
        return {"published": {"plan": [{"name": "method/run-plan.json"}]}}

    assert promised_parts(tmp_path, recorded(["prune", "ladder", "evaluate", "card"], [])) == (
        "rungs",
        "evaluation",
        "card",
    )
    assert promised_parts(tmp_path, recorded(["prune", "ladder", "card"], ["Q4_K_M"])) == ("card",)
    assert promised_parts(tmp_path, {"published": {"plan": [{"name": "../run-plan.json"}]}}) == (
        "rungs",
    )  # outside the release: not read
