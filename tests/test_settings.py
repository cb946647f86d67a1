"""One settings layer: an option spelled the same way is the same setting in every command and in
plans, read by one parser with one error.

Walks every command of the real CLI and every key of every plan table: an option that more than
one command has, or that a plan also names, is made from its registered setting (same flag, same
parser, its help first); a plan key is read by a setting and spelled as it, and the same bad value
is refused with the same words on the command line and in a plan. The docs' table of plan keys is
the one the settings make."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ggufcarve import settings as S
from ggufcarve.cli import app
from ggufcarve.cli.options import commands_by_setting, commands_of, setting_of_option
from ggufcarve.errors import BadInput
from ggufcarve.pipeline.plan import TABLES, parse_plan, plan_keys_markdown
from ggufcarve.settings import table_keys

ROOT = Path(__file__).resolve().parent.parent
GROUP = typer.main.get_command(app)
COMMANDS = commands_of(GROUP)
TABLE_NAMED = {  # a key named after its table reads the setting of the option of that name
    ("[calibration]", "files"): "calibration",
    ("[imatrix]", "file"): "imatrix",
    ("[ladder]", "spec"): "ladder",
}


def visible_options():
    for path, command in COMMANDS:
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                long = next(f for f in param.opts if f.startswith("--"))
                yield " ".join(path), long, param


def plan_keys():
    for where, table in TABLES.items():
        for name, setting, default in table_keys(table):
            yield where, name, setting, default


def help_of(setting: S.Setting) -> str:
    return setting.help.removesuffix(":")


def test_the_walk_sees_every_command_and_table():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"best", "fit", "tune", "select", "score", "prune", "eval", "card", "ladder run", "run", "demo"} <= names
    assert {"[selection]", "[calibration]", "[imatrix]", "[ladder]", "[evaluation]", "[card]"} < set(TABLES)


def test_an_option_of_a_registered_name_is_made_from_its_setting():
    checked = 0
    for command, flag, param in visible_options():
        registered = S.SETTINGS.get(flag.removeprefix("--").replace("-", "_"))
        if registered is None:
            continue
        made_from = setting_of_option(param)
        assert made_from is registered, (command, flag, "not made from the setting of its name")
        assert (param.help or "").startswith(help_of(registered)), (command, flag, param.help)
        if not isinstance(registered.unit, S.Flag):
            assert param.type.func == registered.parse_text, (command, flag)
        if registered.short:
            assert registered.short in param.opts, (command, flag)
        checked += 1
    assert checked > 100


def test_an_option_without_a_setting_belongs_to_one_command():
    """An option no setting defines is its command's own: a second command with the same flag, or a
    plan key of that name, would be a second meaning."""
    owners: dict[str, list[str]] = defaultdict(list)
    for command, flag, _param in visible_options():
        if flag.removeprefix("--").replace("-", "_") not in S.SETTINGS:
            owners[flag].append(command)
    shared = {flag: where for flag, where in owners.items() if len(where) > 1}
    assert not shared, f"register these in ggufcarve/settings.py: {shared}"
    keys = {name for _where, name, _setting, _default in plan_keys()}
    clashing = {flag for flag in owners if flag.removeprefix("--").replace("-", "_") in keys}
    assert not clashing, clashing


def test_every_plan_key_is_read_by_the_setting_it_is_named_after():
    seen = 0
    for where, name, setting, _default in plan_keys():
        expected = TABLE_NAMED.get((where, name), name)
        assert setting.name == expected, (where, name, setting.name)
        assert S.SETTINGS[setting.name] is setting, (where, name)
        seen += 1
    assert seen >= 45


def test_the_plan_defaults_are_the_command_line_defaults():
    """A key a plan leaves out means what the option left out means."""
    from ggufcarve.evaluate.speed import DEFAULT_RUNS, ENGINES

    defaults = {}
    for command, _flag, param in visible_options():
        setting = setting_of_option(param)
        if setting is not None and command in ("eval", "ladder run"):
            defaults[setting.name] = param.default
    for where, name, setting, default in plan_keys():
        if where in ("[evaluation]", "[ladder]") and setting.name in defaults and default is not None:
            assert defaults[setting.name] == default, (where, name, defaults[setting.name], default)
    assert S.SPEED_ENGINE.unit.choices == ENGINES
    assert {n: d for n, _s, d in table_keys(TABLES["[evaluation]"])}["speed_runs"] == DEFAULT_RUNS


BAD = {  # a value each unit refuses, on a command line and in TOML
    S.Count: ("x", "x"),
    S.Fraction: ("2", 2),
    S.Choice: ("nonsense", "nonsense"),
    S.Names: (" , ", []),
    S.KeepUnit: ("eight", "eight"),
    S.File: ("no/such/file.txt", "no/such/file.txt"),
    S.Files: ("no/such/file.txt", "no/such/file.txt"),
    S.Text: ("  ", "  "),
}


def _plan_with(where: str, name: str, value) -> dict:
    plan = {"source": "model.gguf", "output": "release", "ladder": {"spec": "q8-to-iq1"}}
    if where == "plan":
        plan[name] = value
    else:
        plan.setdefault(where.strip("[]"), {})[name] = value
    return plan


def _words(message: str) -> str:
    """What the error says of the value, without where it was given."""
    for mark in (" must be ", ": no such file"):
        if mark in message:
            return mark + message.split(mark, 1)[1].split(" (", 1)[0] if mark == " must be " else mark
    return message


@pytest.mark.parametrize(
    "where, name",
    [
        (w, n)
        for w, n, s, _d in plan_keys()
        if s.name in commands_by_setting(GROUP) and type(s.unit) in BAD and getattr(s.unit, "exists", True)
    ],
)
def test_a_bad_value_is_refused_with_the_same_words_in_a_plan_and_on_the_command_line(tmp_path, where, name):
    setting = dict((n, s) for n, s, _d in table_keys(TABLES[where]))[name]
    text, toml = BAD[type(setting.unit)]
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(BadInput) as planned:
        parse_plan(_plan_with(where, name, toml), tmp_path)
    command = commands_by_setting(GROUP)[setting.name][0]
    result = CliRunner().invoke(app, [*command.split(), setting.flag, text], catch_exceptions=True)
    assert isinstance(result.exception, BadInput), (command, setting.flag, result.output)
    typed = result.exception.message
    assert typed.startswith(setting.flag), typed
    assert planned.value.message.startswith(f"{where} {name}" if where != "plan" else name), planned.value.message
    assert _words(typed) == _words(planned.value.message), (typed, planned.value.message)


def test_an_older_plan_spelling_still_reads_and_both_at_once_are_refused(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    (tmp_path / "other.gguf").write_bytes(b"")
    base = {"source": "model.gguf", "output": "release", "ladder": {"spec": "q8-to-iq1"}}
    selection = {"method": "weights", "keep": 4}
    plan = parse_plan(
        {**base, "selection": selection, "evaluation": {"heldout": "model.gguf", "compare": ["other.gguf"]}}, tmp_path
    )
    assert plan.evaluation.compare == (tmp_path / "other.gguf",)
    with pytest.raises(BadInput, match="compare and compare_models name the same thing"):
        parse_plan(
            {
                **base,
                "selection": selection,
                "evaluation": {"heldout": "model.gguf", "compare": ["other.gguf"], "compare_models": ["other.gguf"]},
            },
            tmp_path,
        )


def test_keep_reads_the_same_forms_in_a_plan_as_on_the_command_line(tmp_path):
    keepset = tmp_path / "kept.json"
    keepset.write_text("{}")
    assert S.KEEP.parse_text("8,12") == S.KEEP.parse_toml([8, 12], "[selection]", tmp_path) == S.Keep(counts="8,12")
    assert S.KEEP.parse_text("8") == S.KEEP.parse_toml(8, "[selection]", tmp_path) == S.Keep(counts="8")
    assert S.KEEP.parse_text("64-192/32") == S.KEEP.parse_toml("64-192/32", "[selection]", tmp_path)
    assert S.KEEP.parse_text(str(keepset)).file == S.KEEP.parse_toml("kept.json", "[selection]", tmp_path).file
    for bad in (0, [8, 0], True, 1.5):
        with pytest.raises(BadInput, match="must be a count"):
            S.KEEP.parse_toml(bad, "[selection]", tmp_path)


def test_the_docs_table_of_plan_keys_is_made_from_the_settings():
    text = (ROOT / "docs" / "run.md").read_text()
    found = re.search(r"<!-- plan-keys -->\n(.*?)<!-- /plan-keys -->", text, re.S)
    assert found, "docs/run.md has no <!-- plan-keys --> table"
    assert found.group(1) == plan_keys_markdown(commands_by_setting(GROUP)), (
        "the plan keys changed: python dev/capture_docs.py --plan-keys writes the table again"
    )


CONTROLS = {"quiet", "json", "force", "dry_run", "output", "compare", "strict"}  # how it runs, not what it computes


@pytest.mark.parametrize(
    "command, settings_classes, inputs",
    [
        ("best", ["ggufcarve.best.plan:BestSettings"], set()),
        ("tune", ["ggufcarve.tune.run:TuneSettings"], set()),
        ("select", ["ggufcarve.select.run:SelectSettings"], set()),
        ("card", ["ggufcarve.release.card:CardSettings"], set()),
        (
            "eval",
            [
                "ggufcarve.evaluate.protocol:EvalSettings",
                "ggufcarve.evaluate.speed:SpeedSettings",
                "ggufcarve.evaluate.loops:LoopSettings",
            ],
            # what is evaluated against what (evaluate_release's arguments); gate_segments is a rule of
            # the loaded gate, --loops the presence of LoopSettings
            {"heldout", "reference", "gate_segments", "loops"},
        ),
    ],
)
def test_a_commands_settings_dataclasses_name_the_settings_of_its_options(command, settings_classes, inputs):
    """Each field of the command's settings dataclasses that a setting reads is an option of the
    command made from that setting, and each such option but the run's controls (and the inputs
    the command hands over beside its settings) is a field."""
    import dataclasses
    import importlib

    from_fields = set()
    for settings_class in settings_classes:
        module, name = settings_class.split(":")
        cls = getattr(importlib.import_module(module), name)
        from_fields |= {f.metadata["setting"].name for f in dataclasses.fields(cls) if "setting" in f.metadata}
        # a field holding the run's Compute is read from its four settings (settings.compute_key)
        from_fields |= {s.name for f in dataclasses.fields(cls) for s in f.metadata.get("settings", ())}
    options = {
        setting_of_option(param).name
        for cmd, _flag, param in visible_options()
        if cmd == command and setting_of_option(param) is not None
    }
    assert from_fields <= options, from_fields - options
    assert options - CONTROLS - inputs <= from_fields, (options - CONTROLS - inputs) - from_fields


@pytest.mark.parametrize("name", sorted(n for n, s in S.SETTINGS.items() if not isinstance(s.unit, S.Flag)))
def test_a_refused_value_is_answered_with_an_example_the_setting_takes(name, tmp_path):
    """The hint after "must be" shows a value of the setting's own unit, which it then accepts."""
    setting = S.SETTINGS[name]
    example = setting.unit.text_example()
    assert example not in ("", "..."), name
    if isinstance(setting.unit, S.File) and setting.unit.exists:
        (tmp_path / example.replace("~/", "")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / example.replace("~/", "")).touch()
        example = str(tmp_path / example.replace("~/", ""))
    if isinstance(setting.unit, S.KeepUnit) or not isinstance(setting.unit, S.File):
        assert setting.parse_text(example) is not None, name
    else:
        assert setting.parse_text(example) == Path(example), name
