"""Re-make the captured command outputs in README.md and docs/*.md.

    python dev/capture_docs.py                  # README.md and every docs/*.md holding a capture
    python dev/capture_docs.py README.md        # these files only
    python dev/capture_docs.py --check          # run everything, write nothing, exit 1 if a file would change
    python dev/capture_docs.py --plan-keys      # only docs/run.md's table of plan keys, from the settings

Markers (HTML comments, invisible on GitHub), each around one fenced block:

    <!-- capture -->                 the block's `$ ` lines (with their `\\` continuation lines) are
    ```console                       commands; they run in order and each is followed by its
    $ ggufcarve demo                 output (stdout and stderr); every other line of the block is
    ```                              replaced
    <!-- /capture -->

    <!-- capture: tail N -->         only the last N lines of each command's output
    <!-- capture: head N -->         only the first N lines
    <!-- capture: grep REGEX -->     only the lines REGEX matches (re.search)
    <!-- capture: drop REGEX -->     only the lines REGEX does not match (progress bars: `drop ━`)
                                     left-out lines are shown as one `...` line per gap

    <!-- capture-file: NAME -->      the block's text is written to NAME in the capture folder
    ```toml                          before the commands of later blocks run (a plan, a keep-set)
    ...
    ```
    <!-- /capture -->

A marked block may be indented (inside a list item): its indentation is taken off its lines and put
back on the output's.

Every markdown file gets one fresh temp folder; its blocks run in the order they appear there, so a
later block reads what an earlier one wrote (the README's tasks read the demo's release). The
folder holds links to the repository's ggufcarve/, ladders/, plans/, evaluation/ and tests/, so a
command names the shipped files (and the test suite's model factory) as it does from a clone.
`ggufcarve` runs this checkout's package (the repository root first on PYTHONPATH) at 100 columns.
In the output the temp folder's and the repository's absolute paths are made relative and the home
directory is written `~`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("ggufcarve", "ladders", "plans", "evaluation", "tests")
WIDTH = 100
TIMEOUT_SECONDS = 1800
OPEN = re.compile(r"^<!-- capture(?::\s*(?P<filter>.*?))?\s*-->$")
OPEN_FILE = re.compile(r"^<!-- capture-file:\s*(?P<name>\S+)\s*-->$")
CLOSE = "<!-- /capture -->"
LAUNCHER = """#!/bin/sh
exec "{python}" -c 'import sys; sys.argv[0] = "ggufcarve"; from ggufcarve.console import main; main()' "$@"
"""


@dataclass
class Capture:
    """One marked block: the lines [start, end) of its file, fence lines included."""

    start: int
    end: int
    kind: str  # "command" or "file"
    argument: str  # the filter of a command block, the file name of a file block
    indent: str = ""  # the fence's indentation (a block inside a list item), taken off the body and put back


def find_captures(lines: list[str], path: Path) -> list[Capture]:
    captures, index = [], 0
    while index < len(lines):
        line = lines[index].strip()
        command, written = OPEN.match(line), OPEN_FILE.match(line)
        if command or written:
            fence = index + 1
            if fence >= len(lines) or not lines[fence].lstrip().startswith("```"):
                raise SystemExit(f"{path}:{index + 1}: a capture marker must be followed by a fenced block")
            indent = lines[fence][: len(lines[fence]) - len(lines[fence].lstrip())]
            close = next((i for i in range(fence + 1, len(lines)) if lines[i].lstrip().startswith("```")), None)
            if close is None or close + 1 >= len(lines) or lines[close + 1].strip() != CLOSE:
                raise SystemExit(f"{path}:{index + 1}: the fenced block must be followed by {CLOSE}")
            captures.append(
                Capture(
                    fence,
                    close + 1,
                    "file" if written else "command",
                    written.group("name") if written else (command.group("filter") or ""),
                    indent,
                )
            )
            index = close + 2
        else:
            index += 1
    return captures


def commands_of(block: list[str]) -> list[list[str]]:
    """The `$ ` command lines of a block's body, each with its continuation lines."""
    commands: list[list[str]] = []
    continued = False
    for line in block:
        if line.startswith("$ "):
            commands.append([line])
        elif continued and commands:
            commands[-1].append(line)
        else:
            continued = False
            continue
        continued = line.rstrip().endswith("\\")
    return commands


