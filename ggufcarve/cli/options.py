"""Typed option aliases shared by the command modules."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from ggufcarve import settings as S
from ggufcarve.errors import BadInput
from ggufcarve.settings import Flag, Keep, Setting

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


def option(setting: Setting, detail: str = "", **kwargs: Any) -> Any:
    """The typer option of a setting: its flag (and short flag), its help with what it does in this
    command (`detail`), its unit's parser (the same reading and errors as the plan's key)."""
    names = [setting.flag, *([setting.short] if setting.short else [])]
    text = f"{setting.help} {detail}" if detail else setting.help.removesuffix(":") + "." * setting.help.endswith(":")
    if isinstance(setting.unit, Flag):
        return typer.Option(*names, help=text, **kwargs)
    kwargs.setdefault("metavar", setting.unit.metavar)
    return typer.Option(*names, help=text, parser=setting.parse_text, **kwargs)


KeepFileOption = Annotated[
    Keep | None,
    option(
        S.KEEP,
        "here a keep-set file: ours, kept_expert_indices.json, carve_manifest.json or expert-selection.json.",
        metavar="FILE",
    ),
]
KeepFirstOption = Annotated[int | None, option(S.KEEP_FIRST)]
KeepIdsOption = Annotated[str | None, option(S.KEEP_IDS)]
QuietOption = Annotated[bool, option(S.QUIET)]
QuietResultOption = Annotated[bool, option(S.QUIET, "The answer's line alone: no ranked table, no next step.")]
JsonOption = Annotated[bool, option(S.JSON, "the result.")]
ForceOption = Annotated[bool, option(S.FORCE, "an existing output.")]
CalibrationOption = Annotated[list[Path] | None, option(S.CALIBRATION)]
ChunkCtxOption = Annotated[
    int,
    option(
        S.CTX,
        "the length of each chunk the text is read in (each starts with BOS and an empty KV cache, as "
        "llama-perplexity and llama-imatrix -c).",
    ),
]
ThreadsOption = Annotated[int | None, option(S.THREADS)]
GpuLayersOption = Annotated[int | None, option(S.GPU_LAYERS)]  # None: auto
RpcOption = Annotated[str | None, option(S.RPC)]  # the value: a tuple of HOST:PORT
TensorSplitOption = Annotated[str | None, option(S.TENSOR_SPLIT)]  # the value: a tuple of shares
NCpuMoeOption = Annotated[int, option(S.N_CPU_MOE)]
LlamaCppOption = Annotated[Path | None, option(S.LLAMA_CPP)]


def one_keep(keep: Keep | None, alias: str | None, alias_name: str) -> Keep | None:
    """--keep, or its older spelling `alias_name`; both given is refused."""
    if keep is not None and alias is not None:
        raise BadInput(
            f"--keep and {alias_name} name the same thing", f"give --keep alone ({alias_name} is its older spelling)"
        )
    return keep if keep is not None else None if alias is None else S.KEEP.parse_text(alias)


def resolve_keepset(layout: MoeLayout, keep: Keep | None, first: int | None, ids: str | None) -> KeepSet:
    """The keep-set of exactly one of --keep FILE, --keep-first K, --keep-ids LIST."""
    from ggufcarve.moe.keepset import keep_first, keep_ids, load_keepset, parse_id_list

    if keep is not None and keep.file is None:
        raise BadInput(
            f"--keep {keep.counts}: a count does not say which experts",
            "give a keep-set file (ggufcarve select or tune writes one), or --keep-first K",
        )
    given = [x is not None for x in (keep, first, ids)]
    if sum(given) != 1:
        raise BadInput(
            "give exactly one of --keep FILE, --keep-first K, --keep-ids LIST",
            "for example --keep kept_expert_indices.json",
        )
    if keep is not None and keep.file is not None:
        return load_keepset(keep.file, layout)
    if first is not None:
        return keep_first(layout, first)
    return keep_ids(layout, parse_id_list(ids or ""))


def commands_of(group: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every command of a (typer-made) command group with its path of names."""
    if hasattr(group, "commands"):
        return [found for name, sub in group.commands.items() for found in commands_of(sub, (*path, name))]
    return [(path, group)]


def setting_of_option(param: Any) -> Setting | None:
    """The setting an option was made from (its parser is the setting's, or, for an on/off flag, its
    flag is the setting's); None for an option of one command alone."""
    func = getattr(getattr(param, "type", None), "func", None)
    owner = getattr(func, "__self__", None)
    if isinstance(owner, Setting):
        return owner
    for flag in getattr(param, "opts", ()):
        setting = S.SETTINGS.get(flag.removeprefix("--").replace("-", "_")) if flag.startswith("--") else None
        if setting is not None and isinstance(setting.unit, Flag):
            return setting
    return None


def commands_by_setting(group: Any) -> dict[str, list[str]]:
    """Setting name -> the commands (as typed) with a visible option made from it."""
    found: dict[str, list[str]] = {}
    for path, command in commands_of(group):
        for param in command.params:
            if getattr(param, "param_type_name", "") == "option" and not param.hidden:
                setting = setting_of_option(param)
                if setting is not None:
                    found.setdefault(setting.name, []).append(" ".join(path))
    return found
