"""The files ggufcarve ships beside its code: `ladders/` (ladder specs) and `evaluation/` (the
default gate, the QA suite).

In a source tree (and an editable install) they are the tree's top-level directories; a wheel
installs them as data files under `<prefix>/share/ggufcarve/` (pyproject.toml,
`[tool.setuptools.data-files]`).
"""

from __future__ import annotations

import sys
from pathlib import Path


def shipped(*parts: str) -> Path:
    """The shipped file or directory `parts` (e.g. "evaluation", "gate.toml"): the source tree's
    when it exists, else the installed data file's; the source tree's path when neither exists."""
    tree = Path(__file__).resolve().parents[1].joinpath(*parts)
    if tree.exists():
        return tree
    installed = Path(sys.prefix, "share", "ggufcarve", *parts)
    return installed if installed.exists() else tree
