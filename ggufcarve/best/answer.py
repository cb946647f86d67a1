"""The answer for a memory budget from measured evaluation results (`ggufcarve eval`'s per-model
documents): among the models whose file plus the context's cache fits, the lowest mean KLD, and
the best of the other family beside it."""

from __future__ import annotations

from typing import Any

DEMO_BUDGET = 6 * 2**20  # between the demo's rungs: its pruned Q4_K_M and its unpruned Q2_K fit, its pruned Q6_K and unpruned Q4_K_M do not


def answer_for_budget(results: list[dict[str, Any]], memory: int, cache_bytes: int) -> dict[str, Any] | None:
    """{winner, runner_up (the best fitting model of the other family, or None), fitting, memory, cache_bytes};
    None when nothing fits."""
    fitting = [r for r in results if r.get("kld_mean") is not None and r["model"]["bytes"] + cache_bytes <= memory]
    if not fitting:
        return None
    winner = min(fitting, key=lambda r: (r["kld_mean"], r["model"]["bytes"]))
    other = [r for r in fitting if r["model"]["pruned"] != winner["model"]["pruned"]]
    runner_up = min(other, key=lambda r: (r["kld_mean"], r["model"]["bytes"])) if other else None
    return {"winner": winner, "runner_up": runner_up, "fitting": sorted(fitting, key=lambda r: r["model"]["bytes"]), "memory": memory, "cache_bytes": cache_bytes}
