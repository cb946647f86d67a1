"""The one builder of a placement's llama.cpp flags: the `llama-server` line a user pastes, the
`llama-cli` and `llama-bench` lines of a card, and llama-bench's argv when ggufcarve times that line.

    context = RunContext(n_ctx=16384, kv_type="q8_0")
    server_argv("m.gguf", Placement(n_cpu_moe=3), 40, context, rpc=("127.0.0.1:50052",), devices=("RPC0",))
    # ['llama-server', '-m', 'm.gguf', '-c', '16384', '-ctk', 'q8_0', '-ctv', 'q8_0', '-fa', 'on',
    #  '--rpc', '127.0.0.1:50052', '-dev', 'RPC0', '-ngl', '999', '--n-cpu-moe', '3']
    bench_args(Placement(n_cpu_moe=3), 40, context, rpc=..., devices=("RPC0",))
    # ['-ctk', 'q8_0', '-ctv', 'q8_0', '-fa', 'on', '-d', '8192',
    #  '--rpc', ..., '-dev', 'RPC0', '-ngl', '999', '-ncmoe', '3']

The spellings (common/arg.cpp for the server and the cli, tools/llama-bench/llama-bench.cpp for the
bench): `--rpc A,B` registers the servers' devices; `-dev` names the devices used, exactly the
budgeted ones (comma-separated; llama-bench separates the devices of one run by "/"); `-ngl` the
layers offloaded, as measured (999: every layer and the output); `-ts` the split (llama-bench: "/");
`--n-cpu-moe N` (llama-bench: `-ncmoe N`) the routed experts of the first N blocks in system memory,
or `-ot PATTERN=CPU` for the last N blocks'; `-c` the context, `-ctk/-ctv` the cache type, `-fa`
flash attention (on with a quantized cache: llama.cpp needs it for a quantized V cache), `-b/-ub`
the batch sizes where they differ from llama.cpp's defaults (2048, 512). llama-bench has no `-c`:
it times decode at depth `-d` (default half the context asked for, the depth a user meets in a run
of that context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ggufcarve.placement.search import Placement

DEFAULT_BATCH, DEFAULT_UBATCH = 2048, 512  # llama.cpp's -b and -ub defaults (common/common.h, llama-bench)


@dataclass(frozen=True)
class RunContext:
    """The context settings of a run line and of its timing."""

    n_ctx: int
    kv_type: str = "f16"
    flash_attn: str = "auto"  # llama.cpp's default; "on" where the cache is quantized
    n_batch: int = DEFAULT_BATCH
    n_ubatch: int = DEFAULT_UBATCH
    depth: int | None = None  # llama-bench -d; None: half of n_ctx

    @property
    def cache_type(self) -> str:
        return self.kv_type.lower()

    @property
    def attention(self) -> str:
        """-fa's value: on with a quantized cache, else as asked."""
        return "on" if self.cache_type != "f16" else self.flash_attn

    @property
    def bench_depth(self) -> int:
        return self.n_ctx // 2 if self.depth is None else self.depth

    def to_json(self) -> dict[str, Any]:
        return {
            "n_ctx": self.n_ctx,
            "kv_type": self.cache_type,
            "flash_attn": self.attention,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "depth": self.bench_depth,
        }


def placement_args(
    placement: Placement,
    main_blocks: int,
    *,
    rpc: tuple[str, ...] = (),
    devices: tuple[str, ...] = (),
    bench: bool = False,
) -> list[str]:
    """--rpc, -dev, -ngl, -ts and --n-cpu-moe N or -ot of `placement` (module docstring)."""
    join = "/" if bench else ","
    args = ["--rpc", ",".join(rpc)] if rpc else []
    offloads = placement.gpu_layers > 0
    if devices and offloads:
        args += ["-dev", join.join(devices)]
    args += ["-ngl", str(placement.gpu_layers)]
    if not offloads:
        return args
    if len(placement.tensor_split) > 1:
        args += ["-ts", join.join(f"{share:g}" for share in placement.tensor_split)]
    override = placement.override_tensor(main_blocks) if placement.from_last else None
    if override:
        args += ["-ot", override]
    elif placement.n_cpu_moe:
        args += ["-ncmoe" if bench else "--n-cpu-moe", str(placement.n_cpu_moe)]
    return args


def context_args(context: RunContext, *, bench: bool = False) -> list[str]:
    """-c (the bench: -d), -ctk/-ctv, -fa, -b/-ub of `context` (module docstring)."""
    args = [] if bench else ["-c", str(context.n_ctx)]
    if context.cache_type != "f16":
        args += ["-ctk", context.cache_type, "-ctv", context.cache_type]
    if context.attention != "auto" or bench:
        args += ["-fa", context.attention]
    if context.n_batch != DEFAULT_BATCH:
        args += ["-b", str(context.n_batch)]
    if context.n_ubatch != DEFAULT_UBATCH:
        args += ["-ub", str(context.n_ubatch)]
    if bench:
        args += ["-d", str(context.bench_depth)]
    return args


def server_argv(
    model_name: str,
    placement: Placement | None,
    main_blocks: int,
    context: RunContext,
    *,
    rpc: tuple[str, ...] = (),
    devices: tuple[str, ...] = (),
    tool: str = "llama-server",
) -> list[str]:
    """The line that runs `model_name` in `placement` (None: llama.cpp's own placement) at `context`."""
    argv = [tool, "-m", model_name, *context_args(context)]
    if placement is not None:
        argv += placement_args(placement, main_blocks, rpc=rpc, devices=devices)
    return argv


def bench_args(
    placement: Placement,
    main_blocks: int,
    context: RunContext,
    *,
    rpc: tuple[str, ...] = (),
    devices: tuple[str, ...] = (),
) -> list[str]:
    """llama-bench's flags that time the run line of `placement` at `context` (without -m, -p, -n, -r, -t)."""
    return [
        *context_args(context, bench=True),
        *placement_args(placement, main_blocks, rpc=rpc, devices=devices, bench=True),
    ]
