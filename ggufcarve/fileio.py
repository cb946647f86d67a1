"""Byte movement with bounded memory: range copies, hashing, and outputs written under a temp name."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import xxhash

from ggufcarve.errors import BadInput, OutputError

CHUNK = 16 << 20  # bytes per read/copy call: bounds memory and sets progress granularity
Progress = Callable[[int], None]  # called with a number of bytes just processed


def _noop(_: int) -> None:
    pass


def copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int, progress: Progress = _noop) -> None:
    """Copy `length` bytes between file descriptors at explicit offsets, in the kernel when it can."""
    done = 0
    kernel_copy = hasattr(os, "copy_file_range")
    buffer: bytearray | None = None
    while done < length:
        count = min(CHUNK, length - done)
        copied = 0
        if kernel_copy:
            try:
                copied = os.copy_file_range(src_fd, dst_fd, count, src_offset + done, dst_offset + done)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ETXTBSY, errno.EPERM):
                    raise
                kernel_copy = False
        if copied == 0:
            if buffer is None:
                buffer = bytearray(CHUNK)
            view = memoryview(buffer)[:count]
            got = os.preadv(src_fd, [view], src_offset + done)
            if got == 0:
                raise BadInput(f"source ended early: {length - done} bytes missing at offset {src_offset + done}", "the source file changed or is truncated")
            written = 0
            while written < got:
                written += os.pwrite(dst_fd, view[written:got], dst_offset + done + written)
            copied = got
        done += copied
        progress(copied)


def read_ranges(fd: int, ranges: Sequence[tuple[int, int]], buffer: bytearray, progress: Progress = _noop) -> Iterator[memoryview]:
    """Yield the bytes of (offset, length) ranges in order, through one reused buffer."""
    for offset, length in ranges:
        done = 0
        while done < length:
            view = memoryview(buffer)[: min(len(buffer), length - done)]
            got = os.preadv(fd, [view], offset + done)
            if got == 0:
                raise BadInput(f"file ended early: {length - done} bytes missing at offset {offset + done}", "the file is truncated")
            yield view[:got]
            done += got
            progress(got)


def xxh3_of_ranges(fd: int, ranges: Sequence[tuple[int, int]], buffer: bytearray, progress: Progress = _noop) -> str:
    hasher = xxhash.xxh3_128()
    for chunk in read_ranges(fd, ranges, buffer, progress):
        hasher.update(chunk)
    return hasher.hexdigest()


def sha256_file(path: str | os.PathLike[str], progress: Progress = _noop, buffer: bytearray | None = None) -> str:
    buffer = buffer or bytearray(CHUNK)
    hasher = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for chunk in read_ranges(fd, [(0, size)], buffer, progress):
            hasher.update(chunk)
    finally:
        os.close(fd)
    return hasher.hexdigest()


PARTIAL_SUFFIX = ".partial"
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
    except (OSError, ValueError):
        pass


def sha256_file_cached(path: str | os.PathLike[str], progress: Progress = _noop) -> str:
    """sha256_file, answered from the cache when this exact file state was hashed before."""
    digest = cached_sha256(path)
    if digest is None:
        digest = sha256_file(path, progress)
        remember_sha256(path, digest)
    return digest


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_outputs(outputs: Sequence[Path], sources: Sequence[Path], bytes_needed: int, force: bool) -> None:
    """Refuse before writing: an output that is a source, exists (without force), or cannot fit.

    A missing output directory is created once every check passed.
    """
    for out in outputs:
        for src in sources:
            if same_file(out, src):
                raise OutputError(f"output {out} is the source file", "write the pruned model to a new path; the source is never modified")
        if out.exists() and not force:
            raise OutputError(f"output {out} already exists", "pass --force to replace it, or choose another path")
        if out.is_dir():
            raise OutputError(f"output {out} is a directory", "give a file path such as model-pruned.gguf")
    directory = outputs[0].parent
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"output directory {directory}: {existing} is not a directory", "choose an output path inside a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"output directory {existing} is not writable", "choose a directory you can write to")
    free = shutil.disk_usage(existing).free
    if free < bytes_needed:
        raise OutputError(f"output needs {bytes_needed / 2**30:.2f} GiB but {existing} has {free / 2**30:.2f} GiB free", "free disk space or write elsewhere")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create output directory {directory}: {err.strerror or err}", "choose a directory you can write to") from None


class BackgroundFlush:
    """fdatasync()s a file on a helper thread while it is being written.

    The kernel then writes dirty pages back during the copy instead of all at the final fsync,
    so copying and the disk's writing overlap.
    """

    def __init__(self, every: int = 256 << 20) -> None:
        self.every = every
        self.pending = 0
        self.fd: int | None = None
        self.error: OSError | None = None
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="ggufcarve-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            fd = self.fd
            if fd is not None and self.error is None:
                try:
                    os.fdatasync(fd)
                except OSError as err:  # the final fsync of the caller reports it too
                    self.error = err
            if self.stopping:
                return

    def wrote(self, fd: int, n: int) -> None:
        """Count bytes written to fd; every `every` bytes a flush is requested."""
        self.pending += n
        if self.pending >= self.every:
            self.pending = 0
            self.fd = fd
            self.wake.set()

    def close(self) -> None:
        """Wait for the flush in progress; call before closing the file descriptors."""
        self.stopping = True
        self.fd = None
        self.wake.set()
        self.thread.join()


def temp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.ggufcarve-{os.getpid()}.tmp")


@contextmanager
def atomic_outputs(paths: Sequence[Path]) -> Iterator[list[tuple[Path, int]]]:
    """Open temp files beside `paths`; on success fsync and rename them into place, else delete them.

    Yields (temp path, read-write file descriptor) pairs in `paths` order.
    """
    temps = [temp_path_for(p) for p in paths]
    fds: list[int] = []
    try:
        for temp in temps:
            fds.append(os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644))
        yield list(zip(temps, fds))
        for fd in fds:
            os.fsync(fd)
        for temp, final in zip(temps, paths):
            os.replace(temp, final)
        dir_fd = os.open(paths[0].parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as err:
        raise OutputError(f"writing {paths[0].parent}: {err.strerror or err}", _hint_for(err)) from None
    finally:
        for fd in fds:
            os.close(fd)
        for temp in temps:
            temp.unlink(missing_ok=True)


def _hint_for(err: OSError) -> str:
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "free disk space (or raise the file size limit) and run again; nothing was left behind"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "choose a directory you can write to"
    return "check the output directory and run again; nothing was left behind"


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path_for(path)
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)

