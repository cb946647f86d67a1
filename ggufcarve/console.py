"""The `ggufcarve` console script. `ggufcarve --version` is answered here, before the command line
(typer, its command modules) is imported, so it costs about what the interpreter's own start does;
everything else goes to `ggufcarve.cli.main`."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from ggufcarve import __version__

        print(f"ggufcarve {__version__}")
        return
    from ggufcarve.cli import main as cli_main

    cli_main()
