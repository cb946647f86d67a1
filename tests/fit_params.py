"""Test helper: llama-fit-params' own per-device figures for a placement (the oracle of memory per device)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ggufcarve.llama.memory import HOST


def fit_params(tool: Path, model: Path, args: list[str]) -> dict[str, tuple[int, int, int]]:
    """llama-fit-params -m MODEL ARGS --fit-print on: device -> (model, context, compute) in MiB
    ("Host" named HOST, as ggufcarve names system memory)."""
    from ggufcarve.llama.launch import child_env

    run = subprocess.run(
        [str(tool), "-m", str(model), *args, "--fit-print", "on"],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {
        m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in re.finditer(r"^(\S+) (\d+) (\d+) (\d+) *$", run.stdout, re.M)
    }
    assert rows, run.stdout[-2000:]
    return {HOST if name == "Host" else name: figures for name, figures in rows.items()}
