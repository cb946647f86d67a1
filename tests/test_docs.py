"""Docs that cannot drift: every `ggufcarve ...` command line in a fenced block of README.md and
docs/*.md names a command the command line has, and only options that command has (with a value
where the option takes one). Checked against the typer app itself, without running anything."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from ggufcarve.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LINE = typer.main.get_command(app)
HELP_NAMES = tuple(COMMAND_LINE.context_settings.get("help_option_names", ("--help",)))
SEPARATORS = ("&&", "||", ";")
SYNOPSIS_MARKS = "[]()"  # `[--ctx 512]`, `(--keep K | --ratio R)`: optional and alternative parts of a synopsis
ENVIRONMENT = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")  # `COLUMNS=140 ggufcarve ...`: variables set for one command


def fenced_blocks(text: str) -> list[tuple[int, list[str]]]:
    """The fenced code blocks of a markdown text: (line number of the first body line, body lines)."""
    blocks, body, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if body is None:
                body, start = [], number + 1
            else:
                blocks.append((start, body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def logical_lines(body: list[str], start: int) -> list[tuple[int, str]]:
    """Lines with their backslash continuations joined, each with the number of its first line."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, line in enumerate(body):
        number, text = (pending[0], pending[1] + " " + line.strip()) if pending else (start + offset, line)
        if text.rstrip().endswith("\\"):
            pending = (number, text.rstrip()[:-1])
        else:
            joined.append((number, text))
            pending = None
    if pending:
        joined.append(pending)
    return joined


def command_lines(text: str) -> list[tuple[int, str]]:
    """The ggufcarve command lines of a markdown text's fenced blocks. In a block with `$ ` prompts
    only the prompted lines are commands (the rest is output); in a block without, every line that
    starts with `ggufcarve` or `python -m ggufcarve` is one."""
    found = []
    for start, body in fenced_blocks(text):
        prompted = any(line.startswith("$ ") for line in body)
        for number, line in logical_lines(body, start):
            line = line.strip()
            if prompted:
                if not line.startswith("$ "):
                    continue
                line = line[2:].strip()
            line = ENVIRONMENT.sub("", line)
            if line.startswith("python -m ggufcarve"):
                line = "ggufcarve" + line[len("python -m ggufcarve") :]
            if line == "ggufcarve" or line.startswith("ggufcarve "):
                found.append((number, line))
    return found


def invocations(line: str) -> list[list[str]]:
    """The ggufcarve invocations of one command line (split at `&&`, `||`, `;` and at a second
    `ggufcarve` written on the same synopsis line), synopsis brackets stripped from every word."""
    runs: list[list[str]] = [[]]
    for word in shlex.split(line, comments=True):
        if word in SEPARATORS:
            runs.append([])
            continue
        ends_command = word.endswith(";")
        word = word.removesuffix(";")
        if word == "ggufcarve" and runs[-1]:
            runs.append([])
        cleaned = word.strip(SYNOPSIS_MARKS)
        if cleaned and cleaned != "|":
            runs[-1].append(cleaned)
        if ends_command:
            runs.append([])
    return [run for run in runs if run and run[0] == "ggufcarve"]


def _options(command) -> dict[str, bool]:
    """Every option name of a command -> whether it takes a value."""
    names = {name: False for name in HELP_NAMES}
    for parameter in command.params:
        if getattr(parameter, "param_type_name", "") != "option":
            continue
        takes_value = not (getattr(parameter, "is_flag", False) or getattr(parameter, "count", False))
        for name in (*parameter.opts, *parameter.secondary_opts):
            names[name] = takes_value
    return names


def _is_option(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-\d+(\.\d+)?", word)


def check_invocation(words: list[str]) -> list[str]:
    """What is wrong with one invocation (its words, `ggufcarve` first): an unknown command, an
    unknown option, a flag given a value, or an option missing its value."""
    command, path, index = COMMAND_LINE, ["ggufcarve"], 1
    while hasattr(command, "commands") and index < len(words):
        word = words[index]
        if _is_option(word):
            problems, index = _check_option(command, path, words, index)
            if problems:
                return problems
            continue
        sub = command.commands.get(word)
        if sub is None:
            return [f"`{' '.join(path)}` has no command {word!r} (it has: {', '.join(command.commands)})"]
        command, index = sub, index + 1
        path.append(word)
    while index < len(words):
        if _is_option(words[index]):
            problems, index = _check_option(command, path, words, index)
            if problems:
                return problems
        else:
            index += 1
    return []


def _check_option(command, path: list[str], words: list[str], index: int) -> tuple[list[str], int]:
    """The problems of the option at words[index], and the index of the word after it (and its value)."""
    word = words[index]
    options = _options(command)
    given_value = word.startswith("--") and "=" in word
    name = word.partition("=")[0] if given_value else word
    if name not in options and not name.startswith("--") and len(name) > 2 and name[:2] in options:
        name, given_value = name[:2], True  # `-t2`: a short option with its value attached
    if name not in options:
        return [f"`{' '.join(path)}` has no option {name} (it has: {', '.join(sorted(options))})"], index + 1
    if not options[name]:
        if given_value:
            return [f"`{' '.join(path)}`'s {name} is a flag and takes no value ({word})"], index + 1
        return [], index + 1
    if given_value:
        return [], index + 1
    if index + 1 >= len(words) or _is_option(words[index + 1]):
        return [f"`{' '.join(path)}`'s {name} takes a value and none follows it"], index + 1
    return [], index + 2


def check_line(line: str) -> list[str]:
    return [problem for words in invocations(line) for problem in check_invocation(words)]


DOC_LINES = [(path, number, line) for path in DOCS for number, line in command_lines(path.read_text())]


@pytest.mark.parametrize(
    ("path", "number", "line"), DOC_LINES, ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in DOC_LINES]
)
def test_a_documented_command_line_is_one_the_command_line_takes(path, number, line):
    assert check_line(line) == [], f"{path.relative_to(ROOT)}:{number}: {line}"


