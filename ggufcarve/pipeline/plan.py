"""A run plan: one TOML file naming the source, the selection, the imatrix, the ladder and the
evaluation, parsed into a validated `RunPlan` before anything touches disk.

    source = "Qwen3.6-35B-A3B-Q8_0.gguf"      # every path is relative to the plan file
    output = "release"                       # the release directory
    # work = "release.work"                  # intermediates: selection, pruned source, imatrices
    # name = "Qwen3.6-35B-A3B-128e"          # {model} in rung file names

    [selection]
    method = "frequency"                     # or keep = "kept_expert_indices.json" (a keep-set file)
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

from ggufcarve import settings as S
from ggufcarve.errors import BadInput
from ggufcarve.llama.devices import CPU, Compute
from ggufcarve.release.card_metadata import CardSettings
from ggufcarve.settings import PLAN_HINT, Keep, key, read_table, table_keys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

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
    topk: int | None = None  # every rung routed to N experts per token (None: the source's)


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
    selection: SelectionStep
    calibration: CalibrationStep | None
    imatrix: ImatrixStep | None
    ladder: LadderStep
    evaluation: EvaluationStep | None
    card: bool
    card_settings: CardSettings | None = None  # a [card] table's; None: all from the GGUF's general.* keys
    raw: dict[str, Any] = field(default_factory=dict, compare=False)
    compute: Compute = CPU  # where every llama.cpp stage runs (threads 0: the physical cores)

    def to_json(self) -> dict[str, Any]:
        """The resolved plan with bare file names (it is published in the release)."""

        def name(p: Path | None) -> str | None:
            return p.name if p is not None else None

        doc: dict[str, Any] = {
            "source": name(self.source),
            "output": name(self.output),
            "name": self.name,
            "threads": self.compute.threads or None,
            "gpu_layers": "auto" if self.compute.auto else self.compute.gpu_layers,
            "rpc_servers": len(self.compute.rpc),
            "tensor_split": list(self.compute.tensor_split),
            "n_cpu_moe": self.compute.n_cpu_moe,
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


# The plan's tables: one field per TOML key, each read by its setting (ggufcarve.settings), the
# same reading, units and errors as the command line's option of that name.


@dataclass(frozen=True)
class PlanKeys:
    """The plan's top-level keys (the tables below are named beside them)."""

    source: Path | None = key(S.SOURCE)
    output: Path | None = key(S.OUTPUT)
    work: Path | None = key(S.WORK)
    name: str | None = key(S.NAME)
    threads: int | None = key(S.THREADS)
    gpu_layers: int | None = key(S.GPU_LAYERS)  # None: auto
    rpc: tuple[str, ...] | None = key(S.RPC)
    tensor_split: tuple[float, ...] | None = key(S.TENSOR_SPLIT)
    n_cpu_moe: int = key(S.N_CPU_MOE, 0)
    card: bool = key(S.CARD, True)


@dataclass(frozen=True)
class SelectionKeys:
    method: str | None = key(S.METHOD)
    keep: Keep | None = key(S.KEEP)
    ratio: float | None = key(S.RATIO)
    keepset: Path | None = key(S.KEEPSET)
    protect: str | None = key(S.PROTECT)
    protect_super_experts: bool = key(S.PROTECT_SUPER_EXPERTS, False)
    seed: int = key(S.SEED, 0)
    methods: str | None = key(S.METHODS)  # method tune
    heldout: tuple[Path, ...] | None = key(S.HELDOUT)  # method tune
    chunks: int | None = key(S.CHUNKS)  # method tune
    stability: bool | None = key(S.STABILITY)  # method tune


@dataclass(frozen=True)
class CalibrationKeys:
    files: tuple[Path, ...] | None = key(S.CALIBRATION)
    ctx: int = key(S.CTX, 512)
    max_tokens: int | None = key(S.MAX_TOKENS)


@dataclass(frozen=True)
class ImatrixKeys:
    file: Path | None = key(S.IMATRIX)
    collect: bool = key(S.COLLECT, False)


@dataclass(frozen=True)
class LadderKeys:
    spec: str | None = key(S.LADDER)
    only: str | None = key(S.ONLY)
    quantizer: str = key(S.QUANTIZER, "auto")
    llama_cpp: Path | None = key(S.LLAMA_CPP)
    topk: tuple[int, ...] | str | None = key(S.TOPK)


