"""The command line starts light: `--version` before typer, `--help` without the heavy libraries."""

import json
import subprocess
import sys

from typer.testing import CliRunner

from ggufcarve import __version__
from ggufcarve.cli import app

HEAVY = ("numpy", "gguf", "llama_cpp", "xxhash")

PROBE = """
import json, sys
sys.argv = ["ggufcarve", *{argv!r}]
from ggufcarve.console import main
try:
    main()
except SystemExit:
    pass
print("\\nLOADED " + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {names!r})))
"""


def loaded_after(argv: list[str], names: tuple[str, ...]) -> tuple[str, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv, names=set(names))],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    head, _, loaded = proc.stdout.rpartition("\nLOADED ")
    return head, json.loads(loaded)


def test_version_is_answered_before_the_command_line_is_imported():
    printed, loaded = loaded_after(["--version"], (*HEAVY, "typer", "rich", "click"))
    assert printed.strip() == f"ggufcarve {__version__}"
    assert loaded == []


def test_the_command_line_says_the_same_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"ggufcarve {__version__}"


def test_help_of_every_group_imports_no_heavy_library():
    for argv in (
        ["--help"],
        ["verify", "--help"],
        ["ladder", "run", "--help"],
        ["eval", "--help"],
        ["select", "--help"],
    ):
        printed, loaded = loaded_after(argv, HEAVY)
        assert "Usage" in printed and loaded == [], (argv, loaded)


def test_a_command_run_alone_is_the_command_of_the_full_app():
    """`main` builds the app of the invoked command only; its help (options, arguments) is the same."""
    from ggufcarve.cli import COMMANDS, build_app

    runner = CliRunner()
    for name in COMMANDS:
        alone, full = runner.invoke(build_app(name), [name, "--help"]), runner.invoke(app, [name, "--help"])
        assert alone.exit_code == full.exit_code == 0 and alone.output == full.output, name


def _help_panels(output: str) -> dict[str, dict[str, str]]:
    """The command sections of a help text (every section but Usage, Arguments and Options):
    panel -> {name: summary}, in the order printed."""
    panels: dict[str, dict[str, str]] = {}
    inside: dict[str, str] | None = None
    for line in output.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            inside = None if line[:-1] in ("Usage", "Arguments", "Options") else panels.setdefault(line[:-1], {})
        elif inside is not None and line.startswith("  ") and line.strip():
            name, _, summary = line.strip().partition(" ")
            inside[name] = summary.strip()
    return panels


def _listed_commands(output: str) -> dict[str, str]:
    """Every command a help text lists, under any panel: name -> summary."""
    return {name: summary for panel in _help_panels(output).values() for name, summary in panel.items()}


