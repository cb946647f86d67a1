"""Typed option aliases shared by the command modules."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperGroup

from ggufcarve.errors import BadInput

if TYPE_CHECKING:
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.moe.layout import MoeLayout


class PanelGroup(TyperGroup):
    """A command group whose plain help lists its commands under their help panels
    (`rich_help_panel`), the panels in the order of their first command; commands without one
    under "Commands". Commands are listed in `order` (typer registers commands before groups),
    the ones it does not name after them."""

    order: tuple[str, ...] = ()

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: self.order.index(name) if name in self.order else len(self.order))

    def format_commands(self, ctx, formatter) -> None:
        listed = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        listed = [(name, command) for name, command in listed if command is not None and not command.hidden]
        if not listed:
            return
        width = formatter.width - 6 - max(len(name) for name, _ in listed)
        panels: dict[str, list[tuple[str, str]]] = {}
        for name, command in listed:
            panels.setdefault(getattr(command, "rich_help_panel", None) or "Commands", []).append(
                (name, command.get_short_help_str(width))
            )
        for panel, rows in panels.items():
            with formatter.section(panel):
                formatter.write_dl(rows)


def command_group(help: str, cls: type[PanelGroup] = PanelGroup) -> typer.Typer:
    """A typer app with plain help text (typer's rich help marks every flag with a stray `<bool>`),
    its commands listed under their help panels."""
    return typer.Typer(
        cls=cls,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )


KeepOption = Annotated[
    Path | None,
    typer.Option(
        "--keep", help="Keep-set JSON: ours, kept_expert_indices.json, carve_manifest.json or expert-selection.json."
    ),
]
KeepFirstOption = Annotated[
    int | None,
    typer.Option(
        "--keep-first",
        help="Keep the first K experts of every MoE block (with grouped routing, the first K/groups of every group).",
    ),
]
KeepIdsOption = Annotated[
    str | None, typer.Option("--keep-ids", help="Keep these ids in every MoE block, e.g. 0,2,4-7.")
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON (no progress bars).")]
ForceOption = Annotated[bool, typer.Option("--force", help="Replace an existing output.")]
CalibrationOption = Annotated[
    list[Path] | None, typer.Option("--calibration", help="Calibration text or JSONL file (repeatable).")
]
CtxOption = Annotated[
    int,
    typer.Option(
        "--ctx", help="Tokens per calibration chunk (each starts with BOS and an empty KV cache, as llama-imatrix -c)."
    ),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads",
        "-t",
        help="CPU threads of every llama.cpp child the command runs (calibration, scoring, quantizing).",
    ),
]
GpuLayersOption = Annotated[
    int,
    typer.Option(
        "--gpu-layers",
        min=0,
        help="Layers every llama.cpp child that loads a model offloads to the GPU (llama.cpp's -ngl; "
        "0: all on the CPU; 99: all). A llama-cpp-python built without a GPU backend ignores it.",
    ),
]
LlamaCppOption = Annotated[
    Path | None,
    typer.Option(
        "--llama-cpp",
        help="Directory holding llama.cpp tools (DIR, DIR/bin or DIR/build/bin). Env: GGUFCARVE_LLAMA_CPP.",
    ),
]


KEEP_FORMS = "a count (8), a list of counts (8,12 or 64-192/32) or a keep-set file"
COUNTS = re.compile(r"[\d\s,/-]+")


@dataclass(frozen=True)
class Keep:
    """What --keep names, in every command that keeps experts: counts (as written: the command's
    parser checks them against the model) or a keep-set file."""

    counts: str | None = None
    file: Path | None = None


def parse_keep(text: str | None, option: str = "--keep") -> Keep | None:
    """--keep's value: counts when it is digits, commas, ranges and steps, else a keep-set file that must exist."""
    if text is None:
        return None
    value = text.strip()
    if COUNTS.fullmatch(value) and any(c.isdigit() for c in value):
        return Keep(counts=value)
    path = Path(value)
    if not path.is_file():
        raise BadInput(
            f"{option} {text!r} is neither counts nor an existing keep-set file", f"{option} takes {KEEP_FORMS}"
        )
    return Keep(file=path)


def one_keep(keep: str | None, alias: str | None, alias_name: str) -> str | None:
    """--keep, or its older spelling `alias_name`; both given is refused."""
    if keep is not None and alias is not None:
        raise BadInput(
            f"--keep and {alias_name} name the same thing", f"give --keep alone ({alias_name} is its older spelling)"
        )
    return keep if keep is not None else alias


def resolve_keepset(layout: MoeLayout, keep: Path | None, first: int | None, ids: str | None) -> KeepSet:
    """The keep-set of exactly one of --keep FILE, --keep-first K, --keep-ids LIST."""
    from ggufcarve.moe.keepset import keep_first, keep_ids, load_keepset, parse_id_list

    if keep is not None and not keep.is_file() and COUNTS.fullmatch(str(keep)):
        raise BadInput(
            f"--keep {keep}: a count does not say which experts",
            "give a keep-set file (ggufcarve select or tune writes one), or --keep-first K",
        )
    given = [x is not None for x in (keep, first, ids)]
    if sum(given) != 1:
        raise BadInput(
            "give exactly one of --keep FILE, --keep-first K, --keep-ids LIST",
            "for example --keep kept_expert_indices.json",
        )
    if keep is not None:
        return load_keepset(keep, layout)
    if first is not None:
        return keep_first(layout, first)
    return keep_ids(layout, parse_id_list(ids or ""))
