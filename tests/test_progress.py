"""The session fixtures' progress reaches the terminal under pytest's default output capture."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from ggufcarve.events import Event
from progress import terminal_progress

@pytest.fixture(scope="session")
def built(request):
    sink = terminal_progress(request.config)
    sink(Event("compile", 3, 10, "steps", "llama-quantize"))
    return True
"""


def test_the_tool_build_progress_shows_without_dash_s(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text("def test_uses_the_build(built):\n    assert built\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown = proc.stdout + proc.stderr
    assert "building llama.cpp's tools" in shown, shown
    assert "toolchain: compile 3/10 steps llama-quantize" in shown, shown
