"""Crash debris: temp names a later run recognises, split outputs replaced as a set, and real
`python -m ggufcarve` processes SIGKILLed at a random point, then run again."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import factory
import numpy as np
import pytest
from clirun import ggufcarve
from gguf.constants import GGMLQuantizationType, GGUFValueType

from ggufcarve import fileio
from ggufcarve.errors import OutputError
from ggufcarve.fileio import (
    TEMP_NAME,
    check_outputs,
    run_token,
    temp_path_for,
    writer_alive,
)
from ggufcarve.gguf.container import (
    TensorHeader,
    encode_header,
    make_kv,
    pad_to,
    read_model,
)

SEED = 1201  # the random kill points are reproducible


# ---------------------------------------------------------------------------------------------
# helpers


def listing(directory: Path) -> list[str]:
    """Every file and directory under `directory`, relative, sorted (hidden ones included)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


# What differs between two runs of the same command: when they ran (time stamps, file times, the
# writing process) and how long their steps took; and a ladder rung that a re-run found finished is
# recorded as "skipped" where a clean run says "built".
VOLATILE = re.compile(r"created|mtime_ns|written_ns|pid|host_token|.*seconds|.*tok_s")


def _stable(value: object) -> object:
    if isinstance(value, dict):
        return {
            k: "built" if k == "status" and v == "skipped" else _stable(v)
            for k, v in value.items()
            if not VOLATILE.fullmatch(k)
        }
    return [_stable(v) for v in value] if isinstance(value, list) else value


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` by relative path (hidden ones included): of its bytes,
    of a JSON file's content less its time stamps and durations (VOLATILE), and of SHA256SUMS's
    lines of the files that are not JSON."""
    found = {}
    for p in sorted(directory.rglob("*")):
        if not p.is_file():
            continue
        if p.suffix == ".json":
            data = json.dumps(_stable(json.loads(p.read_text())), sort_keys=True).encode()
        elif p.name == "SHA256SUMS":
            data = "".join(
                line for line in p.read_text().splitlines(keepends=True) if not line.rstrip().endswith(".json")
            ).encode()
        else:
            data = p.read_bytes()
        found[p.relative_to(directory).as_posix()] = hashlib.sha256(data).hexdigest()
    return found


def temps(directory: Path) -> list[str]:
    return [name for name in listing(directory) if TEMP_NAME.match(Path(name).name)]


def start(*args: object, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ggufcarve", *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )


def kill_while_writing(
    proc: subprocess.Popen[bytes],
    directory: Path,
    rng: random.Random,
    *,
    grown: int,
    max_delay: float,
    target: str | None = None,
) -> None:
    """SIGKILL `proc` a random 0..max_delay seconds after one of its temp files in `directory` (of
    the output named `target`, or any) holds `grown` bytes of data; fails if the process ended
    before it was killed."""
    deadline = time.monotonic() + 300
    while not _temp_grown(directory, grown, target):
        assert proc.poll() is None, f"ended before its temp file grew: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(rng.uniform(0, max_delay))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill: {proc.stderr.read().decode()[-2000:]}"


def _temp_grown(directory: Path, grown: int, target: str | None) -> bool:
    try:
        names = [
            name for name in os.listdir(directory) if (m := TEMP_NAME.match(name)) and target in (None, m["target"])
        ]
    except FileNotFoundError:  # the command has not created its output directory yet
        return False
    for name in names:
        try:
            if (directory / name).stat().st_blocks * 512 >= grown:
                return True
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return False


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A child environment with its own sha256 cache (the first prune of a source hashes it)."""
    return {**os.environ, "GGUFCARVE_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}


@pytest.fixture(scope="module")
def bulk(tmp_path_factory) -> Path:
    """A 242 MiB Q8_0 MoE file of random bytes (4 layers x 32 experts): big enough to kill mid-copy."""
    return factory.write_bulk_moe(tmp_path_factory.mktemp("bulk") / "bulk.gguf")


# ---------------------------------------------------------------------------------------------
# the temp-name scheme


def test_a_temp_name_names_its_writer():
    name = temp_path_for(Path("/models/m.gguf")).name
    match = TEMP_NAME.match(name)
    assert match and match["target"] == "m.gguf" and int(match["pid"]) == os.getpid()
    assert name == f".m.gguf.ggufcarve-{run_token()}.tmp" and writer_alive(name)
    pid, start_ticks, boot = run_token().split("-")
    assert int(start_ticks) > 0 and boot != "0"  # this machine has /proc
    assert not writer_alive(
        f".m.gguf.ggufcarve-{pid}-{int(start_ticks) + 1}-{boot}.tmp"
    )  # the pid, reused by a later process
    other_boot = "0" * 7 + ("1" if boot != "0" * 7 + "1" else "2")
    assert not writer_alive(f".m.gguf.ggufcarve-{pid}-{start_ticks}-{other_boot}.tmp")
    assert writer_alive(f".m.gguf.ggufcarve-{pid}.tmp")  # the earlier form: the pid alone
    assert len(boot) == 16 and writer_alive(
        f".m.gguf.ggufcarve-{pid}-{start_ticks}-{boot[:8]}.tmp"
    )  # BOOT without the host part
    other_host = boot[:8] + ("0" * 8 if boot[8:] != "0" * 8 else "1" * 8)
    assert writer_alive(
        f".m.gguf.ggufcarve-999999999-1-{other_host}.tmp"
    )  # another host's run (a shared directory): never taken for dead
    assert not writer_alive(
        f".m.gguf.ggufcarve-{pid}-{start_ticks}-{other_boot}{boot[8:]}.tmp"
    )  # another boot of this host
    assert writer_alive("m.gguf")  # not a temp name


def test_dead_and_zombie_writers():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        token = run_token(child.pid)
        name = f".m.gguf.ggufcarve-{token}.tmp"
        assert writer_alive(name) and writer_alive(f".m.gguf.ggufcarve-{child.pid}.tmp")
        child.kill()
        deadline = time.monotonic() + 60
        while writer_alive(name) and time.monotonic() < deadline:  # a zombie until it is reaped
            time.sleep(0.01)
        assert not writer_alive(name)
    finally:
        child.kill()
        child.wait()
    assert not writer_alive(name) and not writer_alive(f".m.gguf.ggufcarve-{child.pid}.tmp")


def dead_token() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = run_token(child.pid)
    child.wait()
    return token


def test_dead_runs_temps_are_removed_before_the_disk_check(tmp_path, monkeypatch):
    out = tmp_path / "p.gguf"
    token = dead_token()
    dead = tmp_path / f".p.gguf.ggufcarve-{token}.tmp"
    dead.write_bytes(b"x" * 100_000)
    legacy = tmp_path / ".p.gguf.ggufcarve-999999999.tmp"
    legacy.write_bytes(b"x")
    dead_dir = tmp_path / f".p.gguf.ggufcarve-{token}.tmp.d"  # not a temp name: kept
    dead_dir.mkdir()
    live = temp_path_for(out)
    live.write_bytes(b"mine")
    other = tmp_path / f".q.gguf.ggufcarve-{token}.tmp"
    other.write_bytes(b"another output's")
    real_usage = fileio.shutil.disk_usage
    measured = []

    def usage(path):
        measured.append(sorted(p.name for p in tmp_path.iterdir()))
        return real_usage(path)

    monkeypatch.setattr(fileio.shutil, "disk_usage", usage)
    check_outputs([out], [], 1, False)
    assert measured == [sorted([dead_dir.name, live.name, other.name])]
    with pytest.raises(OutputError, match="GiB free"):
        check_outputs([out], [], 1 << 60, False)


def test_text_outputs_clean_their_dead_temps(tmp_path):
    target = tmp_path / "report.json"
    (tmp_path / f".report.json.ggufcarve-{dead_token()}.tmp").write_text("{")
    fileio.write_text_atomic(target, "{}\n")
    assert listing(tmp_path) == ["report.json"] and target.read_text() == "{}\n"


def test_a_dead_builds_temp_dirs_are_removed_by_the_next_build(tmp_path, monkeypatch):
    import io
    import tarfile

    from ggufcarve.errors import BadInput
    from ggufcarve.llama import build
    from ggufcarve.llama.launch import Finished

    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    token = dead_token()
    staging = fileio.cache_root() / f".llama.cpp-0.0.3-test.ggufcarve-{token}.tmp"
    (staging / "build").mkdir(parents=True)
    (staging / "build" / "ggml.o").write_bytes(b"x" * 10_000)
    sdist = fileio.cache_root() / "sdist" / build.sdist_name("0.0.3-test")
    sdist.parent.mkdir()
    with tarfile.open(sdist, "w:gz") as tar:  # no vendor/llama.cpp: the build stops after the clean-up
        tar.addfile(tarfile.TarInfo("x/setup.py"), io.BytesIO(b""))
    with pytest.raises(BadInput, match="vendor/llama.cpp"):
        build.build_tools(version="0.0.3-test")
    assert not staging.exists()

    download = fileio.cache_root() / "sdist" / f".{build.sdist_name('0.0.4-test')}.ggufcarve-{token}.tmp"
    download.mkdir()
    (download / "half.tar.gz").write_bytes(b"half")

    def fake_pip(argv, **kwargs):
        (Path(argv[argv.index("--dest") + 1]) / build.sdist_name("0.0.4-test")).write_bytes(b"sdist")
        return Finished(list(argv), 0, 0.1, [])

    monkeypatch.setattr(build, "run", fake_pip)
    assert build.fetch_sdist("0.0.4-test").read_bytes() == b"sdist"
    assert listing(fileio.cache_root() / "sdist") == [build.sdist_name("0.0.3-test"), build.sdist_name("0.0.4-test")]


# ---------------------------------------------------------------------------------------------
# split outputs are replaced as a set


def test_a_split_output_is_replaced_as_a_set(make_model, tmp_path):
    src = make_model("qwen3moe", "Q8_0")
    size = read_model(src).total_bytes
    out, clean = tmp_path / "out", tmp_path / "clean"
    out.mkdir()
    clean.mkdir()
    prune = ("prune", src, "--keep-first", 4, "-q")
    assert ggufcarve(*prune, "-o", out / "p.gguf", "--split-max-size", f"{size // 8}").code == 0
    three = [n for n in listing(out) if n.endswith(".gguf")]
    assert len(three) >= 3 and all("-of-" in n for n in three)
    before = {n: (out / n).read_bytes() for n in three}

    two_shards = ("--split-max-size", f"{size // 3}")
    refused = ggufcarve(*prune, "-o", out / "p.gguf", *two_shards)
    assert refused.code == 1 and "already exists" in refused.error_line and "--force" in refused.error_line
    assert {n: (out / n).read_bytes() for n in three} == before

    assert ggufcarve(*prune, "-o", out / "p.gguf", *two_shards, "--force").code == 0
    assert ggufcarve(*prune, "-o", clean / "p.gguf", *two_shards).code == 0
    assert digests(out) == digests(clean) and not set(three) & set(listing(out))
    assert ggufcarve("check-prune", src, out / "p-00001-of-00002.gguf", "-q").code == 0

    assert ggufcarve(*prune, "-o", out / "p.gguf", "--force").code == 0  # one file replaces the set
    assert [n for n in listing(out) if n.endswith(".gguf")] == ["p.gguf"]


def test_a_run_killed_while_renaming_its_shards_is_finished_by_the_rerun(make_model, tmp_path):
    """The swap renames the last shard first and the first shard last: a kill between leaves
    shards without the first one, and the first one's temp file of a dead run."""
    src = make_model("qwen3moe", "Q8_0")
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ("prune", src, "--keep-first", 4, "--split-max-size", f"{read_model(src).total_bytes // 8}", "-q")
    assert ggufcarve(*args, "-o", clean / "p.gguf").code == 0
    assert ggufcarve(*args, "-o", out / "p.gguf").code == 0
    first = sorted(out.glob("p-*.gguf"))[0]
    first.rename(out / f".{first.name}.ggufcarve-{dead_token()}.tmp")
    again = ggufcarve(*args, "-o", out / "p.gguf")
    assert again.code == 0, again.stderr
    assert digests(out) == digests(clean) and not temps(out)
    (out / first.name).unlink()  # no dead run's temp: the shards left are the user's, not replaced without --force
    refused = ggufcarve(*args, "-o", out / "p.gguf")
    assert refused.code == 1 and "already exists" in refused.error_line


def test_the_sources_shards_are_never_part_of_the_replaced_set(make_model, tmp_path):
    """`prune m-00001-of-0000N.gguf --merge -o m.gguf` beside its source: the source shards stay."""
    src = make_model("qwen3moe", "Q8_0")
    work = tmp_path / "work"
    work.mkdir()
    assert (
        ggufcarve(
            "prune",
            src,
            "--keep-first",
            8,
            "-o",
            work / "m.gguf",
            "--split-max-size",
            f"{read_model(src).total_bytes // 3}",
            "--no-provenance",
            "-q",
        ).code
        == 0
    )
    shards = sorted(p.name for p in work.glob("m-*-of-*.gguf"))
    digests = {n: (work / n).read_bytes() for n in shards}
    assert (
        ggufcarve("prune", work / shards[0], "--keep-first", 4, "--merge", "-o", work / "m.gguf", "--force", "-q").code
        == 0
    )
    assert {n: (work / n).read_bytes() for n in shards} == digests and (work / "m.gguf").exists()


# ---------------------------------------------------------------------------------------------
# SIGKILL at a random point, then the same command again


def test_sigkill_mid_prune_then_rerun(bulk, tmp_path, env):
    rng = random.Random(SEED)
    out, clean = tmp_path / "out", tmp_path / "clean"
    out.mkdir()
    clean.mkdir()
    args = ("prune", bulk, "--keep-first", 16, "-q")
    kill_while_writing(start(*args, "-o", out / "p.gguf", env=env), out, rng, grown=4 << 20, max_delay=0.15)
    assert temps(out), "the kill left no temp file: it did not land mid-write"
    again = subprocess.run(
        [sys.executable, "-m", "ggufcarve", *map(str, args), "-o", out / "p.gguf"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stderr
    assert ggufcarve("check-prune", bulk, out / "p.gguf", "-q").code == 0
    assert (
        subprocess.run([sys.executable, "-m", "ggufcarve", *map(str, args), "-o", clean / "p.gguf"], env=env).returncode
        == 0
    )
    assert digests(out) == digests(clean) and not temps(out)


def test_sigkill_mid_split_reprune_then_rerun(bulk, tmp_path, env):
    """A --force re-prune into a different shard count, killed: the re-run leaves only the new set."""
    rng = random.Random(SEED + 1)
    out, clean = tmp_path / "out", tmp_path / "clean"
    out.mkdir()
    clean.mkdir()
    base = ("prune", bulk, "--keep-first", 16, "-q")
    assert (
        subprocess.run(
            [sys.executable, "-m", "ggufcarve", *map(str, base), "-o", out / "p.gguf", "--split-max-size", "40M"],
            env=env,
        ).returncode
        == 0
    )
    old = [n for n in listing(out) if n.endswith(".gguf")]
    assert len(old) == 4
    args = (*base, "-o", out / "p.gguf", "--split-max-size", "100M", "--force")
    kill_while_writing(start(*args, env=env), out, rng, grown=4 << 20, max_delay=0.15)
    assert temps(out)
    again = subprocess.run(
        [sys.executable, "-m", "ggufcarve", *map(str, args)], env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert ggufcarve("check-prune", bulk, out / "p-00001-of-00002.gguf", "-q").code == 0
    assert (
        subprocess.run(
            [sys.executable, "-m", "ggufcarve", *map(str, base), "-o", clean / "p.gguf", "--split-max-size", "100M"],
            env=env,
        ).returncode
        == 0
    )
    assert digests(out) == digests(clean) and not temps(out) and not set(old) & set(listing(out))


def write_bulk_imatrix(path: Path, model_path: Path, seed: int = 0) -> Path:
    """A GGUF imatrix (in_sum2 and counts of every matrix in blk.*) for a write_bulk_moe model."""
    f32 = int(GGMLQuantizationType.F32)
    kvs = [
        make_kv("general.type", GGUFValueType.STRING, "imatrix"),
        make_kv("imatrix.datasets", GGUFValueType.ARRAY, ["calibration.txt"], GGUFValueType.STRING),
        make_kv("imatrix.chunk_count", GGUFValueType.UINT32, 4),
        make_kv("imatrix.chunk_size", GGUFValueType.UINT32, 512),
    ]
    tensors = []
    for t in read_model(model_path).tensors:
        if t.name.startswith("blk.") and len(t.shape) >= 2 and "gate_inp" not in t.name:
            n_mat = t.shape[2] if len(t.shape) == 3 else 1
            tensors += [
                TensorHeader(f"{t.name}.in_sum2", (t.shape[0], n_mat), f32, 4 * t.shape[0] * n_mat),
                TensorHeader(f"{t.name}.counts", (1, n_mat), f32, 4 * n_mat),
            ]
    header, _ = encode_header(3, kvs, tensors, 32)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(header)
        for h in tensors:
            f.write((rng.random(h.nbytes // 4, dtype=np.float32) * 100 + 1).tobytes())
            f.write(bytes(pad_to(h.nbytes, 32) - h.nbytes))
    return path


def test_sigkill_mid_imatrix_remap_then_rerun(tmp_path, env):
    """A 230 MiB imatrix (48 layers x 128 experts, n_embd 4096) of a sparse model file."""
    rng = random.Random(SEED + 2)
    model = factory.write_bulk_moe(
        tmp_path / "model.gguf", n_layer=48, n_expert=128, n_embd=4096, n_ff_exp=1536, sparse=True
    )
    imatrix = write_bulk_imatrix(tmp_path / "imatrix.gguf", model)
    out, clean = tmp_path / "out", tmp_path / "clean"
    out.mkdir()
    clean.mkdir()
    args = ("imatrix", "remap", imatrix, "--source-model", model, "--keep-first", 64, "-q")
    kill_while_writing(start(*args, "-o", out / "imatrix.gguf", env=env), out, rng, grown=1 << 20, max_delay=0.05)
    assert temps(out)
    again = subprocess.run(
        [sys.executable, "-m", "ggufcarve", *map(str, args), "-o", out / "imatrix.gguf"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stderr
    assert (
        subprocess.run(
            [sys.executable, "-m", "ggufcarve", *map(str, args), "-o", clean / "imatrix.gguf"], env=env
        ).returncode
        == 0
    )
    assert digests(out) == digests(clean) and not temps(out)
    assert (out / "imatrix.gguf").read_bytes() == (clean / "imatrix.gguf").read_bytes()


def test_remap_report_is_written_before_the_output_is_renamed(tmp_path, monkeypatch):
    """A run stopped at the rename leaves the report and no output: the re-run needs no --force."""
    model = factory.write_model(tmp_path / "model.gguf", "qwen3moe")
    imatrix = write_bulk_imatrix(tmp_path / "imatrix.gguf", model)
    out = tmp_path / "out" / "pruned.imatrix.gguf"
    report = out.parent / "method" / "pruned.imatrix.imatrix-remap-report.json"
    args = ("imatrix", "remap", imatrix, "--source-model", model, "--keep-first", 4, "-o", out, "-q")
    real_replace = os.replace

    class Stopped(Exception):
        """The process dies here."""

    def stop_at_rename(src, dst, *a, **k):
        if Path(dst) == out:
            assert report.exists()  # the report is already there when the output is renamed
            raise Stopped
        return real_replace(src, dst, *a, **k)

    from ggufcarve.cli import app

    monkeypatch.setattr(fileio.os, "replace", stop_at_rename)
    with pytest.raises(Stopped):
        app(list(map(str, args)), standalone_mode=False)
    monkeypatch.setattr(fileio.os, "replace", real_replace)
    assert report.exists() and not out.exists() and not temps(out.parent)
    again = ggufcarve(*args)
    assert again.code == 0, again.stderr
    assert out.exists() and json.loads(report.read_text())["output"]["sha256"] == fileio.sha256_file(out)


LADDER = """
[[rungs]]
ftype = "Q8_0"
[[rungs]]
ftype = "Q4_K_M"
"""


@pytest.mark.slow
def test_sigkill_mid_ladder_rung_then_rerun(make_model, tmp_path, env):
    """libllama quantizes a 49 MiB F16 model; the run is killed while the second rung is being
    written (the first one is finished and recorded)."""
    rng = random.Random(SEED + 3)
    src = make_model("qwen3moe", "F16", n_embd=512, n_ff_exp=512, n_expert=16)
    spec = tmp_path / "ladder.toml"
    spec.write_text(LADDER)
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ("ladder", "run", spec, "--source", src, "--quantizer", "libllama", "-t", "2", "-q")
    kill_while_writing(
        start(*args, "-o", out, env=env), out, rng, grown=1 << 20, max_delay=0.5, target=f"{src.stem}-Q4_K_M.gguf"
    )
    assert temps(out)
    again = subprocess.run(
        [sys.executable, "-m", "ggufcarve", *map(str, args), "-o", out], env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert ggufcarve("verify", out, "--partial").code == 0
    assert subprocess.run([sys.executable, "-m", "ggufcarve", *map(str, args), "-o", clean], env=env).returncode == 0
    assert digests(out) == digests(clean) and not temps(out)
