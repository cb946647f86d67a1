"""The ggufcarve command line: the typer app, its command groups, and the error boundary.

Only the cli package prints. Each command module imports the library it needs inside its
commands, so `ggufcarve --version` and `--help` start without numpy, gguf or llama_cpp.

Examples:
    ggufcarve inspect model.gguf
    ggufcarve select model.gguf --method weights --keep 128 -o out/selection.json
    ggufcarve tune model.gguf --calibration cal.txt --heldout heldout.txt --keep 128 -o tune/
    ggufcarve prune model.gguf --keep kept_expert_indices.json -o out/model-128e.gguf
    ggufcarve imatrix remap model.imatrix.gguf --model out/model-128e.gguf -o out/model-128e.imatrix.gguf
    ggufcarve fit model.gguf --memory 24GiB --ctx 16384
    ggufcarve ladder run ladders/q8-to-iq1.toml --source out/model-128e.gguf --imatrix out/model-128e.imatrix.gguf \\
        -o release/
    ggufcarve release merge release/      # after ladder runs of single rungs from several hosts
    ggufcarve verify release/
    ggufcarve run plans/frequency-128.toml
    ggufcarve demo
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from ggufcarve import __version__
from ggufcarve.cli import (
    best,
    cache,
    devices,
    evaluate,
    fit,
    imatrix,
    ladder,
    prune,
    release,
    run,
    select,
    toolchain,
    tune,
    verify,
)
from ggufcarve.cli.options import PanelGroup, command_group
from ggufcarve.cli.render import print_error
from ggufcarve.errors import CarveError, DeviceOutOfMemory, Interrupted

HELP = "Cut routed experts out of Mixture-of-Experts GGUF files, byte for byte."


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ggufcarve {__version__}")
        raise typer.Exit()


def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """ggufcarve: expert pruning, imatrix remapping and quantization ladders for MoE GGUF models."""


def _command(function: Callable[..., None], panel: str, summary: str) -> Callable[[typer.Typer, str], None]:
    return lambda group, name: group.command(name, short_help=summary, rich_help_panel=panel)(function)


def _group(sub: typer.Typer, panel: str, summary: str) -> Callable[[typer.Typer, str], None]:
    return lambda group, name: group.add_typer(sub, name=name, short_help=summary, rich_help_panel=panel)


START, DECIDE, BUILD, CHECK, SET_UP = "Start here", "Decide", "Build", "Check and publish", "Set up"

# Every command and command group, in the order of `ggufcarve --help`, with the help panel it is
# listed under (panels in the order of their first command) and its one-line summary (at most 60
# characters: click cuts a longer one to the terminal's width).
COMMANDS: dict[str, Callable[[typer.Typer, str], None]] = {
    "demo": _command(run.demo_command, START, "The whole pipeline on the shipped demo MoE, in minutes."),
    "best": _command(best.best_command, START, "The best pruned or unpruned model for a memory budget."),
    "run": _command(run.run_command, START, "The whole pipeline of a plan file, resumable."),
    "fit": _command(fit.fit_command, DECIDE, "Which kept-expert count and rung fit a memory budget."),
    "tune": _command(tune.tune_command, DECIDE, "Score criteria and K by masking; write the winner."),
    "select": _command(select.select_command, DECIDE, "Choose the experts to keep per MoE block."),
    "score": _command(select.score_command, DECIDE, "Score every expert of every MoE block."),
    "prune": _command(prune.prune, BUILD, "Keep K experts per MoE block, byte for byte."),
    "topk": _command(prune.topk_command, BUILD, "A copy routed to N experts per token, byte for byte."),
    "imatrix": _group(imatrix.app, BUILD, "Collect, read, convert and remap importance matrices."),
    "ladder": _group(ladder.app, BUILD, "Quantize every rung of a ladder from one source."),
    "eval": _command(evaluate.eval_command, CHECK, "PPL, KLD, QA, speed and a gate against a reference."),
    "card": _command(evaluate.card_command, CHECK, "Write a release's model card (README.md)."),
    "verify": _command(verify.verify_command, CHECK, "Check a release directory before publishing it."),
    "release": _group(release.app, CHECK, "Assemble and merge release directories."),
    "check-prune": _command(prune.check_prune_command, CHECK, "Re-check a pruned file against its source."),
    "inspect": _command(prune.inspect, SET_UP, "Show the MoE layout a prune will touch."),
    "devices": _command(devices.devices_command, SET_UP, "The GPUs, RPC devices and memory llama.cpp sees."),
    "toolchain": _group(toolchain.app, SET_UP, "Find, probe and build the llama.cpp tools."),
    "cache": _group(cache.app, SET_UP, "Show and clear ggufcarve's caches."),
}


class TopLevelGroup(PanelGroup):
    order = tuple(COMMANDS)


def build_app(only: str | None = None) -> typer.Typer:
    """The typer app of every command, or of the command `only` alone: typer converts each
    registered command's signature when it runs, about 0.1 s for all of them."""
    group = command_group(HELP, TopLevelGroup)
    group.callback()(main_options)
    for name, register in COMMANDS.items():
        if only in (None, name):
            register(group, name)
    return group


app = build_app()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SIGNAL_NAMES = {
    signal.SIGINT: "Ctrl-C (SIGINT)",
    signal.SIGTERM: "SIGTERM",
    signal.SIGHUP: "SIGHUP (the terminal closed)",
}


