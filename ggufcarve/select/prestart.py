"""The calibration child, started ahead: its interpreter start and imports (numpy, gguf-py,
llama-cpp-python's low-level bindings and the consumers' modules: about 0.15 s) overlap the
parent's own start, model read and checks.

A command that will calibrate calls `prestart()` first thing (the console script calls
`prestart_for_command_line` before it imports the command line, so the child's start runs beside
typer's and rich's imports too); the decode pass
(`ggufcarve.llama.decode.decode`) adopts the child and writes its request to the child's stdin. A
child that is never adopted reads end-of-file when the parent exits, and exits. This module
imports nothing heavy.
"""

from __future__ import annotations

from ggufcarve.select.criteria import TRACE_METHODS

# the modules of the calibration's consumers (select.from_trace.statistics, select.greedy.greedy,
# imatrix.collect.accumulator)
CONSUMER_MODULES = ("ggufcarve.select.from_trace", "ggufcarve.select.greedy", "ggufcarve.imatrix.collect")


def prestart() -> None:
    """Start the calibration child now, unless one waits already."""
    from ggufcarve.llama import decode

    decode.prestart(CONSUMER_MODULES)


CALIBRATING_COMMANDS = ("score", "select")


def _option(argv: list[str], *names: str) -> str | None:
    """The value of the last `--name VALUE` / `--name=VALUE` / `-m VALUE` among `names` in `argv`."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif name.startswith("--") and arg.startswith(name + "="):
                value = arg[len(name) + 1 :]
    return value


def prestart_for_command_line(argv: list[str]) -> None:
    """Start the calibration child at once for a `score` or `select` command line that names a
    trace method and calibration files (as the command itself would, later); anything else, help
    included, starts nothing. The command's own `prestart()` adopts no second child: one waits."""
    if not argv or argv[0] not in CALIBRATING_COMMANDS or "--help" in argv or "-h" in argv:
        return
    if _option(argv, "--method", "-m") in TRACE_METHODS and _option(argv, "--calibration") is not None:
        prestart()
