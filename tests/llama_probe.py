"""Test helper: run a GGUF model in llama.cpp and get logits (and routed experts) or the failure.

A thin wrapper of ``ggufcarve.llama.trace.trace_routing`` (a child process started through the
one launcher) that returns failures as a result instead of raising, so tests can assert on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggufcarve.errors import CarveError
from ggufcarve.llama import trace as tracing


@dataclass
class ProbeResult:
    returncode: int
    stderr: str  # llama.cpp's warnings and errors, or the failure
    logits: np.ndarray | None  # [n_tokens, n_vocab] float32
    routed: dict[int, np.ndarray] = field(default_factory=dict)  # block -> [n_tokens, k] int32

    @property
    def ok(self) -> bool:
        """The child exited cleanly and returned logits (which may still be non-finite)."""
        return self.returncode == 0 and self.logits is not None


def probe(
    model_path, tokens: list[int], *, trace_routing: bool = False, timeout: float = 300, verbose: bool = False
) -> ProbeResult:
    """Decode ``tokens`` in llama.cpp; ``routed`` holds ``ffn_moe_topk`` per MoE block when traced."""
    lines: list[str] = []
    try:
        trace = tracing.trace_routing(
            model_path,
            tokens,
            nodes=(tracing.TOPK,) if trace_routing else (),
            timeout=timeout,
            verbose=verbose,
            on_line=lines.append,
        )
    except CarveError as err:
        return ProbeResult(1, "\n".join(lines) + f"\n{err}", None)
    return ProbeResult(0, "\n".join(lines), trace.logits, trace.topk)
