"""toolchain show | build: the llama.cpp tools ggufcarve runs.

Examples:
    ggufcarve toolchain show
    ggufcarve toolchain build
    ggufcarve toolchain build --backend rpc
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ggufcarve import settings as S
from ggufcarve.cli.options import LlamaCppOption, command_group, option
from ggufcarve.cli.render import new_table, out, progress
from ggufcarve.errors import BadInput

app = command_group("Find, probe and build the llama.cpp tools ggufcarve runs.")
BACKENDS = ("cpu", "rpc", "cuda", "vulkan", "metal")  # llama.tools.BACKENDS, without importing it at start


def _backend(text: str) -> str:
    if text.strip().lower() not in BACKENDS:
        raise BadInput(f"--backend must be one of {', '.join(BACKENDS)} (got {text!r})", "for example --backend rpc")
    return text.strip().lower()


@app.command("show", short_help="Which llama.cpp tools were found where.")
def toolchain_show(
    llama_cpp: LlamaCppOption = None,
    as_json: Annotated[bool, option(S.JSON)] = False,
) -> None:
    """Which llama.cpp tools were found where: build, commit, flavour, sha256; and the libllama backend."""
    from ggufcarve.llama.tools import show_toolchain

    chain = show_toolchain(llama_cpp)
    if as_json:
        out.print_json(json.dumps(chain.to_json()))
        return
    table = new_table(title="llama.cpp tools")
    for column in ("tool", "found in", "path", "build", "commit", "flavour", "sha256"):
        table.add_column(column)
    for name, info in chain.tools.items():
        if info is None:
            table.add_row(name, "[red]missing[/]", "", "", "", "", "")
        else:
            build = f"{info.version or ''} b{info.build_number}" if info.build_number is not None else "?"
            table.add_row(
                name,
                info.origin,
                info.path,
                build.strip(),
                info.commit or "?",
                info.flavour + ("" if info.works else " [red](probe failed)[/]"),
                info.sha256[:12],
            )
    out.print(table)
    lib = chain.libllama
    out.print(
        f"libllama backend: llama-cpp-python {chain.llama_cpp_python or 'not installed'}"
        + (f", {lib['path']} (sha256 {lib['sha256'][:12]})" if lib else " [red](libllama not found)[/]")
    )
    state = {"ready": "", "missing": " (empty)", "other cpu": " [red](built for another CPU: not used)[/]"}[
        chain.cache_state
    ]
    out.print(f"cache: {chain.cache_bin}{state}; this CPU: {chain.cpu.key}")
    if any(info is None for info in chain.tools.values()):
        out.print("build the missing tools with: ggufcarve toolchain build")


@app.command("build", short_help="Compile llama.cpp's tools from the sdist, once.")
def toolchain_build(
    force: Annotated[bool, option(S.FORCE, "the cached tools are built again.")] = False,
    jobs: Annotated[int | None, option(S.JOBS, "compile jobs.")] = None,
    from_dir: Annotated[
        Path | None,
        typer.Option(
            "--from", help="Install tools already built from the same source (a build's bin dir) instead of compiling."
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            help="The ggml backend the tools are built with, on top of the CPU: cpu, rpc (--rpc HOST:PORT and "
            "ggml-rpc-server), cuda, vulkan or metal (default: the installed llama-cpp-python's).",
            metavar="|".join(BACKENDS).upper(),
            parser=_backend,
        ),
    ] = None,
    cuda_architectures: Annotated[
        str | None,
        typer.Option(
            "--cuda-architectures",
            help="With --backend cuda: CMAKE_CUDA_ARCHITECTURES (native, or 90 for an H100/H200): fewer build minutes.",
        ),
    ] = None,
    quiet: Annotated[bool, option(S.QUIET)] = False,
) -> None:
    """Compile llama-quantize, llama-imatrix, llama-perplexity, llama-gguf-split, llama-bench and llama-fit-params
    (and ggml-rpc-server with --backend rpc) into ggufcarve's cache.

    From the llama.cpp source in the llama-cpp-python sdist of the installed version; about 10-14
    minutes on 2 cores, once per version and backend."""
    from ggufcarve.llama.build import build_tools, install_prebuilt
    from ggufcarve.llama.tools import libllama_backend

    if from_dir is not None:
        bin_dir, copied = install_prebuilt(
            from_dir, origin=f"copied from {from_dir}", force=force, backend=backend or libllama_backend()
        )
        out.print(f"installed: {bin_dir}" if copied else f"already cached (pass --force to replace): {bin_dir}")
        return
    with progress(not quiet) as sink:
        bin_dir = build_tools(sink, jobs=jobs, force=force, backend=backend, cuda_architectures=cuda_architectures)
    out.print(f"tools ready in {bin_dir}")
