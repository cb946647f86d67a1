"""The one progress event of every long operation, and the sink protocol that receives it.

Library code never prints: it calls a sink with `Event`s, and the command line renders every
stage as one bar (bytes for I/O, tokens for calibration, chunks for evaluation, rungs for
ladders). A stage is identified by its name; `done` is cumulative within the stage.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

UNITS = ("bytes", "tokens", "chunks", "rungs", "tensors", "percent", "steps")


@dataclass(frozen=True)
class Event:
    stage: str  # what is being done, e.g. "copy", "hash source", "rung Q4_K_M"
    done: int  # units finished so far in this stage
    total: int  # units this stage will do; 0 when not known ahead
    unit: str = "bytes"  # one of UNITS
    message: str = ""  # optional detail: the current tensor, a status, a warning


class Sink(Protocol):
    def __call__(self, event: Event) -> None: ...


def ignore(event: Event) -> None:
    """The sink of callers that do not watch progress."""


class Counter:
    """Turns increments into cumulative events of one stage; safe to call from several threads."""

    def __init__(self, sink: Sink, stage: str, total: int = 0, unit: str = "bytes") -> None:
        self.sink, self.stage, self.total, self.unit = sink, stage, total, unit
        self.done = 0
        self._lock = threading.Lock()

    def __call__(self, n: int, message: str = "") -> None:
        with self._lock:
            self.done += n
            event = Event(self.stage, self.done, self.total, self.unit, message)
        self.sink(event)

    def note(self, message: str) -> None:
        """An event that carries a message and no progress."""
        self.sink(Event(self.stage, self.done, self.total, self.unit, message))
