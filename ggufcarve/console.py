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
    try:
        from ggufcarve.select.prestart import prestart_for_command_line

        prestart_for_command_line(sys.argv[1:])  # a calibration child starts beside the imports below
    except Exception:  # a head start only: the command starts its own child when this one did not start
        import os

        if os.environ.get("GGUFCARVE_DEBUG") == "1":
            raise
    try:
        from ggufcarve.cli import main as cli_main
    except Exception as error:  # a broken installation: one line, as every error of the command line
        import os

        if os.environ.get("GGUFCARVE_DEBUG") == "1":
            raise
        print(
            f"error: internal error: {type(error).__name__}: {' '.join(str(error).split())} "
            "(hint: reinstall ggufcarve with its dependencies; "
            "set GGUFCARVE_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        sys.exit(1)
    cli_main()
