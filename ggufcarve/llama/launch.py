"""The one launcher of llama.cpp children (tools, libllama child tasks) and of the build's subprocesses.

Every child runs with:
  * `GGML_NO_BACKTRACE=1`: on an abort (GGML_ASSERT, uncaught exception) ggml otherwise forks
    gdb to attach to the dying process; gdb inherits the output pipe and can hang for minutes;
  * `LLAMA_ARG_REPACK=0` (the environment form of the tools' `--no-repack`, read by every tool
    built on llama.cpp's common arguments): weight repacking and the extra CPU buffer types (AMX)
    are off; on CPUs with AMX llama.cpp 0.3.36 crashes in
    `ggml_backend_amx_mul_mat` for small models otherwise (libllama child tasks load models with
    `use_extra_bufts = False` for the same reason);
  * stdin closed (or a pipe its input is written to, then closed), stdout and stderr merged and
    streamed line by line to `on_line`; `start` starts a child ahead of its `run`, so that its
    start-up overlaps the caller's own work;
  * an overall timeout and an idle watchdog (no output for `idle_timeout` seconds);
  * its own process group, killed and reaped on any exception, Ctrl-C included;
  * on Linux, the kernel's SIGKILL when ggufcarve itself dies, even by SIGKILL (ORPHAN_GUARD);
  * a Python child (this interpreter) never imports from its working directory (`isolated`).
The last lines of output are kept for the error message.

Children run in sessions of their own, so a terminal's Ctrl-C reaches only ggufcarve. Its signal
handler calls `stop_all`: the process group of every running child is killed at once (those of
worker threads too), every `run` in progress or starting afterwards raises `Interrupted`, and a
child being started in the main thread is killed as soon as `Popen` returns, so no child outlives
the run.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ggufcarve.errors import Interrupted, ToolFailed, ToolMissing

TAIL_LINES = 40
CHILD_ENV = {
    "GGML_NO_BACKTRACE": "1",
    "LLAMA_ARG_REPACK": "0",
}


# Run by `python -S` (no site: a few milliseconds) in every child on Linux, then replaced by the
# child's program (execv keeps the pid): prctl(PR_SET_PDEATHSIG, SIGKILL) makes the kernel kill
# the child when the thread that started it ends, and the setting survives execve. So a ggufcarve
# killed by SIGKILL takes its children with it (`run` starts and waits in one thread). argv:
# ggufcarve's pid (a parent already gone is checked after the prctl), the program, its argv.
ORPHAN_GUARD = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os._exit(128 + signal.SIGKILL)
try:
    os.execv(sys.argv[2], sys.argv[3:])
except OSError as err:
    print(f"cannot run {sys.argv[3]}: {err.strerror}", file=sys.stderr, flush=True)
    os._exit(127)
"""