def keep_lines(output: list[str], rule: str) -> list[str]:
    """The output lines a block shows under its filter; `...` stands for each run left out."""
    if not rule:
        return output
    verb, _, value = rule.partition(" ")
    if verb == "tail":
        kept = set(range(max(0, len(output) - int(value)), len(output)))
    elif verb == "head":
        kept = set(range(min(len(output), int(value))))
    elif verb in ("grep", "drop"):
        pattern = re.compile(value)
        kept = {i for i, line in enumerate(output) if bool(pattern.search(line)) == (verb == "grep")}
    else:
        raise SystemExit(f"unknown capture filter {rule!r}: tail N, head N, grep REGEX or drop REGEX")
    shown: list[str] = []
    for i, line in enumerate(output):
        if i in kept:
            shown.append(line)
        elif not shown or shown[-1] != "...":
            shown.append("...")
    return shown


def relative(text: str, folder: Path) -> str:
    for absolute in (str(folder.resolve()), str(folder), str(ROOT)):
        text = text.replace(absolute + "/", "").replace(absolute, ".")
    return text.replace(str(Path.home()) + "/", "~/")


def run(command: list[str], folder: Path, environment: dict[str, str]) -> list[str]:
    script = "\n".join(line[2:] if i == 0 else line for i, line in enumerate(command))
    print(f"  {command[0]}", file=sys.stderr)
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=folder,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_SECONDS,
    )
    lines = [line.rstrip() for line in relative(done.stdout, folder).splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    if done.returncode != 0:
        print(f"  exit {done.returncode}: {lines[-1] if lines else ''}", file=sys.stderr)
    return lines


def capture_file(path: Path, check: bool) -> bool:
    """Re-make the captures of one markdown file; whether its text changed."""
    lines = path.read_text().splitlines()
    captures = find_captures(lines, path)
    if not captures:
        return False
    print(f"{path.relative_to(ROOT)}: {len(captures)} capture(s)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="ggufcarve-capture-") as temp:
        folder = Path(temp)
        for name in LINKED:
            (folder / name).symlink_to(ROOT / name)
        bin_dir = folder / ".bin"
        bin_dir.mkdir()
        launcher = bin_dir / "ggufcarve"
        launcher.write_text(LAUNCHER.format(python=sys.executable))
        launcher.chmod(0o755)
        environment = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "COLUMNS": str(WIDTH),
            "NO_COLOR": "1",
            "TERM": "dumb",
        }
        new = list(lines)
        rewritten: dict[int, list[str]] = {}
        for capture in captures:
            body = [line.removeprefix(capture.indent) for line in lines[capture.start + 1 : capture.end - 1]]
            if capture.kind == "file":
                (folder / capture.argument).parent.mkdir(parents=True, exist_ok=True)
                (folder / capture.argument).write_text("\n".join(body) + "\n")
                continue
            shown: list[str] = []
            for command in commands_of(body):
                shown += command + keep_lines(run(command, folder, environment), capture.argument)
            rewritten[capture.start] = [capture.indent + line if line else line for line in shown]
        for capture in reversed(captures):  # from the end, so that earlier indices stay valid
            if capture.start in rewritten:
                new[capture.start + 1 : capture.end - 1] = rewritten[capture.start]
        shutil.rmtree(folder / ".bin")
    changed = new != lines
    if changed and not check:
        path.write_text("\n".join(new) + "\n")
    return changed


PLAN_KEYS = re.compile(r"(<!-- plan-keys -->\n)(.*?)(<!-- /plan-keys -->)", re.S)


def write_plan_keys(check: bool) -> bool:
    """docs/run.md's table of plan keys, made from the plan's tables and their settings (between
    `<!-- plan-keys -->` and `<!-- /plan-keys -->`); True when it changed."""
    sys.path.insert(0, str(ROOT))
    import typer

    from ggufcarve.cli import app
    from ggufcarve.cli.options import commands_by_setting
    from ggufcarve.pipeline.plan import plan_keys_markdown

    path = ROOT / "docs" / "run.md"
    text = path.read_text()
    table = plan_keys_markdown(commands_by_setting(typer.main.get_command(app)))
    new = PLAN_KEYS.sub(lambda m: m.group(1) + table + m.group(3), text)
    if new != text and not check:
        path.write_text(new)
    return new != text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/*.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    parser.add_argument("--plan-keys", action="store_true", help="only docs/run.md's table of plan keys (runs nothing)")
    arguments = parser.parse_args()
    if arguments.plan_keys:
        changed_keys = write_plan_keys(arguments.check)
        print(f"{'would change' if arguments.check else 'rewrote'}: docs/run.md" * changed_keys, file=sys.stderr)
        sys.exit(1 if arguments.check and changed_keys else 0)
    files = [path.resolve() for path in arguments.files] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    changed = [path for path in files if capture_file(path, arguments.check)]
    for path in changed:
        print(f"{'would change' if arguments.check else 'rewrote'}: {path.relative_to(ROOT)}", file=sys.stderr)
    sys.exit(1 if arguments.check and changed else 0)


if __name__ == "__main__":
    main()
