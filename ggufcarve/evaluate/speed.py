"""Prompt-processing and decode speed as llama-bench defines them (pp: one batch of N prompt tokens; tg: N
single-token decodes).

With a llama-bench binary (`ggufcarve toolchain build` compiles it), `bench_speed` runs it on the
model: `-p N -n N -r RUNS -t THREADS --repack 0 -o jsonl`, one JSON line per test with every
repetition's tok/s in `samples_ts`. Without one, `measure` times the same two tests inside the
evaluation child on the model's own context. Either way: one warm-up run, then `runs` timed runs;
the median tok/s is reported with every run's figure, the thread count and the engine.

The spread of a measurement is (max - min) / median of its runs' tok/s (None with fewer than two
runs). A spread above NOISY_SPREAD marks it noisy: the tables show its range of runs instead of
the median.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ggufcarve import settings as S
from ggufcarve.errors import BadInput
from ggufcarve.settings import key

if TYPE_CHECKING:
    from ggufcarve.evaluate.engine import Context
    from ggufcarve.llama.devices import Compute


ENGINES = ("auto", "llama-bench", "libllama")  # auto: llama-bench when found, else libllama
DEFAULT_RUNS = 5  # timed runs per test: enough for a spread
NOISY_SPREAD = 0.10  # (max - min) / median above which a measurement is flagged noisy


def spread(runs: list[float]) -> float | None:
    """(max - min) / median of the runs' tok/s; None with fewer than two runs."""
    if len(runs) < 2:
        return None
    middle = statistics.median(runs)
    return (max(runs) - min(runs)) / middle if middle > 0 else None


def speed_text(doc: dict, test: str, unit: bool = True) -> str:
    """A result's `test` ("pp" or "tg") speed as the tables show it: the median tok/s, or
    "noisy: MIN-MAX tok/s" when its runs spread more than NOISY_SPREAD; "–" when not measured."""
    median = doc.get(f"{test}_tok_s")
    if median is None:
        return "–"
    runs = (doc.get("speed") or {}).get(f"{test}_runs") or []
    wide = spread(runs)
    suffix = " tok/s" if unit else ""
    if wide is not None and wide > NOISY_SPREAD:
        return f"noisy: {_tok_s(min(runs))}-{_tok_s(max(runs))}{suffix}"
    return f"{median:.1f}{suffix}" + (" (1 run)" if len(runs) == 1 else "")


def _tok_s(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


@dataclass(frozen=True)
class SpeedSettings:
    pp_tokens: int = 512
    tg_tokens: int = 128
    runs: int = key(S.SPEED_RUNS, DEFAULT_RUNS)
    engine: str = key(S.SPEED_ENGINE, "auto")
    statistic: str = "median"  # of the runs' tok/s; "mean" is llama-bench's avg_ts

    def method(self, depth: int = 0) -> dict[str, object]:
        """What a timing of these settings is, as a report states it."""
        return {
            "tool": "llama-bench",
            "tests": [f"pp{self.pp_tokens}", f"tg{self.tg_tokens}"],
            "repetitions": self.runs,
            "statistic": "mean of the repetitions' tok/s (llama-bench's avg_ts)"
            if self.statistic == "mean"
            else "median of the repetitions' tok/s",
            "depth": depth,
        }


# llama-bench's own method, as `best` and `fit --measure-speed` time a placement: its defaults (pp512, tg128,
# 5 repetitions, their mean), at the depth the run line states
BENCH_METHOD = SpeedSettings(pp_tokens=512, tg_tokens=128, runs=5, statistic="mean")


@dataclass
class Speed:
    pp_tokens: int
    tg_tokens: int
    threads: int
    pp_tok_s: float  # median
    tg_tok_s: float  # median
    pp_runs: list[float] = field(default_factory=list)
    tg_runs: list[float] = field(default_factory=list)
    engine: str = "libllama"  # or "llama-bench"
    computed_on: dict[str, int] = field(default_factory=dict)  # device -> layers, as llama.cpp's loader assigned them

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "pp_spread": spread(self.pp_runs),
            "tg_spread": spread(self.tg_runs),
            "noisy_above_spread": NOISY_SPREAD,
        }


def _prompt_speed(context: Context, tokens: np.ndarray) -> float:
    context.clear()
    started = time.perf_counter()
    context.decode(tokens, 0, len(tokens) - 1)
    context.logits(-1)  # waits for the computation
    return len(tokens) / (time.perf_counter() - started)


