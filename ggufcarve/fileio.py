"""Byte movement with bounded memory: range copies, hashing, and outputs written under a temp name."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from ggufcarve.errors import BadInput, OutputError
from ggufcarve.events import Counter, Sink, ignore

CHUNK = 16 << 20  # bytes per read/copy call: bounds memory and sets progress granularity
Progress = Callable[[int], None]  # called with a number of bytes just processed


def _noop(_: int) -> None:
    pass


def write_at(fd: int, data: bytes | memoryview, position: int) -> None:
    """Write all of `data` at `position` (one pwrite may write less than asked)."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], position + written)


def read_ranges(
    fd: int, ranges: Sequence[tuple[int, int]], buffer: bytearray, progress: Progress = _noop
) -> Iterator[memoryview]:
    """Yield the bytes of (offset, length) ranges in order, through one reused buffer."""
    for offset, length in ranges:
        done = 0
        while done < length:
            view = memoryview(buffer)[: min(len(buffer), length - done)]
            got = os.preadv(fd, [view], offset + done)
            if got == 0:
                raise BadInput(
                    f"file ended early: {length - done} bytes missing at offset {offset + done}",
                    "the file is truncated",
                )
            yield view[:got]
            done += got
            progress(got)


def xxh3_of_ranges(fd: int, ranges: Sequence[tuple[int, int]], buffer: bytearray, progress: Progress = _noop) -> str:
    hasher = xxhash.xxh3_128()
    for chunk in read_ranges(fd, ranges, buffer, progress):
        hasher.update(chunk)
    return hasher.hexdigest()


HASH_READ = 128 << 10
# bytes per read when hashing a whole file. A read this small stays in the L2 cache between the
# kernel's copy and the hash: on 2.1 GiB it cost a fifth of the system time of 16 MiB reads warm,
# and with POSIX_FADV_SEQUENTIAL it read a cold file twice as fast (bench/ladder_bench.py).


def sha256_file(path: str | os.PathLike[str], progress: Progress = _noop) -> str:
    """sha256 of the file, read sequentially in HASH_READ pieces; progress every CHUNK bytes."""
    hasher = hashlib.sha256()
    buffer = bytearray(HASH_READ)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        unreported = 0
        while got := os.readv(fd, [buffer]):
            hasher.update(view[:got])
            unreported += got
            if unreported >= CHUNK:
                progress(unreported)
                unreported = 0
        if unreported:
            progress(unreported)
    finally:
        os.close(fd)
    return hasher.hexdigest()


def hash_files(paths: list[Path], workers: int | None = None, on_event: Sink = ignore) -> dict[Path, str | OSError]:
    """sha256 of each file, files hashed concurrently (largest first, so the tail is short)."""
    total = sum(p.stat().st_size for p in paths)
    workers = max(1, min(workers or os.cpu_count() or 1, len(paths) or 1))
    progress = Counter(on_event, "sha256", total)

    def one(path: Path) -> str | OSError:
        try:
            return sha256_file(path, progress)
        except OSError as err:
            return err

    order = sorted(paths, key=lambda p: -p.stat().st_size)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ggufcarve-sha256") as pool:
        results = dict(zip(order, pool.map(one, order)))
    return results


SHA256_CACHE_NAME = "sha256-cache.json"
ENV_CACHE = "GGUFCARVE_CACHE"


