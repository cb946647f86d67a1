"""Prompt-processing and decode speed in libllama, as llama-bench defines them (pp: one batch of N prompt tokens; tg: N single-token decodes).

Measured inside the evaluation child on the model's own context: one warm-up run, then `runs`
timed runs; the median tok/s is reported with every run's figure and the thread count.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ggufcarve.evaluate.context import Context


@dataclass(frozen=True)
class SpeedSettings:
    pp_tokens: int = 512
    tg_tokens: int = 128
    runs: int = 3


@dataclass
class Speed:
    pp_tokens: int
    tg_tokens: int
    threads: int
    pp_tok_s: float  # median
    tg_tok_s: float  # median
    pp_runs: list[float] = field(default_factory=list)
    tg_runs: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _prompt_speed(context: "Context", tokens: np.ndarray) -> float:
    context.clear()
    started = time.perf_counter()
    context.decode(tokens, 0, len(tokens) - 1)
    context.logits(-1)  # waits for the computation
    return len(tokens) / (time.perf_counter() - started)


def _decode_speed(context: "Context", first: int, n: int) -> float:
    context.clear()
    context.decode([first], 0, 0)
    token = first
    started = time.perf_counter()
    for pos in range(1, n + 1):
        context.decode([token], pos, pos)
        token = int(np.argmax(context.logits(-1)))
    return n / (time.perf_counter() - started)


def measure(context: "Context", settings: SpeedSettings, prompt: np.ndarray, threads: int) -> Speed:
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
