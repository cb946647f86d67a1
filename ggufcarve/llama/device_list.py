"""Listing the devices: through the installed libllama (a child task: `python -m
ggufcarve.llama.device_list`, since ggml-rpc aborts a process whose server goes away) and through a
llama.cpp tool's `--list-devices`.

    libllama_devices(("127.0.0.1:50052",))   # [Device(CPU), Device(RPC0), ...]
    tool_devices(require_tool("llama-bench"), ("127.0.0.1:50052",))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ggufcarve.llama.devices import Device, answers, registered_devices

CHILD_MODULE = "ggufcarve.llama.device_list"
TOOL_DEVICE_LINE = re.compile(r"^\s+(?P<name>\S+): (?P<description>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)$")
MIB = 2**20


@dataclass(frozen=True)
class DevicesRequest:
    """The devices child's request: which RPC servers to add before listing."""

    TASK: ClassVar[str] = "devices"

    rpc: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"rpc": list(self.rpc)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> DevicesRequest:
        return cls(tuple(doc.get("rpc", ())))


def _list_child(request: DevicesRequest, out: Any) -> None:
    import json

    from ggufcarve.llama.libllama import bindings, forward_warnings

    llama_cpp = bindings()
    forward_warnings(llama_cpp)
    llama_cpp.llama_backend_init()
    found = [device.to_json() for device in registered_devices(request.rpc)]
    out.write_text(json.dumps({"devices": found, "offload": bool(llama_cpp.llama_supports_gpu_offload())}))


def libllama_devices(rpc: tuple[str, ...] = ()) -> list[Device]:
    """Every device the installed llama-cpp-python's llama.cpp sees (the RPC servers' added), from a child."""
    import json
    import tempfile

    from ggufcarve.llama import child

    with tempfile.TemporaryDirectory(prefix="ggufcarve-devices-") as tmp:
        result = Path(tmp) / "devices.json"
        doc = child.run(
            CHILD_MODULE,
            DevicesRequest(rpc),
            result,
            lambda p: json.loads(p.read_text()),
            what="listing llama.cpp's devices",
            hint="the last lines are llama.cpp's own",
            timeout=60,
        )
    return [Device.from_json(d) for d in doc["devices"]]


def parse_tool_devices(lines: list[str]) -> list[Device]:
    """The devices of a tool's `--list-devices` (common_print_available_devices: every device but
    the CPU's, "  NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)"); an RPC device's type is RPC."""
    found = []
    for line in lines:
        m = TOOL_DEVICE_LINE.match(line.rstrip())
        if m:
            name = m["name"]
            kind = "RPC" if name.startswith("RPC") else "GPU"
            found.append(Device(name, m["description"], kind, int(m["free"]) * MIB, int(m["total"]) * MIB))
    return found


def tool_devices(tool: Any, rpc: tuple[str, ...] = ()) -> list[Device]:
    """The devices a llama.cpp tool (llama-bench) sees with `rpc` added: its `--list-devices`."""
    from ggufcarve.llama import launch

    for endpoint in rpc:
        answers(endpoint)
    argv = [str(tool), *(["--rpc", ",".join(rpc)] if rpc else []), "--list-devices"]  # --rpc first: it registers
    finished = launch.run(argv, timeout=60, tail_lines=200)
    launch.check(finished, f"{Path(tool).name} --list-devices", "run it by hand to see its output")
    return parse_tool_devices(finished.tail)


def main(argv: list[str] | None = None) -> int:
    from ggufcarve.llama import child

    return child.serve(DevicesRequest, _list_child, argv)


if __name__ == "__main__":
    import sys

    from ggufcarve.llama import child as _child

    _child.exit_now(main(sys.argv[1:]))