def cache_root() -> Path:
    """ggufcarve's cache: $GGUFCARVE_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/ggufcarve."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "ggufcarve"


def _sha256_cache_path() -> Path:
    return cache_root() / SHA256_CACHE_NAME


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def cached_sha256(path: str | os.PathLike[str]) -> str | None:
    """A sha256 computed earlier for this exact file state (device, inode, size, mtime, ctime).

    Any write to the file changes its ctime, which the user cannot set back, so a hit is the
    digest of the current content.
    """
    path = Path(path).resolve()
    try:
        entry = json.loads(_sha256_cache_path().read_text()).get(str(path))
        return entry["sha256"] if entry and entry["stat"] == _stat_key(path) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember_sha256(path: str | os.PathLike[str], digest: str) -> None:
    """Record a digest for cached_sha256; a cache that cannot be written is skipped silently."""
    path = Path(path).resolve()
    cache = _sha256_cache_path()
    try:
        entries = json.loads(cache.read_text()) if cache.exists() else {}
        entries = {k: v for k, v in entries.items() if Path(k).exists()}
        entries[str(path)] = {"stat": _stat_key(path), "sha256": digest}
        write_text_atomic(cache, json.dumps(entries, indent=0, sort_keys=True))
    except (OSError, ValueError, OutputError):
        pass


def sha256_file_cached(path: str | os.PathLike[str], progress: Progress = _noop) -> str:
    """sha256_file, answered from the cache when this exact file state was hashed before."""
    digest = cached_sha256(path)
    if digest is None:
        digest = sha256_file(path, progress)
        remember_sha256(path, digest)
    return digest


def published_files(directory: Path, leave_out: Sequence[str] = ()) -> list[Path]:
    """Every file under `directory` a release publishes, by relative POSIX name: none with a part
    of its relative path hidden (a leading ".", which every temp name has), none of the relative
    names in `leave_out`. None when `directory` does not exist."""
    files = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(root) / name for name in names if not name.startswith(".")]
    by_name = {p.relative_to(directory).as_posix(): p for p in files}
    return [by_name[name] for name in sorted(by_name) if name not in leave_out]


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_outputs(
    outputs: Sequence[Path],
    sources: Sequence[Path],
    bytes_needed: int,
    force: bool,
    *,
    replaces: Sequence[Path] = (),
    belongs: Callable[[str], bool] | None = None,
) -> None:
    """Refuse before writing: an output that is a source, exists (without force), or cannot fit.

    `replaces` are existing files of an earlier output under the same name that the new one does
    not contain (old shards of a split set); they count as existing outputs. Temp files of dead
    runs of any name `belongs` accepts (default: the outputs' and `replaces`' names) are removed
    before free space is measured. A missing output directory is created once every check passed.
    """
    for out in [*outputs, *replaces]:
        for src in sources:
            if same_file(out, src):
                raise OutputError(
                    f"output {out} is the source file",
                    "write the pruned model to a new path; the source is never modified",
                )
        if out.exists() and not force:
            raise OutputError(f"output {out} already exists", "pass --force to replace it, or choose another path")
        if out.is_dir():
            raise OutputError(f"output {out} is a directory", "give a file path such as model-pruned.gguf")
    directory = outputs[0].parent
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(
            f"output directory {directory}: {existing} is not a directory", "choose an output path inside a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"output directory {existing} is not writable", "choose a directory you can write to")
    if belongs is None:
        names = {p.name for p in [*outputs, *replaces]}
        belongs = names.__contains__
    remove_dead_temps(directory, belongs)
    free = shutil.disk_usage(existing).free
    if free < bytes_needed:
        raise OutputError(
            f"output needs {bytes_needed / 2**30:.2f} GiB but {existing} has {free / 2**30:.2f} GiB free",
            "free disk space or choose another -o directory",
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(
            f"cannot create output directory {directory}: {err.strerror or err}", "choose a directory you can write to"
        ) from None


SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h> (Linux): start write-out of the range's dirty pages, do not wait


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None where there is none."""
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int) -> None:
    """Queue a file's dirty pages for writing to disk and return without waiting for them.

    sync_file_range(SYNC_FILE_RANGE_WRITE) where the C library has it; else fdatasync, which waits.
    Durability still needs the final fsync: this only makes the disk start early.
    """
    function = _sync_file_range()
    if function is None or function(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
        os.fdatasync(fd)


class BackgroundFlush:
    """Starts the write-back of a file on a helper thread while it is being written.

    The disk then writes during the copy instead of all at the final fsync, so copying and the
    disk's writing overlap. `start_writeback` does not wait and commits no journal: an fdatasync
    in the middle of the writes makes ext4 stall the writer while its journal commits.
    """

    def __init__(self, every: int = 64 << 20) -> None:
        self.every = every
        self.pending = 0
        self.fd: int | None = None
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="ggufcarve-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        failed = False
        while True:
            self.wake.wait()
            self.wake.clear()
            fd = self.fd
            if fd is not None and not failed:
                try:
                    start_writeback(fd)
                except OSError:  # the caller's final fsync reports the same error
                    failed = True
            if self.stopping:
                return

    def wrote(self, fd: int, n: int) -> None:
        """Count bytes written to fd; every `every` bytes a write-back is started."""
        self.pending += n
        if self.pending >= self.every:
            self.pending = 0
            self.fd = fd
            self.wake.set()

    def close(self) -> None:
        """Wait for the write-back request in progress; call before closing the file descriptors."""
        self.stopping = True
        self.fd = None
        self.wake.set()
        self.thread.join()


# Temp names. Every output NAME is written as `.NAME.ggufcarve-PID-START-BOOT.tmp` in its own
# directory: PID is the writing process, START its start time in clock ticks since boot (field 22
# of /proc/PID/stat) and BOOT the first 8 hex digits of /proc/sys/kernel/random/boot_id followed by
# 8 hex digits of the sha256 of the host name. Together they name one process of one boot of one
# host, so a later run tells a dead run's temp file (no such process, a zombie, the pid reused by a
# process that started at another time, or another boot of this host) from a live concurrent run's.
# A temp file of another host (a shared release directory) is never taken for dead: its process
# cannot be checked from here. Without /proc, START and BOOT are 0 and only the pid is checked. The
# earlier forms `.NAME.ggufcarve-PID.tmp` (the pid alone) and BOOT of 8 hex digits (no host part,
# any other boot is dead) are recognised too.
TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.ggufcarve-(?P<pid>\d+)(?:-(?P<start>\d+)-(?P<boot>[0-9a-f]+))?\.tmp$")


def _process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, None if /proc does not show it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0].decode(), int(fields[19])


