"""Faults a user meets: Ctrl-C (and SIGTERM) in the middle of prune, a ladder rung and eval, and a
disk that fills up while they write. Each runs the real `python -m ggufcarve` in a session of its
own (as a terminal runs a job; Ctrl-C is SIGINT to its process group) and then judges: the exit
status, one error line without a traceback, nothing half-written in the output directory, no
child process left, and a re-run that completes.

A full disk is made two ways: a file size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes past it
fail with EFBIG), which needs no privileges and always runs, and a small tmpfs mounted in a user
and mount namespace (`unshare -rm`), where writes fail with ENOSPC; those tests are skipped where
unprivileged namespaces are not allowed.
"""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import factory
import pytest

from ggufcarve.errors import Interrupted, OutputError
from ggufcarve.fileio import TEMP_NAME
from ggufcarve.gguf.container import read_model
from ggufcarve.llama import launch

SEED = 2203
TOKEN_VAR = "GGUFCARVE_FAULT_TEST"  # set in every command's environment: its children inherit it
TESTS = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# helpers


def listing(directory: Path) -> list[str]:
    """Every file and directory under `directory`, relative, sorted (hidden ones included)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")) if directory.exists() else []


def temps(directory: Path) -> list[str]:
    return [name for name in listing(directory) if TEMP_NAME.match(Path(name).name)]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A command environment: its own ggufcarve cache and a token that marks its processes."""
    return {
        **os.environ,
        "GGUFCARVE_CACHE": str(tmp_path / "cache"),
        "NO_COLOR": "1",
        "TERM": "dumb",
        "COLUMNS": "200",
        TOKEN_VAR: uuid.uuid4().hex,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
    }


