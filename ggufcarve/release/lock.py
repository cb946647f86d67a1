"""The release directory's lock: one writer of quant-manifest.json and SHA256SUMS at a time, across
processes and hosts sharing the directory.

    with lock_release(out_dir):
        ...  # write a rung's fragment, rebuild the manifest and SHA256SUMS from all fragments

The lock is the file `.ggufcarve-ladder.lock`, created with O_CREAT|O_EXCL, which is atomic on
local file systems, NFSv3 and later, Lustre, GPFS, BeeGFS and CephFS (fcntl/flock locks are not:
NFS mounted with `nolock`, Lustre with `localflock` and BeeGFS by default keep them per host).
It holds its owner (host, pid, run token) and is removed on release. While held, a thread touches
it every HEARTBEAT_SECONDS. A waiter breaks the lock when it is stale:
  * its owner is on this host and gone (the pid is dead or reused, or this host rebooted since);
  * its owner is on another host (or unreadable) and the file has not changed (inode, size,
    mtime) for STALE_SECONDS as timed by the waiter's own clock, so clock skew between hosts
    and the file server does not matter; NFS attribute caching delays what a waiter sees by up to
    a minute (acregmax), well inside STALE_SECONDS.
Breaking renames the file to a unique name and checks it was the stale one; a live lock taken
in that instant is put back. The lock only orders rebuilds of the manifest: every fragment is its
own file replaced by rename, so a manifest built while the lock was wrongly broken can only miss a
fragment, and `ggufcarve release merge DIR` rebuilds it from all of them.

`lock_release(..., name=...)` takes another lock file of the same kind: `ggufcarve run` holds one
on its work directory.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ggufcarve.errors import OutputError
from ggufcarve.fileio import host_token, process_alive, run_token

LOCK_NAME = ".ggufcarve-ladder.lock"
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 180.0
WAIT_SECONDS = 900.0
_in_process: dict[str, threading.Lock] = {}  # per lock file: threads of one process take it one at a time
_in_process_guard = threading.Lock()
_held = threading.local()  # the lock files this thread holds: an inner lock_release of one is a no-op


def _owner_record() -> dict[str, Any]:
    pid, start, boot = run_token().split("-")
    return {
        "host": socket.gethostname(),
        "host_token": host_token(),
        "pid": int(pid),
        "start": int(start),
        "boot": boot,
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def read_owner(path: Path) -> dict[str, Any] | None:
    """The owner record of a lock file; None when it is missing, empty or not ours to read."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _owner_gone(owner: dict[str, Any] | None) -> bool:
    """Whether a lock's owner is known to be gone: only an owner on this host can be checked."""
    if owner is None or owner.get("host_token") != host_token() or not isinstance(owner.get("pid"), int):
        return False
    start = owner.get("start") if isinstance(owner.get("start"), int) else None
    return not process_alive(owner["pid"], start, str(owner.get("boot")) if owner.get("boot") is not None else None)


def _describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "a ggufcarve run"
    return f"ggufcarve pid {owner.get('pid')} on {owner.get('host')} (since {owner.get('since')})"


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _break(path: Path, signature: tuple[int, int, int]) -> None:
    """Remove the stale lock file whose signature was seen; leave a newer one in place."""
    grave = path.with_name(f"{path.name}.stale-{run_token()}")
    try:
        os.rename(path, grave)
    except FileNotFoundError:
        return
    if _signature(grave) != signature:  # a live lock taken since the check: put it back
        try:
            os.link(grave, path)
        except FileExistsError:
            pass
    grave.unlink(missing_ok=True)


def _try_create(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, (json.dumps(_owner_record(), sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return os.stat(path).st_ino


@contextmanager
def lock_release(
    out_dir: Path,
    *,
    wait: float = WAIT_SECONDS,
    stale_seconds: float = STALE_SECONDS,
    heartbeat: float = HEARTBEAT_SECONDS,
    name: str = LOCK_NAME,
    hint: str | None = None,
) -> Iterator[None]:
    """Hold the directory's lock file `name` (the release's by default) for the block; waits up
    to `wait` seconds for another holder, breaking a stale lock (see the module docstring).
    Raises OutputError, with `hint` when given, when the wait runs out."""
    path = Path(out_dir) / name
    held: set[str] = _held.__dict__.setdefault("paths", set())
    key = os.path.abspath(path)
    if key in held:
        yield
        return
    with _in_process_guard:
        in_process = _in_process.setdefault(key, threading.Lock())
    with in_process:
        inode = _acquire(path, wait, stale_seconds, hint)
        held.add(key)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(heartbeat):
                try:
                    if os.stat(path).st_ino == inode:
                        os.utime(path)
                except OSError:
                    pass

        beater = threading.Thread(target=beat, name="ggufcarve-lock", daemon=True)
        beater.start()
        try:
            yield
        finally:
            stop.set()
            beater.join()
            held.discard(key)
            try:
                if os.stat(path).st_ino == inode:
                    path.unlink()
            except FileNotFoundError:
                pass


def _acquire(path: Path, wait: float, stale_seconds: float, hint: str | None = None) -> int:
    deadline = time.monotonic() + wait
    seen: tuple[int, int, int] | None = None
    seen_since = time.monotonic()
    delay = 0.05
    while True:
        inode = _try_create(path)
        if inode is not None:
            return inode
        signature = _signature(path)
        if signature is None:
            continue
        now = time.monotonic()
        if signature != seen:
            seen, seen_since = signature, now
        owner = read_owner(path)
        local = owner is not None and owner.get("host_token") == host_token()
        if _owner_gone(owner) or (not local and now - seen_since >= stale_seconds):
            _break(path, signature)
            seen = None
            continue
        if now >= deadline:
            raise OutputError(
                f"{_describe(owner)} holds the lock of {path.parent} ({path.name})",
                hint
                or "wait for it to finish and run again; a lock whose owner died on "
                f"another host is broken after {stale_seconds:.0f} s without a heartbeat",
            )
        time.sleep(min(delay, max(0.0, deadline - now)))
        delay = min(delay * 2, 1.0)
