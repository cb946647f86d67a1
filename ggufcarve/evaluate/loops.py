"""Repetition loops: greedy continuations of a set of prompts, and the share that ends in a repeating cycle.

    settings = LoopSettings(prompts=loop_prompts_from_checks(checks), tokens=256)
    outputs = run_loops(engine, settings.prompts, settings.tokens, progress)   # in the evaluation child
    summary = summarize_loops(outputs, settings, reference_outputs)          # in the parent

Decoding is the QA suite's (greedy: temperature 0, top-k 1; the chat template applied to the
messages, with the generation prompt), for `tokens` new tokens or until an end-of-generation token.

The detector (`find_loop`), for a continuation t[0..n-1] and the parameters P_max
(`max_period`, 64), R (`min_tokens`, 32) and r (`min_repeats`, 3):
  * for a period p, L_p is the length of the longest suffix of t that has period p: the largest
    L <= n with t[i] == t[i - p] for every i in n-L+p .. n-1 (so L_p >= p whenever n >= p);
  * the continuation is in a loop when, for some 1 <= p <= P_max, L_p >= max(R, r * p): it ends
    in a block of p tokens repeated until it fills at least R tokens and at least r whole
    repeats, whichever is larger. The loop's period is the smallest such p, its start n - L_p,
    its repeats L_p / p.
A continuation that stopped at an end-of-generation token is judged the same way (it rarely
ends in a cycle: a model that stops is not looping). Only the end counts: a repeat in the middle
that the model left again is no loop. A near-cycle (a block whose repeats differ, e.g. a counter
in a numbered list) has no period, so it is no loop however long.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggufcarve import settings as S
from ggufcarve.errors import BadInput
from ggufcarve.settings import key, required

if TYPE_CHECKING:
    from ggufcarve.evaluate.engine import Engine

DEFAULT_TOKENS = 256  # new tokens per prompt: room for 3 repeats of the longest period plus a lead-in
MAX_PERIOD = 64
MIN_TOKENS = 32
MIN_REPEATS = 3


@dataclass(frozen=True)
class Loop:
    period: int
    start: int  # index in the continuation where the periodic suffix begins
    length: int  # tokens of the periodic suffix

    @property
    def repeats(self) -> float:
        return self.length / self.period


def periodic_suffix(tokens: Sequence[int], period: int) -> int:
    """L_p: the length of the longest suffix of `tokens` with period `period` (0 when shorter than it)."""
    n = len(tokens)
    if period < 1 or n < period:
        return 0
    i = n - 1
    while i >= period and tokens[i] == tokens[i - period]:
        i -= 1
    return n - 1 - i + period if i >= period else n


def find_loop(
    tokens: Sequence[int], max_period: int = MAX_PERIOD, min_tokens: int = MIN_TOKENS, min_repeats: int = MIN_REPEATS
) -> Loop | None:
    """The loop the continuation ends in (the smallest qualifying period), or None; see the module docstring."""
    tokens = list(tokens)
    for period in range(1, max_period + 1):
        need = max(min_tokens, min_repeats * period)
        if need > len(tokens):
            break  # larger periods need at least as many tokens
        length = periodic_suffix(tokens, period)
        if length >= need:
            return Loop(period, len(tokens) - length, length)
    return None


@dataclass(frozen=True)
class LoopSettings:
    # {"id", "messages", "tools"?} rendered with the chat template, or {"id", "prompt"} as raw text
    prompts: list[dict] = required(S.LOOP_PROMPTS)
    tokens: int = key(S.LOOP_TOKENS, DEFAULT_TOKENS)
    source: str = "QA suite"  # where the prompts come from, as the results name it
    max_period: int = MAX_PERIOD
    min_tokens: int = MIN_TOKENS
    min_repeats: int = MIN_REPEATS

    def request(self) -> dict[str, Any]:
        """What the evaluation child needs."""
        return {"prompts": self.prompts, "tokens": self.tokens}

    def detector(self) -> dict[str, int]:
        return {"max_period": self.max_period, "min_tokens": self.min_tokens, "min_repeats": self.min_repeats}


def loop_prompts_from_checks(checks: Sequence[dict]) -> list[dict]:
    """The QA checks' prompts (their messages and tools) as loop prompts."""
    return [
        {"id": c["id"], "messages": c["messages"], **({"tools": c["tools"]} if c.get("tools") else {})} for c in checks
    ]


