"""Progress of the session fixtures' long steps (the llama.cpp tool build) on pytest's terminal."""

from __future__ import annotations

import contextlib
import time

BUILD_NOTICE = (
    "building llama.cpp's tools (llama-quantize, llama-imatrix, llama-perplexity, ...) from the llama-cpp-python sdist "
    "once: 10-14 min on 2 cores; later runs use the cache (`ggufcarve toolchain build` does the same ahead)"
)


def terminal_progress(config):
    """A sink that shows the tool build on the terminal past pytest's capture: a stage line when it
    changes, then at most one line per 30 s, so the first run does not sit silent for minutes."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    shown = {"stage": None, "at": 0.0}

    def write(line: str) -> None:
        # pytest captures fds 1 and 2 while a fixture runs; the reporter writes to fd 1.
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(line)
            reporter.flush()

    if reporter is not None:
        write(BUILD_NOTICE)

    def sink(event) -> None:
        now = time.monotonic()
        if reporter is None or (event.stage == shown["stage"] and now - shown["at"] < 30):
            return
        shown.update(stage=event.stage, at=now)
        amount = f" {event.done}/{event.total} {event.unit}" if event.total else ""
        write(f"  toolchain: {event.stage}{amount} {event.message}".rstrip())

    return sink