def test_help_groups_the_commands_by_task():
    result = CliRunner().invoke(app, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    panels = {panel: list(commands) for panel, commands in _help_panels(result.output).items()}
    assert panels == {
        "Start here": ["demo", "best", "run"],
        "Decide": ["fit", "tune", "select", "score"],
        "Build": ["prune", "topk", "imatrix", "ladder"],
        "Check and publish": ["eval", "card", "verify", "release", "check-prune"],
        "Set up": ["inspect", "devices", "toolchain", "cache"],
    }
    assert list(panels) == ["Start here", "Decide", "Build", "Check and publish", "Set up"]
    assert list(_help_panels(CliRunner().invoke(app, ["ladder", "--help"]).output)) == ["Commands"]


def test_every_summary_in_help_is_whole_and_h_is_help():
    """click cuts a summary longer than the terminal allows with '...'; every one fits 80 columns."""
    from ggufcarve.cli import COMMANDS

    runner = CliRunner()
    top = runner.invoke(app, ["-h"], terminal_width=80)
    assert top.exit_code == 0
    listed = _listed_commands(top.output)
    assert set(listed) == set(COMMANDS)
    for group in ("imatrix", "toolchain", "ladder", "release"):
        sub = runner.invoke(app, [group, "-h"], terminal_width=80)
        assert sub.exit_code == 0, group
        commands = _listed_commands(sub.output)
        assert commands, group
        listed.update({f"{group} {name}": summary for name, summary in commands.items()})
    for name, summary in listed.items():
        assert summary and not summary.endswith("..."), (name, summary)
    assert runner.invoke(app, ["verify", "-h"]).output == runner.invoke(app, ["verify", "--help"]).output


def test_the_calibration_child_starts_before_the_command_line_only_for_a_calibrating_command(monkeypatch):
    from ggufcarve.select import prestart

    started = []
    monkeypatch.setattr(prestart, "prestart", lambda: started.append(True))
    cases = {
        ("score", "m.gguf", "--method", "reap", "--calibration", "c.txt", "-o", "s.json"): True,
        ("select", "m.gguf", "-m", "razor", "--calibration=c.txt", "--keep", "4"): True,
        ("select", "m.gguf", "--method=frequency", "--calibration", "c.txt"): True,
        ("score", "m.gguf", "--method", "weights", "--calibration", "c.txt"): False,
        ("score", "m.gguf", "--method", "reap"): False,
        ("score", "m.gguf", "--method", "reap", "--calibration", "c.txt", "--help"): False,
        ("eval", "m.gguf", "--method", "reap", "--calibration", "c.txt"): False,
        (): False,
    }
    for argv, expected in cases.items():
        started.clear()
        prestart.prestart_for_command_line(list(argv))
        assert started == ([True] if expected else []), argv


BINDINGS_PROBE = """
import json, sys
from ggufcarve.llama.libllama import bindings
low = bindings()
light = sorted(m for m in sys.modules if m.split(".")[0] in ("llama_cpp", "jinja2"))
import llama_cpp
from llama_cpp import _ggml, llama_backend_init
low_again = bindings() is low and llama_backend_init is low.llama_backend_init and _ggml.libggml is not None
still_light = "llama_cpp.llama" not in sys.modules
from llama_cpp import Llama
print(json.dumps({"light": light, "low_again": low_again, "still_light": still_light, "version": llama_cpp.__version__,
                  "llama": Llama.__module__, "same": llama_cpp.llama_backend_init is low.llama_backend_init}))
"""


def test_the_low_level_bindings_load_without_the_high_level_api_which_still_loads_when_asked():
    """`bindings()` gives llama_cpp.llama_cpp without llama_cpp.llama (jinja2, the chat formats);
    submodules and the low-level names come without it, and `from llama_cpp import Llama` then
    runs the package's own __init__: the package is whole for any other caller."""
    import importlib.metadata

    proc = subprocess.run(
        [sys.executable, "-c", BINDINGS_PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "llama_cpp.llama_cpp" in seen["light"] and "llama_cpp.llama" not in seen["light"], seen["light"]
    assert not any(m.startswith("jinja2") for m in seen["light"]), seen["light"]
    assert seen["low_again"] and seen["still_light"] and seen["same"]
    assert seen["version"] == importlib.metadata.version("llama_cpp_python")
    assert seen["llama"] == "llama_cpp.llama"


def test_a_decode_child_started_ahead_has_its_imports_done_without_the_high_level_api():
    """What the calibration child imports before its request: the consumers' modules and the
    low-level bindings, not llama_cpp.llama."""
    probe = (
        "import json, sys, runpy\n"
        "sys.argv = ['decode', '--preload', 'ggufcarve.select.from_trace', '--preload', 'ggufcarve.imatrix.collect']\n"
        "import ggufcarve.llama.child as child\n"
        "child.exit_now = lambda status: print(json.dumps([status, sorted(m for m in sys.modules "
        "if m.startswith(('llama_cpp', 'ggufcarve.select', 'ggufcarve.imatrix')))]))\n"
        "runpy.run_module('ggufcarve.llama.decode', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True, stdin=subprocess.DEVNULL
    )
    status, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status == 0
    assert {"llama_cpp.llama_cpp", "ggufcarve.select.from_trace", "ggufcarve.imatrix.collect"} <= set(loaded)
    assert "llama_cpp.llama" not in loaded, loaded
