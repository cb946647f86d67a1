"""select.greedy.available_memory on fake /proc and /sys/fs/cgroup trees: cgroup v2, cgroup v1,
no cgroup controller; the expected bytes are the files' numbers, computed here by hand."""

from __future__ import annotations

import pytest

from ggufcarve.select.greedy import available_memory

GIB = 1 << 30
MIB = 1 << 20
V1_UNLIMITED = 9223372036854771712  # memory.limit_in_bytes with no limit set: PAGE_COUNTER_MAX pages of 4 KiB


def _write(root, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _meminfo(root, available_kib: int) -> None:
    _write(
        root,
        "proc/meminfo",
        f"MemTotal:       {4 * available_kib} kB\nMemFree:        1000 kB\nMemAvailable:   {available_kib} kB\n",
    )


def test_cgroup_v2_left_below_memory_max(tmp_path):
    _meminfo(tmp_path, 8 * GIB // 1024)
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice/job\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.max", f"{2 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.current", f"{500 * MIB}\n")
    assert available_memory(tmp_path) == 2 * GIB - 500 * MIB


def test_cgroup_v2_an_ancestors_limit_counts(tmp_path):
    _meminfo(tmp_path, 8 * GIB // 1024)
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice/job\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", f"{1 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/memory.current", f"{900 * MIB}\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.max", "max\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.current", f"{100 * MIB}\n")
    assert available_memory(tmp_path) == 1 * GIB - 900 * MIB


def test_cgroup_v2_without_a_limit_is_meminfo(tmp_path):
    _meminfo(tmp_path, 3 * GIB // 1024)
    _write(tmp_path, "proc/self/cgroup", "0::/\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    _write(tmp_path, "sys/fs/cgroup/memory.current", f"{100 * MIB}\n")
    assert available_memory(tmp_path) == 3 * GIB


@pytest.mark.parametrize("listed", ["/docker/abc", "/"])
def test_cgroup_v1_left_below_limit_in_bytes(tmp_path, listed):
    """`listed`: the group's path in /proc/self/cgroup; "/docker/abc" where it is visible under the
    mount, "/" in a cgroup namespace, where the mount's root is the group."""
    _meminfo(tmp_path, 8 * GIB // 1024)
    _write(tmp_path, "proc/self/cgroup", f"12:pids:/\n4:memory:{listed}\n1:name=systemd:/\n0::/\n")
    group = "sys/fs/cgroup/memory" + ("/docker/abc" if listed != "/" else "")
    _write(tmp_path, f"{group}/memory.limit_in_bytes", f"{3 * GIB}\n")
    _write(tmp_path, f"{group}/memory.usage_in_bytes", f"{1 * GIB}\n")
    assert available_memory(tmp_path) == 2 * GIB


def test_cgroup_v1_with_the_memory_controller_among_others(tmp_path):
    _meminfo(tmp_path, 8 * GIB // 1024)
    _write(tmp_path, "proc/self/cgroup", "3:cpu,memory:/job\n")
    _write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", f"{3 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/job/memory.usage_in_bytes", f"{2 * GIB}\n")
    assert available_memory(tmp_path) == 1 * GIB


def test_cgroup_v1_unlimited_is_meminfo(tmp_path):
    _meminfo(tmp_path, 5 * GIB // 1024)
    _write(tmp_path, "proc/self/cgroup", "4:memory:/job\n0::/\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{7 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/job/memory.usage_in_bytes", f"{1 * GIB}\n")
    assert available_memory(tmp_path) == 5 * GIB


@pytest.mark.parametrize("cgroup_file", [True, False])
def test_no_cgroup_is_meminfo(tmp_path, cgroup_file):
    _meminfo(tmp_path, 6 * GIB // 1024)
    if cgroup_file:
        _write(tmp_path, "proc/self/cgroup", "0::/\n")
    assert available_memory(tmp_path) == 6 * GIB


def test_a_limit_below_usage_is_zero(tmp_path):
    _meminfo(tmp_path, 6 * GIB // 1024)
    _write(tmp_path, "proc/self/cgroup", "0::/job\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.max", f"{1 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.current", f"{2 * GIB}\n")
    assert available_memory(tmp_path) == 0


def test_no_meminfo_is_unknown(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "0::/job\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.max", f"{1 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.current", "0\n")
    assert available_memory(tmp_path) is None
