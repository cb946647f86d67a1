"""Small pieces every report shares: the Pareto front of models by size and a quality figure, a
list shortened to its first items with the count of the rest, and the repetition-loops column of
the markdown tables of evaluation results (eval's summary, the model card)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def pareto_front(items: Iterable[T], size: Callable[[T], float], value: Callable[[T], float]) -> list[T]:
    """The items no other item dominates, smallest first: another dominates one when it is at most
    its size with at most its value (lower is better), and smaller or lower in one of the two.
    Items equal in both stay together on the front."""
    ordered = sorted(items, key=lambda item: (size(item), value(item)))
    front: list[T] = []
    for item in ordered:
        if (
            not front
            or value(item) < value(front[-1])
            or (value(item) == value(front[-1]) and size(item) == size(front[-1]))
        ):
            front.append(item)
    return front


def shortened(items: Sequence[str], shown: int, separator: str = "; ") -> str:
    """The first `shown` items joined by `separator`, then " (+N more)" for the N left out."""
    text = separator.join(items[:shown])
    return text + (f" (+{len(items) - shown} more)" if len(items) > shown else "")


def loop_cell(doc: dict) -> str:
    """A model's repetition loops as a table cell: "2/10 (ref 1/10)", or "–" without --loops."""
    loops = doc.get("loops")
    if not loops:
        return "–"
    reference = (
        f" (ref {loops['reference_looped']}/{loops['total']})" if loops.get("reference_looped") is not None else ""
    )
    return f"{loops['looped']}/{loops['total']}{reference}"


def add_loop_column(lines: list[str], docs: list[dict]) -> None:
    """Append a Loops column to the markdown table that ends `lines` (a header, a rule, one row per
    doc in order) and the note saying what it counts, when any doc was evaluated with --loops."""
    if not any(d.get("loops") for d in docs):
        return
    start = len(lines) - len(docs) - 2
    lines[start] += " Loops |"
    lines[start + 1] += "---|"
    for i, doc in enumerate(docs):
        lines[start + 2 + i] += f" {loop_cell(doc)} |"
    lines += ["", loop_note(next(d["loops"] for d in docs if d.get("loops")))]


def loop_note(loops: dict) -> str:
    """What the Loops column counts, in one sentence."""
    d = loops["detector"]
    return (
        f"Loops: prompts ({loops['prompts_from']}) whose greedy continuation of "
        f"{loops['tokens']} tokens ends in a block of p <= {d['max_period']} tokens "
        f"repeated over at least max({d['min_tokens']} tokens, "
        f"{d['min_repeats']} repeats); the reference's count in brackets."
    )
