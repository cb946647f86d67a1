"""The answer for a memory budget among models already built and evaluated (the demo's rungs): the
one measurement layer (`measure.tournament`) decides it over the files, from the per-token tables
`ggufcarve eval` left in the content-keyed cache (it decodes only what is not there): among the
models whose memory fits (what llama.cpp allocates to run each at the evaluation's context, from
eval's report: weights, cache, compute and output buffers; file plus cache for a report without
it), the lowest mean KLD, or, when others are within noise of it, the smallest of them; and the
best fitting model of the other family beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ggufcarve.events import Sink, ignore
from ggufcarve.llama.devices import Compute

# between the demo's rungs as llama.cpp allocates them at 256 tokens: its pruned Q4_K_M (9.51 MiB) and its
# unpruned Q2_K (9.96 MiB) fit, its pruned Q6_K (10.90 MiB) and unpruned Q4_K_M (13.03 MiB) do not
DEMO_BUDGET = 10 * 2**20 + 2**19


def memory_of(result: dict[str, Any], cache_bytes: int) -> int:
    """The bytes a model evaluated by eval takes to run: its report's measured total, else file + cache."""
    measured = result.get("memory")
    return int(measured[0]["total"]) if measured else int(result["model"]["bytes"]) + cache_bytes


def answer_for_budget(
    results: list[dict[str, Any]],
    memory: int,
    cache_bytes: int,
    *,
    directories: list[Path],
    source: Path,
    heldout: list[Path],
    ctx: int,
    chunks: int | None,
    compute: Compute,
    work: Path,
    on_event: Sink = ignore,
) -> dict[str, Any] | None:
    """{winner, runner_up (the best fitting finalist of the other family, or None), tie_with (the results within
    noise of the winner), fitting, memory, cache_bytes}; None when nothing fits. `results` are eval's per-model
    documents of files under `directories`."""
    from ggufcarve.measure.tournament import (
        Candidate,
        MeasureSettings,
        measure,
        measure_tables,
        metric_value,
        prepare_segments,
    )

    scored = [r for r in results if r.get("kld_mean") is not None]
    fitting = [r for r in scored if memory_of(r, cache_bytes) <= memory]
    if not fitting:
        return None
    files = {p.name: p for directory in directories for p in sorted(directory.rglob("*.gguf"))}
    by_name = {r["model"]["name"]: r for r in scored if r["model"]["file"] in files}
    segments = prepare_segments(
        source, heldout, chunk_ctx=ctx, chunks=chunks, compute=compute, work=work, on_event=on_event
    )
    pool = [
        Candidate(
            name,
            files[r["model"]["file"]],
            fits=memory_of(r, cache_bytes) <= memory,
            file_bytes=r["model"]["bytes"],
        )
        for name, r in by_name.items()
    ]
    measured = measure(pool, segments, MeasureSettings(compute, tables=measure_tables()), work, on_event=on_event)
    decision = measured.groups[""]
    if decision["winner"] is None:
        return None

    def doc(name: str) -> dict[str, Any]:
        record = measured.records[name]
        return {
            **by_name[name],
            "kld_mean": record["kld_mean"],
            "kld_mean_stderr": record["kld_mean_stderr"],
            "chunks_scored": record["chunks_scored"],
            "stopped_early": record["stopped_early"],
            "delta_vs_leader": record["delta_vs_leader"],
            "delta_stderr": record["delta_stderr"],
        }

    winner = by_name[decision["winner"]]
    others = [
        n
        for n, r in measured.records.items()
        if r["fits"] and by_name[n]["model"]["pruned"] != winner["model"]["pruned"]
    ]
    # the best of the other family: the one that lasted the most rounds, then the lowest mean KLD
    runner_up = (
        min(
            others,
            key=lambda n: (-measured.records[n]["chunks_scored"], metric_value(measured.records[n], "kld_mean"), n),
        )
        if others
        else None
    )
    return {
        "winner": doc(decision["winner"]),
        "runner_up": doc(runner_up) if runner_up else None,
        "tie_with": [doc(n) for n in decision["tie_with"]],
        "fitting": sorted((doc(n) for n in by_name if measured.records[n]["fits"]), key=lambda r: r["model"]["bytes"]),
        "memory": memory,
        "cache_bytes": cache_bytes,
        "chunks_decoded": measured.decoded_chunks,
        "chunks_cached": measured.cached_chunks,
    }