# Run instead of `python -m MODULE ARGS` by a Python without -P (3.10): `-m` puts the working
# directory first on sys.path, where a directory named ggufcarve would shadow the installed package.
SAFE_PATH_STUB = (
    "import runpy, sys; del sys.path[0]; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)

_running: dict[int, subprocess.Popen[bytes]] = {}  # every child of a `run` in progress, by pid
_stopped_by: list[int] = []  # the signal `stop_all` was called for; no child runs after it
_main_starting = [False]  # the main thread is inside Popen: a signal handler must not raise there


def stop_all(signum: int) -> bool:
    """Kill the process group of every running child; every `run` then raises Interrupted(signum).

    Meant for a signal handler (which runs in the main thread, between two bytecodes of whatever it
    was doing). Returns False when the main thread is starting a child: raising there would lose
    the child's pid, so the handler returns and `run` raises Interrupted once the child is known.
    """
    if not _stopped_by:
        _stopped_by.append(signum)
    for proc in list(_running.values()):
        _kill_group(proc.pid)
    return not _main_starting[0]


def _check_stopped() -> None:
    if _stopped_by:
        raise Interrupted(_stopped_by[0])


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every llama.cpp child: this process's, plus CHILD_ENV and `extra`."""
    return {**os.environ, **CHILD_ENV, **(extra or {})}


@dataclass
class Finished:
    """What a child did: its argv, exit status (negative: killed by that signal), time, output tail."""

    argv: list[str]
    returncode: int
    seconds: float
    tail: list[str] = field(default_factory=list)
    timed_out: str = ""  # "", "timeout" or "idle"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe_failure(self) -> str:
        """One line: why it stopped and its last output lines."""
        if self.timed_out == "timeout":
            why = f"timed out after {self.seconds:.0f} s"
        elif self.timed_out == "idle":
            why = f"printed nothing for too long and was stopped after {self.seconds:.0f} s"
        elif self.returncode == -signal.SIGXFSZ:
            why = "killed by SIGXFSZ: a file it wrote reached the file size limit (ulimit -f)"
        elif self.returncode < 0:
            why = (
                "killed by signal "
                f"""{
                    signal.Signals(-self.returncode).name
                    if -self.returncode in signal.valid_signals()
                    else -self.returncode
                }"""
            )
        else:
            why = f"exited {self.returncode}"
        last = " | ".join(line.strip() for line in self.tail[-3:] if line.strip())
        return f"{why}" + (f": {last}" if last else "")


@dataclass
class Started:
    """A child started ahead of its `run` (`start`): it waits for its input on stdin."""

    argv: list[str]
    proc: subprocess.Popen[bytes]


def guarded(args: list[str]) -> list[str]:
    """`args` run through ORPHAN_GUARD on Linux (the program resolved on PATH first); ToolMissing
    when there is no such program."""
    program = shutil.which(args[0])
    if program is None:
        raise ToolMissing(
            f"cannot run {Path(args[0]).name}: no such program, or it is not executable",
            "check the path (ggufcarve toolchain show)",
        )
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-S", "-c", ORPHAN_GUARD, str(os.getpid()), program, *args]


def isolated(args: list[str]) -> list[str]:
    """`args`, where they run this interpreter, without the working directory on sys.path: Python's
    -P (3.11+), or SAFE_PATH_STUB in place of `-m` on 3.10."""
    if not args or args[0] != sys.executable or "-P" in args[1:2]:
        return args
    if sys.version_info >= (3, 11):
        return [args[0], "-P", *args[1:]]
    if args[1:2] == ["-m"]:
        return [args[0], "-c", SAFE_PATH_STUB, *args[2:]]
    return args


def _spawn(
    args: list[str], cwd: str | os.PathLike[str] | None, env: Mapping[str, str] | None, stdin: int
) -> subprocess.Popen[bytes]:
    """Popen in a session of its own, registered in `_running`; safe against a stop signal meanwhile."""
    _check_stopped()
    command = guarded(isolated(args))
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        _main_starting[0] = True
    try:
        proc = subprocess.Popen(
            command,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=child_env(env),
            start_new_session=True,
        )
        _running[proc.pid] = proc
    except BaseException as err:
        _check_stopped()
        if isinstance(err, OSError):
            raise ToolMissing(
                f"cannot run {Path(args[0]).name}: {err.strerror or err}", "check the path (ggufcarve toolchain show)"
            ) from None
        raise
    finally:
        if in_main:
            _main_starting[0] = False  # from here on a signal handler may raise: the caller kills the child
    try:
        _check_stopped()  # a signal that came while Popen ran, or stopped another thread's child
    except BaseException:
        _kill(proc)
        _running.pop(proc.pid, None)
        raise
    return proc


def start(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Started:
    """Start a child now, with a pipe as its stdin, for a later `run(..., started=, input=)` to
    feed and follow: its start-up (interpreter, imports) overlaps the caller's own work. A child
    that is never run reads end-of-file when this process exits."""
    args = [os.fspath(a) for a in argv]
    return Started(args, _spawn(args, cwd, env, subprocess.PIPE))


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
    idle_timeout: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    tail_lines: int = TAIL_LINES,
    started: Started | None = None,
    input: bytes | None = None,
) -> Finished:
    """Run a child to completion; never raises for its exit status (see `check`).

    `started`: a child from `start` (its argv, cwd and env were given there) instead of a new one;
    `input`: bytes written to the child's stdin, which is then closed (otherwise stdin is closed).
    Raises ToolMissing when the program cannot be started. On any exception in the caller's
    `on_line` (or KeyboardInterrupt) the child's process group is killed and reaped first.
    """
    if started is None:
        args = [os.fspath(a) for a in argv]
        proc = _spawn(args, cwd, env, subprocess.DEVNULL if input is None else subprocess.PIPE)
    else:
        args, proc = started.argv, started.proc
    try:
        if proc.stdin is not None:
            try:
                proc.stdin.write(input or b"")
                proc.stdin.close()
            except BrokenPipeError:  # the child died: its output and status say why
                pass
    except BaseException:
        _kill(proc)
        _running.pop(proc.pid, None)
        raise
    began = time.monotonic()  # timeouts count from here, when the child has its work
    output: _Output | None = None
    try:
        output = _Output(proc, tail_lines)
        timed_out = output.follow(on_line, timeout, idle_timeout)
        if timed_out:
            _kill(proc)
        code = proc.wait()
        _check_stopped()  # killed by stop_all, not failed
    except BaseException:
        _kill(proc)
        raise
    finally:
        _running.pop(proc.pid, None)
        if output is not None:
            output.close()
    return Finished(args, code, time.monotonic() - began, list(output.tail), timed_out)


class _Output:
    """A child's merged stdout and stderr, read line by line (the last `tail_lines` kept)."""

    def __init__(self, proc: subprocess.Popen[bytes], tail_lines: int) -> None:
        if proc.stdout is None:
            raise RuntimeError(f"{proc.args!r}: the child's output is not a pipe")
        self.proc, self.stream = proc, proc.stdout
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.stream, selectors.EVENT_READ)
        self.pending = b""
        self.ended = False

    def follow(
        self,
        on_line: Callable[[str], None] | None,
        timeout: float | None,
        idle_timeout: float | None,
        until: Callable[[str], bool] | None = None,
    ) -> str:
        """Read lines until the output ends or a line for which `until` is true; "" then, else "timeout" or
        "idle" when a limit passed first (counted from this call)."""
        began = last_output = time.monotonic()
        _check_stopped()
        while not self.ended:
            now = time.monotonic()
            waits = [1.0]
            if timeout is not None:
                waits.append(began + timeout - now)
            if idle_timeout is not None:
                waits.append(last_output + idle_timeout - now)
            events = self.selector.select(max(0.0, min(waits)))
            now = time.monotonic()
            if events:
                chunk = os.read(self.stream.fileno(), 1 << 16)
                if not chunk:
                    self.ended = True
                    if self.pending:
                        self._line(self.pending, on_line)
                        self.pending = b""
                    break
                last_output = now
                self.pending += chunk
                *lines, self.pending = self.pending.split(b"\n")
                for number, raw in enumerate(lines):
                    text = self._line(raw, on_line)
                    if until is not None and until(text):
                        self.pending = b"\n".join([*lines[number + 1 :], self.pending])
                        return ""
            if timeout is not None and now - began > timeout:
                return "timeout"
            if idle_timeout is not None and now - last_output > idle_timeout:
                return "idle"
        return ""

    def _line(self, raw: bytes, on_line: Callable[[str], None] | None) -> str:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        self.tail.append(text)
        if on_line is not None:
            on_line(text)
        return text

    def close(self) -> None:
        if not self.stream.closed:
            self.selector.close()
            self.stream.close()


