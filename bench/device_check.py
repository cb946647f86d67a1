"""The device checks of bench/device_check.sh, one PASS/FAIL line each, on the first GPU llama.cpp sees.

    python bench/device_check.py            # after llama-cpp-python and the tools are built with the GPU's backend
    python bench/device_check.py --rpc 127.0.0.1:50052   # the same checks on an RPC device (no GPU needed)

1. devices: libllama and llama-bench see a GPU (or the RPC device);
2. memory: the dry load of the demo model with every layer on the device, per device, against
   llama-fit-params with the same placement (within max(1%, 16 MiB) per device and column), and
   the same with --n-cpu-moe 2 (the experts of blocks 0 and 1 in system memory);
3. masked KLD with -ngl 99: a keep-set scored by masking on the device equals llama-perplexity's
   --kl-divergence on the really pruned file run with -ngl 99 (relative 1e-4, its 6 printed decimals);
4. best: `ggufcarve best` on the demo model with --gpu-memory and no --gpu-layers answers, every
   stage computed on the device (best.json's `computed_on`, llama.cpp's own loader lines), the
   winner timed there in its own placement, its run line naming the device's -ngl.
Exit status: the number of failed checks.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20
STARTED = time.monotonic()


def say(ok: bool, what: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {what} ({time.monotonic() - STARTED:.0f}s)", flush=True)
    return ok


def fit_params_rows(tool: Path, model: Path, args: list[str]) -> dict[str, tuple[int, int, int]]:
    """llama-fit-params --fit-print on: device -> (model, context, compute) MiB."""
    run = subprocess.run(
        [str(tool), "-m", str(model), *args, "--fit-print", "on"], capture_output=True, text=True, timeout=300
    )
    rows = {}
    for line in run.stdout.splitlines():
        m = re.match(r"^(\S+) (\d+) (\d+) (\d+)\s*$", line)
        if m:
            rows["host" if m[1] == "Host" else m[1]] = (int(m[2]), int(m[3]), int(m[4]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rpc", default="")
    parser.add_argument("--ctx", type=int, default=4096)
    options = parser.parse_args()
    rpc = tuple(e for e in options.rpc.split(",") if e)

    from ggufcarve.demo import CALIBRATION, DEMO_MODEL, HELDOUT
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.device_list import libllama_devices, tool_devices
    from ggufcarve.llama.devices import Compute
    from ggufcarve.llama.memory import MemorySettings, dry_load
    from ggufcarve.llama.tools import require_tool
    from ggufcarve.placement.memory import device_memory

    failed = 0
    bench = require_tool("llama-bench")
    seen = [d for d in libllama_devices(rpc) if d.type in ("GPU", "IGPU", "RPC")]
    by_tools = tool_devices(bench, rpc)
    failed += not say(
        bool(seen) and [d.name for d in by_tools] == [d.name for d in seen],
        f"devices: libllama {[d.name for d in seen]}, llama-bench {[d.name for d in by_tools]}",
    )
    if not seen:
        return failed + 4
    compute = Compute(99, rpc, threads=4)
    for placed in (compute, Compute(99, rpc, threads=4, n_cpu_moe=2)):
        load = dry_load(DEMO_MODEL, MemorySettings(options.ctx, compute=placed))
        ours = {r.device: r for r in device_memory(read_model(DEMO_MODEL), load)}
        theirs = fit_params_rows(
            require_tool("llama-fit-params"), DEMO_MODEL, [*placed.tool_args(), "-c", str(options.ctx)]
        )
        worst = 0.0
        for device, (model_mib, context_mib, compute_mib) in theirs.items():
            row = ours.get(device)
            for mine, other in (
                ((row.weights, model_mib), (row.cache, context_mib), (row.compute, compute_mib)) if row else ()
            ):
                worst = max(worst, abs(mine / MIB - other) / max(0.01 * other, 16))
        failed += not say(
            bool(theirs) and theirs.keys() <= ours.keys() and worst <= 1,
            f"memory per device vs llama-fit-params, {' '.join(placed.tool_args())}: {sorted(theirs)} "
            f"(worst {worst:.2f} of the tolerance)",
        )

    from ggufcarve.evaluate import kld
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, prepare_segments

    keep = {b: tuple(range(0, 16, 2)) for b in range(4)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        segments = prepare_segments(DEMO_MODEL, [HELDOUT], chunk_ctx=256, chunks=4, compute=compute, work=work)
        table = measure([Candidate("masked", DEMO_MODEL, keep=keep)], segments, MeasureSettings(compute), work).table(
            "masked"
        )
        masked = kld.kld_statistics(table).kld_mean
        pruned = work / "pruned.gguf"
        subprocess.run(
            [sys.executable, "-m", "ggufcarve", "prune", str(DEMO_MODEL), "--keep-ids", "0,2,4,6,8,10,12,14"]
            + ["-o", str(pruned), "-q"],
            check=True,
        )
        tool = require_tool("llama-perplexity")
        device = [*compute.tool_args(), "-c", "256", "--chunks", "4"]
        base = work / "base.kld"
        subprocess.run(
            [str(tool), "-m", str(DEMO_MODEL), "-f", str(HELDOUT), *device, "--kl-divergence-base", str(base)],
            capture_output=True,
            timeout=600,
            check=True,
        )
        found = None
        for _ in range(6):
            run = subprocess.run(
                [str(tool), "-m", str(pruned), *device, "--kl-divergence-base", str(base), "--kl-divergence"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            found = re.search(r"^Mean    KLD:\s*(-?[\d.]+)", run.stdout + run.stderr, re.M)
            if found:
                break
        theirs_kld = float(found[1]) if found else float("nan")
        failed += not say(
            abs(masked - theirs_kld) <= 1e-4 * theirs_kld + 2e-6,
            f"masked KLD on the device {masked:.6f} vs llama-perplexity on the pruned file {theirs_kld:.6f}",
        )
        out = work / "best"
        argv = [sys.executable, "-m", "ggufcarve", "best", str(DEMO_MODEL), "--memory", "64GiB", "--gpu-memory", "8GiB"]
        argv += [
            "--heldout",
            str(HELDOUT),
            "--calibration",
            str(CALIBRATION),
            "--ctx",
            "4096",
            "--chunks",
            "4",
            "-o",
            str(out),
            "-q",
        ]
        argv += ["--rpc", ",".join(rpc)] if rpc else []
        run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        doc = json.loads((out / "best.json").read_text()) if (out / "best.json").exists() else {}
        answer = next((c["id"] for c in doc.get("candidates", []) if c.get("winner")), None)
        failed += not say(
            run.returncode == 0 and answer is not None,
            f"best on the device: winner {answer}" + ("" if run.returncode == 0 else f": {run.stderr[-300:]}"),
        )
        gpu = seen[0].name
        computed = {
            stage: sorted({d for entry in entries for d in entry["layers"]})
            for stage, entries in doc.get("computed_on", {}).items()
            if stage != "dry-load"
        }
        failed += not say(
            {"calibration", "tournament", "speed"} <= set(computed) and all(d == [gpu] for d in computed.values()),
            f"best without --gpu-layers computed every stage on {gpu}: {computed}",
        )
        winner = doc.get("winner") or {}
        line = (winner.get("run_command") or {}).get("argv", [])
        failed += not say(
            winner.get("speed_placement") == winner.get("placement")
            and list(winner.get("speed_computed_on") or {}) == [gpu]
            and "-ngl" in line,
            f"the answer timed where it runs ({winner.get('speed_computed_on')}, "
            f"{winner.get('decode_tok_s')} tok/s): {' '.join(line)}",
        )
    return failed


if __name__ == "__main__":
    sys.exit(main())
