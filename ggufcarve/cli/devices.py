"""devices: what llama.cpp sees through the installed llama-cpp-python and through the tools.

Examples:
    ggufcarve devices
    ggufcarve devices --rpc 127.0.0.1:50052,127.0.0.1:50053 --json
"""

from __future__ import annotations

import json
from typing import Annotated

from ggufcarve import settings as S
from ggufcarve.cli.options import JsonOption, LlamaCppOption, option
from ggufcarve.cli.render import new_table, out, size


def devices_command(
    rpc: Annotated[str | None, option(S.RPC, "They are listed with the others.")] = None,
    llama_cpp: LlamaCppOption = None,
    as_json: JsonOption = False,
) -> None:
    """The devices llama.cpp sees (GPUs, RPC servers' devices, the CPU) and system memory, through the
    installed llama-cpp-python and through the tools (llama-bench --list-devices): name, type, free
    and total memory."""
    from ggufcarve.llama.device_list import libllama_devices, tool_devices
    from ggufcarve.llama.devices import device_order, host_memory
    from ggufcarve.llama.tools import backend_of_tool, find_tool, libllama_backend

    endpoints = tuple(rpc or ())
    seen = device_order(libllama_devices(endpoints))
    bench = find_tool("llama-bench", llama_cpp)
    by_tools = tool_devices(bench, endpoints) if bench is not None else None
    host = host_memory()
    doc = {
        "libllama": {"backend": libllama_backend(), "devices": [d.to_json() for d in seen]},
        "tools": None
        if bench is None
        else {
            "tool": bench.name,
            "backend": backend_of_tool(bench),
            "devices": [d.to_json() for d in by_tools or []],
        },
        "host": host.to_json(),
    }
    if as_json:
        out.print_json(json.dumps(doc))
        return
    table = new_table(title="llama.cpp's devices")
    for column, justify in (("device", "left"), ("type", "left"), ("free", "right"), ("total", "right")):
        table.add_column(column, justify=justify)
    table.add_column("seen by")
    tool_names = {d.name for d in by_tools or []}
    for device in seen:
        where = ["libllama"] + (["tools"] if device.name in tool_names else [])
        table.add_row(device.name, device.type, size(device.free), size(device.total), ", ".join(where))
    for device in by_tools or []:
        if device.name not in {d.name for d in seen}:
            table.add_row(device.name, device.type, size(device.free), size(device.total), "tools")
    table.add_row(host.name, "memory", size(host.free), size(host.total), "system")
    out.print(table)
    tools_line = (
        "tools: not built (ggufcarve toolchain build)"
        if bench is None
        else f"tools: {bench.parent}, built with {backend_of_tool(bench) or 'an unknown backend'}"
    )
    out.print(f"libllama: built with {libllama_backend()}; {tools_line}", highlight=False)
