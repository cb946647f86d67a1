"""The settings layer: every option that more than one command takes, and every key of a run plan,
defined once as a `Setting`: its name (the plan key; the flag is `--name` with dashes), its unit
(how a value is read from a command line and from TOML, and what it must be) and its help.

The command line's options are made from these (`cli.options.option`), the plan's tables are
dataclasses whose fields name them (`pipeline.plan`), and the docs' table of plan keys is written
from them (`plan_keys_markdown`), so a name means one thing, in one unit, with one error, wherever
it is spelled:

    --ctx 1          ->  --ctx must be an integer >= 2 (got '1')
    ctx = 1          ->  [evaluation] ctx must be an integer >= 2 (got 1)

A command adds a sentence saying what the setting does there (`detail`); an option only one
command has and no plan names stays with that command.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.llama.devices import AUTO, CPU, Compute, parse_endpoints, parse_split

PLAN_HINT = "see plans/*.toml for complete examples"


# ---------------------------------------------------------------------------------------------
# units: how a value is read from a command line (text) and from a plan (TOML), and what it must be


class Unit:
    """A kind of value. `what` completes "must be ..." in both sources' errors; `example` is a
    value a hint shows."""

    what = "a value"
    metavar = "TEXT"
    example = "..."
    toml_form = '"{}"'  # how an example is written in TOML

    def from_text(self, text: str) -> Any:
        return text

    def from_toml(self, value: Any, base: Path) -> Any:
        if not isinstance(value, str):
            raise ValueError
        return self.from_text(value)

    def text_example(self) -> str:
        """A value a hint shows on a command line."""
        return self.example

    def toml_example(self) -> str:
        return self.toml_form.format(self.text_example())


@dataclass(frozen=True)
class Count(Unit):
    """A whole number at least `minimum`."""

    example: str = "..."
    minimum: int = 0
    metavar = "N"
    toml_form = "{}"

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"an integer >= {self.minimum}"

    def from_text(self, text: str) -> int:
        return self._checked(int(text.strip()))

    def from_toml(self, value: Any, base: Path) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError
        return self._checked(value)

    def _checked(self, value: int) -> int:
        if value < self.minimum:
            raise ValueError
        return value

    def text_example(self) -> str:
        return self.example if self.example != "..." else str(max(self.minimum, 1))


@dataclass(frozen=True)
class Layers(Count):
    """`auto` (AUTO: placed on the devices present) or a whole number of layers."""

    example: str = "auto"
    metavar = "auto|N"
    toml_form = '"{}"'

    @property
    def what(self) -> str:  # type: ignore[override]
        return "auto or an integer >= 0"

    def from_text(self, text: str) -> int:
        return AUTO if text.strip().lower() == "auto" else self._checked(int(text.strip()))

    def from_toml(self, value: Any, base: Path) -> int:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return AUTO
        return super().from_toml(value, base)


@dataclass(frozen=True)
class Fraction(Unit):
    """A number in (0, 1]."""

    what = "a number in (0, 1]"
    metavar = "R"
    toml_form = "{}"
    example: str = "0.5"

    def from_text(self, text: str) -> float:
        return self._checked(float(text))

    def from_toml(self, value: Any, base: Path) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        return self._checked(float(value))

    @staticmethod
    def _checked(value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError
        return value


@dataclass(frozen=True)
class Positive(Fraction):
    """A finite number > 0 (Fraction's reading without its upper bound)."""

    what = "a number > 0"
    metavar = "X"
    example: str = "2"

    @staticmethod
    def _checked(value: float) -> float:
        if not 0 < value < float("inf"):
            raise ValueError
        return value


@dataclass(frozen=True)
class Text(Unit):
    """A non-empty string on one line."""

    example: str = "..."
    what = "a non-empty string"

    def from_text(self, text: str) -> str:
        if not text.strip() or "\n" in text:
            raise ValueError
        return text


@dataclass(frozen=True)
class Choice(Unit):
    """One of `choices`, case-insensitive; the value is the choice as listed."""

    choices: tuple[str, ...] = ()

    @property
    def what(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(self.choices)

    @property
    def example(self) -> str:  # type: ignore[override]
        return self.choices[0]

    @property
    def metavar(self) -> str:  # type: ignore[override]
        return "|".join(self.choices).upper() if len(self.choices) <= 3 else "NAME"

    def from_text(self, text: str) -> str:
        for choice in self.choices:
            if text.strip().lower() == choice.lower():
                return choice
        raise ValueError


TOPK_AUTO = "auto"


@dataclass(frozen=True)
class UsedCounts(Unit):
    """Experts routed per token: one count, several comma-separated (a list in a plan), or `auto`; the value is
    the tuple of counts, or "auto"."""

    example: str = "4"
    what = "an integer >= 1, several comma-separated, or auto"
    metavar = "N"
    toml_form = "{}"

    def from_text(self, text: str) -> tuple[int, ...] | str:
        if text.strip().lower() == TOPK_AUTO:
            return TOPK_AUTO
        counts = tuple(int(part.strip()) for part in text.split(","))
        if not counts or any(count < 1 for count in counts):
            raise ValueError
        return tuple(dict.fromkeys(counts))

    def from_toml(self, value: Any, base: Path) -> tuple[int, ...] | str:
        if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return self.from_text(",".join(map(str, value)))
        if isinstance(value, int) and not isinstance(value, bool):
            return self.from_text(str(value))
        if isinstance(value, str):
            return self.from_text(value)
        raise ValueError


def one_used_count(value: tuple[int, ...] | str | None, label: str = "--topk") -> int | None:
    """The one count a command that writes files takes from --topk (`label`: the option or plan key; None: not
    given)."""
    if value is None:
        return None
    if value == TOPK_AUTO or len(value) != 1:
        shown = value if isinstance(value, str) else ",".join(map(str, value))
        raise BadInput(
            f"{label} {shown}: a written file is routed to one count of experts per token",
            "give one, for example 4 (best weighs several, or auto)",
        )
    return value[0]


@dataclass(frozen=True)
class Flag(Unit):
    """On or off: a flag on the command line, true or false in a plan."""

    what = "true or false"
    metavar = ""
    example = "true"
    toml_form = "{}"

    def from_toml(self, value: Any, base: Path) -> bool:
        if not isinstance(value, bool):
            raise ValueError
        return value


@dataclass(frozen=True)
class File(Unit):
    """A path: on a command line as given, in a plan relative to the plan file. `exists`: it must
    be there when read (an input)."""

    example: str = "..."
    what = "a path"
    metavar = "PATH"
    exists: bool = True

    def from_text(self, text: str) -> Path:
        if not text.strip():
            raise ValueError
        path = Path(os.path.expanduser(text))
        if self.exists and not path.exists():
            raise Missing(path)
        return path

    def from_toml(self, value: Any, base: Path) -> Path:
        if not isinstance(value, str) or not value.strip():
            raise ValueError
        path = Path(os.path.expanduser(value))
        path = path if path.is_absolute() else base / path
        if self.exists and not path.exists():
            raise Missing(path)
        return path


@dataclass(frozen=True)
class Files(File):
    """Paths: on a command line the option is repeated (a path each time); in a plan one path or a
    list of them."""

    what = "a path or a list of paths"
    toml_form = '["{}"]'

    def from_toml(self, value: Any, base: Path) -> tuple[Path, ...]:  # type: ignore[override]
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values:
            raise ValueError
        return tuple(File.from_toml(self, v, base) for v in values)


@dataclass(frozen=True)
class Names(Unit):
    """A list of names: repeated or comma-separated on a command line, a list (or one
    comma-separated string) in a plan; the value is the comma-joined names, as written."""

    example: str = "..."
    what = "names, comma-separated or a list of strings"
    metavar = "NAMES"
    toml_form = '["{}"]'

    def from_text(self, text: str) -> str:
        names = [n.strip() for n in text.split(",")]
        if not names or not all(names):
            raise ValueError
        return ",".join(names)

    def from_toml(self, value: Any, base: Path) -> str:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise ValueError
        return self.from_text(",".join(values))


COUNTS = re.compile(r"[\d\s,/-]+")


@dataclass(frozen=True)
class Keep:
    """What a keep setting names: counts (as written: the command checks them against the model)
    or a keep-set file."""

    counts: str | None = None
    file: Path | None = None


@dataclass(frozen=True)
class KeepUnit(Unit):
    """Experts kept per MoE block: a count (8), a list of counts (8,12 or 64-192/32) or a keep-set
    file; in a plan also a list of integers."""

    what = "a count (8), a list of counts (8,12 or 64-192/32) or a keep-set file"
    metavar = "K|LIST|FILE"
    toml_form = "{}"
    example: str = "128"

    def from_text(self, text: str) -> Keep:
        return self._read(text, None)

    def from_toml(self, value: Any, base: Path) -> Keep:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return Keep(counts=str(value))
        if isinstance(value, list):
            if not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
                raise ValueError
            return Keep(counts=",".join(str(v) for v in value))
        if not isinstance(value, str):
            raise ValueError
        return self._read(value, base)

    @staticmethod
    def _read(text: str, base: Path | None) -> Keep:
        """Counts when the text is digits, commas, ranges and steps; else a keep-set file (relative to
        `base` when given), which must exist."""
        value = text.strip()
        if COUNTS.fullmatch(value) and any(c.isdigit() for c in value):
            return Keep(counts=value)
        path = Path(os.path.expanduser(value))
        path = path if base is None or path.is_absolute() else base / path
        if not path.is_file():
            if path.suffix or "/" in value:
                raise Missing(path)
            raise ValueError
        return Keep(file=path)


MEMORY_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,  # a bare letter is binary, as `free -h` and llama.cpp print
}
MEMORY_SIZE = re.compile(r"\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-z]*)\s*")


def parse_memory(text: str, flag: str = "--memory", allow_zero: bool = False) -> int:
    """'24GiB', '24GB', '24000MiB', '23.5G', '25769803776B' -> bytes (GB decimal, GiB and bare G binary).
    A number without a unit is refused: 24 would be 24 bytes. Zero only with `allow_zero`."""
    match = MEMORY_SIZE.fullmatch(text or "")
    unit = match["unit"].upper() if match else ""
    if match and float(match["number"]) == 0 and not allow_zero:
        raise BadInput(
            f"{flag} {text!r}: a budget of nothing", "write a positive size like 24GiB (GB = 10^9 bytes, GiB = 2^30)"
        )
    if match and not unit:
        raise BadInput(
            f"{flag} {text!r} has no unit",
            f"write it like {match['number']}GiB (or {match['number']}GB = 10^9 bytes, {match['number']}B for bytes)",
        )
    if (
        not match
        or unit not in MEMORY_UNITS
        or float(match["number"]) <= 0
        and not (allow_zero and float(match["number"]) == 0)
    ):
        raise BadInput(
            f"{flag} {text!r} is not a memory size",
            "write it like 24GiB, 24GB or 24000MiB (GB = 10^9 bytes, GiB = 2^30)",
        )
    return int(float(match["number"]) * MEMORY_UNITS[unit])


def parse_margin(text: str, flag: str = "--gpu-margin") -> int:
    """'1GiB', '512MiB', '0', '0MiB' -> bytes: a size as parse_memory reads it, zero with or without a unit."""
    return 0 if text.strip() == "0" else parse_memory(text, flag, allow_zero=True)


class Budgets(tuple):
    """Memory budgets, bytes per device (a tuple of ints), and the device each one names (`names`:
    empty where they were given in the one device order, the first offload devices)."""

    names: tuple[str, ...]

    def __new__(cls, sizes: Any = (), names: Any = ()) -> Budgets:
        made = super().__new__(cls, sizes)
        made.names = tuple(names)
        return made

    def __repr__(self) -> str:
        return f"Budgets({tuple(self)!r}, names={self.names!r})"


DEVICE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def parse_memories(text: str, flag: str = "--gpu-memory") -> Budgets:
    """'8GiB,8GiB,10GiB' -> bytes per device in device order; 'CUDA0=20GiB,CUDA1=8GiB' -> bytes per
    device named (each size as parse_memory reads it)."""
    parts = [part.strip() for part in text.split(",")]
    hint = "write it like 24GiB, 8GiB,8GiB,10GiB (one per GPU in device order) or CUDA0=20GiB,CUDA1=8GiB"
    if not parts or not all(parts):
        raise BadInput(f"{flag} {text!r} is not a list of sizes", hint)
    named = [part.partition("=") for part in parts]
    if any(sep for _, sep, _ in named):
        if not all(sep and DEVICE_NAME.match(name.strip()) for name, sep, _ in named):
            raise BadInput(f"{flag} {text!r}: give every size a device, or none", hint)
        names = [name.strip() for name, _, _ in named]
        if len(set(names)) != len(names):
            raise BadInput(f"{flag} {text!r} names a device twice", "give each device one budget")
        return Budgets((parse_memory(size.strip(), flag) for _, _, size in named), names)
    return Budgets(parse_memory(part, flag) for part in parts)


@dataclass(frozen=True)
class Size(Unit):
    """A memory size with its unit: 24GiB, 24GB, 24000MiB (GB = 10^9 bytes, GiB and a bare G = 2^30);
    the value is bytes."""

    what = "a memory size such as 24GiB"
    metavar = "SIZE"
    example: str = "24GiB"


@dataclass(frozen=True)
class Endpoints(Unit):
    """RPC servers: HOST:PORT, comma-separated on a command line, a list (or one comma-separated
    string) in a plan; the value is the tuple of endpoints."""

    what = "HOST:PORT[,HOST:PORT...]"
    metavar = "HOST:PORT[,...]"
    example: str = "127.0.0.1:50052"
    toml_form = '["{}"]'

    def from_text(self, text: str) -> tuple[str, ...]:
        try:
            return parse_endpoints(text)
        except BadInput:
            raise ValueError from None

    def from_toml(self, value: Any, base: Path) -> tuple[str, ...]:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise ValueError
        return self.from_text(",".join(values))


@dataclass(frozen=True)
class Shares(Unit):
    """Proportions, one per device (llama.cpp's -ts 3,1): comma-separated on a command line, a list
    of numbers in a plan."""

    what = "shares such as 1,1 or 3,1 (one per device)"
    metavar = "R,R[,...]"
    example: str = "1,1"
    toml_form = "[{}]"

    def from_text(self, text: str) -> tuple[float, ...]:
        try:
            return parse_split(text)
        except BadInput:
            raise ValueError from None

    def from_toml(self, value: Any, base: Path) -> tuple[float, ...]:
        if not isinstance(value, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            raise ValueError
        return self.from_text(",".join(str(v) for v in value))


@dataclass(frozen=True)
class Margin(Size):
    """The memory kept free on each device: a size as Size reads it, or zero (0, 0MiB); the value is bytes."""

    what = "a memory size such as 1GiB, or 0"
    example: str = "1GiB"


@dataclass(frozen=True)
class Sizes(Unit):
    """Memory sizes, one per device in device order (24GiB or 8GiB,8GiB,10GiB) or per device named
    (CUDA0=20GiB,CUDA1=8GiB); the value is Budgets (a tuple of bytes and the names)."""

    what = "memory sizes such as 24GiB, 8GiB,8GiB (one per GPU) or CUDA0=20GiB,CUDA1=8GiB"
    metavar = "SIZE[,SIZE...]|DEVICE=SIZE[,...]"
    example: str = "24GiB"


class Missing(Exception):
    """A path a setting reads is not there."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


# ---------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class Setting:
    """One named setting: the plan key `name`, the flag `--name` (dashes for underscores)."""

    name: str
    unit: Unit
    help: str
    short: str | None = None  # a one-letter flag beside the long one

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse_text(self, text: Any) -> Any:
        """A command line's value (typer hands a default through as it is)."""
        if not isinstance(text, str):
            return text
        if isinstance(self.unit, Margin):
            return parse_margin(text, self.flag)
        if isinstance(self.unit, Size):
            return parse_memory(text, self.flag)
        if isinstance(self.unit, Sizes):
            return parse_memories(text, self.flag)
        return self._read(
            lambda: self.unit.from_text(text),
            self.flag,
            repr(text),
            f"for example {self.flag} {self.unit.text_example()}",
        )

    def parse_toml(self, value: Any, where: str, base: Path, key: str | None = None) -> Any:
        """A plan's value of this setting in the table `where` ("[evaluation]"; "plan" at the top),
        under its own name or the table's `key` for it."""
        name = key or self.name
        label = f"{where} {name}" if where != "plan" else name
        if isinstance(self.unit, Margin) and isinstance(value, (str, int)) and not isinstance(value, bool):
            return parse_margin(str(value), label)
        if isinstance(self.unit, Size) and isinstance(value, str):
            return parse_memory(value, label)
        if isinstance(self.unit, Sizes) and isinstance(value, (str, list)):
            return parse_memories(value if isinstance(value, str) else ",".join(map(str, value)), label)
        hint = f"for example {name} = {self.unit.toml_example()}"
        return self._read(lambda: self.unit.from_toml(value, base), label, repr(value), hint, plan=True)

    def _read(self, read: Callable[[], Any], label: str, shown: str, example: str, plan: bool = False) -> Any:
        try:
            return read()
        except Missing as missing:
            raise BadInput(
                f"{label} {shown}: no such file ({missing.path})",
                "paths in a plan are relative to the plan file" if plan else "check the path",
            ) from None
        except (ValueError, KeyError, TypeError):
            raise BadInput(f"{label} must be {self.unit.what} (got {shown})", example) from None


def key(setting: Setting, default: Any = None) -> Any:
    """A settings dataclass's field read as `setting`, with its default (in a plan table the field's
    name is the TOML key)."""
    return field(default=default, metadata={"setting": setting})


def required(setting: Setting) -> Any:
    """A settings dataclass's field without a default, read as `setting`."""
    return field(metadata={"setting": setting})


def setting_of(table_field: Any) -> Setting:
    return table_field.metadata["setting"]


def read_table(table: type, doc: Any, where: str, base: Path, extra: tuple[str, ...] = ()) -> Any:
    """A plan table (a dataclass whose fields are `key`s) from its TOML mapping: every key checked
    against the fields and the `extra` names (an unknown key is a typo), every value read by its
    setting."""
    if not isinstance(doc, dict):
        raise BadInput(f"{where} must be a table", PLAN_HINT)
    names = [f.name for f in fields(table) if "setting" in f.metadata] + list(extra)
    unknown = sorted(set(doc) - set(names))
    if unknown:
        from ggufcarve.listing import shortened

        raise BadInput(
            f"{where}: unknown key " + shortened([repr(k) for k in unknown], 1),
            f"the keys of {where} are {', '.join(names)}",
        )
    values = {}
    for f in fields(table):
        if f.name in doc and "setting" in f.metadata and doc[f.name] is not None:
            values[f.name] = setting_of(f).parse_toml(doc[f.name], where, base, f.name)
    return table(**values)


def table_keys(table: type) -> list[tuple[str, Setting, Any]]:
    """(key, setting, default) of every key of a plan table, in the table's order."""
    return [
        (f.name, setting_of(f), None if f.default is MISSING else f.default)
        for f in fields(table)
        if "setting" in f.metadata
    ]


# The settings. Each help says what the setting is; a command's option adds what it does there.

THREADS = Setting(
    "threads",
    Count(minimum=1),
    "CPU threads of every llama.cpp child the command runs: calibration, scoring, quantizing "
    "(default: the physical cores).",
    short="-t",
)
GPU_LAYERS = Setting(
    "gpu_layers",
    Layers(),
    "Layers every llama.cpp child that loads a model offloads to the devices (llama.cpp's -ngl). auto, the "
    "default: as many as fit the devices present (GPUs of the installed backend, --rpc servers) in their free "
    "memory less llama.cpp's 1 GiB margin, the routed experts of the first blocks in system memory where the "
    "model is larger (llama.cpp's --fit on); the CPU where there is no device. 0: all on the CPU; 99: all.",
)
RPC = Setting(
    "rpc",
    Endpoints(),
    "RPC servers whose devices every llama.cpp child adds (llama.cpp's --rpc; ggml-rpc-server -H HOST -p PORT "
    "on each), e.g. 127.0.0.1:50052,127.0.0.1:50053.",
)
TENSOR_SPLIT = Setting(
    "tensor_split",
    Shares(),
    "How the offloaded layers are shared between the devices, one share each in device order (llama.cpp's -ts), "
    "e.g. 1,1. Default: by their free memory.",
)
N_CPU_MOE = Setting(
    "n_cpu_moe",
    Count(minimum=0, example="12"),
    "Keep the routed experts of the first N MoE blocks in system memory while --gpu-layers offloads the "
    "rest (llama.cpp's --n-cpu-moe): a model larger than the GPU runs on it.",
)
COMPUTE_SETTINGS = (THREADS, GPU_LAYERS, RPC, TENSOR_SPLIT, N_CPU_MOE)  # the fields of llama.devices.Compute


def compute(
    threads: int | None = None,
    gpu_layers: int | None = None,
    rpc: tuple[str, ...] | None = None,
    tensor_split: tuple[float, ...] | None = None,
    n_cpu_moe: int | None = None,
    devices: tuple[str, ...] = (),
) -> Compute:
    """The one `Compute` of a run, from its five settings (None: not given; --gpu-layers then auto)
    and the devices its budgets are for (none: every offload device)."""
    return Compute(
        AUTO if gpu_layers is None else gpu_layers,
        tuple(rpc or ()),
        tuple(tensor_split or ()),
        threads or 0,
        n_cpu_moe or 0,
        tuple(devices),
    )


def compute_key() -> Any:
    """A settings dataclass's field holding the run's `Compute`, read from the COMPUTE_SETTINGS."""
    return field(default=CPU, metadata={"settings": COMPUTE_SETTINGS})


CTX = Setting("ctx", Count(minimum=2, example="512"), "Context length in tokens:")
BENCH_DEPTH = Setting(
    "bench_depth",
    Count(minimum=0, example="8192"),
    "Tokens already in the context when llama-bench times decode and prompt speed (its -d; default: half of "
    "--ctx, the depth a run of that context meets on average).",
)
CHUNK_CTX = Setting(
    "chunk_ctx",
    Count(minimum=2, example="512"),
    "Tokens per chunk of the calibration pass and of the held-out scoring (as llama-perplexity -c), "
    "where it can differ from --ctx.",
)
CHUNKS = Setting("chunks", Count(minimum=1, example="32"), "Use at most this many chunks of each text file:")
MAX_TOKENS = Setting(
    "max_tokens", Count(minimum=1, example="65536"), "Trace at most this many calibration tokens (whole chunks)."
)
CALIBRATION = Setting("calibration", Files(example="calibration.jsonl"), "Calibration text or JSONL file (repeatable).")
HELDOUT = Setting("heldout", Files(example="heldout.txt"), "Held-out text (repeatable): each file is its own segment.")
KEEP = Setting("keep", KeepUnit(), "Experts kept per MoE block:", short="-k")
KEEP_FIRST = Setting(
    "keep_first",
    Count(minimum=1, example="64"),
    "Keep the first K experts of every MoE block (with grouped routing, the first K/groups of every group).",
)
KEEP_IDS = Setting("keep_ids", Text(example="0,2,4-7"), "Keep these ids in every MoE block, e.g. 0,2,4-7.")
METHOD = Setting(
    "method", Text(example="frequency"), "Selection criterion (ggufcarve select --help lists them).", short="-m"
)
METHODS = Setting(
    "methods",
    Names(example="reap"),
    "The criteria that compete: all, or a list such as reap,frequency,weights.",
)
Z = Setting(
    "z",
    Positive(),
    "Standard errors of the paired difference (over chunks) beyond which a candidate is worse "
    "(halving, ties, the search's moves); default 2:",
)
SEED = Setting("seed", Count(minimum=0, example="0"), "Seed of the random criterion.")
RATIO = Setting("ratio", Fraction(), "Fraction of the experts kept (instead of keep).")
PROTECT = Setting(
    "protect",
    Text(example="0,5,9-11"),
    "Never drop these experts: ids for every block (0,5,9-11) or a keep-set-like JSON file of ids per block.",
)
PROTECT_SUPER_EXPERTS = Setting(
    "protect_super_experts",
    Flag(),
    "Keep REAP's super experts (outlier maximum outputs, first 75% of the blocks).",
)
STABILITY = Setting(
    "stability",
    Flag(),
    "Also build each calibration method's keep-sets from each half of the calibration text (one more "
    "pass per half) and report their overlap per block.",
)
SEARCH = Setting(
    "search",
    Flag(),
    "Then search from each K's winner: swaps of one kept and one dropped expert in a block, ranked by HOPE's "
    "pairwise proxy, scored by masking on the calibration text, taken when better beyond noise.",
)
SEARCH_PASSES = Setting(
    "search_passes",
    Count(minimum=1, example="4"),
    "The search's budget in passes over the calibration text (chunks scored, cached ones too; default: what "
    "tune itself scored for the K, its calibration pass, held-out reference and tournament, at least 2).",
)
IMATRIX = Setting("imatrix", File(example="model.imatrix.gguf"), "An imatrix (GGUF or legacy .dat):")
COLLECT = Setting(
    "collect", Flag(), "Collect the imatrix from the calibration text (in the selection's pass when it traces)."
)
LADDER = Setting(
    "ladder", Text(example="q8-to-iq1"), "Ladder spec: a shipped name (q8-to-iq1) or a TOML path (default: q8-to-iq1)."
)
ONLY = Setting("only", Names(example="Q4_K_M"), "Only these (repeat or comma-separate):")
QUANTIZER = Setting(
    "quantizer",
    Text(example="auto"),
    "auto | binary | libllama | PATH to llama-quantize (auto prefers a found binary).",
)
LLAMA_CPP = Setting(
    "llama_cpp",
    File(example="~/llama.cpp"),
    "Directory holding llama.cpp tools (DIR, DIR/bin or DIR/build/bin). Env: GGUFCARVE_LLAMA_CPP.",
)
REFERENCE = Setting(
    "reference",
    File(example="model-Q8_0.gguf"),
    "The unpruned model (GGUF), a llama-perplexity --kl-divergence-base file or a top-k cache (.reflogp).",
)
QA = Setting(
    "qa", File(example="evaluation/qa"), "QA suite: a .jsonl file or a directory of them (e.g. evaluation/qa)."
)
GATE = Setting("gate", File(example="evaluation/gate.toml"), "Gate thresholds (TOML; default evaluation/gate.toml).")
SPEED_RUNS = Setting(
    "speed_runs",
    Count(minimum=0, example="5"),
    "Timed runs of pp and tg speed: the median is reported, or the range when the runs spread more than 10% "
    "of it; 0 skips speed.",
)
SPEED_ENGINE = Setting(
    "speed_engine",
    Choice(choices=("auto", "llama-bench", "libllama")),
    "auto (llama-bench when the tools have it, else in-process), llama-bench or libllama.",
)
TOP_K = Setting(
    "top_k",
    Count(minimum=1, example="128"),
    "Cache only the reference's top-K log-probs per token (and sampled tail tokens): a small cache, an "
    "estimated KLD. Default: every token, as llama-perplexity keeps them.",
)
TOPK = Setting(
    "topk",
    UsedCounts(),
    "Experts each token is routed to, {arch}.expert_used_count (default: the file's own; the trained value is "
    "recorded beside a written one):",
)
TAIL_SAMPLES = Setting(
    "tail_samples",
    Count(minimum=0, example="32"),
    "With top-k: tail tokens sampled per token; the KLD estimate is unbiased and its sampling error is printed "
    "(0: a lower bound).",
)
GATE_SEGMENTS = Setting(
    "gate_segments",
    Choice(choices=("every", "overall")),
    "With several held-out files: every (a model fails when any file fails the gate) or overall (the files' "
    "verdicts are only reported). Default: the gate file's `segments`, else overall.",
)
LOOPS = Setting(
    "loops",
    Flag(),
    "Continue the QA prompts (or the loop prompts) greedily and report the share that ends in a repeating "
    "cycle, for the reference and every model.",
)
LOOP_PROMPTS = Setting(
    "loop_prompts",
    File(example="prompts.txt"),
    "Prompts for the loops (implies them): one per line, asked as a user message, or a .jsonl file of "
    '{"prompt": raw text} or {"messages": [...]} objects.',
)
LOOP_TOKENS = Setting("loop_tokens", Count(minimum=1, example="256"), "New tokens per loop prompt (default 256).")
COMPARE_MODELS = Setting(
    "compare_models",
    Files(example="other-Q4_K_M.gguf"),
    "More models evaluated against the same reference (their own rows in the summary).",
)
UNPRUNED = Setting(
    "unpruned",
    Names(example="Q4_K_M"),
    "Rungs of the ladder spec also quantized from the unpruned source, compared at equal size.",
)
SOURCE = Setting(
    "source", File(example="model-Q8_0.gguf"), "The GGUF the work starts from (first shard if split; never modified):"
)
OUTPUT = Setting("output", File(exists=False, example="release"), "Where the outputs go:", short="-o")
WORK = Setting(
    "work",
    File(exists=False, example="release.work"),
    "Directory of intermediates (selection, pruned source, imatrices; default: OUTPUT.work).",
)
NAME = Setting(
    "name",
    Text(example="Qwen3.6-35B-A3B-128e"),
    "{model} in rung file names (default: the source name without its quant tag).",
)
CARD = Setting("card", Flag(), "Write the model card (or a [card] table of its settings).")
KEEPSET = Setting(
    "keepset",
    File(example="kept_expert_indices.json"),
    "A keep-set file: the experts kept, as given (the same as keep = FILE).",
)
BASE_MODEL = Setting(
    "base_model",
    Text(example="Qwen/Qwen3.6-35B-A3B"),
    "The base model's Hub repo id, OWNER/NAME (default: the GGUF's general.base_model.0.repo_url).",
)
LICENSE = Setting(
    "license",
    Text(example="apache-2.0"),
    "A Hub license identifier, e.g. apache-2.0 (default: the GGUF's general.license).",
)
LICENSE_NAME = Setting(
    "license_name",
    Text(example="my-license"),
    "With license other: the license's short name (default: general.license.name).",
)
LICENSE_LINK = Setting(
    "license_link",
    Text(example="LICENSE"),
    "With license other: its URL, or a file of the release such as LICENSE (default: general.license.link).",
)
MODEL_NAME = Setting(
    "model_name",
    Text(example="Qwen3.6-35B-A3B-128e"),
    "The card's title (default: the GGUF's general.basename and size label).",
)
REPO_ID = Setting(
    "repo_id",
    Text(example="you/Qwen3.6-35B-A3B-128e-GGUF"),
    "The Hub repo the release is uploaded to, OWNER/NAME (adds download and llama-server -hf lines).",
)
MEMORY = Setting(
    "memory",
    Size(),
    "Memory budget for what llama.cpp allocates (weights, KV cache, compute and output buffers), e.g. 24GiB, "
    "24GB, 24000MiB (GB = 10^9 bytes, GiB and a bare G = 2^30).",
)
GPU_MEMORY = Setting(
    "gpu_memory",
    Sizes(example="16GiB"),
    "GPU memory, one size per GPU in device order (16GiB or 8GiB,8GiB,10GiB; the order ggufcarve devices "
    "lists them) or per device named (CUDA0=20GiB,CUDA1=8GiB, RPC0=1GiB); a device without a budget is not used:",
)
GPU_MARGIN = Setting(
    "gpu_margin",
    Margin(),
    "GPU memory kept free on each device beyond weights, cache and compute buffers (default: llama.cpp "
    "--fit's target margin, 1GiB; 0 accepted):",
)
KV_TYPE = Setting("kv_type", Choice(choices=("f16", "q8_0")), "KV cache type for K and V: f16 or q8_0.")
QUIET = Setting("quiet", Flag(), "No progress output.", short="-q")
JSON = Setting("json", Flag(), "Print JSON (no progress output):")
FORCE = Setting("force", Flag(), "Replace what exists:")
DRY_RUN = Setting("dry_run", Flag(), "Write nothing:")
JOBS = Setting("jobs", Count(minimum=1, example="2"), "Jobs in parallel (default: the CPU count):", short="-j")
MERGE = Setting("merge", Flag(), "Merge several into one:")
SPLIT_MAX_SIZE = Setting(
    "split_max_size",
    Text(example="50G"),
    "Re-shard the output, e.g. 50G or 512M (decimal units, as llama-gguf-split).",
)
REPORT = Setting("report", File(exists=False, example="report.json"), "Where the report is written")
STRICT = Setting("strict", Flag(), "Fail (exit 1) for more than by default:")
MODEL = Setting("model", File(example="model.gguf"), "A GGUF model:")
FORMAT = Setting("format", Choice(choices=("gguf", "dat")), "The output imatrix's format: gguf or dat (legacy).")
CHUNK_SIZE = Setting("chunk_size", Count(minimum=1, example="512"), "Tokens per chunk of an imatrix:")
COMPARE = Setting("compare", Flag(), "Compare the two selection files given as arguments.")

SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        THREADS,
        GPU_LAYERS,
        RPC,
        TENSOR_SPLIT,
        N_CPU_MOE,
        CTX,
        CHUNK_CTX,
        CHUNKS,
        MAX_TOKENS,
        CALIBRATION,
        HELDOUT,
        KEEP,
        KEEP_FIRST,
        KEEP_IDS,
        METHOD,
        METHODS,
        SEED,
        RATIO,
        PROTECT,
        PROTECT_SUPER_EXPERTS,
        STABILITY,
        SEARCH,
        SEARCH_PASSES,
        IMATRIX,
        COLLECT,
        LADDER,
        ONLY,
        QUANTIZER,
        LLAMA_CPP,
        REFERENCE,
        QA,
        GATE,
        SPEED_RUNS,
        SPEED_ENGINE,
        TOP_K,
        TOPK,
        TAIL_SAMPLES,
        GATE_SEGMENTS,
        LOOPS,
        LOOP_PROMPTS,
        LOOP_TOKENS,
        COMPARE_MODELS,
        UNPRUNED,
        SOURCE,
        OUTPUT,
        WORK,
        NAME,
        CARD,
        KEEPSET,
        BASE_MODEL,
        LICENSE,
        LICENSE_NAME,
        LICENSE_LINK,
        MODEL_NAME,
        REPO_ID,
        MEMORY,
        GPU_MEMORY,
        GPU_MARGIN,
        BENCH_DEPTH,
        Z,
        KV_TYPE,
        QUIET,
        JSON,
        FORCE,
        DRY_RUN,
        JOBS,
        MERGE,
        SPLIT_MAX_SIZE,
        REPORT,
        STRICT,
        MODEL,
        FORMAT,
        CHUNK_SIZE,
        COMPARE,
    )
}
