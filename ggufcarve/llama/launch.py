"""The one launcher of llama.cpp children (tools, libllama child tasks) and of the build's subprocesses.

Every child runs with:
  * `GGML_NO_BACKTRACE=1`: on an abort (GGML_ASSERT, uncaught exception) ggml otherwise forks
    gdb to attach to the dying process; gdb inherits the output pipe and can hang for minutes;
  * `LLAMA_ARG_REPACK=0` (the environment form of the tools' `--no-repack`, read by every tool
    built on llama.cpp's common arguments): weight repacking and the extra CPU buffer types (AMX)
    are off; on CPUs with AMX llama.cpp 0.3.36 crashes in
    `ggml_backend_amx_mul_mat` for small models otherwise (libllama child tasks load models with
    `use_extra_bufts = False` for the same reason);
  * stdin closed, stdout and stderr merged and streamed line by line to `on_line`;
  * an overall timeout and an idle watchdog (no output for `idle_timeout` seconds);
  * its own process group, killed and reaped on any exception, Ctrl-C included.
The last lines of output are kept for the error message.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ggufcarve.errors import ToolFailed, ToolMissing

TAIL_LINES = 40
CHILD_ENV = {
    "GGML_NO_BACKTRACE": "1",
    "LLAMA_ARG_REPACK": "0",
}


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
        elif self.returncode < 0:
            why = f"killed by signal {signal.Signals(-self.returncode).name if -self.returncode in signal.valid_signals() else -self.returncode}"
        else:
            why = f"exited {self.returncode}"
        last = " | ".join(line.strip() for line in self.tail[-3:] if line.strip())
        return f"{why}" + (f": {last}" if last else "")


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
    idle_timeout: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    tail_lines: int = TAIL_LINES,
) -> Finished:
    """Run a child to completion; never raises for its exit status (see `check`).

    Raises ToolMissing when the program cannot be started. On any exception in the caller's
    `on_line` (or KeyboardInterrupt) the child's process group is killed and reaped first.
    """
    args = [os.fspath(a) for a in argv]
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=cwd, env=child_env(env), start_new_session=True,
        )
    except OSError as err:
        raise ToolMissing(f"cannot run {Path(args[0]).name}: {err.strerror or err}", "check the path (ggufcarve toolchain show)") from None
    tail: deque[str] = deque(maxlen=tail_lines)
    timed_out = ""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    pending = b""
    last_output = started
    try:
        while True:
            now = time.monotonic()
            waits = [1.0]
            if timeout is not None:
                waits.append(started + timeout - now)
            if idle_timeout is not None:
                waits.append(last_output + idle_timeout - now)
            events = selector.select(max(0.0, min(waits)))
            now = time.monotonic()
            if events:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                last_output = now
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", errors="replace").rstrip("\r")
                    tail.append(line)
                    if on_line is not None:
                        on_line(line)
            if timeout is not None and now - started > timeout:
                timed_out = "timeout"
                break
            if idle_timeout is not None and now - last_output > idle_timeout:
                timed_out = "idle"
                break
        if pending:
            line = pending.decode("utf-8", errors="replace").rstrip("\r")
            tail.append(line)
            if on_line is not None:
                on_line(line)
        if timed_out:
            _kill(proc)
        code = proc.wait()
    except BaseException:
        _kill(proc)
        raise
    finally:
        selector.close()
        proc.stdout.close()
    return Finished(args, code, time.monotonic() - started, list(tail), timed_out)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole process group (it may have children of its own) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


def check(finished: Finished, what: str, hint: str) -> Finished:
    """Raise ToolFailed (one line: what, why, the last output) unless the child succeeded."""
    if not finished.ok:
        raise ToolFailed(f"{what} {finished.describe_failure()}", hint)
    return finished


def run_checked(argv: Sequence[str | os.PathLike[str]], what: str, hint: str, **kwargs: object) -> Finished:
    """`run`, then `check`."""
    return check(run(argv, **kwargs), what, hint)  # type: ignore[arg-type]
