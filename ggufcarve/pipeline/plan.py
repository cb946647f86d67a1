"""A run plan: one TOML file naming the source, the selection, the imatrix, the ladder and the
evaluation, parsed into a validated `RunPlan` before anything touches disk.

    source = "Qwen3.6-35B-A3B-Q8_0.gguf"      # every path is relative to the plan file
    output = "release"                       # the release directory
    # work = "release.work"                  # intermediates: selection, pruned source, imatrices
    # name = "Qwen3.6-35B-A3B-128e"          # {model} in rung file names

    [selection]
    method = "frequency"                     # or keepset = "kept_expert_indices.json"
    keep = 128                               # or ratio = 0.5
    # method = "tune"                        # measure instead: the tournament of `ggufcarve tune`
    # methods = ["reap", "frequency", "weights"]   # or "all" (the default)
    # keep = [128, 96, 64]                   # every K scored; the first K is carved
    # heldout = "tune-heldout.txt"           # default: [evaluation] heldout
    # chunks = 16                            # held-out chunks per file (default: [evaluation] chunks)
    # stability = true                       # keep-sets from each half of the calibration text

    [calibration]
    files = ["calibration.jsonl"]
    ctx = 512
    max_tokens = 512

    [imatrix]
    collect = true                           # or file = "model.imatrix.gguf" (llama-imatrix's)

    [ladder]
    spec = "q8-to-iq1"                       # a name in ladders/ or a path

    [evaluation]
    # heldout: or a list, each file its own segment; reference: the unpruned source unless given
    heldout = "heldout.txt"
    # gate_segments = "every"                # with several heldout files: a model fails when any file fails
    # loops = true                           # repetition loops of the QA prompts' greedy continuations
    # top_k = 128                            # a small reference cache and an estimated KLD (default: every token)

    [card]                                   # or card = false; each key defaults to the GGUF's general.* keys
    base_model = "Qwen/Qwen3.6-35B-A3B"
    license = "apache-2.0"                   # "other" also needs license_name and license_link
    # model_name, repo_id

Every key is checked (an unknown key is a typo, not something to ignore) and every file must exist;
the errors are one line with a hint, like every other command's.

`method = "tune"` runs `ggufcarve tune` as the plan's selection stage: one calibration pass scores
every criterion in `methods` ("all" or a list; default "all"), each criterion's keep-set at every K
in `keep` (a list, or one K) is scored against the unpruned model by masking, and the run carves
the winner at the first K listed (tune's `winner`, its `expert-selection.json`); the other K are
scored for the table and the cliff in tune.md, which the release publishes as method/tune.md
with the chart method/tune-kld.png. The keep-sets are scored on `heldout` (one file or a list),
by default the [evaluation] heldout file: then the release's evaluation is measured on the text
that chose the winner, which favours it; give a separate file for an unbiased evaluation. The
chunk size is [calibration] ctx (else [evaluation] ctx); `chunks` defaults to [evaluation] chunks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.listing import shortened

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PLAN_HINT = "see plans/*.toml for complete examples"
TUNE = "tune"  # [selection] method: the tournament of `ggufcarve tune`
TUNE_ONLY = ("methods", "heldout", "chunks", "stability")  # [selection] keys of method tune alone


@dataclass(frozen=True)
class SelectionStep:
    method: str | None  # None: the keep-set file is used as given
    keep: int | None
    ratio: float | None
    keepset: Path | None
    protect: str | None  # ids for every block (0,5,9-11), or the path of a keep-set-like file (resolved)
    protect_super_experts: bool
    seed: int
    protect_file: Path | None = None  # the protect file, when `protect` names one
    keeps: tuple[int, ...] = ()  # method tune: every K scored; keeps[0] is carved
    methods: tuple[str, ...] = ()  # method tune: the criteria that compete
    heldout: tuple[Path, ...] = ()  # method tune: the text the keep-sets are scored on
    chunks: int | None = None  # method tune: held-out chunks per file (None: all)
    stability: bool = False  # method tune: keep-sets from each half of the calibration text too

    @property
    def tunes(self) -> bool:
        return self.method == TUNE


@dataclass(frozen=True)
class CalibrationStep:
    files: tuple[Path, ...]
    ctx: int
    max_tokens: int | None


@dataclass(frozen=True)
class ImatrixStep:
    file: Path | None  # the unpruned model's imatrix, remapped to the kept experts
    collect: bool  # collected from the calibration text (in the selection's pass when it traces)


@dataclass(frozen=True)
class LadderStep:
    spec: Path
    only: tuple[str, ...]
    quantizer: str  # auto, binary, libllama, or the resolved path of a llama-quantize binary
    llama_cpp: Path | None


@dataclass(frozen=True)
class EvaluationStep:
    heldout: Path | tuple[Path, ...] | None  # one file (a string in the plan), or a list of files: each one a segment
    reference: Path | None  # None: the unpruned source
    ctx: int
    chunks: int | None
    qa: Path | None
    gate: Path | None
    speed_runs: int
    speed_engine: str  # auto (llama-bench when found), llama-bench, libllama
    top_k: (
        int | None
    )  # None: every token's reference log-prob (llama-perplexity's KLD); K: a top-K cache, an estimated KLD
    tail_samples: int | None  # with top_k: tail tokens sampled per token
    compare: tuple[Path, ...]  # more models evaluated against the same reference
    unpruned: tuple[str, ...]  # rungs of the ladder spec also quantized from the unpruned source
    gate_segments: str | None = (
        None  # every, overall: what a held-out file failing the gate does (None: the gate file's)
    )
    loops: bool = False  # repetition loops of greedy continuations (implied by loop_prompts)
    loop_prompts: Path | None = None
    loop_tokens: int | None = None

    @property
    def heldout_files(self) -> tuple[Path, ...]:
        if self.heldout is None:
            return ()
        return (self.heldout,) if isinstance(self.heldout, Path) else self.heldout


@dataclass(frozen=True)
class RunPlan:
    path: Path | None
    source: Path
    output: Path
    work: Path
    name: str | None
    threads: int | None
    selection: SelectionStep
    calibration: CalibrationStep | None
    imatrix: ImatrixStep | None
    ladder: LadderStep
    evaluation: EvaluationStep | None
    card: bool
    card_settings: Any = None  # release.card.CardSettings of a [card] table; None: all from the GGUF's keys
    raw: dict[str, Any] = field(default_factory=dict, compare=False)
    gpu_layers: int = 0  # layers offloaded to the accelerator in every llama.cpp stage

    def to_json(self) -> dict[str, Any]:
        """The resolved plan with bare file names (it is published in the release)."""

        def name(p: Path | None) -> str | None:
            return p.name if p is not None else None

        doc: dict[str, Any] = {
            "source": name(self.source),
            "output": name(self.output),
            "name": self.name,
            "threads": self.threads,
            "gpu_layers": self.gpu_layers,
            "selection": {
                "method": self.selection.method,
                "keep": self.selection.keep,
                "ratio": self.selection.ratio,
                "keepset": name(self.selection.keepset),
                "protect": name(self.selection.protect_file) or self.selection.protect,
                "protect_super_experts": self.selection.protect_super_experts,
                "seed": self.selection.seed,
            },
            "ladder": {
                "spec": name(self.ladder.spec),
                "only": list(self.ladder.only),
                "quantizer": self.ladder.quantizer
                if self.ladder.quantizer in ("auto", "binary", "libllama")
                else name(Path(self.ladder.quantizer)),
            },
            "card": self.card_settings.to_json() if self.card_settings is not None else self.card,
        }
        if self.selection.tunes:
            doc["selection"].update(
                keep=list(self.selection.keeps),
                methods=list(self.selection.methods),
                heldout=[p.name for p in self.selection.heldout],
                chunks=self.selection.chunks,
                stability=self.selection.stability,
            )
        if self.calibration is not None:
            doc["calibration"] = {
                "files": [p.name for p in self.calibration.files],
                "ctx": self.calibration.ctx,
                "max_tokens": self.calibration.max_tokens,
            }
        if self.imatrix is not None:
            doc["imatrix"] = {"file": name(self.imatrix.file), "collect": self.imatrix.collect}
        if self.evaluation is not None:
            e = self.evaluation
            doc["evaluation"] = {
                "heldout": name(e.heldout) if not isinstance(e.heldout, tuple) else [p.name for p in e.heldout],
                "reference": name(e.reference) or "source",
                "ctx": e.ctx,
                "chunks": e.chunks,
                "qa": name(e.qa),
                "gate": name(e.gate),
                "speed_runs": e.speed_runs,
                "speed_engine": e.speed_engine,
                "top_k": e.top_k,
                "tail_samples": e.tail_samples,
                "compare": [p.name for p in e.compare],
                "unpruned": list(e.unpruned),
                **({"gate_segments": e.gate_segments} if e.gate_segments else {}),
                **(
                    {"loops": True, "loop_prompts": name(e.loop_prompts), "loop_tokens": e.loop_tokens}
                    if e.loops or e.loop_prompts
                    else {}
                ),
            }
        return doc


KEYS = {
    "plan": (
        "source",
        "output",
        "work",
        "name",
        "threads",
        "gpu_layers",
        "card",
        "selection",
        "calibration",
        "imatrix",
        "ladder",
        "evaluation",
    ),
    "[selection]": ("method", "keep", "ratio", "keepset", "protect", "protect_super_experts", "seed", *TUNE_ONLY),
    "[calibration]": ("files", "ctx", "max_tokens"),
    "[imatrix]": ("file", "collect"),
    "[ladder]": ("spec", "only", "quantizer", "llama_cpp"),
    "[evaluation]": (
        "heldout",
        "reference",
        "ctx",
        "chunks",
        "qa",
        "gate",
        "speed_runs",
        "speed_engine",
        "top_k",
        "tail_samples",
        "compare",
        "unpruned",
        "gate_segments",
        "loops",
        "loop_prompts",
        "loop_tokens",
    ),
}


class _Table:
    """One TOML table being read: its keys checked against KEYS, and typed getters."""

    def __init__(self, doc: Any, where: str, base: Path) -> None:
        if not isinstance(doc, dict):
            raise BadInput(f"{where} must be a table", PLAN_HINT)
        self.doc, self.where, self.base = doc, where, base
        keys = KEYS[where]
        unknown = sorted(set(doc) - set(keys))
        if unknown:
            raise BadInput(
                f"{where}: unknown key " + shortened([repr(k) for k in unknown], 1),
                f"the keys of {where} are {', '.join(keys)}",
            )

    def _get(self, key: str) -> Any:
        return self.doc.get(key)

    def _fail(self, key: str, what: str) -> BadInput:
        return BadInput(f"{self.where}: {key} must be {what} (got {self.doc.get(key)!r})", PLAN_HINT)

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            raise self._fail(key, "a non-empty string")
        return value

    def integer(self, key: str, default: int | None = None, minimum: int | None = None) -> int | None:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            raise self._fail(key, "an integer" + (f" >= {minimum}" if minimum is not None else ""))
        return value

    def number(self, key: str) -> float | None:
        value = self._get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, "a number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self._get(key)
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self._fail(key, "a list of strings")
        return tuple(value)

    def path(self, key: str, *, must_exist: bool = True) -> Path | None:
        value = self.string(key)
        return None if value is None else self._resolve(key, value, must_exist)

    def paths(self, key: str) -> tuple[Path, ...]:
        return tuple(self._resolve(key, v, True) for v in self.strings(key))

    def _resolve(self, key: str, value: str, must_exist: bool) -> Path:
        path = Path(os.path.expanduser(value))
        path = path if path.is_absolute() else self.base / path
        if must_exist and not path.exists():
            raise BadInput(
                f"{self.where}: {key} = {value!r}: no such file ({path})",
                "paths in a plan are relative to the plan file",
            )
        return path

    def table(self, key: str) -> _Table | None:
        value = self._get(key)
        return None if value is None else _Table(value, f"[{key}]", self.base)


def parse_plan(doc: dict[str, Any], base: Path, path: Path | None = None) -> RunPlan:
    """Validate a plan document; relative paths are resolved against `base`."""
    from ggufcarve.moe.kept import ratio_problem
    from ggufcarve.select.criteria import criterion_named

    top = _Table(doc, "plan", base)
    source = top.path("source")
    if source is None:
        raise BadInput("plan: no source", 'give source = "MODEL.gguf" (the unpruned GGUF, first shard if split)')
    output_name = top.string("output")
    if output_name is None:
        raise BadInput("plan: no output", 'give output = "DIR" (the release directory)')
    output = top._resolve("output", output_name, False)
    work_name = top.string("work")
    work = top._resolve("work", work_name, False) if work_name else output.with_name(output.name + ".work")
    name = top.string("name")
    threads = top.integer("threads", minimum=1)
    gpu_layers = top.integer("gpu_layers", minimum=0) or 0
    card, card_settings = _card(top)

    sel = top.table("selection") or _Table({}, "[selection]", base)
    method = sel.string("method")
    keepset = sel.path("keepset")
    keeps = _tune_keeps(sel) if method == TUNE else ()
    keep = keeps[0] if keeps else sel.integer("keep", minimum=1)
    ratio = sel.number("ratio")
    protect = sel.string("protect")
    protect_file = _protect_file(sel, protect)
    if protect_file is not None:
        protect = str(protect_file)
    protect_super = sel.boolean("protect_super_experts", False)
    seed = sel.integer("seed", 0) or 0
    if (method is None) == (keepset is None):
        raise BadInput(
            '[selection]: give exactly one of method = "..." or keepset = "FILE"',
            'for example method = "frequency" with keep = 128',
        )
    given = [k for k in TUNE_ONLY if sel._get(k) is not None]
    if given and method != TUNE:
        raise BadInput(
            f'[selection]: {given[0]} applies to method = "{TUNE}" only',
            f'drop {given[0]}, or set method = "{TUNE}" to measure the criteria against each other',
        )
    methods: tuple[str, ...] = ()
    if method == TUNE:
        spec = None
        methods = _tune_methods(sel)
        if ratio is not None:
            raise BadInput(
                f"[selection]: method {TUNE} takes keep = [K, ...], not ratio",
                "for example keep = [8] or keep = [12, 8, 4]; the first K is carved",
            )
        if protect is not None or protect_super:
            raise BadInput(
                f"[selection]: method {TUNE} does not protect experts",
                "drop protect and protect_super_experts, or choose one method instead of tune",
            )
    elif method is not None:
        spec = criterion_named(method)
        if (keep is None) == (ratio is None):
            raise BadInput(
                f"[selection]: method {method} needs exactly one of keep = K or ratio = R", "for example keep = 128"
            )
        if ratio is not None and ratio_problem(ratio):
            raise BadInput(
                f"[selection]: ratio {ratio_problem(ratio)}", "ratio is the fraction of the experts kept, e.g. 0.5"
            )
    else:
        spec = None
        if keep is not None or ratio is not None or protect is not None or protect_super:
            raise BadInput(
                "[selection]: keep, ratio and protect apply to a method, not to a given keepset",
                "drop them, or choose a method instead of the keep-set file",
            )

    cal_table = top.table("calibration")
    calibration = None
    if cal_table is not None:
        files = cal_table.paths("files")
        ctx = cal_table.integer("ctx", 512, minimum=2) or 512
        max_tokens = cal_table.integer("max_tokens", minimum=1)
        if not files:
            raise BadInput("[calibration]: files is empty", 'give files = ["calibration.jsonl"]')
        calibration = CalibrationStep(files, ctx, max_tokens)

    im_table = top.table("imatrix")
    imatrix = None
    if im_table is not None:
        file = im_table.path("file")
        collect = im_table.boolean("collect", False)
        if (file is None) == (not collect):
            raise BadInput(
                '[imatrix]: give exactly one of file = "MODEL.imatrix.gguf" or collect = true',
                "collect = true gathers it from [calibration] in the selection's pass",
            )
        if collect and calibration is None:
            raise BadInput("[imatrix]: collect = true needs a [calibration] table", "give [calibration] files = [...]")
        imatrix = ImatrixStep(file, collect)

    if spec is not None:
        if spec.needs == "calibration" and calibration is None:
            raise BadInput(
                f"[selection]: method {method} traces calibration text", "add a [calibration] table with files = [...]"
            )
        if spec.needs == "imatrix" and imatrix is None:
            raise BadInput(
                f"[selection]: method {method} reads an imatrix", 'add [imatrix] file = "..." or collect = true'
            )
    tune_reads = [
        m for m in methods if criterion_named(m).needs != "model"
    ]  # the imatrix ones from tune's own calibration pass
    if tune_reads and calibration is None:
        raise BadInput(
            f"[selection]: method {TUNE} with {tune_reads[0]} traces calibration text",
            "add a [calibration] table with files = [...], or list "
            "only zero-shot methods (weights, router-norm, random)",
        )
    if (
        calibration is not None
        and not tune_reads
        and (spec is None or spec.needs != "calibration")
        and (imatrix is None or not imatrix.collect)
    ):
        raise BadInput(
            "[calibration] is given but nothing reads it",
            "use a calibration method (frequency, ean, reap, razor) or [imatrix] collect = true, or drop [calibration]",
        )

    lad = top.table("ladder")
    if lad is None:
        raise BadInput("plan: no [ladder] table", 'give [ladder] spec = "q8-to-iq1" (or a path to a ladder TOML)')
    spec_value = lad.string("spec")
    if spec_value is None:
        raise BadInput("[ladder]: no spec", 'give spec = "q8-to-iq1" (or a path to a ladder TOML)')
    from ggufcarve.quant.spec import find_spec

    ladder = LadderStep(
        find_spec(spec_value, base, "[ladder] spec"),
        tuple(r.upper() for r in lad.strings("only")),
        _quantizer(lad),
        lad.path("llama_cpp"),
    )
    _check_rungs(ladder.spec, ladder.only, "[ladder] only")

    ev_table = top.table("evaluation")
    evaluation = None
    if ev_table is not None:
        from ggufcarve.evaluate.speed import DEFAULT_RUNS

        reference = ev_table.string("reference")
        evaluation = EvaluationStep(
            heldout=ev_table.paths("heldout")
            if isinstance(ev_table._get("heldout"), list)
            else ev_table.path("heldout"),
            reference=None if reference in (None, "source") else ev_table._resolve("reference", reference, True),
            ctx=ev_table.integer("ctx", 512, minimum=2) or 512,
            chunks=ev_table.integer("chunks", minimum=1),
            qa=ev_table.path("qa"),
            gate=ev_table.path("gate"),
            speed_runs=ev_table.integer("speed_runs", DEFAULT_RUNS, minimum=0) or 0,
            speed_engine=ev_table.string("speed_engine", "auto") or "auto",
            top_k=ev_table.integer("top_k", minimum=1),
            tail_samples=ev_table.integer("tail_samples", minimum=0),
            compare=ev_table.paths("compare"),
            unpruned=tuple(r.upper() for r in ev_table.strings("unpruned")),
            gate_segments=ev_table.string("gate_segments"),
            loops=ev_table.boolean("loops", False),
            loop_prompts=ev_table.path("loop_prompts"),
            loop_tokens=ev_table.integer("loop_tokens", minimum=1),
        )
        from ggufcarve.evaluate.speed import ENGINES

        if evaluation.speed_engine not in ENGINES:
            raise BadInput(
                f"[evaluation]: speed_engine = {evaluation.speed_engine!r} is not one of {', '.join(ENGINES)}",
                "auto uses llama-bench when the tools have it, else the embedded engine",
            )
        if not evaluation.heldout_files and evaluation.reference is None:
            raise BadInput(
                "[evaluation]: no heldout text",
                'give heldout = "FILE" (scored by every model against the unpruned source)',
            )
        _check_rungs(ladder.spec, evaluation.unpruned, "[evaluation] unpruned")
    selection = SelectionStep(method, keep, ratio, keepset, protect, protect_super, seed, protect_file)
    if method == TUNE:
        heldout = sel.paths("heldout") or (evaluation.heldout_files if evaluation is not None else ())
        if not heldout:
            raise BadInput(
                f"[selection]: method {TUNE} scores the keep-sets on held-out text",
                'give [selection] heldout = "FILE" (or an [evaluation] heldout, which it then reads)',
            )
        chunks = sel.integer("chunks", minimum=1)
        selection = replace(
            selection,
            keeps=keeps,
            methods=methods,
            heldout=heldout,
            stability=sel.boolean("stability", False),
            chunks=chunks if chunks is not None else (evaluation.chunks if evaluation is not None else None),
        )
    if source.resolve().parent == output.resolve():
        raise BadInput(
            f"plan: the output directory {output} holds the source",
            "write the release to its own directory: everything in it is published",
        )
    if work.resolve() == output.resolve():
        raise BadInput(
            "plan: work and output are the same directory",
            "intermediates (the pruned source, imatrices) must not be published: give work another directory",
        )
    return RunPlan(
        path,
        source,
        output,
        work,
        name,
        threads,
        selection,
        calibration,
        imatrix,
        ladder,
        evaluation,
        card,
        card_settings,
        raw=doc,
        gpu_layers=gpu_layers,
    )


def _tune_keeps(table: _Table) -> tuple[int, ...]:
    """[selection] keep of method tune: a list of expert counts (or one), duplicates dropped, order kept."""
    value = table._get("keep")
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        value is None
        or not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
    ):
        raise BadInput(
            f"[selection]: keep of method {TUNE} must be a list of expert counts (got {value!r})",
            "for example keep = [8] or keep = [12, 8, 4]; the first K is carved",
        )
    return tuple(dict.fromkeys(values))


def _tune_methods(table: _Table) -> tuple[str, ...]:
    """[selection] methods of method tune: "all" (the default) or a list of criteria, each one `select` knows."""
    from ggufcarve.select.criteria import ALL_METHODS, criterion_named

    value = table._get("methods")
    if value is None or value == "all":
        return ALL_METHODS
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise BadInput(
            f'[selection]: methods must be "all" or a list of criteria (got {value!r})',
            'for example methods = ["reap", "frequency", "weights"]',
        )
    for name in value:
        if name == TUNE:
            raise BadInput(
                f"[selection]: methods lists {TUNE} itself",
                'list the criteria that compete, e.g. ["reap", "frequency", "weights"]',
            )
        try:
            criterion_named(name)
        except BadInput as err:
            raise BadInput(f"[selection]: methods: {err.message}", err.hint) from None
    return tuple(dict.fromkeys(value))


def _card(top: _Table) -> tuple[bool, Any]:
    """`card = true | false`, or a [card] table of the card's settings (the card is written)."""
    value = top._get("card")
    if isinstance(value, dict):
        from ggufcarve.release.card import CardSettings

        return True, CardSettings.from_mapping(value)
    return top.boolean("card", True), None