@dataclass(frozen=True)
class EvaluationKeys:
    heldout: tuple[Path, ...] | None = key(S.HELDOUT)
    reference: Path | None = key(S.REFERENCE)  # "source" (the default) is read before the setting
    ctx: int = key(S.CTX, 512)
    chunks: int | None = key(S.CHUNKS)
    qa: Path | None = key(S.QA)
    gate: Path | None = key(S.GATE)
    speed_runs: int = key(S.SPEED_RUNS, 5)
    speed_engine: str = key(S.SPEED_ENGINE, "auto")
    top_k: int | None = key(S.TOP_K)
    tail_samples: int | None = key(S.TAIL_SAMPLES)
    compare_models: tuple[Path, ...] | None = key(S.COMPARE_MODELS)
    unpruned: str | None = key(S.UNPRUNED)
    gate_segments: str | None = key(S.GATE_SEGMENTS)
    loops: bool = key(S.LOOPS, False)
    loop_prompts: Path | None = key(S.LOOP_PROMPTS)
    loop_tokens: int | None = key(S.LOOP_TOKENS)


TABLES: dict[str, type] = {  # where -> its keys, in the order the docs list them
    "plan": PlanKeys,
    "[selection]": SelectionKeys,
    "[calibration]": CalibrationKeys,
    "[imatrix]": ImatrixKeys,
    "[ladder]": LadderKeys,
    "[evaluation]": EvaluationKeys,
    "[card]": CardSettings,
}
SUBTABLES = ("selection", "calibration", "imatrix", "ladder", "evaluation", "card")
OLDER_KEYS = {"[evaluation]": {"compare": "compare_models"}}  # older spelling -> the key's name


def plan_keys_markdown(commands: dict[str, list[str]]) -> str:
    """The docs' table of plan keys, from the tables' fields and their settings; `commands`: setting
    name -> the commands with an option made from the same setting (it reads the same there)."""
    rows = ["| key | value | default | option of | what it is |", "|---|---|---|---|---|"]
    for where, table in TABLES.items():
        for name, setting, default in table_keys(table):
            label = name if where == "plan" else f"{where} {name}"
            shown = "–" if default is None else toml_value(default)
            users = commands.get(setting.name, [])
            option = f"`{setting.flag}` ({', '.join(users)})" if users else "–"
            text = (setting.help.removesuffix(":") + "." * setting.help.endswith(":")).replace("|", "\\|")
            rows.append(f"| `{label}` | {setting.unit.what} | {shown} | {option} | {text} |")
    return "\n".join(rows) + "\n"


def _read(doc: dict[str, Any], name: str, base: Path, skip: tuple[str, ...] = ()) -> Any:
    """The table `name` of the plan document, but the keys in `skip`."""
    where = f"[{name}]"
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise BadInput(f"{where} must be a table", PLAN_HINT)
    table = {k: v for k, v in table.items() if k not in skip}
    for older, newer in OLDER_KEYS.get(where, {}).items():
        if older in table:
            if newer in table:
                raise BadInput(f"{where}: {older} and {newer} name the same thing", f"give {newer} alone")
            table[newer] = table.pop(older)
    return read_table(TABLES[where], table, where, base)


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(n.upper() for n in value.split(",")) if value else ()


