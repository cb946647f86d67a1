"""The one error family ggufcarve raises: a message saying what and where, and a hint saying what next."""

from __future__ import annotations


class CarveError(Exception):
    """Base error: `message` says what went wrong and where, `hint` the next step."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message


class BadInput(CarveError):
    """An input file or argument is malformed or inconsistent."""


class UnsupportedModel(CarveError):
    """The model is valid GGUF but ggufcarve cannot prune it safely."""


class OutputError(CarveError):
    """The output cannot be written (exists, unwritable, disk full)."""


class VerificationFailed(CarveError):
    """A written file does not match what the plan promised."""


class ToolMissing(CarveError):
    """A llama.cpp tool or library is not available."""


class ToolFailed(CarveError):
    """A llama.cpp tool ran and failed."""


class DeviceOutOfMemory(ToolFailed):
    """A llama.cpp child could not allocate its buffers on a device, with what it was loading: the
    `model` path, its placement (`compute`, a llama.devices.Compute) and its context (`n_ctx`, None
    when the request does not say), so that a placement that fits can be answered."""

    def __init__(self, message: str, hint: str, *, model: str, compute: object, n_ctx: int | None) -> None:
        super().__init__(message, hint)
        self.model = model
        self.compute = compute
        self.n_ctx = n_ctx


class Interrupted(BaseException):
    """A signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP) stopped the run.

    A BaseException, as KeyboardInterrupt is: `except Exception` handlers let it through, while
    `finally` blocks and context managers delete temp files and kill llama.cpp children on the way
    out. The command line exits with 128 + the signal number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
