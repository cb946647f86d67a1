"""The one launcher of llama.cpp children: environment, streaming, timeouts, kill and reap."""

from __future__ import annotations

import os
import sys
import time

import pytest

from ggufcarve.errors import ToolFailed, ToolMissing
from ggufcarve.llama import launch


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def alive(pid: int, grace: float = 2.0) -> bool:
    """Whether `pid` still runs `grace` seconds from now (a SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + grace
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _running(pid)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def test_environment_and_line_streaming():
    lines: list[str] = []
    code = (
        "import os; print(os.environ['GGML_NO_BACKTRACE'], os.environ['LLAMA_ARG_REPACK']); "
        "import sys; print('err', file=sys.stderr); print('no newline', end='')"
    )
    done = launch.run(py(code), on_line=lines.append)
    assert done.ok and done.returncode == 0
    assert lines == ["1 0", "err", "no newline"] and done.tail == lines


def test_exit_status_and_tail_in_the_error():
    done = launch.run(py("import sys\nfor i in range(100): print(i)\nsys.exit(3)"), tail_lines=5)
    assert not done.ok and done.returncode == 3 and done.tail == ["95", "96", "97", "98", "99"]
    with pytest.raises(ToolFailed, match=r"the child exited 3: 97 \| 98 \| 99 \(hint: look\)"):
        launch.check(done, "the child", "look")


def test_overall_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, "
        f"'-c', 'import time; time.sleep(600)']); open({str(pid_file)!r}, "
        "'w').write(str(p.pid)); print('started', flush=True); time.sleep(600)"
    )
    start = time.monotonic()
    done = launch.run(py(code), timeout=2.0)
    assert time.monotonic() - start < 60
    assert done.timed_out == "timeout" and not done.ok and "timed out" in done.describe_failure()
    assert not alive(int(pid_file.read_text()))


def test_idle_watchdog_stops_a_silent_child():
    code = "import time\nfor i in range(3): print(i, flush=True); time.sleep(0.2)\ntime.sleep(60)"
    lines: list[str] = []
    done = launch.run(py(code), on_line=lines.append, idle_timeout=1.5)
    assert done.timed_out == "idle" and lines == ["0", "1", "2"]


def test_child_killed_and_reaped_when_the_caller_raises(tmp_path):
    pid_file = tmp_path / "child.pid"

    def stop(line: str) -> None:
        raise KeyboardInterrupt

    code = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "print('hello', flush=True); time.sleep(60)"
    )
    with pytest.raises(KeyboardInterrupt):
        launch.run(py(code), on_line=stop)
    assert not alive(int(pid_file.read_text()))


def test_missing_program_is_one_clear_error(tmp_path):
    with pytest.raises(ToolMissing, match="cannot run no-such-tool"):
        launch.run([str(tmp_path / "no-such-tool")])


def test_a_child_started_ahead_gets_its_input_when_run():
    started = launch.start(py("import sys, time; time.sleep(0.3); print(sys.stdin.read().upper())"))
    time.sleep(0.5)  # the caller's own work; the child waits on its stdin meanwhile
    lines: list[str] = []
    done = launch.run([], started=started, input=b"request", on_line=lines.append, timeout=60)
    assert done.ok and lines == ["REQUEST"], done.tail
    assert done.argv == started.argv and done.seconds < 60
    assert started.proc.pid not in launch._running


def test_input_reaches_a_child_run_at_once():
    lines: list[str] = []
    assert launch.run(py("import sys; print(len(sys.stdin.read()))"), input=b"x" * 200_000, on_line=lines.append).ok
    assert lines == ["200000"]


def test_a_calibration_child_started_ahead_and_never_used_exits_with_its_parent(tmp_path):
    """A command that fails after starting the calibration child ahead leaves no process behind."""
    import subprocess

    pid_file = tmp_path / "pid"
    code = (
        "import sys; from ggufcarve.select import prestart; prestart.prestart(); "
        f"from ggufcarve.llama import child; open({str(pid_file)!r}, "
        "'w').write(str(child._ahead['ggufcarve.llama.decode'].proc.pid)); sys.exit(1)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 1
    assert not alive(int(pid_file.read_text()), grace=30.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_children_die_with_a_sigkilled_ggufcarve(tmp_path, where):
    """The kernel kills a child when ggufcarve dies by SIGKILL, which no handler sees."""
    import signal
    import subprocess

    pid_file = tmp_path / "pid"
    child = f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid())); import time; time.sleep(120)"
    start = f"launch.run([sys.executable, '-c', {child!r}])"
    if where == "worker thread":
        start = f"threading.Thread(target=lambda: {start}).start(); time.sleep(120)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import sys, threading, time; from ggufcarve.llama import launch; {start}"]
    )
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    assert alive(child_pid, grace=0)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert not alive(child_pid, grace=10.0), "the child outlived its SIGKILLed parent"


def test_a_guarded_child_keeps_its_pid_and_argv():
    started = launch.start(py("import os; print(os.getpid())"))
    lines: list[str] = []
    assert launch.run([], started=started, on_line=lines.append).ok
    assert lines == [str(started.proc.pid)]  # the guard execs the program in place
    lines.clear()
    assert launch.run([sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b", "--c"], on_line=lines.append).ok
    assert lines == ["['a b', '--c']"]


@pytest.mark.parametrize("form", ["-c", "-m"])
def test_a_python_child_never_imports_ggufcarve_from_its_working_directory(tmp_path, form):
    """A directory named ggufcarve where a command runs does not shadow the installed package in
    the launcher's Python children (`python -m` and `-c` otherwise put the working directory first)."""
    (tmp_path / "ggufcarve").mkdir()
    (tmp_path / "ggufcarve" / "__init__.py").write_text("raise SystemExit('shadowed by the working directory')\n")
    (tmp_path / "ggufcarve" / "where.py").write_text("print('shadowed by the working directory')\n")
    code = "import ggufcarve, os; print(os.path.dirname(os.path.realpath(ggufcarve.__file__)))"
    argv = py(code) if form == "-c" else [sys.executable, "-m", "ggufcarve.shipped"]
    lines: list[str] = []
    finished = launch.run(argv, cwd=tmp_path, on_line=lines.append)
    assert finished.ok, finished.describe_failure()
    assert not any("shadowed" in line for line in lines), lines
    if form == "-c":
        assert lines == [os.path.dirname(os.path.dirname(os.path.realpath(launch.__file__)))]


