"""The ggufcarve command line: the typer app, its command groups, and the error boundary.

Only the cli package prints. Each command module imports the library it needs inside its
commands, so `ggufcarve --version` and `--help` start without numpy, gguf or llama_cpp.

Examples:
    ggufcarve inspect model.gguf
    ggufcarve select model.gguf --method weights --keep 128 -o out/selection.json
    ggufcarve prune model.gguf --keep kept_expert_indices.json -o out/model-128e.gguf
    ggufcarve imatrix remap model.imatrix.gguf --model out/model-128e.gguf -o out/model-128e.imatrix.gguf
    ggufcarve ladder run ladders/q8-to-iq1.toml --source out/model-128e.gguf --imatrix out/model-128e.imatrix.gguf -o release/
    ggufcarve release merge release/      # after ladder runs of single rungs from several hosts
    ggufcarve verify release/
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from ggufcarve import __version__
from ggufcarve.cli import evaluate, imatrix, ladder, prune, release, select, toolchain, verify
from ggufcarve.cli.options import command_group
from ggufcarve.cli.render import print_error
from ggufcarve.errors import CarveError

app = command_group("Cut routed experts out of Mixture-of-Experts GGUF files, byte for byte.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ggufcarve {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False,
) -> None:
    """ggufcarve: expert pruning, imatrix remapping and quantization ladders for MoE GGUF models."""


app.command()(prune.inspect)
app.command()(prune.prune)
app.command("check-prune")(prune.check_prune_command)
app.command("score")(select.score_command)
app.command("select")(select.select_command)
app.add_typer(imatrix.app, name="imatrix")
app.add_typer(toolchain.app, name="toolchain")
app.add_typer(ladder.app, name="ladder")
app.add_typer(release.app, name="release")
app.command("verify")(verify.verify_command)
app.command("eval")(evaluate.eval_command)
app.command("card")(evaluate.card_command)


def main() -> None:
    debug = os.environ.get("GGUFCARVE_DEBUG") == "1"
    try:
        app()
    except CarveError as error:
        if debug:
            raise
        print_error(error.message, error.hint)
        sys.exit(error.exit_code)
    except OSError as error:  # a file vanished, a permission or the disk failed outside the checked paths
        if debug:
            raise
        where = f"{error.filename}: " if error.filename else ""
        print_error(f"{where}{error.strerror or error}", "check the path, its permissions and the free disk space, then run again (GGUFCARVE_DEBUG=1 shows where)")
        sys.exit(1)