def load_loop_prompts(path: Path) -> list[dict]:
    """Prompts from a file: a .jsonl file holds one JSON object per line, {"prompt": "raw text"} (no
    chat template) or {"messages": [{"role", "content"}, ...]} (the chat template applied), each
    with an optional "id"; any other file holds one prompt per non-empty line, asked as a user message."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(
            f"{path}: cannot read the loop prompts ({getattr(err, 'strerror', None) or err})",
            "give a UTF-8 text file, one prompt per line, or a .jsonl file",
        ) from None
    prompts: list[dict] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name}:{number}"
        if path.suffix != ".jsonl":
            prompts.append({"id": f"line-{number}", "messages": [{"role": "user", "content": line.strip()}]})
            continue
        try:
            doc = json.loads(line)
        except ValueError as err:
            raise BadInput(
                f"{where}: not valid JSON ({err})", 'one object per line: {"prompt": "..."} or {"messages": [...]}'
            ) from None
        if (
            not isinstance(doc, dict)
            or ("prompt" in doc) == ("messages" in doc)
            or set(doc) - {"id", "prompt", "messages", "tools"}
        ):
            raise BadInput(
                f'{where}: a loop prompt is an object with either "prompt" or "messages" (and an optional "id")',
                'e.g. {"id": "story", "prompt": "Once upon a time"}',
            )
        if "prompt" in doc and not (isinstance(doc["prompt"], str) and doc["prompt"]):
            raise BadInput(f'{where}: "prompt" must be a non-empty string', 'e.g. {"prompt": "Once upon a time"}')
        messages = doc.get("messages")
        if messages is not None and not (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise BadInput(
                f'{where}: "messages" must be a non-empty list of {{role, content}} strings',
                'e.g. {"messages": [{"role": "user", "content": "Tell a story"}]}',
            )
        prompts.append({**doc, "id": str(doc.get("id", f"line-{number}"))})
    if not prompts:
        raise BadInput(f"{path}: no prompts", 'one prompt per line, or a .jsonl file of {"prompt": ...} objects')
    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        raise BadInput(
            f"{path}: the id '{next(i for i in ids if ids.count(i) > 1)}' is used twice", "give every prompt its own id"
        )
    return prompts


def run_loops(engine: Engine, prompts: list[dict], tokens: int, progress: Callable[[int, int], None]) -> list[dict]:
    """Greedy continuations of every prompt, `tokens` new tokens at most: [{id, tokens, output, prompt_tokens,
    ended}]."""
    from ggufcarve.evaluate.qa import render_prompt

    template = engine.chat_template()
    encoded = []
    for prompt in prompts:
        if "prompt" in prompt:
            encoded.append(engine.tokenize(prompt["prompt"].encode("utf-8"), add_special=True, parse_special=False))
        else:
            text, has_bos = render_prompt(engine, template, prompt)
            encoded.append(engine.tokenize(text, add_special=not has_bos, parse_special=True))
    context = engine.context(-(-(max(len(p) for p in encoded) + tokens) // 256) * 256)
    outputs = []
    try:
        progress(0, len(prompts))
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            continuation = list(context.generate(ids.tolist(), tokens))
            text = b"".join(engine.piece(t) for t in continuation).decode("utf-8", errors="replace")
            outputs.append(
                {
                    "id": prompt["id"],
                    "tokens": continuation,
                    "output": text,
                    "prompt_tokens": int(len(ids)),
                    "ended": len(continuation) < tokens,
                }
            )
            progress(i + 1, len(prompts))
    finally:
        context.close()
    return outputs


@dataclass
class LoopSummary:
    share: float
    looped: int
    total: int
    prompts: list[dict] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _judge(outputs: list[dict], settings: LoopSettings) -> LoopSummary:
    rows = []
    for output in outputs:
        loop = find_loop(output["tokens"], **settings.detector())
        rows.append(
            {
                "id": output["id"],
                "looped": loop is not None,
                "period": loop.period if loop else None,
                "loop_start": loop.start if loop else None,
                "repeats": round(loop.repeats, 2) if loop else None,
                "output_tokens": len(output["tokens"]),
                "ended": output["ended"],
                "prompt_tokens": output["prompt_tokens"],
                "output": output.get("output"),
                "tokens": output["tokens"],
            }
        )
    looped = sum(r["looped"] for r in rows)
    return LoopSummary(looped / len(rows) if rows else 0.0, looped, len(rows), rows)


def summarize_loops(outputs: list[dict], settings: LoopSettings, reference: list[dict] | None) -> dict[str, Any]:
    """The loop record of one model: its share of looping prompts, the reference's (None without a
    GGUF reference), the detector's parameters and every prompt's verdict."""
    own = _judge(outputs, settings)
    theirs = _judge(reference, settings) if reference is not None else None
    return {
        "share": own.share,
        "looped": own.looped,
        "total": own.total,
        "tokens": settings.tokens,
        "prompts_from": settings.source,
        "reference_share": theirs.share if theirs else None,
        "reference_looped": theirs.looped if theirs else None,
        "detector": settings.detector(),
        "prompts": own.prompts,
        "reference_looped_ids": [r["id"] for r in theirs.prompts if r["looped"]] if theirs else None,
    }
