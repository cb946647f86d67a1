"""Test helpers: run the ggufcarve command line the way a user does (a child process: exit code,
stdout, stderr), hash files, read a tensor's bytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    @property
    def error_line(self) -> str:
        """The last non-empty stderr line (where the one-line error goes)."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def ggufcarve(*args: object, preexec_fn=None, cwd: Path | None = None) -> CliResult:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.run(
        [sys.executable, "-m", "ggufcarve", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
        cwd=cwd,
        timeout=600,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tensor_bytes(path: Path, name: str) -> bytes:
    """The data of tensor `name` of a GGUF file or split set (first shard)."""
    from ggufcarve.gguf.container import read_model

    model = read_model(path)
    shard, info = model.tensor_index[name]
    start, end = model.shards[shard].data_range(info)
    with open(model.shards[shard].path, "rb") as f:
        f.seek(start)
        return f.read(end - start)
