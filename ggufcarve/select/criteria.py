"""The registry of expert-selection criteria: every criterion `score`, `select`, `tune`, `best` and a
run plan accept, what it reads, whether it can protect super experts, whether it records
per-expert outputs, what it computes and where it comes from. Every list of criteria in the
package is derived from CRITERIA; named subsets (BEST_DEFAULT, the demo's tournament) are built
with `subset`, which refuses a name the registry lacks when their module is imported.

    markdown_table()   # the table of docs/criteria.md (a test keeps the page up to date)

This module imports only the standard library and ggufcarve.errors: the command line's help and
the calibration child's start read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggufcarve.errors import BadInput

# What a criterion reads.
WEIGHTS = "weights"  # the model file's tensors alone
SEED = "seed"  # nothing from the model but its shape: a seeded baseline
IMATRIX = "imatrix"  # an imatrix llama-imatrix (or `ggufcarve imatrix collect`) wrote for the model
CALIBRATION_PASS = "calibration pass"  # one decode pass of calibration text through llama.cpp, traced
RAZOR_PASS = "razor pass"  # the calibration pass plus each routed token's refill expert evaluated
GREEDY_MEMORY = "greedy's memory"  # the calibration pass with every expert's output of every token held per block
READS = (WEIGHTS, SEED, IMATRIX, CALIBRATION_PASS, RAZOR_PASS, GREEDY_MEMORY)
# what each kind of reading asks of the command line: "model" (nothing more), "imatrix" (--imatrix)
# or "calibration" (--calibration)
NEEDS = {
    WEIGHTS: "model",
    SEED: "model",
    IMATRIX: "imatrix",
    CALIBRATION_PASS: "calibration",
    RAZOR_PASS: "calibration",
    GREEDY_MEMORY: "calibration",
}


@dataclass(frozen=True)
class Criterion:
    name: str
    reads: str  # one of READS
    super_experts: bool  # records each expert's largest output element, so --protect-super-experts applies
    records_outputs: bool  # captures each routed expert's output (ffn_moe_down), not only the routing
    summary: str
    source: str  # the paper (with its arXiv id) or "rule" and where the rule comes from

    @property
    def needs(self) -> str:
        """\"model", "imatrix" or "calibration": the input the command line must give."""
        return NEEDS[self.reads]


CRITERIA: dict[str, Criterion] = {
    c.name: c
    for c in (
        Criterion(
            "weights",
            WEIGHTS,
            False,
            False,
            "||router row|| x scale energy of the expert's weights (zero-shot, one read of the model)",
            "rule: the published zero-shot carve of Qwen3.6-35B-A3B (router propensity x weight scale energy)",
        ),
        Criterion(
            "aimer",
            WEIGHTS,
            False,
            False,
            "mean |w| / RMS(w) over the expert's gate, up and down weights "
            "together; the lowest are kept (scored as RMS(w) / mean |w|)",
            "AIMER, arXiv 2603.18492",
        ),
        Criterion("router-norm", WEIGHTS, False, False, "||router row|| alone", "rule: the router's propensity alone"),
        Criterion("random", SEED, False, False, "seeded uniform scores (a baseline)", "rule: a baseline"),
        Criterion(
            "imatrix-counts",
            IMATRIX,
            False,
            False,
            "routed (token, slot) counts an imatrix recorded per expert",
            "rule: frequency read from llama-imatrix's counts",
        ),
        Criterion(
            "imatrix-energy",
            IMATRIX,
            False,
            False,
            "mean ||h||^2 of the tokens routed to each expert, from ffn_down_exps in_sum2",
            "rule: llama-imatrix's input energy of ffn_down_exps",
        ),
        Criterion(
            "imatrix-msan",
            IMATRIX,
            False,
            False,
            "msan estimated from an imatrix, no pass: sum_c E[h_c^2] ||W_down[:, "
            "c]||^2; ranks like the traced msan to Spearman 0.89-0.97 per block "
            "(mean 0.91-0.94) on the demo model: a ranking aid, not a measurement",
            "rule: an estimate of MSAN (arXiv 2606.15716) from an imatrix",
        ),
        Criterion(
            "frequency",
            CALIBRATION_PASS,
            False,
            False,
            "routed (token, slot) counts in llama.cpp's own routing of the calibration text",
            "REAP, arXiv 2510.13999 (its frequency baseline)",
        ),
        Criterion(
            "ean",
            CALIBRATION_PASS,
            True,
            True,
            "mean ||f_e(x)|| over the tokens routed to e (expert output norm)",
            "REAP, arXiv 2510.13999 (EAN); MAN in arXiv 2606.15716",
        ),
        Criterion(
            "ean-sum",
            CALIBRATION_PASS,
            True,
            True,
            "sum of ||f_e(x)|| over the tokens routed to e (REAP's EAN sum form: frequency x ean)",
            "REAP, arXiv 2510.13999 (EAN, sum form)",
        ),
        Criterion(
            "msan",
            CALIBRATION_PASS,
            True,
            True,
            "mean ||f_e(x)||^2 over the tokens routed to e (mean squared activation norm)",
            "MSAN, arXiv 2606.15716",
        ),
        Criterion(
            "mone",
            CALIBRATION_PASS,
            True,
            True,
            "MoNE: routed count x output variance E||f_e - mean f_e||^2 over the tokens routed to e (ungated outputs)",
            "MoNE, arXiv 2507.00390",
        ),
        Criterion(
            "reap",
            CALIBRATION_PASS,
            True,
            True,
            "mean g_e ||f_e(x)|| over the tokens routed to e, g the weight llama.cpp applied",
            "REAP, arXiv 2510.13999",
        ),
        Criterion(
            "hope",
            CALIBRATION_PASS,
            True,
            True,
            "pairwise: per block the E x E mean of g_i ||f_i|| g_j ||f_j|| over tokens routing to both i and j; "
            "drops the experts whose quadratic form is smallest (relaxed to [0, 1]^E, then rounded), per K",
            "HOPE, arXiv 2609.18916",
        ),
        Criterion(
            "razor",
            RAZOR_PASS,
            True,
            True,
            "conditional RMS of the output change when e is deleted and the router's next expert takes its place",
            "rule: RAZOR's published method (the 256 -> 128 expert RAZOR release)",
        ),
        Criterion(
            "greedy",
            GREEDY_MEMORY,
            False,
            True,
            "backward elimination per block: drop the expert whose removal "
            "raises mean ||y - y_S||^2 of the block's routed output least "
            "(routing recomputed over S); opt-in: on the demo model mean KLD "
            "at K=4/8/12 0.712/0.114/0.0064 against reap's 0.861/0.135/0.0095, "
            "for 1.7x the pass time and 11x its peak memory (tokens x experts x n_embd per block)",
            "rule: backward elimination on each block's output",
        ),
    )
}


def _reading(*reads: str) -> tuple[str, ...]:
    return tuple(c.name for c in CRITERIA.values() if c.reads in reads)


ZERO_SHOT = _reading(WEIGHTS, SEED)  # no data: the model file alone
IMATRIX_METHODS = _reading(IMATRIX)
PASS_METHODS = _reading(CALIBRATION_PASS)  # every one filled by one calibration pass that captures the expert outputs
TRACE_METHODS = _reading(CALIBRATION_PASS, RAZOR_PASS, GREEDY_MEMORY)  # every criterion a calibration pass fills
SUPER_EXPERT_METHODS = tuple(c.name for c in CRITERIA.values() if c.super_experts)
# `tune --methods all`: razor is left out (its pass is the heavier one); greedy last, which tune
# leaves out when its memory estimate does not fit
ALL_METHODS = (*PASS_METHODS, *IMATRIX_METHODS, *ZERO_SHOT, *_reading(GREEDY_MEMORY))


def criterion_named(name: str) -> Criterion:
    try:
        return CRITERIA[name]
    except KeyError:
        raise BadInput(f"unknown method {name!r}", f"choose one of {', '.join(CRITERIA)}") from None


def subset(*names: str) -> tuple[str, ...]:
    """`names` as a tuple, each a criterion of the registry (a named subset, checked at import)."""
    for name in names:
        criterion_named(name)
    return names


BEST_DEFAULT = subset(
    "reap", "frequency", "ean", "weights"
)  # `best`'s keep-set tournament unless --methods says otherwise


def method_help() -> str:
    """The help of `--method`: the criteria grouped by what they need."""
    return (
        f"{', '.join(ZERO_SHOT)} (no data); {', '.join(IMATRIX_METHODS)} (--imatrix); {', '.join(TRACE_METHODS)} "
        "(--calibration: one pass fills all but razor and greedy, razor's "
        "pass all; greedy eliminates experts on each block's output)."
    )


def all_help() -> str:
    """What `tune --methods all` holds, in words."""
    return (
        f"the {len(PASS_METHODS)} criteria of one calibration pass, the "
        f"{len(IMATRIX_METHODS)} imatrix criteria from the same pass's imatrix, "
        f"{', '.join(ZERO_SHOT)}, and greedy"
    )


def markdown_table() -> str:
    """The registry as a Markdown table, one row per criterion in registry order."""
    lines = [
        "| criterion | reads | protects super experts | records expert outputs | what it scores | source |",
        "|---|---|---|---|---|---|",
    ]
    for c in CRITERIA.values():
        cells = [
            f"`{c.name}`",
            c.reads,
            "yes" if c.super_experts else "no",
            "yes" if c.records_outputs else "no",
            c.summary,
            c.source,
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"