class Conversation:
    """A child kept running across several requests: `exchange` writes one line to its stdin and follows its
    output until a line marks the answer; `close` ends its stdin and reaps it. The child's process group is
    killed on any exception, as `run` kills it."""

    def __init__(self, started: Started, tail_lines: int = TAIL_LINES) -> None:
        self.argv, self.proc = started.argv, started.proc
        self.output = _Output(self.proc, tail_lines)
        self.began = time.monotonic()

    def exchange(
        self,
        data: bytes,
        until: Callable[[str], bool],
        *,
        on_line: Callable[[str], None] | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> Finished | None:
        """Write `data` (one line) and read the child's lines until `until(line)`: None, the child waits for the
        next line. A child that ended (or timed out, then killed) instead: its Finished."""
        try:
            if self.proc.stdin is None:
                raise RuntimeError(f"{self.argv!r}: the child's input is not a pipe")
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except BrokenPipeError:  # the child died: its output and status say why
                pass
            timed_out = self.output.follow(on_line, timeout, idle_timeout, until)
            if not timed_out and not self.output.ended:
                return None
            return self._finish(timed_out)
        except BaseException:
            self.kill()
            raise

    def _finish(self, timed_out: str = "") -> Finished:
        if timed_out:
            _kill(self.proc)
        code = self.proc.wait()
        _running.pop(self.proc.pid, None)
        self.output.close()
        _check_stopped()
        return Finished(self.argv, code, time.monotonic() - self.began, list(self.output.tail), timed_out)

    def close(self, grace: float = 30.0) -> Finished:
        """End the child's input; it exits once it has read it (killed after `grace` seconds)."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except BrokenPipeError:
                    pass
            timed_out = self.output.follow(None, grace, None) if not self.output.ended else ""
            return self._finish(timed_out)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """Kill the child's process group now (nothing more is read from it)."""
        if self.proc.poll() is None:
            _kill(self.proc)
        _running.pop(self.proc.pid, None)
        if not self.output.stream.closed:
            self.output.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole process group (it may have children of its own) and reap it."""
    _kill_group(proc.pid)
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


# What llama.cpp aborts with when a device goes away (ggml/src/ggml-rpc/ggml-rpc.cpp, ggml-cuda):
# an RPC server that died or cannot be reached, a GPU out of memory.
DEVICE_LOST = re.compile(
    r"(?P<rpc>Remote RPC server crashed or returned malformed response"
    r"|Failed to connect to (?P<endpoint>\S+)|RPC handshake failed for (?P<handshake>\S+))"
    r"|(?P<oom>CUDA error: out of memory|cudaMalloc failed: out of memory|ErrorOutOfDeviceMemory"
    r"|failed to allocate \S+ buffer of size \d+)"
)
OUT_OF_MEMORY = "a device ran out of memory"
DEVICE_HINT = (
    "restart the ggml-rpc-server (or free the device's memory, or place less on it) and run the same "
    "command again: finished builds and cached measurements are kept"
)


def device_failure(lines: Sequence[str], servers: Sequence[str] = ()) -> str | None:
    """The device a failed child lost, in words, from llama.cpp's abort lines (`servers`: the RPC
    servers it was given, named when the abort names none); None for another failure."""
    found = [m for m in map(DEVICE_LOST.search, lines) if m is not None]
    if not found:
        return None
    named = next((m["endpoint"] or m["handshake"] for m in found if m["endpoint"] or m["handshake"]), None)
    if any(m["rpc"] for m in found):
        endpoint = named or ", ".join(servers)
        return f"the RPC server {endpoint} went away" if endpoint else "an RPC server went away (--rpc)"
    return f"{OUT_OF_MEMORY} ({found[-1]['oom']})"


def check(finished: Finished, what: str, hint: str, servers: Sequence[str] = ()) -> Finished:
    """Raise ToolFailed (one line: what, why, the last output) unless the child succeeded; a child
    that lost its device says which (`servers`: the RPC servers it was given) and how to go on."""
    if not finished.ok:
        lost = device_failure(finished.tail, servers)
        if lost is not None:
            raise ToolFailed(f"{what}: {lost}", DEVICE_HINT)
        raise ToolFailed(f"{what} {finished.describe_failure()}", hint)
    return finished


def run_checked(argv: Sequence[str | os.PathLike[str]], what: str, hint: str, **kwargs: object) -> Finished:
    """`run`, then `check`."""
    return check(run(argv, **kwargs), what, hint)  # type: ignore[arg-type]
