"""--cross-check: llama-perplexity on the same text and context, its figures beside ggufcarve's.

With a GGUF reference, llama-perplexity first writes its own `--kl-divergence-base` file from the
reference (`-f TEXT -c CTX [--chunks N]`); each model then runs in its PPL mode (`-f TEXT`, the
`Final estimate` line) and its KLD mode (`--kl-divergence`, the final statistics tables). The
two PPLs must agree to 4 significant digits (one engine, one convention); the KLDs of the default
reference (a base file ggufcarve writes) differ only by the rounding of the two base files' 16-bit
values, those of a top-k cache also by its estimate's error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ggufcarve.events import Event, Sink, ignore

if TYPE_CHECKING:
    from ggufcarve.evaluate.models import ModelEntry
    from ggufcarve.evaluate.protocol import EvalSettings, Reference

TOOL_TIMEOUT_IDLE = 3600.0
# llama.cpp's common log prints from a worker thread and is never flushed at exit (common/log.cpp,
# common_log_main), so under load the last lines, the final statistics, can be missing while the
# exit code is 0: such a run is repeated up to this many times (half the runs lost them on a
# loaded 2-core machine); the repeats are in the result's notes, and a run that lacks them every
# time is an error.
ATTEMPTS = 6
FINAL_ESTIMATE = re.compile(r"Final estimate: PPL = ([-\d.]+) \+/- ([-\d.]+)")
MEAN_PPL = re.compile(r"^Mean PPL\(Q\)\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)")
MEAN_KLD = re.compile(r"^Mean\s+KLD:\s*([-\d.]+)\s*±\s*([-\d.]+)")
KLD_ROW = re.compile(
    r"^\s*(Maximum|99\.9%|99\.0%|95\.0%|90\.0%|Median|10\.0%|5\.0%|1\.0%|0\.1%|Minimum)\s+KLD:\s*([-\d.]+)"
)
RMS_DP = re.compile(r"^RMS Δp\s*:\s*([-\d.]+)\s*±\s*([-\d.]+) %")
SAME_TOP = re.compile(r"^Same top p:\s*([-\d.]+)\s*±\s*([-\d.]+) %")
KLD_ROW_NAMES = {
    "Maximum": "max",
    "99.9%": "p999",
    "99.0%": "p99",
    "95.0%": "p95",
    "90.0%": "p90",
    "Median": "median",
    "10.0%": "p10",
    "5.0%": "p5",
    "1.0%": "p1",
    "0.1%": "p01",
    "Minimum": "min",
}


def agrees(a: float, b: float, digits: int = 4) -> bool:
    """a and b agree to `digits` significant digits: they differ by at most half a unit in the last of them."""
    if a == b:
        return True
    magnitude = math.floor(math.log10(max(abs(a), abs(b))))
    return abs(a - b) <= 0.5 * 10 ** (magnitude - digits + 1)


def parse_kld_output(lines: list[str]) -> dict:
    """llama-perplexity --kl-divergence's final statistics: ppl, kld_mean(_stderr), kld percentiles, rms_dp,
    same_top_p (fractions)."""
    found: dict = {"kld": {}}
    for line in lines:
        if m := MEAN_PPL.match(line):
            found["ppl"], found["ppl_stderr"] = float(m[1]), float(m[2])
        elif m := MEAN_KLD.match(line):
            found["kld_mean"], found["kld_mean_stderr"] = float(m[1]), float(m[2])
        elif m := KLD_ROW.match(line):
            found["kld"][KLD_ROW_NAMES[m[1]]] = float(m[2])
        elif m := RMS_DP.match(line):
            found["rms_dp"], found["rms_dp_stderr"] = float(m[1]) / 100, float(m[2]) / 100
        elif m := SAME_TOP.match(line):
            found["same_top_p"], found["same_top_p_stderr"] = float(m[1]) / 100, float(m[2]) / 100
    return found


def missing_statistics(parse, found: dict) -> str:
    """The closing lines, quoted and joined, that `parse`'s output lacked ("" when none): the PPL
    mode's "Final estimate" line; the KLD mode's "Mean PPL(Q)" line, which opens its closing
    block, and its "Same top p" line, which ends it (all lines between arrived when both did)."""
    if parse is parse_ppl_output:
        needed = {"ppl": "Final estimate"}
    else:
        needed = {"ppl": "Mean PPL(Q)", "same_top_p": "Same top p"}
    return " or ".join(f"'{line}'" for key, line in needed.items() if found.get(key) is None)


def parse_ppl_output(lines: list[str]) -> dict:
    for line in lines:
        if m := FINAL_ESTIMATE.search(line):
            return {"ppl": float(m[1]), "ppl_stderr": float(m[2])}
    return {}


@dataclass
class CrossCheck:
    tool: Path
    settings: EvalSettings
    heldout: Path | None
    base_file: Path | None
    work: Path

    def _run(self, argv: list[str], what: str) -> list[str]:
        """Run llama-perplexity and return the lines of its `--log-file` (its tables and log lines, in order;
        at debug verbosity, `-lv 5`, for the loader's "layer N assigned to device D" lines, recorded as
        where the cross-check computed)."""
        from ggufcarve.llama import launch
        from ggufcarve.llama.computed import layers_of, record

        log = self.work / f"llama-perplexity-{len(list(self.work.glob('llama-perplexity-*.log')))}.log"
        finished = launch.run(
            [str(self.tool), *argv, *self.settings.child_compute.tool_args(), "-lv", "5", "--log-file", str(log)],
            idle_timeout=TOOL_TIMEOUT_IDLE,
        )
        launch.check(finished, f"llama-perplexity ({what})", "run the same command by hand to see its whole output")
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        record(layers_of(lines), "crosscheck")
        return lines

    def _statistics(self, argv: list[str], parse, what: str, sink: Sink, notes: list[str]) -> dict:
        """Run until the output holds its closing statistics (see ATTEMPTS), and parse them; a
        repeated run is announced on `sink` and described in `notes`."""
        from ggufcarve.errors import ToolFailed

        lacked: list[str] = []  # the closing lines each run lacked
        for attempt in range(1, ATTEMPTS + 1):
            lines = self._run(argv, what)
            found = parse(lines)
            missing = missing_statistics(parse, found)
            if not missing:
                if lacked:
                    notes.append(
                        f"llama-perplexity ({what}) ran again: {len(lacked)} of its "
                        f"{attempt} runs exited 0 without its closing statistics "
                        f"(no {lacked[0]} line), which its log thread drops at exit under load"
                    )
                return found
            lacked.append(missing)
            if attempt < ATTEMPTS:
                sink(
                    Event(
                        "llama-perplexity",
                        0,
                        1,
                        "steps",
                        f"{what}: no {missing} line in its output; running it again ({attempt + 1} of {ATTEMPTS})",
                    )
                )
        last = " | ".join(line.strip() for line in lines[-2:] if line.strip())
        raise ToolFailed(
            f"llama-perplexity ({what}) exited 0 without its closing "
            f"statistics (no {lacked[-1]} line) in each of {ATTEMPTS} runs; "
            f"its output ends: {last}",
            "run the same command by hand to see its whole output, or run on a less loaded machine",
        )

    def _chunk_args(self) -> list[str]:
        return ["--chunks", str(self.settings.chunks)] if self.settings.chunks else []

    @classmethod
    def prepare(
        cls,
        reference_path: Path,
        reference: Reference,
        heldout: Path | None,
        settings: EvalSettings,
        work: Path,
        sink: Sink = ignore,
    ) -> CrossCheck:
        from ggufcarve.llama.tools import require_tool

        check = cls(require_tool("llama-perplexity", settings.llama_cpp_dir), settings, heldout, None, work)
        if reference.kind == "base":
            check.base_file = reference.file
        elif reference.entry is not None and heldout is not None:
            sink(Event("llama-perplexity", 0, 1, "steps", f"base file of {reference.label}"))
            base = work / "llama-perplexity-base.kld"
            check._run(
                [
                    "-m",
                    str(reference.entry.path),
                    "-f",
                    str(heldout),
                    "-c",
                    str(settings.ctx),
                    *check._chunk_args(),
                    "--kl-divergence-base",
                    str(base),
                ],
                "writing the base file",
            )
            check.base_file = base
            sink(Event("llama-perplexity", 1, 1, "steps", f"base file of {reference.label}"))
        return check

    def check(self, entry: ModelEntry, doc: dict, sink: Sink = ignore) -> dict:
        """llama-perplexity's figures for one model, and whether its PPL agrees with ggufcarve's."""
        result: dict = {"tool": "llama-perplexity"}
        notes: list[str] = []
        sink(Event("llama-perplexity", 0, 1, "steps", entry.name))
        if self.heldout is not None:
            what = f"PPL of {entry.name}"
            argv = ["-m", str(entry.path), "-f", str(self.heldout), "-c", str(self.settings.ctx), *self._chunk_args()]
            result["ppl_mode"] = self._statistics(argv, parse_ppl_output, what, sink, notes)
        if self.base_file is not None:
            what = f"KLD of {entry.name}"
            argv = [
                "-m",
                str(entry.path),
                "-c",
                str(doc["parameters"]["ctx"]),
                "--kl-divergence-base",
                str(self.base_file),
                "--kl-divergence",
            ]
            result["kld_mode"] = self._statistics(argv, parse_kld_output, what, sink, notes)
        if notes:
            result["notes"] = notes
        ppl = (result.get("ppl_mode") or {}).get("ppl") or (result.get("kld_mode") or {}).get("ppl")
        result["ppl"] = ppl
        result["ppl_agrees"] = ppl is not None and agrees(doc["ppl"], ppl)
        sink(Event("llama-perplexity", 1, 1, "steps", entry.name))
        return result
