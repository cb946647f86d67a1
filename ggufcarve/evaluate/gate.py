"""The release gate: thresholds from a TOML file, and a PASS/FAIL verdict per model naming the failed criteria.

A gate file holds top-level keys (or the same keys under a `[gate]` table), each a number:

    max_ppl_increase_percent   PPL above the reference's, in %
    max_kld_mean, max_kld_p99, max_kld_p999, max_rms_dp
    min_same_top_p             fraction of tokens whose most likely token equals the reference's
    min_qa_passed              QA checks passed (count); min_qa_pass_rate the same as a fraction
    min_qa_exact_vs_reference  fraction of QA outputs identical to the reference's
    min_pp_tok_s, min_tg_tok_s prompt-processing and decode speed
    max_loop_share             share of loop prompts whose greedy continuation ends in a repeating
                               cycle (ggufcarve.evaluate.loops; eval --loops)
    max_loop_share_increase    that share minus the reference's (not measured without a GGUF reference)

A criterion whose measurement was not made (no QA suite, no speed run) is listed as not measured
and does not fail the gate.

With several held-out files each file (segment) is judged on its own by the criteria it measures
(PPL, KLD, Δp, same top p) beside the overall verdict. The key `segments` (a string) says what the
segments' verdicts do: "overall" (the default) reports them only; "every" fails a model when any
segment fails, its failed criteria named "FILE: criterion ...".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def _ppl_increase(m: dict) -> float | None:
    if m.get("ppl") is None or not m.get("ppl_reference"):
        return None
    return 100.0 * (m["ppl"] / m["ppl_reference"] - 1.0)


def _loop_increase(m: dict) -> float | None:
    if m.get("loop_share") is None or m.get("loop_share_reference") is None:
        return None
    return m["loop_share"] - m["loop_share_reference"]


def _qa_rate(m: dict) -> float | None:
    return m["qa_passed"] / m["qa_total"] if m.get("qa_total") else None


# key -> (the measurement it reads, "max" or "min" limit)
CRITERIA: dict[str, tuple[Callable[[dict], Any], str]] = {
    "max_ppl_increase_percent": (_ppl_increase, "max"),
    "max_kld_mean": (lambda m: m.get("kld_mean"), "max"),
    "max_kld_p99": (lambda m: m.get("kld_p99"), "max"),
    "max_kld_p999": (lambda m: m.get("kld_p999"), "max"),
    "max_rms_dp": (lambda m: m.get("rms_dp"), "max"),
    "min_same_top_p": (lambda m: m.get("same_top_p"), "min"),
    "min_qa_passed": (lambda m: m.get("qa_passed") if m.get("qa_total") else None, "min"),
    "min_qa_pass_rate": (_qa_rate, "min"),
    "min_qa_exact_vs_reference": (lambda m: m.get("qa_exact_vs_reference"), "min"),
    "min_pp_tok_s": (lambda m: m.get("pp_tok_s"), "min"),
    "min_tg_tok_s": (lambda m: m.get("tg_tok_s"), "min"),
    "max_loop_share": (lambda m: m.get("loop_share"), "max"),
    "max_loop_share_increase": (_loop_increase, "max"),
}


SEGMENT_MODES = ("overall", "every")  # the gate's `segments` key: what a failed segment does to the model's verdict


@dataclass(frozen=True)
class Gate:
    thresholds: dict[str, float]
    source: str  # the gate file's name
    segments: str = "overall"  # SEGMENT_MODES

    def judge(self, measurements: dict) -> Verdict:
        failed, passed, not_measured = [], [], []
        for key, limit in self.thresholds.items():
            measure, direction = CRITERIA[key]
            value = measure(measurements)
            if value is None:
                not_measured.append(key)
                continue
            if value <= limit if direction == "max" else value >= limit:
                passed.append(key)
            else:
                failed.append(f"{key[4:]} {value:.4g} {'>' if direction == 'max' else '<'} {limit:g}")
        return Verdict("FAIL" if failed else "PASS", failed, passed, not_measured)


@dataclass
class Verdict:
    verdict: str  # "PASS" or "FAIL"
    failed: list[str] = field(default_factory=list)  # "kld_mean 0.21 > 0.1"
    passed: list[str] = field(default_factory=list)  # criterion keys
    not_measured: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return self.verdict if not self.failed else f"FAIL ({'; '.join(self.failed)})"


def default_gate_path() -> Path:
    """The default gate shipped with the package: evaluation/gate.toml (ggufcarve/shipped.py)."""
    from ggufcarve.shipped import shipped

    return shipped("evaluation", "gate.toml")


def load_gate(path: Path) -> Gate:
    """Read a gate file; an unknown key, a non-number or unreadable TOML is one BadInput line."""
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise BadInput(
            f"{path}: cannot read the gate file ({err.strerror})", "give a TOML file like evaluation/gate.toml"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise BadInput(f"{path}: not valid TOML ({err})", "see evaluation/gate.toml") from None
    table = doc.get("gate", doc) if set(doc) <= {"gate"} else doc
    if not isinstance(table, dict):
        raise BadInput(f"{path}: [gate] must be a table", "see evaluation/gate.toml")
    thresholds: dict[str, float] = {}
    segments = table.get("segments", "overall")
    if segments not in SEGMENT_MODES:
        raise BadInput(
            f"{path}: gate key 'segments' must be one of {', '.join(SEGMENT_MODES)}, got {segments!r}",
            "every: a model fails when any held-out file fails",
        )
    for key, value in table.items():
        if key == "segments":
            continue
        if key not in CRITERIA:
            raise BadInput(f"{path}: unknown gate key '{key}'", f"known keys: {', '.join(CRITERIA)}, segments")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadInput(
                f"{path}: gate key '{key}' must be a number, got {value!r}", "for example max_kld_mean = 0.1"
            )
        thresholds[key] = float(value)
    return Gate(thresholds, Path(path).name, segments)
