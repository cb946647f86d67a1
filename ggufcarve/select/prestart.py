"""The calibration child, started ahead: its interpreter start and imports (numpy, gguf-py,
llama_cpp and the consumers' modules: about half a second) overlap the parent's own start, model
read and checks.

A command that will calibrate calls `prestart()` first thing; the decode pass
(`ggufcarve.llama.decode.decode`) adopts the child and writes its request to the child's stdin. A
child that is never adopted reads end-of-file when the parent exits, and exits. This module
imports nothing heavy.
"""

from __future__ import annotations

from ggufcarve.llama import decode

TRACE_METHODS = ("frequency", "ean", "ean-sum", "msan", "mone", "reap", "razor", "greedy")
# the modules of the calibration's consumers (select.from_trace.statistics, select.greedy.greedy,
# imatrix.collect.accumulator)
CONSUMER_MODULES = ("ggufcarve.select.from_trace", "ggufcarve.select.greedy", "ggufcarve.imatrix.collect")


def prestart() -> None:
    """Start the calibration child now, unless one waits already."""
    decode.prestart(CONSUMER_MODULES)
