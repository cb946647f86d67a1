"""The calibration child, started ahead: its interpreter start and imports (numpy, gguf-py,
llama_cpp: about half a second) overlap the parent's own start, model read and checks.

A command that will calibrate calls `prestart()` first thing; `run_calibration` adopts the child
(`adopt()`) and writes its request to the child's stdin. A child that is never adopted reads
end-of-file when the parent exits, and exits. This module imports nothing heavy.
"""

from __future__ import annotations

import sys

from ggufcarve.llama import launch

TRACE_METHODS = ("frequency", "ean", "reap", "razor")
CHILD_ARGV = (sys.executable, "-m", "ggufcarve.select.calibrate", "--request", "-")
# numpy's matrix products (RAZOR's refill experts) run beside llama.cpp's own threads: a BLAS
# thread pool on top oversubscribes the cores (measured: 30x slower products on 2 cores).
SINGLE_THREADED_BLAS = {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_ahead: list[launch.Started] = []


def prestart() -> None:
    """Start the calibration child now, unless one waits already."""
    if not _ahead:
        _ahead.append(launch.start(CHILD_ARGV, env=SINGLE_THREADED_BLAS))


def adopt() -> launch.Started | None:
    """The child `prestart` started, still waiting for its request; None if there is none."""
    while _ahead:
        started = _ahead.pop()
        if started.proc.poll() is None:
            return started
    return None