def processes_of(env: dict[str, str]) -> list[tuple[int, str]]:
    """(pid, command line) of every live process (zombies excluded) whose environment holds env's token."""
    marker = f"{TOKEN_VAR}={env[TOKEN_VAR]}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if marker not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            if stat[stat.rindex(b")") + 2 :].split()[0] in (b"Z", b"X"):
                continue
            found.append(
                (int(entry), Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            )
        except (OSError, ValueError):
            continue
    return found


def no_process_left(env: dict[str, str], grace: float = 3.0) -> list[tuple[int, str]]:
    """The processes of env's token still alive after `grace` seconds (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + grace
    while (alive := processes_of(env)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def start(*args: object, env: dict[str, str], preexec_fn=None) -> subprocess.Popen[str]:
    """`python -m ggufcarve ARGS` as a terminal starts a job: a session and process group of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "ggufcarve", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def run(*args: object, env: dict[str, str], preexec_fn=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ggufcarve", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
        timeout=600,
    )


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def wait_until(condition, proc: subprocess.Popen[str], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"ended before {what}: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def temp_grown(directory: Path, grown: int, target: str | None = None) -> bool:
    try:
        names = [n for n in os.listdir(directory) if (m := TEMP_NAME.match(n)) and target in (None, m["target"])]
    except FileNotFoundError:
        return False
    for name in names:
        try:
            if (directory / name).stat().st_blocks * 512 >= grown:
                return True
        except FileNotFoundError:
            pass
    return False


def press_ctrl_c(proc: subprocess.Popen[str], signum: int = signal.SIGINT) -> tuple[int, str, float]:
    """Signal the job's process group as a terminal does; (exit status, stderr, seconds until it exited)."""
    sent = time.monotonic()
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr, time.monotonic() - sent


def assert_stopped_cleanly(code: int, stderr: str, seconds: float, signum: int = signal.SIGINT) -> None:
    assert code == 128 + signum, stderr[-3000:]
    assert seconds < 60, f"took {seconds:.1f} s to stop"
    assert "Traceback" not in stderr, stderr[-3000:]
    line = error_line(stderr)
    assert line.startswith("error: stopped by ") and "run the same command again" in line, stderr[-3000:]


def file_size_limit(limit: int):
    """preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored instead of killing)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return apply


def assert_disk_full(result: subprocess.CompletedProcess[str], written: Path) -> None:
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = error_line(result.stderr)
    assert line.startswith(f"error: disk full while writing {written}"), line
    assert "free disk space or choose another" in line and "nothing half-written was left behind" in line, line


LADDER = """
[[rungs]]
ftype = "Q8_0"
[[rungs]]
ftype = "Q4_K_M"
"""


@pytest.fixture(scope="module")
def bulk(tmp_path_factory) -> Path:
    """A 242 MiB Q8_0 MoE file (4 layers x 32 experts): a prune of it takes long enough to stop mid-copy."""
    return factory.write_bulk_moe(tmp_path_factory.mktemp("bulk") / "bulk.gguf")


@pytest.fixture(scope="module")
def f16_moe(tmp_path_factory) -> Path:
    """A 49 MiB F16 MoE model: its Q4_K_M rung takes long enough to be stopped mid-write."""
    return factory.write_model(
        tmp_path_factory.mktemp("f16") / "moe-F16.gguf", "qwen3moe", dtype="F16", n_embd=512, n_ff_exp=512, n_expert=16
    )


# ---------------------------------------------------------------------------------------------
# Ctrl-C and SIGTERM


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_prune_then_rerun(bulk, tmp_path, env, signum):
    rng = random.Random(SEED + signum)
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ("prune", bulk, "--keep-first", 16, "-q")
    proc = start(*args, "-o", out / "p.gguf", env=env)
    wait_until(lambda: temp_grown(out, 4 << 20), proc, "its temp file grew")
    time.sleep(rng.uniform(0, 0.15))
    assert_stopped_cleanly(*press_ctrl_c(proc, signum), signum=signum)
    assert listing(out) == [], "a stopped prune left files behind"
    assert no_process_left(env) == []
    again = run(*args, "-o", out / "p.gguf", env=env)
    assert again.returncode == 0, again.stderr
    assert run("check-prune", bulk, out / "p.gguf", "-q", env=env).returncode == 0
    assert run(*args, "-o", clean / "p.gguf", env=env).returncode == 0
    assert listing(out) == listing(clean)


def _ctrl_c_mid_rung(f16_moe: Path, tmp_path: Path, env: dict[str, str], quantizer: str, seed: int) -> None:
    rng = random.Random(seed)
    spec = tmp_path / "ladder.toml"
    spec.write_text(LADDER)
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ("ladder", "run", spec, "--source", f16_moe, "--quantizer", quantizer, "-t", "2", "-q")
    proc = start(*args, "-o", out, env=env)
    wait_until(
        lambda: temp_grown(out, 1 << 20, f"{f16_moe.stem.removesuffix('-F16')}-Q4_K_M.gguf"),
        proc,
        "the second rung's temp file grew",
    )
    time.sleep(rng.uniform(0, 0.3))
    children = [cmd for pid, cmd in processes_of(env) if pid != proc.pid]
    assert children, "no quantizer child was running"
    assert_stopped_cleanly(*press_ctrl_c(proc))
    assert no_process_left(env) == [], "a quantizer child outlived the stopped ladder"
    assert temps(out) == []
    assert not any(name.endswith("Q4_K_M.gguf") for name in listing(out)), "the rung in flight left a file"
    manifest = json.loads((out / "quant-manifest.json").read_text())
    assert [r["status"] for r in manifest["rungs"]] == ["built"]  # the finished rung is recorded, the stopped one not
    again = run(*args, "-o", out, env=env)
    assert again.returncode == 0, again.stderr
    assert run("verify", out, "--partial", env=env).returncode == 0
    assert run(*args, "-o", clean, env=env).returncode == 0
    assert listing(out) == listing(clean) and temps(out) == []


@pytest.mark.slow
def test_ctrl_c_mid_rung_of_llama_quantize_then_rerun(f16_moe, tmp_path, env, llama_tools):
    _ctrl_c_mid_rung(f16_moe, tmp_path, env, str(llama_tools / "llama-quantize"), SEED + 10)


@pytest.mark.slow
def test_ctrl_c_mid_rung_of_libllama_then_rerun(f16_moe, tmp_path, env):
    _ctrl_c_mid_rung(f16_moe, tmp_path, env, "libllama", SEED + 11)


EVAL_WORDS = "the reference is scored once and cached while every model is compared with it token by token".split()


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    rng = random.Random(7)
    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text(" ".join(rng.choice(EVAL_WORDS) for _ in range(300)) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("child", [1, 2], ids=["reference-pass", "model-pass"])
def test_ctrl_c_mid_eval_then_rerun(make_model, q8_moe, heldout, tmp_path, env, child):
    """Stopped while the reference's log-probs are computed (1st child) or a model is scored (2nd)."""
    rng = random.Random(SEED + 20 + child)
    reference = make_model("qwen3moe", dtype="F16")
    out, cache = tmp_path / "out", tmp_path / "reflogp"
    args = (
        "eval",
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        128,
        "--speed-runs",
        1,
        "--cache",
        cache,
        "-t",
        2,
        "-q",
        "-o",
        out,
    )
    proc = start(*args, env=env)
    seen: set[int] = set()

    def children_started() -> bool:
        seen.update(pid for pid, cmd in processes_of(env) if "ggufcarve.evaluate.child" in cmd)
        return len(seen) >= child

    wait_until(children_started, proc, f"evaluation child {child} started")
    time.sleep(rng.uniform(0, 0.2))
    assert_stopped_cleanly(*press_ctrl_c(proc))
    assert no_process_left(env) == [], "an evaluation child outlived the stopped eval"
    assert [n for n in listing(out) if not n.startswith(".")] == [] and temps(out) == []
    assert not out.exists(), "the stopped eval left the -o directory it created"
    assert temps(cache) == [], "the stopped reference pass left its temp cache"
    cached = [n for n in listing(cache) if n.endswith(".kld")]
    assert child == 2 or cached == [], "a half-computed reference cache got its final name"
    again = run(*args, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    doc = json.loads((out / f"{q8_moe.stem}.json").read_text())
    assert doc["parameters"]["chunks"] >= 1 and doc["kld_mean"] >= 0 and (out / "summary.md").exists()
    assert doc["reference"]["log_probs_cached"] == (child == 2)


def test_a_signal_while_the_main_thread_starts_a_child_kills_that_child(tmp_path, monkeypatch):
    """The signal handler cannot raise inside Popen (the pid would be lost): `run` raises once it is known."""
    monkeypatch.setattr(launch, "_stopped_by", [])
    pid_file = tmp_path / "child.pid"
    real_popen = subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        assert launch.stop_all(signal.SIGINT) is False  # what the handler sees in the middle of Popen
        return proc

    monkeypatch.setattr(launch.subprocess, "Popen", popen_then_signal)
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    started = time.monotonic()
    with pytest.raises(Interrupted) as stopped:
        launch.run([sys.executable, "-c", code])
    assert stopped.value.signum == signal.SIGINT and time.monotonic() - started < 60
    assert launch._running == {}
    with pytest.raises(Interrupted):  # nothing starts after a stop
        launch.run([sys.executable, "-c", "pass"])


SIGNAL_IN_A_FINALIZER = """
import signal, sys
from ggufcarve.cli import install_stop_handlers
from ggufcarve.errors import Interrupted

class Finalized:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # the handler runs here, inside __del__
        sum(range(1000))

install_stop_handlers()
Finalized()
try:
    for _ in range(10_000_000):
        pass
except Interrupted as stop:
    sys.exit(stop.exit_code)
sys.exit(3)
"""


def test_a_signal_that_lands_in_a_finalizer_still_stops_the_run(env):
    """Python prints and drops an exception raised inside a __del__ or a weakref callback; a stop
    signal handled there is delivered again, so the run stops instead of going on with it lost."""
    result = subprocess.run(
        [sys.executable, "-c", SIGNAL_IN_A_FINALIZER], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr


SIGNAL_IN_A_FINALIZER_WHILE_UNWINDING = """
import signal, sys, threading
from ggufcarve.cli import install_stop_handlers, stopping
from ggufcarve.errors import Interrupted

class Dropped:  # what Python hands sys.unraisablehook for an exception raised inside a finalizer
    exc_value = Interrupted(signal.SIGINT)

def redelivering():
    return any(t.name == "ggufcarve-stop" and t.is_alive() for t in threading.enumerate())

install_stop_handlers()
sys.unraisablehook(Dropped())
try:
    for _ in range(10**9):  # the redelivered stop lands here (the loop's end: a hang guard)
        pass
except Interrupted:
    sys.unraisablehook(Dropped())  # a stop dropped by a finalizer that ran while the first one unwound
    stopping()  # what the command line does first when it reports the stop
    try:  # the report (rich's first import) runs while the redelivering threads end
        while redelivering():
            pass
        sum(range(1000))  # a stop still pending is handled at the next bytecodes
    except Interrupted:
        sys.exit(4)
    sys.exit(130)
sys.exit(3)
"""


def test_a_stop_queued_again_while_the_first_unwinds_does_not_break_the_report(env):
    """A stop signal handled inside a finalizer is delivered again from a thread; when a second one
    lands in a finalizer while the first stop unwinds, its redelivery must not raise into the
    report of the stop (seen: the error line's rich import interrupted, exit 1 with a traceback)."""
    result = subprocess.run(
        [sys.executable, "-c", SIGNAL_IN_A_FINALIZER_WHILE_UNWINDING],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 130, result.stderr
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_stop_all_kills_the_children_of_worker_threads(tmp_path, monkeypatch):
    """The dry runs of a ladder run in threads: a stop kills their children and each run raises."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(launch, "_stopped_by", [])
    code = "import time; print('up', flush=True); time.sleep(600)"
    up: list[str] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch.run, [sys.executable, "-c", code], on_line=up.append) for _ in range(2)]
        deadline = time.monotonic() + 60
        while len(up) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = list(launch._running)
        assert len(pids) == 2
        started = time.monotonic()
        assert launch.stop_all(signal.SIGTERM) is True
        for future in futures:
            with pytest.raises(Interrupted):
                future.result(timeout=60)
    assert time.monotonic() - started < 60 and launch._running == {}
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped


# ---------------------------------------------------------------------------------------------
# a full disk: the file size limit (always)


def test_file_size_limit_mid_prune_then_rerun(make_model, tmp_path, env):
    src = make_model("qwen3moe", "Q8_0")
    out = tmp_path / "out"
    args = ("prune", src, "--keep-first", 6, "-q", "-o", out / "p.gguf")
    full = run(*args, env=env, preexec_fn=file_size_limit(read_model(src).total_bytes // 4))
    assert_disk_full(full, out / "p.gguf")
    assert "File too large" in error_line(full.stderr)
    assert listing(out) == []
    again = run(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert run("check-prune", src, out / "p.gguf", "-q", env=env).returncode == 0


def test_file_size_limit_on_the_report_leaves_no_output(make_model, tmp_path, env, monkeypatch):
    """The pruned model fits, its report does not: the model is not renamed into place either."""
    from ggufcarve import fileio
    from ggufcarve.cli import app

    src = make_model("qwen3moe", "Q8_0")
    out = tmp_path / "out"
    real_open = open

    def full_for_reports(path, mode="r", *args, **kwargs):
        if "w" in mode and ".pruning-report.json" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(fileio, "open", full_for_reports, raising=False)
    with pytest.raises(
        OutputError, match=r"disk full while writing .*p\.pruning-report\.json \(No space left on device\)"
    ):
        app(["prune", str(src), "--keep-first", "6", "-q", "-o", str(out / "p.gguf")], standalone_mode=False)
    assert [n for n in listing(out) if n != "method"] == [] and temps(out / "method") == []


def test_prune_refuses_before_writing_when_space_is_short(make_model, tmp_path, monkeypatch):
    from ggufcarve import fileio
    from ggufcarve.cli import app

    src = make_model("qwen3moe", "Q8_0")
    real = fileio.shutil.disk_usage
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(OutputError, match="GiB free"):
        app(
            ["prune", str(src), "--keep-first", "6", "-q", "-o", str(tmp_path / "out" / "p.gguf")],
            standalone_mode=False,
        )
    assert listing(tmp_path / "out") == []


def test_ladder_refuses_before_writing_when_space_is_short(make_model, tmp_path, monkeypatch, env):
    from ggufcarve.cli import app
    from ggufcarve.quant import ladder_plan

    spec = tmp_path / "ladder.toml"
    spec.write_text(LADDER)
    monkeypatch.setenv("GGUFCARVE_CACHE", env["GGUFCARVE_CACHE"])
    real = shutil.disk_usage
    monkeypatch.setattr(ladder_plan.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(OutputError, match="the ladder needs about .* but .* has 1.00 MiB free"):
        app(
            [
                "ladder",
                "run",
                str(spec),
                "--source",
                str(make_model("qwen3moe", "Q8_0")),
                "--quantizer",
                "libllama",
                "-q",
                "-o",
                str(tmp_path / "out"),
            ],
            standalone_mode=False,
        )
    assert listing(tmp_path / "out") == []


def test_eval_child_refuses_before_writing_when_space_is_short(tmp_path, monkeypatch):
    from ggufcarve.evaluate import child

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    assert child._too_little_space({tmp_path / "a.reflogp": 600, tmp_path / "b.kld": 600}) == {
        "path": str(tmp_path / "a.reflogp"),
        "bytes": 1200,
        "free": 1000,
    }
    assert child._too_little_space({tmp_path / "a.reflogp": 600}) is None


@pytest.mark.slow
@pytest.mark.parametrize("quantizer", ["binary", "libllama"])
def test_file_size_limit_mid_rung_then_rerun(f16_moe, tmp_path, env, llama_tools, quantizer):
    """llama-quantize is killed by SIGXFSZ (the launcher restores its default), the libllama child
    gets EFBIG and llama.cpp's `iostream error`: both are the disk-full message."""
    spec = tmp_path / "ladder.toml"
    spec.write_text(LADDER)
    out = tmp_path / "out"
    backend = str(llama_tools / "llama-quantize") if quantizer == "binary" else "libllama"
    args = ("ladder", "run", spec, "--source", f16_moe, "--quantizer", backend, "-t", "2", "-q", "-o", out)
    full = run(*args, env=env, preexec_fn=file_size_limit(8 << 20))
    assert_disk_full(full, out / f"{f16_moe.stem.removesuffix('-F16')}-Q8_0.gguf")
    assert "file size limit" in error_line(full.stderr)
    assert temps(out) == [] and not any(n.endswith("Q8_0.gguf") for n in listing(out))
    assert no_process_left(env) == []
    again = run(*args, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert run("verify", out, "--partial", env=env).returncode == 0


@pytest.mark.slow
def test_file_size_limit_mid_eval_reference_pass(make_model, q8_moe, heldout, tmp_path, env):
    reference = make_model("qwen3moe", dtype="F16")
    out, cache = tmp_path / "out", tmp_path / "reflogp"
    args = (
        "eval",
        q8_moe,
        "--reference",
        reference,
        "--heldout",
        heldout,
        "--ctx",
        128,
        "--speed-runs",
        0,
        "--cache",
        cache,
        "-t",
        2,
        "-q",
        "-o",
        out,
    )
    full = run(*args, env=env, preexec_fn=file_size_limit(64 << 10))
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    line = error_line(full.stderr)
    assert (
        line.startswith(f"error: disk full while writing {cache}")
        and ".kld (File too large)" in line
        and "another --cache directory" in line
    ), line
    assert listing(cache) == [] and [n for n in listing(out) if not n.startswith(".")] == []
    again = run(*args, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / f"{q8_moe.stem}.json").read_text())["kld_mean"] >= 0


# ---------------------------------------------------------------------------------------------
# a full disk: a small tmpfs (where user namespaces allow mounting one)


def _tmpfs_permitted() -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True)
    return probe.returncode == 0


tmpfs = pytest.mark.skipif(not _tmpfs_permitted(), reason="cannot mount a tmpfs in a user namespace here (unshare -rm)")


def in_tmpfs(mount: Path, size: int, scenario: str, *args: str, env: dict[str, str]) -> dict:
    """Run `scenario(*args)` of this module in a new user and mount namespace with a tmpfs of
    `size` bytes at `mount`; returns what the scenario printed (JSON)."""
    mount.mkdir(parents=True, exist_ok=True)
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_faults, "
        f"json; print(json.dumps(test_faults.{scenario}(*sys.argv[1:])))"
    )
    script = f'mount -t tmpfs -o size={size} tmpfs "$1" && shift && exec "$@"'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(mount), sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fill(directory: Path) -> Path:
    """Take every free byte of `directory`'s file system."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return filler


def scenario_prune_fills_up(src: str, mount: str) -> dict:
    """Prune into the tmpfs; once its temp file grew, the disk is filled (the prune stopped with
    SIGSTOP meanwhile); then the filler is removed and the prune run again."""
    out = Path(mount) / "out"
    args = ("prune", src, "--keep-first", 16, "-q", "-o", out / "p.gguf")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggufcarve", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_until(lambda: temp_grown(out, 2 << 20), proc, "its temp file grew")
    proc.send_signal(signal.SIGSTOP)
    filler = _fill(Path(mount))
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    left = listing(out)
    filler.unlink()
    again = run(*args, env=dict(os.environ))
    check = run("check-prune", src, out / "p.gguf", "-q", env=dict(os.environ))
    return {
        "code": proc.returncode,
        "stderr": stderr,
        "left": left,
        "again": again.returncode,
        "again_stderr": again.stderr,
        "check": check.returncode,
        "out": str(out),
    }


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes() if entry.isdigit() else b""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
            found.append(int(entry))
    return found


def scenario_rung_fills_up(quantizer: str, source: str, spec: str, mount: str) -> dict:
    """A ladder into the tmpfs; once the rung's temp file grew, the quantizer child is stopped
    (SIGSTOP), the disk filled and the child continued; then the filler is removed and the ladder
    run again."""
    out = Path(mount) / "out"
    args = ("ladder", "run", spec, "--source", source, "--quantizer", quantizer, "-t", "2", "-q", "-o", out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggufcarve", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_until(lambda: temp_grown(out, 1 << 20), proc, "the rung's temp file grew")
    writers = _children(proc.pid)
    for pid in writers:
        os.kill(pid, signal.SIGSTOP)
    filler = _fill(Path(mount))
    for pid in writers:
        os.kill(pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=300)
    left = listing(out)
    filler.unlink()
    again = run(*args, env=dict(os.environ))
    verify = run("verify", out, "--partial", env=dict(os.environ))
    return {
        "code": proc.returncode,
        "stderr": stderr,
        "left": left,
        "again": again.returncode,
        "again_stderr": again.stderr,
        "verify": verify.returncode,
        "out": str(out),
        "writers": len(writers),
    }


def scenario_too_small(*command: str) -> dict:
    """Run a command once; what it printed and what it left in the tmpfs."""
    done = run(*command, env=dict(os.environ))
    return {
        "code": done.returncode,
        "stderr": done.stderr,
        "left": listing(Path(command[-1]).parent) if command[-2] == "-o" else [],
    }


@tmpfs
def test_disk_fills_up_mid_prune_then_rerun(bulk, tmp_path, env):
    size = read_model(bulk).total_bytes * 3 // 5 + (16 << 20)  # the output (16 of 32 experts) and some room
    result = in_tmpfs(tmp_path / "mnt", size, "scenario_prune_fills_up", str(bulk), str(tmp_path / "mnt"), env=env)
    assert result["code"] == 1 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    line = error_line(result["stderr"])
    assert line.startswith(f"error: disk full while writing {result['out']}/p.gguf (No space left on device)"), line
    assert "free disk space or choose another -o directory" in line
    assert result["left"] == [], "a prune that ran out of space left files"
    assert result["again"] == 0 and result["check"] == 0, result["again_stderr"][-3000:]


@tmpfs
def test_prune_into_a_too_small_disk_is_refused_before_writing(make_model, tmp_path, env):
    src = make_model("qwen3moe", "Q8_0")
    mnt = tmp_path / "mnt"
    result = in_tmpfs(
        mnt,
        256 << 10,
        "scenario_too_small",
        "prune",
        str(src),
        "--keep-first",
        "6",
        "-q",
        "-o",
        str(mnt / "p.gguf"),
        env=env,
    )
    assert (
        result["code"] == 1
        and "GiB free" in error_line(result["stderr"])
        and "free disk space" in error_line(result["stderr"])
    )
    assert result["left"] == []


@tmpfs
@pytest.mark.slow
def test_eval_cache_on_a_too_small_disk_is_refused_before_writing(make_model, q8_moe, heldout, tmp_path, env):
    reference = make_model("qwen3moe", dtype="F16")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    result = in_tmpfs(
        mnt,
        64 << 10,
        "scenario_too_small",
        "eval",
        str(q8_moe),
        "--reference",
        str(reference),
        "--heldout",
        str(heldout),
        "--ctx",
        "128",
        "--speed-runs",
        "0",
        "--cache",
        str(mnt),
        "-t",
        "2",
        "-q",
        "-o",
        str(out),
        env=env,
    )
    line = error_line(result["stderr"])
    assert result["code"] == 1 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert (
        ".kld needs" in line
        and "MiB free" in line
        and "another --cache directory" in line
        and "nothing was written" in line
    ), line
    assert listing(out) == []


@tmpfs
@pytest.mark.slow
@pytest.mark.parametrize("quantizer", ["binary", "libllama"])
def test_disk_fills_up_mid_rung_then_rerun(f16_moe, tmp_path, env, llama_tools, quantizer):
    """llama.cpp's quantizer says only `iostream error` when its write fails; the free space tells
    ggufcarve it was a full disk."""
    spec = tmp_path / "ladder.toml"
    spec.write_text('[[rungs]]\nftype = "Q8_0"\n')
    mnt = tmp_path / "mnt"
    backend = str(llama_tools / "llama-quantize") if quantizer == "binary" else "libllama"
    result = in_tmpfs(mnt, 128 << 20, "scenario_rung_fills_up", backend, str(f16_moe), str(spec), str(mnt), env=env)
    assert result["writers"] == 1
    assert result["code"] == 1 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    line = error_line(result["stderr"])
    assert line.startswith(
        "error: disk full while writing "
        f"{result['out']}/{f16_moe.stem.removesuffix('-F16')}-Q8_0.gguf (0.0 MiB free after"
    ), line
    assert "free disk space or choose another -o directory" in line, line
    assert not any(TEMP_NAME.match(Path(n).name) or n.endswith(".gguf") for n in result["left"]), result["left"]
    assert result["again"] == 0 and result["verify"] == 0, result["again_stderr"][-3000:]