def _decode_speed(context: Context, first: int, n: int) -> float:
    context.clear()
    context.decode([first], 0, 0)
    token = first
    started = time.perf_counter()
    for pos in range(1, n + 1):
        context.decode([token], pos, pos)
        token = int(np.argmax(context.logits(-1)))
    return n / (time.perf_counter() - started)


def measure(context: Context, settings: SpeedSettings, prompt: np.ndarray, threads: int) -> Speed:
    """pp and tg tok/s in a single-sequence context; `prompt` supplies the pp tokens (repeated when short)."""
    pp = max(1, min(settings.pp_tokens, context.n_ctx, context.n_batch))
    tg = max(1, min(settings.tg_tokens, context.n_ctx - 1))
    tokens = np.resize(np.asarray(prompt, dtype=np.int32), pp)
    first = context.engine.bos if context.engine.add_bos else int(tokens[0])
    _prompt_speed(context, tokens)
    _decode_speed(context, first, min(tg, 8))
    pp_runs = [_prompt_speed(context, tokens) for _ in range(settings.runs)]
    tg_runs = [_decode_speed(context, first, tg) for _ in range(settings.runs)]
    return Speed(pp, tg, threads, statistics.median(pp_runs), statistics.median(tg_runs), pp_runs, tg_runs)


BENCH_IDLE_TIMEOUT = 600.0


def bench_speed(
    tool: Path,
    model: Path,
    settings: SpeedSettings,
    compute: Compute,
    placement: tuple[str, ...] = (),
    flags: list[str] | None = None,
) -> Speed:
    """pp and tg tok/s of `model` measured by llama-bench (weight repacking off, placed by
    `compute`, whose threads are resolved: llama-bench's -ngl, --rpc, -ts, -t; `placement`: more
    placement flags, -ncmoe N). `flags`: the whole placement and context of a run line instead
    (placement.run_line.bench_args), `compute` then giving the threads alone. With layers
    offloaded, a llama-bench that sees no device (built for the CPU alone) is refused: it would time
    the CPU under a GPU's placement."""
    from ggufcarve.errors import ToolFailed
    from ggufcarve.llama import launch

    placed = compute.tool_args(bench=True) if flags is None else [*flags, "-t", str(compute.threads or 1)]
    layers = int(placed[placed.index("-ngl") + 1]) if "-ngl" in placed else 0
    if layers > 0:
        from ggufcarve.llama.device_list import tool_devices

        if not tool_devices(tool, compute.rpc):
            raise BadInput(
                f"{tool} sees no GPU or RPC device, so --gpu-layers {layers} would time the CPU",
                "build the tools with the device's backend (ggufcarve toolchain build --backend cuda, or rpc with "
                "--rpc), or measure speed with --gpu-layers 0",
            )

    argv = [
        tool,
        "-m",
        model,
        "-p",
        str(settings.pp_tokens),
        "-n",
        str(settings.tg_tokens),
        "-r",
        str(settings.runs),
        *placed,
        *placement,  # llama-bench's own placement flags (-ncmoe N)
        "--repack",
        "0",
        "-o",
        "jsonl",
        "-v",  # llama.cpp's log at debug level on stderr: the loader's "layer N assigned to device D" lines
    ]
    lines: list[str] = []
    finished = launch.run(argv, on_line=lines.append, idle_timeout=BENCH_IDLE_TIMEOUT)
    launch.check(
        finished,
        f"llama-bench on {model.name}",
        "check that the model loads in llama.cpp (llama-bench's last lines are above)",
    )
    tests = []
    for line in lines:
        if line.startswith("{"):
            try:
                tests.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    pp = [t for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    tg = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if len(pp) != 1 or len(tg) != 1 or not pp[0].get("samples_ts") or not tg[0].get("samples_ts"):
        raise ToolFailed(
            f"llama-bench on {model.name} printed {len(tests)} test result(s), not one pp and one tg test",
            "run it by hand with -o jsonl to see its output",
        )
    pp_runs = [float(x) for x in pp[0]["samples_ts"]]
    tg_runs = [float(x) for x in tg[0]["samples_ts"]]
    from ggufcarve.llama.computed import layers_of, record

    computed_on = layers_of(lines)
    record(computed_on, "speed")
    middle = statistics.mean if settings.statistic == "mean" else statistics.median
    return Speed(
        int(pp[0]["n_prompt"]),
        int(tg[0]["n_gen"]),
        int(pp[0].get("n_threads", compute.threads)),
        middle(pp_runs),
        middle(tg_runs),
        pp_runs,
        tg_runs,
        engine="llama-bench",
        computed_on=computed_on,
    )
