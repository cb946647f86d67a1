"""The child-task protocol (ggufcarve.llama.child), run end to end with a toy child task.

The toy child is a module written here, served by `child.serve`; what it does is chosen by its
request, so every expectation below is fixed by the toy's own code, not by the parent's.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ggufcarve.errors import BadInput, OutputError, ToolFailed
from ggufcarve.events import Event
from ggufcarve.llama import child, launch

TOY = """
import errno, os, sys
from dataclasses import asdict, dataclass
from typing import ClassVar
from ggufcarve.errors import BadInput, ToolFailed
from ggufcarve.llama import child

@dataclass(frozen=True)
class Toy:
    TASK: ClassVar[str] = "toy"
    action: str
    def to_json(self):
        return asdict(self)
    @classmethod
    def from_json(cls, doc):
        return cls(**doc)

SERVED = []

def work(request, out):
    print("llama_model_load: a log line", file=sys.stderr, flush=True)
    child.progress("step", 1, 2, "steps")
    action = request.action
    SERVED.append(action)
    if action == "served":
        out.write_text(f"{os.getpid()} {' '.join(SERVED)}")
        return
    if action == "refuse":
        raise BadInput("this input is refused", "give another one")
    if action == "fail":
        raise ToolFailed("llama.cpp could not load m.gguf", "check that m.gguf loads")
    if action == "full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))
    if action == "short":
        raise child.ShortOfSpace(out, 3 << 20, 1 << 20)
    if action == "abort":
        print("GGML_ASSERT(false) failed", file=sys.stderr, flush=True)
        os.abort()
    if action == "nothing":
        return
    child.progress("step", 2, 2, "steps")
    out.write_text(action)

if __name__ == "__main__":
    sys.exit(child.serve(Toy, work))
"""


@dataclass(frozen=True)
class Toy:
    TASK: ClassVar[str] = "toy"
    action: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Toy:
        return cls(**doc)


@pytest.fixture
def toy(tmp_path):
    """The toy child's module name and the environment that finds it."""
    (tmp_path / "toy_child.py").write_text(TOY)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)}
    return "toy_child", env


def run_toy(toy, tmp_path: Path, action: str, events: list[Event] | None = None, **kwargs: Any) -> str:
    module, env = toy
    return child.run(
        module,
        Toy(action),
        tmp_path / "result.txt",
        lambda p: p.read_text(),
        what="the toy child",
        hint="the parent's own hint",
        sink=(events.append if events is not None else lambda e: None),
        stages={"step": "toy steps"},
        env=env,
        timeout=120,
        **kwargs,
    )


def test_progress_lines_become_events_and_the_result_is_read(toy, tmp_path):
    events: list[Event] = []
    lines: list[str] = []
    assert run_toy(toy, tmp_path, "done", events, on_line=lines.append) == "done"
    assert events == [Event("toy steps", 1, 2, "steps"), Event("toy steps", 2, 2, "steps")]
    assert lines == ["llama_model_load: a log line"]  # protocol lines are not passed on


def test_a_child_started_ahead_is_adopted(toy, tmp_path):
    module, env = toy
    child.start(module, env=env)
    started = child._ahead[module]
    assert run_toy(toy, tmp_path, "ahead") == "ahead"
    assert module not in child._ahead and started.proc.returncode == 0
    # a child started ahead and given nothing exits 0
    assert launch.run(child.argv(module), input=b"", env=env, timeout=120).ok


def test_an_error_line_with_a_hint_is_bad_input(toy, tmp_path):
    with pytest.raises(BadInput) as refused:
        run_toy(toy, tmp_path, "refuse")
    assert refused.value.message == "this input is refused" and refused.value.hint == "give another one"


def test_a_failure_quotes_the_childs_own_last_lines(toy, tmp_path):
    with pytest.raises(ToolFailed) as failed:
        run_toy(toy, tmp_path, "fail")
    assert (
        failed.value.message
        == f"the toy child exited {child.EXIT_FAILED}: llama.cpp could not load m.gguf | llama_model_load: a log line"
    )
    assert failed.value.hint == "check that m.gguf loads"