def parse_plan(doc: dict[str, Any], base: Path, path: Path | None = None) -> RunPlan:
    """Validate a plan document; relative paths are resolved against `base`."""
    from ggufcarve.moe.kept import ratio_problem
    from ggufcarve.select.criteria import criterion_named

    if not isinstance(doc, dict):
        raise BadInput("plan must be a table", PLAN_HINT)
    card_value = doc.get("card")
    top_doc = {k: v for k, v in doc.items() if k not in SUBTABLES or (k == "card" and not isinstance(v, dict))}
    unknown_tables = [k for k in doc if k in SUBTABLES and k != "card" and not isinstance(doc[k], dict)]
    if unknown_tables:
        raise BadInput(f"[{unknown_tables[0]}] must be a table", PLAN_HINT)
    top = read_table(PlanKeys, top_doc, "plan", base, extra=SUBTABLES)
    if top.source is None:
        raise BadInput("plan: no source", 'give source = "MODEL.gguf" (the unpruned GGUF, first shard if split)')
    if top.output is None:
        raise BadInput("plan: no output", 'give output = "DIR" (the release directory)')
    source, output = top.source, top.output
    work = top.work if top.work is not None else output.with_name(output.name + ".work")
    raw_evaluation = doc.get("evaluation") if isinstance(doc.get("evaluation"), dict) else {}
    reference_is_source = raw_evaluation.get("reference") == "source"  # the default, named
    read = {  # every value of every table is read (and refused) before any rule across keys
        name: _read(doc, name, base, skip=("reference",) if name == "evaluation" and reference_is_source else ())
        for name in SUBTABLES
        if name in doc and (name != "card" or isinstance(card_value, dict))
    }
    card, card_settings = top.card, None
    if "card" in read:
        card, card_settings = True, read["card"].check()

    sel = read.get("selection") or SelectionKeys()
    method, keep_value, ratio = sel.method, sel.keep, sel.ratio
    keepset = sel.keepset
    if keep_value is not None and keep_value.file is not None:
        if keepset is not None:
            raise BadInput("[selection]: keep = FILE and keepset name the same thing", "give keep = FILE alone")
        keepset, keep_value = keep_value.file, None
    keeps = _tune_keeps(keep_value) if method == TUNE else ()
    keep = keeps[0] if keeps else _one_keep(keep_value, method)
    protect = sel.protect
    protect_file = _protect_file(base, protect)
    if protect_file is not None:
        protect = str(protect_file)
    protect_super = sel.protect_super_experts
    if (method is None) == (keepset is None):
        raise BadInput(
            '[selection]: give exactly one of method = "..." or keep = "FILE"',
            'for example method = "frequency" with keep = 128',
        )
    given = [k for k in TUNE_ONLY if getattr(sel, k) is not None]
    if given and method != TUNE:
        raise BadInput(
            f'[selection]: {given[0]} applies to method = "{TUNE}" only',
            f'drop {given[0]}, or set method = "{TUNE}" to measure the criteria against each other',
        )
    methods: tuple[str, ...] = ()
    if method == TUNE:
        spec = None
        methods = _tune_methods(sel.methods)
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

    calibration = None
    if "calibration" in read:
        cal = read["calibration"]
        if not cal.files:
            raise BadInput("[calibration]: files is empty", 'give files = ["calibration.jsonl"]')
        calibration = CalibrationStep(cal.files, cal.ctx, cal.max_tokens)

    imatrix = None
    if "imatrix" in read:
        im = read["imatrix"]
        if (im.file is None) == (not im.collect):
            raise BadInput(
                '[imatrix]: give exactly one of file = "MODEL.imatrix.gguf" or collect = true',
                "collect = true gathers it from [calibration] in the selection's pass",
            )
        if im.collect and calibration is None:
            raise BadInput("[imatrix]: collect = true needs a [calibration] table", "give [calibration] files = [...]")
        imatrix = ImatrixStep(im.file, im.collect)

    if spec is not None:
        if spec.needs == "calibration" and calibration is None:
            raise BadInput(
                f"[selection]: method {method} traces calibration text", "add a [calibration] table with files = [...]"
            )
        if spec.needs == "imatrix" and imatrix is None:
            raise BadInput(
                f"[selection]: method {method} reads an imatrix", 'add [imatrix] file = "..." or collect = true'
            )
    tune_reads = [m for m in methods if criterion_named(m).needs != "model"]  # from tune's own calibration pass
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

    if "ladder" not in read:
        raise BadInput("plan: no [ladder] table", 'give [ladder] spec = "q8-to-iq1" (or a path to a ladder TOML)')
    lad = read["ladder"]
    if lad.spec is None:
        raise BadInput("[ladder]: no spec", 'give spec = "q8-to-iq1" (or a path to a ladder TOML)')
    from ggufcarve.quant.spec import find_spec

    ladder = LadderStep(
        find_spec(lad.spec, base, "[ladder] spec"),
        _names(lad.only),
        _quantizer(lad.quantizer, base),
        lad.llama_cpp,
        S.one_used_count(lad.topk, "[ladder] topk"),
    )
    _check_rungs(ladder.spec, ladder.only, "[ladder] only")

    evaluation = None
    if "evaluation" in read:
        ev = read["evaluation"]
        single = isinstance(raw_evaluation.get("heldout"), str)  # one file: a path, as the plan wrote it
        heldout = ev.heldout[0] if ev.heldout is not None and single else ev.heldout
        evaluation = EvaluationStep(
            heldout=heldout,
            reference=ev.reference,
            ctx=ev.ctx,
            chunks=ev.chunks,
            qa=ev.qa,
            gate=ev.gate,
            speed_runs=ev.speed_runs,
            speed_engine=ev.speed_engine,
            top_k=ev.top_k,
            tail_samples=ev.tail_samples,
            compare=ev.compare_models or (),
            unpruned=_names(ev.unpruned),
            gate_segments=ev.gate_segments,
            loops=ev.loops,
            loop_prompts=ev.loop_prompts,
            loop_tokens=ev.loop_tokens,
        )
        if not evaluation.heldout_files and evaluation.reference is None:
            raise BadInput(
                "[evaluation]: no heldout text",
                'give heldout = "FILE" (scored by every model against the unpruned source)',
            )
        _check_rungs(ladder.spec, evaluation.unpruned, "[evaluation] unpruned")
    selection = SelectionStep(method, keep, ratio, keepset, protect, protect_super, sel.seed, protect_file)
    if method == TUNE:
        heldout = sel.heldout or (evaluation.heldout_files if evaluation is not None else ())
        if not heldout:
            raise BadInput(
                f"[selection]: method {TUNE} scores the keep-sets on held-out text",
                'give [selection] heldout = "FILE" (or an [evaluation] heldout, which it then reads)',
            )
        selection = replace(
            selection,
            keeps=keeps,
            methods=methods,
            heldout=heldout,
            stability=bool(sel.stability),
            chunks=sel.chunks if sel.chunks is not None else (evaluation.chunks if evaluation is not None else None),
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
        path=path,
        source=source,
        output=output,
        work=work,
        name=top.name,
        selection=selection,
        calibration=calibration,
        imatrix=imatrix,
        ladder=ladder,
        evaluation=evaluation,
        card=card,
        card_settings=card_settings,
        raw=doc,
        compute=S.compute(top.threads, top.gpu_layers, top.rpc, top.tensor_split, top.n_cpu_moe),
    )


