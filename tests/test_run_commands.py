"""`ggufcarve run` writes what the separate commands write: the same plan run once as a plan and
once by hand (imatrix collect, select, prune, imatrix remap, ladder run, eval, card) publishes the
same files with the same bytes.

The only bytes allowed to differ are what records the moment and the duration of a run (`created`,
`mtime_ns` and the `timings` / `seconds` / `*_seconds` fields of the JSON reports), whether the reference's log-probs
came from the cache (the commands compute their own, in a fresh cache) and the records that hash those
reports (their sha256 and size in quant-manifest.json and SHA256SUMS); `method/run-plan.json` is
the plan's own record, which the hand-run commands have no equivalent of.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from clirun import ggufcarve, sha256

WORDS = (
    "the router sends each token to two experts and the experts that few tokens reach are the first to be pruned "
    "from the file while every other tensor is copied byte for byte"
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
SOURCE = "qwen3moe-Q8_0.gguf"
VOLATILE = ("created", "timings", "seconds", "mtime_ns", "log_probs_cached")


def _inputs(directory: Path, source: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, directory / SOURCE)
    rng = random.Random(11)
    (directory / "calibration.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(600)) + "\n")
    (directory / "heldout.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(400)) + "\n")
    (directory / "ladder.toml").write_text(SPEC)


def _ok(*args: object) -> None:
    result = ggufcarve(*args)
    assert result.code == 0, (args, result.stderr[-3000:])


def _normalised(value, volatile_names: set[str]):
    if isinstance(value, dict):
        name = value.get("name") if isinstance(value.get("name"), str) else None
        return {
            k: ("(volatile)" if name in volatile_names and k in ("sha256", "bytes") else _normalised(v, volatile_names))
            for k, v in value.items()
            if k not in VOLATILE and not k.endswith("_seconds")
        }
    if isinstance(value, list):
        return [_normalised(v, volatile_names) for v in value]
    return value


def _published(release: Path) -> dict[str, Path]:
    return {
        p.relative_to(release).as_posix(): p
        for p in sorted(release.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(release).parts)
    }


@pytest.mark.slow
def test_a_plan_publishes_what_the_commands_publish(q8_moe, tmp_path):
    planned, by_hand = tmp_path / "planned", tmp_path / "by-hand"
    _inputs(planned, q8_moe)
    _inputs(by_hand, q8_moe)
    (planned / "plan.toml").write_text(f'''source = "{SOURCE}"
output = "release"
threads = 2

[selection]
method = "weights"
keep = 4

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
chunks = 4
speed_runs = 0
''')
    _ok("run", planned / "plan.toml", "-q")

    d, work, release = by_hand, by_hand / "release.work", by_hand / "release"
    work.mkdir()
    _ok(
        "imatrix",
        "collect",
        d / SOURCE,
        "--calibration",
        d / "calibration.txt",
        "--ctx",
        128,
        "-t",
        2,
        "-o",
        work / "qwen3moe.imatrix.gguf",
        "-q",
    )
    _ok("select", d / SOURCE, "--method", "weights", "--keep", 4, "-o", work / "expert-selection.json", "-q")
    _ok("prune", d / SOURCE, "--keep", work / "expert-selection.json", "-o", work / "qwen3moe-4e-Q8_0.gguf", "-q")
    _ok(
        "imatrix",
        "remap",
        work / "qwen3moe.imatrix.gguf",
        "--keep",
        work / "expert-selection.json",
        "--model",
        work / "qwen3moe-4e-Q8_0.gguf",
        "--source-model",
        d / SOURCE,
        "-o",
        work / "qwen3moe-4e.imatrix.gguf",
        "-q",
    )
    _ok(
        "ladder",
        "run",
        d / "ladder.toml",
        "--source",
        work / "qwen3moe-4e-Q8_0.gguf",
        "--imatrix",
        work / "qwen3moe-4e.imatrix.gguf",
        "--quantizer",
        "libllama",
        "-t",
        2,
        "-o",
        release,
        "-q",
    )
    _ok(
        "eval",
        release,
        "--reference",
        d / SOURCE,
        "--heldout",
        d / "heldout.txt",
        "--ctx",
        128,
        "--chunks",
        4,
        "--speed-runs",
        0,
        "-t",
        2,
        "--cache",
        tmp_path / "cache",
        "-o",
        release / "evaluation",
        "-q",
    )
    _ok("card", release)

    ours, theirs = _published(planned / "release"), _published(release)
    assert set(ours) - set(theirs) == {"method/run-plan.json"} and not set(theirs) - set(ours), sorted(
        set(ours) ^ set(theirs)
    )
    reports = {name for name in theirs if name.endswith(".json")} | {
        "README.md",
        "evaluation/summary.md",
        "method/run-plan.json",
    }
    reports |= {
        Path(name).name for name in reports
    }  # as inputs of other reports they are named without their directory
    for name in sorted(theirs):
        if name.endswith(".json"):
            a, b = (json.loads(p.read_text()) for p in (ours[name], theirs[name]))
            if name == "quant-manifest.json":
                del a["published"]["plan"]  # method/run-plan.json
            assert _normalised(a, reports) == _normalised(b, reports), name
        elif name == "SHA256SUMS":

            def sums(path: Path) -> dict[str, str]:
                pairs = (line.split("  ", 1) for line in path.read_text().splitlines() if line.strip())
                return {
                    n: ("(volatile)" if n in reports else digest) for digest, n in pairs if n != "method/run-plan.json"
                }

            assert sums(ours[name]) == sums(theirs[name])
        else:
            assert sha256(ours[name]) == sha256(theirs[name]), name
