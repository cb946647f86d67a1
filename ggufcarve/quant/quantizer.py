"""llama.cpp's quantizer, two backends: llama-quantize (binary) and llama_model_quantize in a child (libllama)."""

from __future__ import annotations

import os
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ggufcarve.errors import BadInput, ToolFailed, ToolMissing
from ggufcarve.llama import launch
from ggufcarve.llama.tools import (
    ToolInfo,
    _is_executable,
    libllama_info,
    llama_cpp_version,
    locate_tool,
    probe_tool,
    require_tool,
)

# tensor_requires_imatrix in src/llama-quant.cpp: the target types whose quantization without
# importance data llama.cpp refuses ("this quantization requires an imatrix!" when no imatrix is
# given, "Missing importance matrix for tensor ..." when the given one lacks the tensor's entry),
# Q2_K only inside a Q2_K_S file, and never for the token embeddings or the output matrix.
IMATRIX_TYPES = frozenset({"IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"})
NEVER_NEEDS_IMATRIX = frozenset({"token_embd.weight", "per_layer_token_embd.weight", "output.weight"})
# The file types whose type choice (llama_tensor_get_type_impl) gives some tensors of an ordinary
# model a type in IMATRIX_TYPES: their default type, or IQ3_XXS for attn_q/attn_k/ffn_gate/ffn_up
# in IQ3_XS, or Q2_K in Q2_K_S. Only a prediction before the dry run; the dry run's per-tensor
# target types decide.
IMATRIX_FTYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"})


def tensor_requires_imatrix(tensor_name: str, target_type: str, ftype: str) -> bool:
    """llama.cpp's tensor_requires_imatrix: does quantizing `tensor_name` to `target_type` in a
    file of type `ftype` need its imatrix entry? (Types and ftypes by name, any case.)"""
    if tensor_name in NEVER_NEEDS_IMATRIX:
        return False
    target = target_type.upper()
    if target == "Q2_K":
        return ftype.upper() == "Q2_K_S"
    return target in IMATRIX_TYPES


@dataclass(frozen=True)
class QuantizeJob:
    """One llama-quantize invocation, backend-independent."""

    source: Path
    output: Path | None  # None for a dry run
    ftype: str  # llama-quantize ftype name, e.g. "Q4_K_M"
    imatrix: Path | None = None
    allow_requantize: bool = True
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    tensor_types: tuple[tuple[str, str], ...] = ()  # (regex, ggml type), first match wins
    pure: bool = False
    dry_run: bool = False
    nthreads: int | None = None

    @property
    def cwd(self) -> Path | None:
        """The directory the quantizer runs in: the imatrix's, so that `--imatrix` is its bare name.

        llama-quantize stores the `--imatrix` argument verbatim in the output's
        `quantize.imatrix.file` key; run from there, a published rung names its imatrix without
        a local directory. Source and output are passed as absolute paths.
        """
        return Path(os.path.abspath(self.imatrix)).parent if self.imatrix is not None else None

    def flags(self, flavour: str = "llama.cpp", *, names_only: bool = False) -> list[str]:
        """The quantizer's arguments; `names_only` gives the form a release records (file names
        without directories), not one to run."""

        def file_arg(path: Path) -> str:
            return path.name if names_only else os.path.abspath(path)

        argv: list[str] = []
        if self.allow_requantize:
            argv.append("--allow-requantize")
        if self.pure:
            argv.append("--pure")
        if self.imatrix is not None:
            argv += ["--imatrix", self.imatrix.name]  # relative to self.cwd
        if self.output_tensor_type:
            argv += [
                "--output-tensor-type",
                self.output_tensor_type.lower() if flavour == "ik_llama.cpp" else self.output_tensor_type,
            ]
        if self.token_embedding_type:
            argv += [
                "--token-embedding-type",
                self.token_embedding_type.lower() if flavour == "ik_llama.cpp" else self.token_embedding_type,
            ]
        if self.tensor_types:
            if flavour == "ik_llama.cpp":
                argv += ["--custom-q", ",".join(f"{p}={t.lower()}" for p, t in self.tensor_types)]
            else:
                for pattern, type_name in self.tensor_types:
                    argv += ["--tensor-type", f"{pattern}={type_name}"]
        if self.dry_run:
            argv.append("--dry-run")
        argv.append(file_arg(self.source))
        if not self.dry_run:
            if self.output is None:
                raise RuntimeError(f"{self.ftype}: a quantize job that is not a dry run needs an output")
            argv.append(file_arg(self.output))
        argv.append(self.ftype.upper())
        if self.nthreads:
            argv.append(str(self.nthreads))
        return argv


@dataclass
class QuantizeRun:
    argv: list[str]
    returncode: int
    seconds: float
    tail: list[str]  # the last lines of the quantizer's output
    error: str | None  # the decisive error line, when it failed