def _tune_keeps(keep: Keep | None) -> tuple[int, ...]:
    """[selection] keep of method tune: expert counts (one or a list), duplicates dropped, order kept."""
    from ggufcarve.tune.run import parse_keeps

    if keep is None or keep.counts is None:
        raise BadInput(
            f"[selection]: keep of method {TUNE} must be a list of expert counts (got {keep!r})",
            "for example keep = [8] or keep = [12, 8, 4]; the first K is carved",
        )
    try:
        return parse_keeps(keep.counts)
    except BadInput:
        raise BadInput(
            f"[selection]: keep of method {TUNE} must be a list of expert counts (got {keep.counts!r})",
            "for example keep = [8] or keep = [12, 8, 4]; the first K is carved",
        ) from None


def _one_keep(keep: Keep | None, method: str | None) -> int | None:
    """[selection] keep of one method: one count (a method carves one K)."""
    if keep is None or keep.counts is None:
        return None
    if not keep.counts.strip().isdigit() or int(keep.counts) < 1:
        raise BadInput(
            f"[selection]: method {method} carves one count, keep = {keep.counts!r}",
            f'give keep = 128, or method = "{TUNE}" to weigh several counts',
        )
    return int(keep.counts)


def _tune_methods(value: str | None) -> tuple[str, ...]:
    """[selection] methods of method tune: "all" (the default) or a list of criteria, each one `select` knows."""
    from ggufcarve.tune.run import parse_methods

    if value is None:
        value = "all"
    if TUNE in value.split(","):
        raise BadInput(
            f"[selection]: methods lists {TUNE} itself",
            'list the criteria that compete, e.g. ["reap", "frequency", "weights"]',
        )
    try:
        return parse_methods(value)
    except BadInput as err:
        raise BadInput(f"[selection]: methods: {err.message}", err.hint) from None


QUANTIZER_CHOICES = ("auto", "binary", "libllama")


def _quantizer(value: str, base: Path) -> str:
    """auto, binary, libllama, or a llama-quantize path relative to the plan, which must exist."""
    if value in QUANTIZER_CHOICES:
        return value
    path = Path(os.path.expanduser(value))
    path = path if path.is_absolute() else base / path
    if not path.exists():
        raise BadInput(
            f"[ladder] quantizer {value!r}: no such file ({path})", "paths in a plan are relative to the plan file"
        )
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BadInput(
            f"[ladder]: quantizer = {value!r} is not an executable file ({path})",
            "give auto, binary, libllama or the path of llama-quantize, relative to the plan file",
        )
    return str(path.resolve())


def _protect_file(base: Path, value: str | None) -> Path | None:
    """The protect file a [selection] protect value names (a .json name, or an existing file
    beside the plan), resolved against the plan; None for a list of ids, which is checked here."""
    if value is None:
        return None
    candidate = Path(os.path.expanduser(value))
    candidate = candidate if candidate.is_absolute() else base / candidate
    if value.endswith(".json") or candidate.exists():
        if not candidate.exists():
            raise BadInput(
                f"[selection] protect {value!r}: no such file ({candidate})",
                "paths in a plan are relative to the plan file",
            )
        return candidate
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
