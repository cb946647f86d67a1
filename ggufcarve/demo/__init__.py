"""The demo model and its texts, installed with the package (see data/MODEL.md).

DEMO_MODEL   a 16-expert, top-4 Qwen3-MoE (GGUF arch qwen3moe, Q8_0) trained on CPython's
             standard library
CALIBRATION  calibration text for expert selection: stdlib modules kept out of training
HELDOUT      held-out evaluation text: other stdlib modules kept out of training
"""

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
DEMO_MODEL = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
CALIBRATION = DATA / "calibration.txt"
HELDOUT = DATA / "heldout.txt"
LICENSE = DATA / "LICENSE-PSF.txt"
NOTES = DATA / "MODEL.md"
