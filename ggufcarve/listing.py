"""Small pieces every report shares: the Pareto front of models by size and a quality figure, and a
list shortened to its first items with the count of the rest."""

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
        if not front or value(item) < value(front[-1]) or (value(item) == value(front[-1]) and size(item) == size(front[-1])):
            front.append(item)
    return front


def shortened(items: Sequence[str], shown: int, separator: str = "; ") -> str:
    """The first `shown` items joined by `separator`, then " (+N more)" for the N left out."""
    text = separator.join(items[:shown])
    return text + (f" (+{len(items) - shown} more)" if len(items) > shown else "")
