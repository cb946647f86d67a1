"""One release from several ladder runs: per-rung fragments under the release's lock, `release merge`,
then `verify`. Rungs are quantized by libllama (llama.cpp's own quantizer, no compiled tools)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from clirun import ggufcarve, sha256

from ggufcarve.errors import OutputError
from ggufcarve.fileio import host_token, run_token
from ggufcarve.release.lock import LOCK_NAME, lock_release, read_owner

SPEC = """
[[rungs]]
ftype = "Q6_K"
[[rungs]]
ftype = "Q4_K_M"
"""
FRAGMENTS = ".ggufcarve-fragments"


@pytest.fixture
def spec(tmp_path) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    return path


def ladder_argv(spec: Path, source: Path, out: Path, rung: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ggufcarve",
        "ladder",
        "run",
        str(spec),
        "--source",
        str(source),
        "-o",
        str(out),
        "--only",
        rung,
        "--quantizer",
        "libllama",
        "-t",
        "1",
        "-q",
    ]


def run_concurrently(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for argv in argvs
    ]
    done = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.code == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and "(hint: " in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def two_hosts(spec, q8_moe, tmp_path) -> Path:
    """Q6_K and Q4_K_M quantized at the same time by two processes into one directory."""
    out = tmp_path / "release"
    runs = run_concurrently(ladder_argv(spec, q8_moe, out, "Q6_K"), ladder_argv(spec, q8_moe, out, "Q4_K_M"))
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.slow
def test_concurrent_only_runs_merge_and_verify(two_hosts, q8_moe):
    out = two_hosts
    assert sorted(p.name for p in (out / FRAGMENTS).iterdir()) == ["Q4_K_M.json", "Q6_K.json"]
    assert not (out / LOCK_NAME).exists()
    # the last run's rebuild under the lock already saw the other's fragment
    assert [r["name"] for r in json.loads((out / "quant-manifest.json").read_text())["rungs"]] == ["Q6_K", "Q4_K_M"]

    merged = ggufcarve("release", "merge", out)
    assert merged.code == 0, merged.stderr
    assert "Q6_K" in merged.stdout and "Q4_K_M" in merged.stdout
    manifest = json.loads((out / "quant-manifest.json").read_text())
    assert [r["name"] for r in manifest["rungs"]] == ["Q6_K", "Q4_K_M"]  # the spec's order
    for rung in manifest["rungs"]:
        path = out / rung["files"][0]["name"]
        assert (
            rung["status"] == "built" and rung["sha256"] == sha256(path) and rung["source_sha256"] == [sha256(q8_moe)]
        )
    listed = sorted(line.split("  ", 1)[1] for line in (out / "SHA256SUMS").read_text().splitlines())
    assert listed == sorted(["quant-manifest.json", *(r["files"][0]["name"] for r in manifest["rungs"])])
    verified = ggufcarve("verify", out, "--partial")
    assert verified.code == 0, verified.stderr
    assert "OK: 3 files" in verified.stdout

    assert not (out / FRAGMENTS).exists()  # every rung of the ladder merged: the fragments are not left in the release

    # idempotent: merging again adopts the manifest's rungs as fragments (as of a release made
    # before fragments existed) and gives the same bytes
    before = {name: (out / name).read_bytes() for name in ("quant-manifest.json", "SHA256SUMS")}
    again = ggufcarve("release", "merge", out, "--json")
    assert (
        again.code == 0 and json.loads(again.stdout)["changed"] is False and json.loads(again.stdout)["adopted"] == 2
    ), again.stdout
    assert {name: (out / name).read_bytes() for name in before} == before
    assert [r["name"] for r in json.loads((out / "quant-manifest.json").read_text())["rungs"]] == ["Q6_K", "Q4_K_M"]
    assert ggufcarve("verify", out, "--partial").code == 0


@pytest.mark.slow
def test_merge_refuses_a_fragment_of_another_source(spec, q8_moe, tmp_path):
    out = tmp_path / "release"
    assert ggufcarve(*ladder_argv(spec, q8_moe, out, "Q4_K_M")[3:]).code == 0
    other_dir = tmp_path / "other"
    pruned = tmp_path / "models" / "other-Q8_0.gguf"
    pruned.parent.mkdir()
    assert ggufcarve("prune", q8_moe, "-o", pruned, "--keep-first", 4, "-q").code == 0
    assert ggufcarve(*ladder_argv(spec, pruned, other_dir, "Q6_K")[3:]).code == 0
    # a job of the other model wrote into this release's directory
    shutil.copy(other_dir / "other-Q6_K.gguf", out)
    shutil.copy(other_dir / FRAGMENTS / "Q6_K.json", out / FRAGMENTS)
    before = {name: (out / name).read_bytes() for name in ("quant-manifest.json", "SHA256SUMS")}
    line = one_line_error(ggufcarve("release", "merge", out))
    assert "fragments disagree on the source" in line
    assert (
        f"{q8_moe.name} (sha256 {sha256(q8_moe)[:12]})" in line
        and f"{pruned.name} (sha256 {sha256(pruned)[:12]})" in line
    )
    assert ".ggufcarve-fragments/Q4_K_M.json" in line and ".ggufcarve-fragments/Q6_K.json" in line
    assert {name: (out / name).read_bytes() for name in before} == before  # nothing written
    # a ladder run into it is refused too, before it quantizes
    refused = ggufcarve(*ladder_argv(spec, q8_moe, out, "Q4_K_M")[3:])
    assert (
        refused.code == 1
        and f"holds the release of {pruned.name}" in refused.error_line
        and "Traceback" not in refused.stderr
    )


@pytest.mark.slow
def test_rungs_made_by_different_quantizers_each_record_their_own(two_hosts):
    out = two_hosts
    fragment = out / FRAGMENTS / "Q4_K_M.json"
    doc = json.loads(fragment.read_text())
    ours = doc["run"]["quantizer"]
    theirs = {**ours, "build": 1, "commit": "0123abc"}  # the other host's llama.cpp build
    doc["run"]["quantizer"] = theirs
    fragment.write_text(json.dumps(doc))
    merged = ggufcarve("release", "merge", out)
    assert merged.code == 0, merged.stderr
    manifest = json.loads((out / "quant-manifest.json").read_text())
    assert {r["name"]: r["quantizer"] for r in manifest["rungs"]} == {"Q6_K": ours, "Q4_K_M": theirs}
    assert any("different quantizers" in w for w in manifest["warnings"])
    carded = ggufcarve("card", out)
    assert carded.code == 0, carded.stderr
    assert "made by different builds, each named in `quant-manifest.json`" in (out / "README.md").read_text()
    assert ggufcarve("verify", out, "--partial").code == 0
    # one build again: the rungs carry no quantizer of their own (the merge removed the fragments: adopted back
    # from the manifest)
    from ggufcarve.release.fragments import adopt_manifest

    assert not (out / FRAGMENTS).exists() and adopt_manifest(out) == 2
    doc = json.loads(fragment.read_text())
    assert doc["run"]["quantizer"] == theirs and "quantizer" not in doc["rung"]
    doc["run"]["quantizer"] = ours
    fragment.write_text(json.dumps(doc))
    assert ggufcarve("release", "merge", out).code == 0
    manifest = json.loads((out / "quant-manifest.json").read_text())
    assert all("quantizer" not in r for r in manifest["rungs"]) and manifest["quantizer"] == ours
    assert not any("different quantizers" in w for w in manifest["warnings"])


@pytest.mark.slow
def test_merge_refuses_a_rung_whose_file_differs(two_hosts):
    out = two_hosts
    q4 = next(out.glob("*-Q4_K_M.gguf"))
    data = bytearray(q4.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    q4.write_bytes(bytes(data))
    line = one_line_error(ggufcarve("release", "merge", out))
    assert f"{q4.name} of rung Q4_K_M has sha256 {sha256(q4)[:12]}" in line and "--only" in line
    q4.unlink()
    line = one_line_error(ggufcarve("release", "merge", out))
    assert f"{q4.name} of rung Q4_K_M is missing" in line
    (out / FRAGMENTS / "Q4_K_M.json").unlink()  # the hint's other way: leave the rung out
    merged = ggufcarve("release", "merge", out)
    assert merged.code == 0, merged.stderr
    assert [r["name"] for r in json.loads((out / "quant-manifest.json").read_text())["rungs"]] == ["Q6_K"]
    assert ggufcarve("verify", out, "--partial").code == 0


# ---------------------------------------------------------------------------------------------
# the lock (no llama.cpp)


def dead_token() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = run_token(child.pid)
    child.wait()
    return token


def write_lock(directory: Path, *, token: str, host: str, host_tok: str) -> Path:
    pid, start, boot = token.split("-")
    path = directory / LOCK_NAME
    path.write_text(
        json.dumps(
            {
                "host": host,
                "host_token": host_tok,
                "pid": int(pid),
                "start": int(start),
                "boot": boot,
                "since": "2026-01-01T00:00:00Z",
            }
        )
    )
    return path


def test_a_lock_of_a_dead_process_on_this_host_is_broken_at_once(tmp_path):
    lock = write_lock(tmp_path, token=dead_token(), host="here", host_tok=host_token())
    started = time.monotonic()
    with lock_release(tmp_path, wait=60, stale_seconds=600):
        owner = read_owner(lock)
        assert owner["pid"] == os.getpid() and owner["host_token"] == host_token()
    assert time.monotonic() - started < 60
    assert not lock.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_remote_lock_is_broken_only_once_its_heartbeat_stops(tmp_path):
    other = "0" * 8 if host_token() != "0" * 8 else "1" * 8
    lock = write_lock(tmp_path, token=f"{os.getpid()}-1-{'a' * 8}{other}", host="node17", host_tok=other)
    beating = threading.Event()
    beating.set()

    def heartbeat() -> None:
        while beating.is_set():
            os.utime(lock)
            time.sleep(0.05)

    beater = threading.Thread(target=heartbeat, daemon=True)
    beater.start()
    try:
        with pytest.raises(OutputError, match="node17 .*holds the lock"):
            with lock_release(tmp_path, wait=1.5, stale_seconds=0.5):
                pass
    finally:
        beating.clear()
        beater.join()
    assert read_owner(lock)["host"] == "node17"  # a live remote lock is never broken
    started = time.monotonic()
    with lock_release(tmp_path, wait=60, stale_seconds=0.5):
        assert read_owner(lock)["pid"] == os.getpid()
    assert 0.4 < time.monotonic() - started < 60
    assert not lock.exists()


def test_a_live_holder_on_this_host_is_waited_for(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from ggufcarve.release.lock import lock_release\n"
                f"with lock_release(Path({str(tmp_path)!r}), heartbeat=60):\n "
                "   print('held', flush=True); time.sleep(1.5)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputError, match=f"pid {holder.pid} on .*holds the lock"):
            with lock_release(tmp_path, wait=0.6, stale_seconds=0.1):  # a live process of this host: its pid keeps it
                pass
        started = time.monotonic()
        with lock_release(tmp_path, wait=60):
            assert read_owner(tmp_path / LOCK_NAME)["pid"] == os.getpid()
        assert time.monotonic() - started < 60
    finally:
        holder.kill()
        holder.wait()