@functools.cache
def _boot_token() -> str:
    """BOOT of this process's temp names: 8 hex digits of the boot id, 8 of the host name's sha256."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    except OSError:
        return "0"
    return boot + host_token() if boot else "0"


@functools.cache
def host_token() -> str:
    """8 hex digits naming this host (from its host name): equal on every process of one host."""
    import socket

    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def process_alive(pid: int, start: int | None, boot: str | None) -> bool:
    """Whether the process of a run token (PID-START-BOOT, see the temp names) may still be
    running: False only when it is known to be gone; True for a process of another host."""
    if boot is not None and start is not None and boot != "0":
        mine = _boot_token()
        if len(boot) == 16 and len(mine) == 16 and boot[8:] != mine[8:]:
            return True  # another host's: nothing here can tell
        if boot != mine and boot[:8] != mine[:8]:
            return False
    if not _pid_exists(pid):
        return False
    state = _process_state(pid)
    if state is None:  # /proc hides it (or there is no /proc): the pid exists, assume it is the writer
        return True
    if state[0] in ("Z", "X"):  # exited, not yet reaped
        return False
    return start is None or start == 0 or state[1] == start


def _pid_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the process exists under another uid
        return True
    return True


def run_token(pid: int | None = None) -> str:
    """PID-START-BOOT of a process (default: this one), as it appears in its temp names."""
    pid = os.getpid() if pid is None else pid
    state = _process_state(pid)
    return f"{pid}-{state[1] if state else 0}-{_boot_token()}"


def temp_path_for(path: Path) -> Path:
    """The temp name this process writes `path` under (a file or a directory)."""
    return path.with_name(f".{path.name}.ggufcarve-{run_token()}.tmp")


def writer_alive(temp_name: str) -> bool:
    """Whether the process whose temp name this is may still be writing it (True for other names)."""
    match = TEMP_NAME.match(temp_name)
    if match is None:
        return True
    start = int(match["start"]) if match["start"] is not None else None
    return process_alive(int(match["pid"]), start, match["boot"])


def dead_temps(directory: Path, belongs: Callable[[str], bool]) -> list[Path]:
    """Temp files and directories in `directory` of runs no longer alive, for the names `belongs` accepts."""
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        match = TEMP_NAME.match(name)
        if match and belongs(match["target"]) and not writer_alive(name):
            found.append(directory / name)
    return found


def bytes_on_disk(path: Path) -> int:
    """Allocated bytes of a file, or of everything under a directory."""
    try:
        if path.is_dir() and not path.is_symlink():
            return sum((Path(root) / n).lstat().st_blocks * 512 for root, _, files in os.walk(path) for n in files)
        return path.lstat().st_blocks * 512
    except OSError:
        return 0


def remove_dead_temps(directory: Path, belongs: Callable[[str], bool]) -> list[Path]:
    """Delete the temp files (and directories) of dead runs for the names `belongs` accepts."""
    removed = dead_temps(directory, belongs)
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)  # a concurrent re-run may have removed it first
    return removed


def make_temp_dir(path: Path) -> Path:
    """Create this process's temp directory for `path` (replaced into place later by the caller)."""
    temp = temp_path_for(path)
    shutil.rmtree(temp, ignore_errors=True)  # this process's own, from an attempt that failed
    temp.mkdir(parents=True)
    return temp


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextmanager
def atomic_outputs(paths: Sequence[Path], replaces: Sequence[Path] = ()) -> Iterator[list[tuple[Path, int]]]:
    """Open temp files beside `paths`; on success fsync and rename them into place, else delete them.

    Yields (temp path, read-write file descriptor) pairs in `paths` order. `paths` is one output:
    a single file, or a split set whose first file is the one a loader is given. `replaces` are
    files of an earlier output of the same name that the new one does not contain (old shards);
    they are removed. A set of several files cannot be renamed atomically, so the swap never shows
    a loader a mix of old and new shards: the old first file and `replaces` go first, then the new
    files are renamed last to first. A crash during the swap leaves a set without its first file,
    which nothing loads.
    """
    temps = [temp_path_for(p) for p in paths]
    fds: list[int] = []
    try:
        for temp in temps:
            fds.append(os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644))
        yield list(zip(temps, fds))
        for fd in fds:
            os.fsync(fd)
        if len(paths) > 1:
            paths[0].unlink(missing_ok=True)
        for old in sorted(replaces):
            old.unlink(missing_ok=True)
        for temp, final in reversed(list(zip(temps, paths))):
            os.replace(temp, final)
        _fsync_dir(paths[0].parent)
    except OSError as err:
        raise write_failed(err, paths[0]) from None
    finally:
        for fd in fds:
            os.close(fd)
        for temp in temps:
            temp.unlink(missing_ok=True)