def test_the_docs_show_the_commands_of_every_task():
    readme = {
        " ".join(words[:3])
        for _, line in command_lines((ROOT / "README.md").read_text())
        for words in invocations(line)
    }
    for expected in (
        "ggufcarve demo -q",
        "ggufcarve verify ggufcarve-demo/release",
        "ggufcarve imatrix remap",
        "ggufcarve ladder run",
    ):
        assert expected in readme, expected
    named = {words[1] for _, _, line in DOC_LINES for words in invocations(line) if len(words) > 1}
    assert {
        "demo",
        "best",
        "run",
        "prune",
        "ladder",
        "verify",
        "tune",
        "fit",
        "select",
        "score",
        "eval",
        "card",
        "imatrix",
        "release",
        "inspect",
        "toolchain",
        "check-prune",
    } <= named


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("ggufcarve prnue model.gguf --keep-first 4 -o out.gguf", "has no command 'prnue'"),
        ("ggufcarve prune model.gguf --keep-frist 4 -o out.gguf", "has no option --keep-frist"),
        ("ggufcarve imatrix remapp x.gguf -o y.gguf", "`ggufcarve imatrix` has no command 'remapp'"),
        ("ggufcarve verify release/ --strict=yes", "--strict is a flag and takes no value"),
        ("ggufcarve prune model.gguf --keep-first 4 -o", "-o takes a value and none follows it"),
        ("ggufcarve fit model.gguf --memory --ctx 4096", "--memory takes a value and none follows it"),
        ("ggufcarve release merge r/ && ggufcarve verfy r/", "has no command 'verfy'"),
        ("ggufcarve --versoin", "`ggufcarve` has no option --versoin"),
    ],
)
def test_the_checker_finds_a_made_up_command_or_option(line, problem):
    problems = check_line(line)
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize(
    "line",
    [
        "ggufcarve prune model.gguf --keep-first 4 -o out.gguf -q",
        "ggufcarve verify release/ --strict",
        "ggufcarve ladder run l.toml --source m.gguf -o r/ --only=Q4_K_M -t2",
        "ggufcarve select MODEL --method M (--keep K | --ratio R) "
        "[--calibration FILE ...] [--ctx 512] -o SELECTION.json",
        "ggufcarve --version",
        "ggufcarve imatrix --help",
    ],
)
def test_the_checker_takes_a_right_line(line):
    assert check_line(line) == []


def test_command_lines_are_read_from_fenced_blocks_only_and_prompts_mark_output():
    text = "\n".join(
        [
            "ggufcarve not-in-a-block --x",
            "```console",
            "$ ggufcarve verify release/ \\",
            "    --strict",
            "ggufcarve run: the title of a table, an output line",
            "```",
            "```",
            "ggufcarve fit m.gguf --memory 24GiB   # a synopsis line",
            "python -m ggufcarve demo",
            "```",
        ]
    )
    assert [(number, line.split()) for number, line in command_lines(text)] == [
        (3, ["ggufcarve", "verify", "release/", "--strict"]),
        (8, ["ggufcarve", "fit", "m.gguf", "--memory", "24GiB", "#", "a", "synopsis", "line"]),
        (9, ["ggufcarve", "demo"]),
    ]


def test_a_command_line_is_read_past_the_variables_it_sets():
    text = "\n".join(["```console", "$ GGUFCARVE_CACHE=new COLUMNS=140 ggufcarve verify r/", "```"])
    assert command_lines(text) == [(2, "ggufcarve verify r/")]


def _capture_script():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("capture_docs", ROOT / "dev" / "capture_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_capture_marker_in_the_docs_wraps_one_fenced_block():
    capture = _capture_script()
    found = {path.name: capture.find_captures(path.read_text().splitlines(), path) for path in DOCS}
    assert [c.kind for c in found["README.md"]] == ["command", "command", "file", "command", "command", "command"]


def test_the_capture_filters_keep_the_lines_they_name_and_mark_the_gaps():
    capture = _capture_script()
    output = ["a", "b", "answer: x", "c", "run it: y"]
    assert capture.keep_lines(output, "") == output
    assert capture.keep_lines(output, "tail 1") == ["...", "run it: y"]
    assert capture.keep_lines(output, "head 2") == ["a", "b", "..."]
    assert capture.keep_lines(output, "grep ^answer|^run it") == ["...", "answer: x", "...", "run it: y"]
    assert capture.keep_lines(output, "drop ^answer|^run it") == ["a", "b", "...", "c", "..."]
    assert capture.commands_of(["$ ggufcarve a \\", "    --b", "output", "$ ggufcarve c"]) == [
        ["$ ggufcarve a \\", "    --b"],
        ["$ ggufcarve c"],
    ]


def test_a_capture_inside_a_list_item_is_found_with_its_indentation():
    capture = _capture_script()
    indented = [
        "- item:",
        "  <!-- capture: tail 1 -->",
        "  ```console",
        "  $ ggufcarve c",
        "  ```",
        "  <!-- /capture -->",
    ]
    assert capture.find_captures(indented, Path("x.md")) == [capture.Capture(2, 5, "command", "tail 1", "  ")]