def test_a_device_out_of_memory_is_raised_with_what_was_loaded_unless_llama_cpp_recovered():
    """llama.cpp's "failed to allocate RPC0 buffer of size N" in a failed child's lines: DeviceOutOfMemory
    with the request's model, Compute and context; followed by llama_context's retry without pipeline
    parallelism (which then allocates less), nothing."""
    from ggufcarve.errors import DeviceOutOfMemory
    from ggufcarve.llama.child import out_of_memory
    from ggufcarve.llama.devices import Compute

    class Request:
        TASK = "evaluate"
        model = "m.gguf"
        compute = Compute(99, ("127.0.0.1:1",))
        n_ctx = 4096

    failed = ["alloc_tensor_range: failed to allocate RPC0[127.0.0.1:1] buffer of size 36351805952"]
    with pytest.raises(DeviceOutOfMemory) as raised:
        out_of_memory(Request(), failed, "evaluating m.gguf")
    error = raised.value
    assert (error.model, error.compute, error.n_ctx) == ("m.gguf", Request.compute, 4096)
    assert error.message == (
        "evaluating m.gguf: a device ran out of memory "
        "(failed to allocate RPC0[127.0.0.1:1] buffer of size 36351805952)"
    )
    recovered = [*failed, "graph_reserve: compute buffer allocation failed, retrying without pipeline parallelism"]
    out_of_memory(Request(), recovered, "evaluating m.gguf")  # no error
    out_of_memory(Request(), ["llama_model_load: error loading model: some other reason"], "evaluating m.gguf")