def test_an_os_error_line_is_the_disk_full_error_of_the_file_shown(toy, tmp_path):
    final = tmp_path / "final.bin"
    with pytest.raises(OutputError) as full:
        run_toy(
            toy, tmp_path, "full", outputs={str(tmp_path / "result.txt"): (final, "choose another --cache directory")}
        )
    assert full.value.message == f"disk full while writing {final} ({os.strerror(errno.ENOSPC)})"
    assert "choose another --cache directory" in full.value.hint
    with pytest.raises(OutputError) as short:
        run_toy(toy, tmp_path, "short")
    assert (
        short.value.message == f"result.txt needs 3.0 MiB but {tmp_path} has 1.0 MiB free"
        and "nothing was written" in short.value.hint
    )


def test_a_child_that_dies_midway_is_named_by_its_last_lines(toy, tmp_path):
    events: list[Event] = []
    with pytest.raises(ToolFailed) as died:
        run_toy(toy, tmp_path, "abort", events)
    assert (
        died.value.message == f"the toy child killed by signal {signal.SIGABRT.name}: "
        "llama_model_load: a log line | GGML_ASSERT(false) failed"
    )
    assert died.value.hint == "the parent's own hint" and "@ggufcarve" not in died.value.message
    assert events == [Event("toy steps", 1, 2, "steps")]
    with pytest.raises(ToolFailed, match="the toy child exited 0 without writing its result"):
        run_toy(toy, tmp_path, "nothing")


def test_a_request_of_another_task_is_refused_by_the_child(toy, tmp_path):
    @dataclass(frozen=True)
    class Other(Toy):
        TASK: ClassVar[str] = "other"

    module, env = toy
    with pytest.raises(ToolFailed, match="exited 3: this child serves toy requests, not 'other'"):
        child.run(
            module,
            Other("done"),
            tmp_path / "result.txt",
            lambda p: p.read_text(),
            what="the toy child",
            hint="",
            env=env,
            timeout=120,
        )


def test_protocol_lines_read_back_and_other_lines_are_not_protocol():
    progress = child.Progress("decode", 3, 10, "tokens")
    error = child.ChildError(
        child.OS, "No space left on device", "", errno.ENOSPC, "No space left on device", "/x/y.npz"
    )
    assert child.parse(child.line(child.PROGRESS, progress)) == progress
    assert child.parse(child.line(child.ERROR, error)) == error
    for other in ("llama_model_load: loaded", "@ggufcarve progress not json", '@ggufcarve progress {"task": "x"}', ""):
        assert child.parse(other) is None
    assert sys.executable == child.argv("m")[0]


def test_a_session_serves_request_after_request_in_one_child(toy, tmp_path):
    module, env = toy
    session = child.Session(module, env=env)
    events: list[Event] = []
    answers = [
        session.run(
            Toy("served"),
            tmp_path / f"result-{n}.txt",
            lambda p: p.read_text(),
            what="the toy child",
            hint="",
            sink=events.append,
            stages={"step": "toy steps"},
            timeout=120,
        )
        for n in range(3)
    ]
    pids = {a.split()[0] for a in answers}
    assert len(pids) == 1 and answers[-1].split()[1:] == ["served"] * 3  # one process, its state kept
    assert events.count(Event("toy steps", 1, 2, "steps")) == 3
    proc = session.conversation.proc
    session.close()
    assert not session.alive and proc.returncode == 0


def test_a_failed_request_ends_its_session_with_the_childs_error(toy, tmp_path):
    module, env = toy
    session = child.Session(module, env=env)
    run = lambda action: session.run(
        Toy(action), tmp_path / "result.txt", lambda p: p.read_text(), what="the toy child", hint="h", timeout=120
    )
    assert run("done") == "done"
    with pytest.raises(ToolFailed, match=f"the toy child exited {child.EXIT_FAILED}: llama.cpp could not load"):
        run("fail")
    assert not session.alive
    with pytest.raises(ToolFailed, match="its child has ended"):
        run("done")
    aborted = child.Session(module, env=env)
    with pytest.raises(ToolFailed, match=f"killed by signal {signal.SIGABRT.name}: .*GGML_ASSERT"):
        aborted.run(
            Toy("abort"), tmp_path / "r.txt", lambda p: p.read_text(), what="the toy child", hint="", timeout=120
        )
    assert not aborted.alive and launch._running == {}
