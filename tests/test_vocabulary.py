"""One vocabulary: an option spelled the same way means the same thing in every command.

Walks every command of the real CLI: --keep names experts kept per block (counts or a keep-set
file), --ctx a context length in tokens, --chunk-ctx the scoring chunk, --threads and --gpu-layers
llama.cpp's; the older spellings (--k, --eval-ctx) are hidden aliases; and each command refuses a
--keep form it has no use for with a hint, before any work."""

from __future__ import annotations

import json

import pytest
import typer
from clirun import ggufcarve

from ggufcarve.cli import app
from ggufcarve.demo import DEMO_MODEL, HELDOUT

MEANING = {  # option -> words its help must hold
    "--keep": ("kept", "keep"),
    "--ctx": ("tokens", "context"),
    "--chunk-ctx": ("chunk",),
    "--threads": ("threads",),
    "--gpu-layers": ("-ngl",),
}
HIDDEN_ALIASES = {"--k": "--keep", "--eval-ctx": "--chunk-ctx"}


def commands(group, path: tuple[str, ...] = ()):
    if hasattr(group, "commands"):  # a group (typer's click, whichever module provides it)
        for name, sub in group.commands.items():
            yield from commands(sub, (*path, name))
    else:
        yield path, group


ALL = list(commands(typer.main.get_command(app)))


def test_the_walk_finds_the_commands():
    names = {" ".join(p) for p, _ in ALL}
    assert {"fit", "best", "tune", "select", "prune", "eval", "imatrix collect", "run"} <= names


@pytest.mark.parametrize("option", sorted(MEANING))
def test_each_option_means_one_thing_everywhere(option):
    seen = 0
    for path, command in ALL:
        for param in command.params:
            if getattr(param, "param_type_name", "") == "option" and option in param.opts and not param.hidden:
                seen += 1
                text = (param.help or "").lower()
                assert any(word in text for word in MEANING[option]), (" ".join(path), option, param.help)
    assert seen, option


def test_older_spellings_are_hidden_aliases():
    for path, command in ALL:
        for param in command.params:
            if param.param_type_name != "option":
                continue
            for old, new in HIDDEN_ALIASES.items():
                if old in param.opts:
                    assert param.hidden, (" ".join(path), old)
                    assert any(new in p.opts for p in command.params if p.param_type_name == "option"), (
                        " ".join(path),
                        old,
                        new,
                    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["select", DEMO_MODEL, "--method", "weights", "--keep", "8,12", "-o", "{tmp}/s.json"],
            "select writes one selection",
        ),
        (
            ["select", DEMO_MODEL, "--method", "weights", "--keep", "{keepset}", "-o", "{tmp}/s.json"],
            "is a selection already",
        ),
        (
            ["tune", DEMO_MODEL, "--keep", "{keepset}", "--heldout", HELDOUT, "-o", "{tmp}/t"],
            "tune weighs the criteria's keep-sets",
        ),
        (["prune", DEMO_MODEL, "--keep", "8", "-o", "{tmp}/p.gguf"], "a count does not say which experts"),
        (["fit", DEMO_MODEL, "--memory", "1GiB", "--keep", "eight"], "must be a count (8), a list of counts"),
    ],
)
def test_a_keep_form_a_command_has_no_use_for_is_refused_with_a_hint(tmp_path, argv, message):
    keepset = tmp_path / "given.json"
    keepset.write_text(json.dumps({str(b): list(range(8)) for b in range(4)}))
    argv = [str(a).replace("{tmp}", str(tmp_path)).replace("{keepset}", str(keepset)) for a in argv]
    result = ggufcarve(*argv)
    assert result.code == 1 and message in result.error_line and "hint:" in result.error_line, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["given.json"]


def test_select_takes_one_count_as_before(tmp_path):
    result = ggufcarve(
        "select", DEMO_MODEL, "--method", "weights", "--keep", "8", "-o", tmp_path / "s.json", "--no-heatmap"
    )
    assert result.code == 0, result.stderr
    assert {len(ids) for ids in json.loads((tmp_path / "s.json").read_text())["layers"].values()} == {8}
