"""The one protocol of ggufcarve's Python child tasks (the decode pass, the evaluation), both sides.

A child task is a module run as `python -m MODULE [--preload M ...]` through the one launcher
(llama.cpp aborts the whole process on a failed assert, so its work runs in a child):
  * stdin: envelopes, one JSON line each, `{"task": T, "result": PATH, "request": {...}}`: the task
    the module serves, the one result file the child writes, and the typed request (a dataclass per
    task, `ChildRequest`); the child serves them in turn until its stdin ends (`run`: one envelope;
    a `Session`: one per call, the child and what it loaded kept between them); empty stdin (a child
    started ahead and never needed) exits 0 at once;
  * answered: after each envelope's result file is written, the line `@ggufcarve done {"result": PATH}`;
  * progress: lines `@ggufcarve progress {"task", "done", "total", "unit"}` (an `Event` in the parent);
  * where it computed: after each model it loads, `@ggufcarve computed {"task", "layers"}`, the
    devices llama.cpp's loader assigned the layers to (`llama.computed`, recorded in the parent);
  * errors: at most one line `@ggufcarve error {"kind", "message", "hint", ...}`, kind
      - "input": the child refuses its input (BadInput in the parent), exit EXIT_REFUSED;
      - "failed": the work failed (ToolFailed, with the child's last lines), exit EXIT_FAILED;
      - "os": a read or write failed, with "errno", "strerror", "filename" and, for a file that
        would not fit, "needed" and "free" bytes (OutputError: the one-line disk-full error),
        exit EXIT_OS_ERROR;
  * every other line is llama.cpp's log or Python's own (a traceback: exit 1);
  * the result file, written only on success.
`start` starts a child ahead, its imports done while the parent works; `run` adopts it. A child's
main ends with `exit_now(serve(...))`.

The libllama quantizer child (`llama.quantize_child`) is not a task of this protocol: it takes
llama-quantize's command line, so that the command a release records runs by hand, and its output
is parsed as the binary's is.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Protocol, TypeVar

from ggufcarve.errors import BadInput, CarveError, DeviceOutOfMemory, ToolFailed
from ggufcarve.events import Event, Sink, ignore
from ggufcarve.llama import launch
from ggufcarve.llama.computed import record
from ggufcarve.llama.devices import CPU, Compute

PREFIX = "@ggufcarve "
PROGRESS = "progress"
COMPUTED = "computed"
ERROR = "error"
DONE = "done"
EXIT_REFUSED, EXIT_FAILED, EXIT_OS_ERROR = 2, 3, 4
INPUT, FAILED, OS = "input", "failed", "os"  # ChildError.kind
QUOTED_LINES = 3  # the child's own last lines an error quotes

T = TypeVar("T")


class ChildRequest(Protocol):
    """The typed request of one task: a dataclass with its task name and a JSON form."""

    TASK: ClassVar[str]

    def to_json(self) -> dict[str, Any]: ...

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Progress:
    task: str
    done: int
    total: int
    unit: str


@dataclass(frozen=True)
class ComputedOn:
    task: str
    layers: dict[str, int]  # device -> layers llama.cpp assigned it


@dataclass(frozen=True)
class ChildError:
    kind: str  # INPUT, FAILED or OS
    message: str
    hint: str = ""
    errno: int | None = None
    strerror: str | None = None
    filename: str | None = None
    needed: int | None = None  # bytes a file needs, when it would not fit
    free: int | None = None  # bytes free where it was to be written


class ShortOfSpace(OSError):
    """Raised in a child before writing `path`: it needs `needed` bytes, its file system has `free`."""

    def __init__(self, path: str | Path, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, "No space left on device", str(path))
        self.needed, self.free = needed, free


@dataclass(frozen=True)
class Done:
    result: str  # the result file of the envelope just served


def line(kind: str, payload: Progress | ComputedOn | ChildError | Done) -> str:
    """One protocol line (no newline)."""
    fields = {k: v for k, v in asdict(payload).items() if v is not None}
    return f"{PREFIX}{kind} {json.dumps(fields, sort_keys=True)}"


def parse(text: str) -> Progress | ComputedOn | ChildError | Done | None:
    """The protocol line `text` carries, or None for any other line."""
    if not text.startswith(PREFIX):
        return None
    kind, _, payload = text[len(PREFIX) :].partition(" ")
    try:
        fields = json.loads(payload)
        if kind == PROGRESS:
            return Progress(str(fields["task"]), int(fields["done"]), int(fields["total"]), str(fields["unit"]))
        if kind == COMPUTED:
            return ComputedOn(str(fields["task"]), {str(k): int(v) for k, v in fields["layers"].items()})
        if kind == ERROR:
            return ChildError(**fields)
        if kind == DONE:
            return Done(str(fields["result"]))
    except (ValueError, KeyError, TypeError):
        return None
    return None


# ---------------------------------------------------------------------------------------------
# the child


def progress(task: str, done: int, total: int, unit: str) -> None:
    """Report progress to the parent."""
    _say(line(PROGRESS, Progress(task, done, total, unit)))


def computed(task: str, layers: dict[str, int]) -> None:
    """Tell the parent where the model just loaded computes (device -> layers)."""
    _say(line(COMPUTED, ComputedOn(task, layers)))


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def error_of(err: BaseException) -> tuple[ChildError, int] | None:
    """The error line and exit status an exception of the child's work becomes; None: not one the
    protocol carries (the child lets Python print its traceback)."""
    if isinstance(err, BadInput):
        return ChildError(INPUT, err.message, err.hint), EXIT_REFUSED
    if isinstance(err, CarveError):
        return ChildError(FAILED, err.message, err.hint), EXIT_FAILED
    if isinstance(err, OSError):
        needed, free = (err.needed, err.free) if isinstance(err, ShortOfSpace) else (None, None)
        return ChildError(
            OS,
            err.strerror or str(err),
            "",
            err.errno,
            err.strerror,
            None if err.filename is None else str(err.filename),
            needed,
            free,
        ), EXIT_OS_ERROR
    return None


def serve(
    request_type: type[ChildRequest], work: Callable[[Any, Path], None], argv: Sequence[str] | None = None
) -> int:
    """The child's main: import the `--preload` modules, read the envelope on stdin,
    run `work(request, result_path)`; its BadInput, other CarveError and OSError become the error
    line. Returns the exit status."""
    parser = argparse.ArgumentParser(description=f"Run one {request_type.TASK} request (a JSON envelope on stdin).")
    parser.add_argument(
        "--preload", action="append", default=[], help="a module to import before the request arrives (repeatable)"
    )
    args = parser.parse_args(argv)
    for module in args.preload:
        importlib.import_module(module)
    for text in sys.stdin:
        if not text.strip():
            continue
        status = _serve_one(request_type, work, text)
        if status:
            return status
    return 0


def _serve_one(request_type: type[ChildRequest], work: Callable[[Any, Path], None], text: str) -> int:
    envelope = json.loads(text)
    if envelope.get("task") != request_type.TASK:
        _say(
            line(
                ERROR,
                ChildError(
                    FAILED,
                    f"this child serves {request_type.TASK} requests, not {envelope.get('task')!r}",
                    "a ggufcarve bug: the parent started the wrong child",
                ),
            )
        )
        return EXIT_FAILED
    try:
        work(request_type.from_json(envelope["request"]), Path(envelope["result"]))
    except (CarveError, OSError) as err:
        reported = error_of(err)
        if reported is None:
            raise
        _say(line(ERROR, reported[0]))
        return reported[1]
    sys.stdout.flush()
    _say(line(DONE, Done(str(envelope["result"]))))
    return 0


def exit_now(status: int) -> NoReturn:
    """End the child with `status` once `serve` has returned: its output streams flushed, then
    `os._exit`, without the interpreter's teardown (module finalizers, numpy's and llama_cpp's
    objects freed one by one: about 30 ms of a decode child's exit, for which the parent waits).
    Nothing is left to do then: the result file is written and renamed, and the kernel closes
    the files and maps of a process that exits."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# ---------------------------------------------------------------------------------------------
