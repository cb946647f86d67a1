"""The plan `ggufcarve demo` runs: the trained demo MoE shipped in ggufcarve/demo/data, a short
tournament (`[selection] method = "tune"`: five criteria from one pass over the calibration text,
each keeping 8 of 16 experts, scored by masking on 4 chunks of the held-out text) whose winner is
carved, the full model's imatrix collected from the calibration text, the six-rung demo ladder
through the embedded llama.cpp (no compiled tools), and an evaluation of every rung and of two
quants of the unpruned model against the unpruned model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ggufcarve.pipeline.plan import RunPlan, parse_plan
from ggufcarve.select.criteria import subset

FILES = Path(__file__).resolve().parent / "demo_files"
PLAN_NAME = "plan.toml"
TOURNAMENT = subset("reap", "frequency", "ean-sum", "weights", "random")


def demo_document(directory: Path) -> dict[str, Any]:
    from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT

    directory = directory.resolve()
    return {
        "source": str(DEMO_MODEL),
        "output": str(directory / "release"),
        "work": str(directory / "work"),
        "name": "demo-tune-8e",
        # the tournament's held-out text is the evaluation's (its first 4 chunks of the 16 evaluated)
        "selection": {"method": "tune", "methods": list(TOURNAMENT), "keep": [8], "chunks": 4},
        "calibration": {"files": [str(CALIBRATION)], "ctx": 256, "max_tokens": 4096},
        "imatrix": {"collect": True},
        "ladder": {"spec": str(FILES / "ladder.toml"), "quantizer": "libllama"},
        "evaluation": {
            "heldout": str(HELDOUT),
            "ctx": 256,
            "chunks": 16,
            "gate": str(FILES / "gate.toml"),
            "speed_runs": 3,
            "speed_engine": "libllama",
            "unpruned": ["Q4_K_M", "Q2_K"],
        },
        # trained from scratch by this project (no base model), released under its license
        "card": {"license": "mit", "model_name": "ggufcarve demo MoE (16x256, top-4, 4 layers)"},
    }


def demo_plan(directory: Path) -> RunPlan:
    return parse_plan(demo_document(directory), directory.resolve())


def write_demo_plan(directory: Path) -> Path:
    """DIRECTORY/plan.toml: the demo's plan as a file `ggufcarve run` takes (a starting point for your own)."""
    from ggufcarve.fileio import write_text_atomic
    from ggufcarve.pipeline.plan import plan_text

    text = plan_text(
        demo_document(directory), "The plan of `ggufcarve demo`; run it again with `ggufcarve run` on this file."
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PLAN_NAME
    write_text_atomic(path, text)
    return path