QUANTIZER_CHOICES = ("auto", "binary", "libllama")


def _quantizer(table: _Table) -> str:
    """auto, binary, libllama, or a llama-quantize path relative to the plan, which must exist."""
    value = table.string("quantizer", "auto") or "auto"
    if value in QUANTIZER_CHOICES:
        return value
    path = table._resolve("quantizer", value, True)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BadInput(
            f"[ladder]: quantizer = {value!r} is not an executable file ({path})",
            "give auto, binary, libllama or the path of llama-quantize, relative to the plan file",
        )
    return str(path.resolve())


def _protect_file(table: _Table, value: str | None) -> Path | None:
    """The protect file a [selection] protect value names (a .json name, or an existing file
    beside the plan), resolved against the plan; None for a list of ids, which is checked here."""
    if value is None:
        return None
    candidate = Path(os.path.expanduser(value))
    candidate = candidate if candidate.is_absolute() else table.base / candidate
    if value.endswith(".json") or candidate.exists():
        return table._resolve("protect", value, True)
    from ggufcarve.moe.keepset import parse_id_list

    try:
        parse_id_list(value)
    except BadInput:
        raise BadInput(
            f"[selection]: protect = {value!r} is neither expert ids (0,5,9-11) nor a file",
            "paths in a plan are relative to the plan file",
        ) from None
    return None


def _check_rungs(spec_path: Path, rungs: tuple[str, ...], where: str) -> None:
    from ggufcarve.quant.spec import load_spec

    if not rungs:
        return
    names = [r.name.upper() for r in load_spec(spec_path).rungs]
    for rung in rungs:
        if rung not in names:
            raise BadInput(f"{where}: {rung} is not a rung of {spec_path.name}", f"the rungs are {', '.join(names)}")


def load_plan(path: str | os.PathLike[str]) -> RunPlan:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path}: no such plan file", PLAN_HINT) from None
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: cannot read the plan ({err})", PLAN_HINT) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise BadInput(f"{path}: not valid TOML ({err})", PLAN_HINT) from None
    return parse_plan(doc, path.resolve().parent, path)


def toml_value(value: Any) -> str:
    """A TOML literal of a bool, number, string or list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def plan_text(doc: dict[str, Any], comment: str) -> str:
    """A plan document (top-level keys, then one table per dict) as TOML under a comment line."""
    lines = [f"# {comment}", ""]
    lines += [f"{k} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for table, values in doc.items():
        if isinstance(values, dict):
            lines += ["", f"[{table}]", *[f"{k} = {toml_value(v)}" for k, v in values.items()]]
    return "\n".join(lines) + "\n"
