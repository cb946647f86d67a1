"""`tune --stability`: each calibration criterion's keep-sets from each half of the calibration text, and
how much the two halves' keep-sets overlap per block: the calibration text cut in two, the overlap measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve.errors import BadInput


def split_text(path: Path) -> tuple[str, str]:
    """A calibration file's two halves: a JSONL file's records split in half by count; a text file
    split at the line break nearest its middle character."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix.lower() == ".jsonl":
        lines = [line for line in text.splitlines() if line.strip()]
        half = len(lines) // 2
        return "\n".join(lines[:half]) + "\n", "\n".join(lines[half:]) + "\n"
    middle = len(text) // 2
    before, after = text.rfind("\n", 0, middle), text.find("\n", middle)
    candidates = [i for i in (before, after) if 0 <= i < len(text) - 1]
    if not candidates:
        raise BadInput(
            f"{path}: one line only, no half to split off",
            "give calibration text of several lines, or leave out --stability",
        )
    cut = min(candidates, key=lambda i: abs(i - middle)) + 1
    return text[:cut], text[cut:]


def overlap(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, Any]:
    """Per block |A∩B|/|A| of two keep-sets (block -> kept expert ids), and its mean over blocks."""
    per_block = [len(set(a[blk]) & set(b[blk])) / len(a[blk]) for blk in sorted(a, key=int) if a[blk]]
    return {"overlap": float(np.mean(per_block)) if per_block else 1.0, "per_block": per_block}