# the parent

_ahead: dict[str, launch.Started] = {}  # module -> its child started ahead, not yet run


def argv(module: str, preload: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", module, *(arg for name in preload for arg in ("--preload", name))]


def start(module: str, preload: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
    """Start a child of `module` now, importing `preload`, unless one waits already; the next `run`
    of that module adopts it (its `env` was given here)."""
    if module not in _ahead:
        _ahead[module] = launch.start(argv(module, preload), env=env)


def adopt(module: str) -> launch.Started | None:
    """The child `start` started for `module`, still waiting for its request; None if there is none."""
    started = _ahead.pop(module, None)
    return started if started is not None and started.proc.poll() is None else None


def run(
    module: str,
    request: ChildRequest,
    result: Path,
    read: Callable[[Path], T],
    *,
    what: str,
    hint: str,
    sink: Sink = ignore,
    stages: Mapping[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    outputs: Mapping[str, tuple[Path, str]] | None = None,
    timeout: float | None = None,
    idle_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> T:
    """Run `request` in a child of `module` (the one `start` started, or a new one) and `read` its result file.

    Progress lines become events (stage: `stages[task]`, else the task's name) for `sink`; other
    lines go to `on_line`. `what` names the child in an error ("tracing m.gguf: the decode child"),
    `hint` is the hint when it fails without saying why. An error line raises BadInput, ToolFailed
    or OutputError; an OS error names the file by `outputs[filename]` = (the path to show, the
    other place the hint suggests), else by its own name and TMPDIR.
    """
    watch = _Watch(sink, stages or {}, on_line)
    finished = launch.run(
        argv(module),
        started=adopt(module),
        input=_envelope(request, result),
        on_line=watch,
        timeout=timeout,
        idle_timeout=idle_timeout,
        env=env,
    )
    return watch.result(finished, request, result, read, what, hint, outputs or {})


def _envelope(request: ChildRequest, result: Path) -> bytes:
    return (json.dumps({"task": request.TASK, "result": str(result), "request": request.to_json()}) + "\n").encode()


class _Watch:
    """A child's lines while it serves one envelope: progress becomes events, an error line is kept with the
    child's own lines before it, the rest goes to `on_line`."""

    def __init__(self, sink: Sink, stages: Mapping[str, str], on_line: Callable[[str], None] | None) -> None:
        self.sink, self.stages, self.on_line = sink, stages, on_line
        self.errors: list[tuple[ChildError, list[str]]] = []
        self.own: deque[str] = deque(maxlen=launch.TAIL_LINES)  # the child's lines, not the protocol's
        self.done = False

    def __call__(self, text: str) -> None:
        parsed = parse(text)
        if isinstance(parsed, Progress):
            self.sink(Event(self.stages.get(parsed.task, parsed.task), parsed.done, parsed.total, parsed.unit))
        elif isinstance(parsed, ComputedOn):
            record(parsed.layers, self.stages.get(parsed.task, parsed.task))
        elif isinstance(parsed, ChildError):
            self.errors.append((parsed, list(self.own)))
        elif isinstance(parsed, Done):
            self.done = True
        else:
            self.own.append(text)
            if self.on_line is not None:
                self.on_line(text)

    def answered(self, text: str) -> bool:
        """The line ends the envelope: its result is written, or the child said why not."""
        return text.startswith(PREFIX) and isinstance(parse(text), (Done, ChildError))

    def result(
        self,
        finished: launch.Finished | None,
        request: ChildRequest,
        result: Path,
        read: Callable[[Path], T],
        what: str,
        hint: str,
        outputs: Mapping[str, tuple[Path, str]],
    ) -> T:
        """The result file read, or the error the child's lines and its end (`finished`; None: still running) say."""
        if self.errors:
            error, before = self.errors[0]
            out_of_memory(request, before, what)
            raise _carve_error(error, before, finished or launch.Finished([], EXIT_FAILED, 0.0), what, hint, outputs)
        if finished is not None:
            if not finished.ok:  # llama.cpp logs a failed allocation it then recovers from (pipeline parallelism off)
                out_of_memory(request, list(self.own), what)
            launch.check(replace(finished, tail=list(self.own)), what, hint, placed(request)[1].rpc)
        if not result.exists():
            raise ToolFailed(f"{what} exited 0 without writing its result", "run again; GGUFCARVE_DEBUG=1 shows more")
        return read(result)


def placed(request: ChildRequest) -> tuple[str, Compute, int | None]:
    """What a request loads where: its model, its Compute (the memory child's in its settings) and its
    context (None where the request does not name one)."""
    settings = getattr(request, "settings", None)
    compute = getattr(request, "compute", None) or getattr(settings, "compute", None) or CPU
    batching = getattr(request, "batching", None)
    n_ctx = getattr(request, "n_ctx", None) or getattr(settings, "n_ctx", None) or getattr(batching, "ctx", None)
    return str(getattr(request, "model", "")), compute, n_ctx


RECOVERED = "retrying without pipeline parallelism"  # src/llama-context.cpp, after a failed compute buffer


def out_of_memory(request: ChildRequest, lines: Sequence[str], what: str) -> None:
    """Raise DeviceOutOfMemory where llama.cpp's lines say a device could not hold what the request
    placed on it (at load: "failed to allocate RPC0 buffer of size N"; later, a CUDA or Vulkan
    out-of-memory abort)."""
    lost = launch.device_failure(lines)
    if lost is None or not lost.startswith(launch.OUT_OF_MEMORY):
        return
    last = max(i for i, line in enumerate(lines) if launch.DEVICE_LOST.search(line))
    if any(RECOVERED in line for line in lines[last:]):  # llama_context retried without pipeline parallelism
        return
    model, compute, n_ctx = placed(request)
    raise DeviceOutOfMemory(f"{what}: {lost}", launch.DEVICE_HINT, model=model, compute=compute, n_ctx=n_ctx)


class Session:
    """One child of `module` serving request after request (the child keeps what it loaded between them: the
    measurement child its model). `close` ends it; a failed request ends it too."""

    def __init__(self, module: str, preload: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.module = module
        self.conversation: launch.Conversation | None = launch.Conversation(
            adopt(module) or launch.start(argv(module, preload), env=env)
        )

    @property
    def alive(self) -> bool:
        return self.conversation is not None

    def run(
        self,
        request: ChildRequest,
        result: Path,
        read: Callable[[Path], T],
        *,
        what: str,
        hint: str,
        sink: Sink = ignore,
        stages: Mapping[str, str] | None = None,
        outputs: Mapping[str, tuple[Path, str]] | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> T:
        """`request` served by this session's child, as `run` serves it in a child of its own."""
        if self.conversation is None:
            raise ToolFailed(f"{what}: its child has ended", "a ggufcarve bug: a closed session was asked again")
        watch = _Watch(sink, stages or {}, None)
        finished = self.conversation.exchange(
            _envelope(request, result), watch.answered, on_line=watch, timeout=timeout, idle_timeout=idle_timeout
        )
        if finished is None and watch.errors:  # the child exits after an error line: its status says how
            finished = self.conversation.close()
        if finished is not None:
            self.conversation = None
        return watch.result(finished, request, result, read, what, hint, outputs or {})

    def close(self) -> None:
        if self.conversation is not None:
            conversation, self.conversation = self.conversation, None
            conversation.close()

    def kill(self) -> None:
        if self.conversation is not None:
            conversation, self.conversation = self.conversation, None
            conversation.kill()


def _carve_error(
    error: ChildError,
    before: list[str],
    finished: launch.Finished,
    what: str,
    hint: str,
    outputs: Mapping[str, tuple[Path, str]],
) -> CarveError:
    if error.kind == INPUT:
        return BadInput(error.message, error.hint)
    if error.kind == OS:
        from ggufcarve.errors import OutputError
        from ggufcarve.fileio import write_failed

        shown, elsewhere = outputs.get(
            error.filename or "", (Path(error.filename or "."), "set TMPDIR to a directory with more room")
        )
        if error.needed is not None and error.free is not None:
            return OutputError(
                f"{shown.name} needs {error.needed / 2**20:.1f} MiB but "
                f"{shown.parent} has {error.free / 2**20:.1f} MiB free",
                f"free disk space or {elsewhere}; nothing was written",
            )
        return write_failed(OSError(error.errno, error.strerror or error.message), shown, elsewhere)
    last = " | ".join(text.strip() for text in before[-QUOTED_LINES:] if text.strip())
    return ToolFailed(
        f"{what} {replace(finished, tail=[]).describe_failure()}: {error.message}" + (f" | {last}" if last else ""),
        error.hint or hint,
    )