# "[  12/ 733]                blk.0.attn_k.weight - [ 2048,   512,     1,     1], type =   q8_0, "
# llama-quantize prints a line per tensor; the largest expert tensor of a big model at an IQ type
# takes minutes, never an hour.
QUANTIZER_IDLE_TIMEOUT = 3600.0
TENSOR_LINE = re.compile(
    r"^\[\s*(?P<index>\d+)/\s*(?P<total>\d+)\]\s+(?P<name>\S+)\s+-\s+\[(?P<shape>[^\]]*)\],\s+type =\s*(?P<type>\S+?),"
)
DRY_RUN_SIZE = re.compile(r"size =\s*(?P<before>[\d.]+) MiB(?: ->\s*(?P<after>[\d.]+) MiB \((?P<target>[^)]+)\))?")
ERROR_PATTERNS = (
    re.compile(r"Missing importance matrix for tensor \S+.*"),
    re.compile(r"this quantization requires an imatrix!?"),
    re.compile(r"imatrix size \d+ is different from tensor size \d+ for \S+"),
    re.compile(r"requantizing from type \S+ is disabled"),
    re.compile(r"error loading model.*|failed to load model.*|llama_model_quantize: failed to quantize: .*"),
    re.compile(r"GGML_ASSERT.*"),
)


def find_error(lines: Sequence[str]) -> str | None:
    for pattern in ERROR_PATTERNS:
        for line in lines:
            if m := pattern.search(line):
                return m.group(0).strip()
    return None


class Quantizer(ABC):
    """A way of running llama.cpp's quantizer. Subclasses render argv; running is shared."""

    backend = ""
    timeout: float | None = None  # seconds for one rung; None: no limit (a big model takes hours)
    idle_timeout: float | None = QUANTIZER_IDLE_TIMEOUT

    @abstractmethod
    def argv(self, job: QuantizeJob, *, names_only: bool = False) -> list[str]:
        """The exact command line that quantizes `job` (run in `job.cwd`); with `names_only`, the
        form a release records: program and files by name, no local directories."""

    def child_env(self) -> dict[str, str]:
        """Environment the quantizer child needs on top of the launcher's."""
        return {}

    def recorded_argv(self, job: QuantizeJob, output: Path) -> list[str]:
        """The command a release records for `job`: file names only, and the final output name
        instead of the temp name the run writes to."""
        from dataclasses import replace

        return self.argv(replace(job, output=output), names_only=True)

    @abstractmethod
    def describe(self) -> dict[str, object]:
        """backend, path, version/build, sha256: recorded in the manifest."""

    def run(self, job: QuantizeJob, on_line: Callable[[str], None] | None = None) -> QuantizeRun:
        argv = self.argv(job)
        keep: list[str] = []  # lines that may carry the decisive error

        def watch(line: str) -> None:
            if "rror" in line or "imatrix" in line or "GGML_ASSERT" in line or "failed" in line:
                keep.append(line)
            if on_line is not None:
                on_line(line)

        finished = launch.run(
            argv, on_line=watch, timeout=self.timeout, idle_timeout=self.idle_timeout, cwd=job.cwd, env=self.child_env()
        )
        code = finished.returncode if not finished.timed_out else -9
        error = None if finished.ok else (find_error(keep + finished.tail) or finished.describe_failure())
        return QuantizeRun(argv, code, finished.seconds, finished.tail, error)

    def dry_run(self, job: QuantizeJob) -> DryRun:
        """Target type and size of every tensor, as the quantizer would choose them; nothing written.

        The job's imatrix is passed on: llama.cpp picks some target types by whether an imatrix
        is given at all (IQ3_XXS and IQ4_NL/IQ4_XS files, Q4_0/Q5_0 ffn_down), so the dry run of
        the real job is the one whose types decide which imatrix entries are needed.
        """
        from dataclasses import replace

        lines: list[str] = []
        result = self.run(replace(job, dry_run=True, output=None), lines.append)
        if result.returncode != 0:
            raise ToolFailed(
                f"{self.backend} quantizer dry run for {job.ftype} failed: {result.error}",
                "check that the source loads in llama.cpp and the rung's types are valid",
            )
        return parse_dry_run(lines, job.ftype)


# "llama_model_quantize_impl: WARNING: dry run completed successfully, but actually completing this
#  quantization will require an imatrix!"  (printed only when no imatrix was given)
DRY_RUN_IMATRIX_WARNING = "will require an imatrix"


