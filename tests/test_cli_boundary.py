"""The command line's error boundary: every exception that reaches it is one line on stderr."""

from __future__ import annotations

import json
import sys

import pytest
from clirun import ggufcarve


def test_a_manifest_whose_rung_is_a_list_is_one_line(tmp_path):
    (tmp_path / "quant-manifest.json").write_text(
        json.dumps({"rungs": [["Q8_0", "m-Q8_0.gguf"]], "source": {"name": "m.gguf"}})
    )
    result = ggufcarve("card", tmp_path)
    assert result.code == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [result.error_line]
    assert "quant-manifest.json: rungs[0] is not a rung record" in result.error_line


def _card_raising(monkeypatch, tmp_path, error: Exception, debug: str):
    """`ggufcarve card` in this process, its gather() raising `error`."""
    from ggufcarve import cli
    from ggufcarve.release import card

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli, "install_stop_handlers", lambda: None)  # this process keeps its own handlers
    monkeypatch.setattr(card, "gather", broken)
    monkeypatch.setattr(sys, "argv", ["ggufcarve", "card", str(tmp_path)])
    monkeypatch.setenv("GGUFCARVE_DEBUG", debug)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "300")


def test_an_unexpected_exception_is_one_internal_error_line(monkeypatch, capsys, tmp_path):
    from ggufcarve import cli

    _card_raising(monkeypatch, tmp_path, KeyError("rungs"), "0")
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: internal error: KeyError: 'rungs' (hint: set GGUFCARVE_DEBUG=1 for the traceback)"
    ]


def test_ggufcarve_debug_shows_the_traceback(monkeypatch, tmp_path):
    from ggufcarve import cli

    _card_raising(monkeypatch, tmp_path, KeyError("rungs"), "1")
    with pytest.raises(KeyError):
        cli.main()


def test_a_broken_installation_is_one_line(monkeypatch, capsys):
    from ggufcarve import console

    monkeypatch.setitem(sys.modules, "ggufcarve.cli", None)  # its import fails as a missing dependency's would
    monkeypatch.setattr(sys, "argv", ["ggufcarve", "inspect", "m.gguf"])
    monkeypatch.delenv("GGUFCARVE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stopped:
        console.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        stopped.value.code == 1
        and len(lines) == 1
        and lines[0].startswith("error: internal error: ModuleNotFoundError: ")
    ), lines


def test_output_that_is_not_a_terminal_keeps_each_line_whole(tmp_path):
    """Piped or logged (no terminal, no COLUMNS): no line is wrapped mid-value and no table cell is cut."""
    import os
    import subprocess
    import sys

    from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ggufcarve",
            "best",
            str(DEMO_MODEL),
            "--memory",
            "64MiB",
            "--ctx",
            "256",
            "--heldout",
            str(HELDOUT),
            "--calibration",
            str(CALIBRATION),
            "-o",
            str(tmp_path / "b"),
            "--dry-run",
            "-q",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("  K", "  unpruned-"))]
    assert rows and all("file " in line and "total " in line for line in rows), proc.stdout
    assert any(
        len(line) > 100 for line in proc.stdout.splitlines()
    )  # wider than the 80 columns rich assumes without a terminal


def test_a_command_line_to_paste_stays_one_line_in_a_narrow_terminal():
    """At 40 columns (COLUMNS set: rich wraps text there) a printed run line keeps its arguments on one
    line, shell-quoted, so that a copy of it runs."""
    import os
    import shlex
    import subprocess
    import sys

    argv = ["llama-server", "-m", "a model with spaces.gguf", "-c", "16384", "-ngl", "99", "--override-kv",
            "qwen3moe.expert_used_count=int:6"]  # fmt: skip
    code = f"from ggufcarve.cli.render import print_command; print_command('run it', {argv!r}, ' (here)')"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "COLUMNS": "40"}, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line == f"run it: {shlex.join(argv)} (here)" and shlex.split(line[len("run it: ") : -len(" (here)")]) == argv