# Write errors that mean "no room": the file system is full (ENOSPC), the user's quota is used up
# (EDQUOT), or the file reached the process's file size limit, RLIMIT_FSIZE / `ulimit -f` (EFBIG;
# with SIGXFSZ at its default a write past the limit kills the process instead).
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def disk_full_error(path: Path, detail: str, elsewhere: str = "choose another -o directory") -> OutputError:
    """The one message for an output that did not fit: which file, why, and what to do."""
    return OutputError(
        f"disk full while writing {path} ({detail})",
        f"free disk space or {elsewhere}, then run again; nothing half-written was left behind",
    )


def write_failed(err: OSError, path: Path, elsewhere: str = "choose another -o directory") -> OutputError:
    """The OutputError of a failed write of `path` (its final name, not the temp name written)."""
    detail = err.strerror or str(err)
    if err.errno in DISK_FULL:
        return disk_full_error(path, detail, elsewhere)
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot write {path}: {detail}", "choose a directory you can write to")
    return OutputError(
        f"writing {path} failed: {detail}",
        "check the output directory and run again; nothing half-written was left behind",
    )


@contextmanager
def atomic_file(path: Path, elsewhere: str = "choose another -o directory", sync: bool = True) -> Iterator[Path]:
    """A temp path beside `path` to write to; on success it is fsynced (unless not `sync`: a file
    read back at once and then deleted, such as a child task's result) and renamed to `path`, on
    any failure (Ctrl-C included) deleted. Dead runs' temp files of `path` are removed first.
    An OSError while writing becomes one OutputError (`write_failed`)."""
    temp = temp_path_for(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(path.parent, path.name.__eq__)
        yield temp
        if sync:
            fd = os.open(temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(temp, path)
    except OSError as err:
        raise write_failed(err, path, elsewhere) from None
    finally:
        temp.unlink(missing_ok=True)


def save_figure(figure: Any, path: Path) -> Path:
    """A matplotlib figure as PNG at `path`, written to a temp name and renamed (no partial chart)."""
    with atomic_file(path, sync=False) as temp:
        figure.savefig(temp, format="png")
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file under this process's temp name, fsync, rename; dead runs' temps of it go first."""
    with atomic_file(path) as temp:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)


def size_unit(n_bytes: float) -> tuple[str, int]:
    """The unit sizes up to `n_bytes` read in: GiB from 1 GiB, MiB from 1 MiB, KiB below."""
    return ("GiB", 2**30) if n_bytes >= 2**30 else ("MiB", 2**20) if n_bytes >= 2**20 else ("KiB", 2**10)


def format_size(n_bytes: float, unit: tuple[str, int] | None = None) -> str:
    """`n_bytes` with its unit (size_unit's, or the given one) and three significant digits or more:
    "7.92 MiB", "15.3 MiB", "512 MiB", "17.28 GiB"."""
    name, scale = unit or size_unit(n_bytes)
    value = n_bytes / scale
    digits = 2 if value < 10 or name == "GiB" and value < 100 else 1 if value < 100 else 0
    return f"{value:.{digits}f} {name}"