@dataclass
class DryRun:
    ftype: str
    targets: dict[str, str]  # tensor -> target type (upper case); unchanged tensors keep their type
    quantized: set[str]  # tensors the quantizer converts
    size_bytes: int  # estimated tensor data of the output
    warned_imatrix_required: bool = False  # llama.cpp's own verdict of a dry run without an imatrix

    def needs_imatrix_entries(self) -> list[str]:
        """Tensors whose imatrix entry llama.cpp requires when an imatrix is given: the converted
        ones whose target type requires it (without an entry, "Missing importance matrix")."""
        return sorted(n for n in self.quantized if tensor_requires_imatrix(n, self.targets[n], self.ftype))

    def refused_without_imatrix(self) -> list[str]:
        """Tensors for which llama.cpp refuses the job when no imatrix is given at all: its check
        runs over every quantizable tensor's target type, converted or not."""
        return sorted(n for n, target in self.targets.items() if tensor_requires_imatrix(n, target, self.ftype))


def parse_dry_run(lines: Sequence[str], ftype: str) -> DryRun:
    targets: dict[str, str] = {}
    quantized: set[str] = set()
    size = 0.0
    warned = False
    for line in lines:
        m = TENSOR_LINE.match(line)
        if not m:
            warned = warned or DRY_RUN_IMATRIX_WARNING in line
            continue
        s = DRY_RUN_SIZE.search(line, m.end())
        if s and s["after"]:
            targets[m["name"]] = s["target"].upper()
            quantized.add(m["name"])
            size += float(s["after"])
        else:
            targets[m["name"]] = m["type"].upper()
            size += float(s["before"]) if s else 0.0
    return DryRun(ftype.upper(), targets, quantized, int(size * 2**20), warned)


class BinaryQuantizer(Quantizer):
    backend = "binary"

    def __init__(self, path: Path, info: ToolInfo | None = None) -> None:
        self.path = Path(os.path.abspath(path))  # the quantizer runs in the imatrix's directory
        self.tool = info or probe_tool(self.path, "llama-quantize", "given")
        if not self.tool.works:
            raise ToolMissing(
                f"{self.path} does not behave like llama-quantize ({self.tool.note})",
                "pass the llama-quantize binary, or --quantizer libllama",
            )

    @property
    def flavour(self) -> str:
        return self.tool.flavour

    def argv(self, job: QuantizeJob, *, names_only: bool = False) -> list[str]:
        return [self.path.name if names_only else str(self.path), *job.flags(self.tool.flavour, names_only=names_only)]

    def describe(self) -> dict[str, object]:
        t = self.tool
        return {
            "backend": self.backend,
            "path": t.path,
            "version": t.version,
            "build": t.build_number,
            "commit": t.commit,
            "flavour": t.flavour,
            "sha256": t.sha256,
        }


class LibllamaQuantizer(Quantizer):
    backend = "libllama"
    flavour = "llama.cpp"

    def __init__(self) -> None:
        lib = libllama_info()
        if lib is None:
            raise ToolMissing(
                "llama-cpp-python's libllama was not found", "pip install llama-cpp-python, or use --quantizer binary"
            )
        self.lib = lib

    def argv(self, job: QuantizeJob, *, names_only: bool = False) -> list[str]:
        return [
            Path(sys.executable).name if names_only else sys.executable,
            "-m",
            "ggufcarve.llama.quantize_child",
            *job.flags("llama.cpp", names_only=names_only),
        ]

    def child_env(self) -> dict[str, str]:
        # the child runs in the imatrix's directory: it must import this ggufcarve, wherever it lives
        package_root = str(Path(__file__).resolve().parents[2])
        inherited = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": package_root + (os.pathsep + inherited if inherited else "")}

    def describe(self) -> dict[str, object]:
        version = llama_cpp_version()
        return {
            "backend": self.backend,
            "path": self.lib["path"],
            "version": version,
            "build": None,
            "commit": None,
            "flavour": "llama.cpp",
            "sha256": self.lib["sha256"],
            "python": sys.executable,
        }


def make_quantizer(choice: str = "auto", llama_cpp_dir: str | os.PathLike[str] | None = None) -> Quantizer:
    """`auto` prefers a found llama-quantize binary, else libllama; `binary`, `libllama`, or a PATH to a binary."""
    if choice == "libllama":
        return LibllamaQuantizer()
    if choice in ("auto", "binary"):
        found = locate_tool("llama-quantize", llama_cpp_dir)
        if found is not None:
            return BinaryQuantizer(found[0], probe_tool(found[0], "llama-quantize", found[1]))
        if choice == "binary":
            require_tool("llama-quantize", llama_cpp_dir)
        return LibllamaQuantizer()
    path = Path(choice).expanduser()
    if not _is_executable(path):
        raise BadInput(
            f"--quantizer {choice}: not auto, binary, libllama or an executable file",
            "give one of auto|binary|libllama or the path of llama-quantize",
        )
    return BinaryQuantizer(path.resolve(), probe_tool(path.resolve(), "llama-quantize", "--quantizer"))