def _stop(signum: int, _frame: object) -> None:
    """The handler of STOP_SIGNALS: llama.cpp children killed, then Interrupted raised in the main
    thread. Later signals are ignored while the run cleans up (bounded: threads stop within a
    fraction of a second, children are already killed)."""
    from ggufcarve.llama import launch

    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    if launch.stop_all(signum):
        raise Interrupted(signum)


_redelivering: list[threading.Event] = []  # one per delivering thread, set once Interrupted is raised
_reported: list[bool] = []  # the stop is being reported: a stop delivered again is dropped


def _ignore_late(signum: int, frame: FrameType | None) -> None:
    """The handler of a stop signal delivered after the stop was raised (a redelivery already queued)."""


def stopping() -> None:
    """The stop is raised and about to be reported: every redelivering thread ends and a stop still
    queued for the main thread lands in a handler that does nothing (a finalizer that ran while the
    first Interrupted unwound may have queued another)."""
    _reported.append(True)
    for delivered in _redelivering:
        delivered.set()
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _ignore_late)


def _stop_again(signum: int, frame: FrameType | None) -> None:
    """The handler of a stop signal delivered again: Interrupted raised, unless the signal landed
    inside _unraisable itself (then the delivering thread tries again)."""
    while frame is not None:
        if frame.f_code is _unraisable.__code__:
            return
        frame = frame.f_back
    for delivered in _redelivering:
        delivered.set()
    signal.signal(signum, signal.SIG_IGN)
    raise Interrupted(signum)


def _deliver_again(signum: int, delivered: threading.Event) -> None:
    while not delivered.wait(0.005):
        _thread.interrupt_main(signum)


def _unraisable(hook: object) -> None:
    """sys.unraisablehook: an Interrupted raised while Python ran a weakref callback or a __del__
    is printed and dropped by Python, and the run would go on with the stop signals ignored. It is
    delivered again instead, through the same signal, from a thread that repeats it until the main
    thread has raised it outside this hook."""
    stop = getattr(hook, "exc_value", None)
    if isinstance(stop, Interrupted) and _reported:
        return
    if isinstance(stop, Interrupted) and threading.current_thread() is threading.main_thread():
        _redelivering.append(threading.Event())
        signal.signal(stop.signum, _stop_again)
        threading.Thread(
            target=_deliver_again, args=(stop.signum, _redelivering[-1]), name="ggufcarve-stop", daemon=True
        ).start()
        return
    sys.__unraisablehook__(hook)


def install_stop_handlers() -> None:
    """STOP_SIGNALS raise Interrupted in the main thread, except a signal already ignored (nohup's
    SIGHUP, a background job's SIGINT)."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop)
    sys.unraisablehook = _unraisable


def _answered(error: DeviceOutOfMemory, argv: list[str]) -> CarveError:
    """placement.advice's answer to `error` with the command's --gpu-margin (llama.cpp's --fit margin
    when not given or not readable), its dry loads drawn as progress unless -q or --json was given."""
    from ggufcarve import settings as S
    from ggufcarve.cli.render import progress
    from ggufcarve.llama.devices import FIT_MARGIN
    from ggufcarve.placement.advice import fitting_answer

    margin = FIT_MARGIN
    for i, arg in enumerate(argv):
        text = arg.partition("=")[2] if arg.startswith(S.GPU_MARGIN.flag + "=") else None
        if arg == S.GPU_MARGIN.flag and i + 1 < len(argv):
            text = argv[i + 1]
        if text is not None:
            try:
                margin = S.GPU_MARGIN.parse_text(text)
            except CarveError:
                pass
    quiet = any(arg in ("-q", "--quiet", "--json") for arg in argv)
    with progress(not quiet, transient=True) as sink:
        return fitting_answer(error, margin, sink)


def main() -> None:
    debug = os.environ.get("GGUFCARVE_DEBUG") == "1"
    install_stop_handlers()
    invoked = sys.argv[1] if len(sys.argv) > 1 else None
    try:
        (build_app(invoked) if invoked in COMMANDS else app)()
    except Interrupted as stop:
        stopping()
        if debug:
            raise
        print_error(
            f"stopped by {SIGNAL_NAMES.get(stop.signum, signal.Signals(stop.signum).name)}: "
            "temp files removed, any llama.cpp child killed",
            "run the same command again; finished outputs are kept, nothing half-written was left behind",
        )
        sys.exit(stop.exit_code)
    except CarveError as error:
        if debug:
            raise
        if isinstance(error, DeviceOutOfMemory):  # answered with the placement that fits the devices
            error = _answered(error, sys.argv[2:])
        print_error(error.message, error.hint)
        sys.exit(error.exit_code)
    except OSError as error:  # a file vanished, a permission or the disk failed outside the checked paths
        if debug:
            raise
        from ggufcarve.fileio import DISK_FULL, disk_full_error

        if error.errno in DISK_FULL:
            full = disk_full_error(
                Path(error.filename) if error.filename else Path("an output"), error.strerror or str(error)
            )
            print_error(full.message, full.hint)
            sys.exit(full.exit_code)
        where = f"{error.filename}: " if error.filename else ""
        print_error(
            f"{where}{error.strerror or error}",
            "check the path, its permissions and the free disk space, then run again (GGUFCARVE_DEBUG=1 shows where)",
        )
        sys.exit(1)
    except Exception as error:  # a defect of ggufcarve: one line, the traceback only on request
        if debug:
            raise
        text = " ".join(str(error).split())
        print_error(
            f"internal error: {type(error).__name__}" + (f": {text}" if text else ""),
            "set GGUFCARVE_DEBUG=1 for the traceback",
        )
        sys.exit(1)
