"""Checkpoint files on a local disk: names checked to stay inside the folder, regular files only.

Every file is opened with ``O_NONBLOCK`` and checked with ``fstat`` before a byte is read,
so a FIFO, a device (``/dev/zero``), a directory or a symlink loop where a file should be is
a clear error, never a hang or an endless read; reads never ask for more than the file holds.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from inspector.errors import (
    CheckpointFileMissingError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    output_exists,
)
from inspector.storage.base import (
    ByteRange,
    IOCounter,
    Kind,
    Listed,
    WindowBase,
    relative_name,
)

_BLOCK = 1 << 23
_ONE_READ = 1 << 30  # what one pread returns whole (Linux: up to 2 GiB - 4 KiB)

_SPECIAL = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class LocalStorage:
    """A local folder (see :class:`inspector.storage.base.Storage`)."""

    def __init__(self, root: str | os.PathLike, io_counter: IOCounter | None = None) -> None:
        # normalised as well as absolute: shown as '/x/demo/fp8', not 'notebooks/../demo/fp8'
        self.root = Path(os.path.abspath(Path(root).expanduser()))
        self.location = str(self.root)
        self.io = io_counter or IOCounter()
        self._checked: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"LocalStorage({self.location!r})"

    def describe(self, name: str) -> str:
        return str(self.root / name) if name else self.location

    def check(self, name: object, *, referrer: str, key: str | None = None) -> str:
        if isinstance(name, str) and name in self._checked:
            return self._checked[name]
        checked = _inside(self.root, name, referrer=referrer, key=key)
        self._checked[checked] = checked
        return checked

    def kind(self, name: str = "") -> Kind | None:
        try:
            mode = os.stat(self.root / name).st_mode
        except (OSError, ValueError):
            return None
        return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else None

    def size(self, name: str) -> int:
        try:
            info = os.stat(self.root / name)
        except (OSError, ValueError) as exc:
            raise _error(exc, self.describe(name)) from None
        _require_regular(info.st_mode, self.describe(name))
        return info.st_size

    def list(self, name: str = "") -> list[tuple[str, Listed]]:
        found: list[tuple[str, Listed]] = []
        try:
            with os.scandir(self.root / name) as entries:
                for entry in entries:
                    kind = self.kind(f"{name}/{entry.name}" if name else entry.name)
                    found.append((entry.name, kind or "other"))
        except OSError as exc:
            raise _error(exc, self.describe(name)) from None
        return sorted(found)

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with self._open(name) as (fd, size):
            length = size - offset if length is None else length
            _check_range(offset, length, size, self.describe(name))
            data = _pread(fd, offset, length, self.describe(name))
        self.io.add(length)
        return data

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        with self._open(name) as (fd, size):
            _check_range(offset, len(buffer), size, self.describe(name))
            _pread_into(fd, offset, buffer, self.describe(name))
        self.io.add(len(buffer))

    def window(self, name: str, offset: int, length: int) -> io.RawIOBase:
        fd = _open_regular(self.root / name, self.describe(name))[0]
        return _Window(fd, offset, length, self.io)

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self.root / name, self.io)

    def local_path(self, name: str) -> Path:
        return self.root / name

    def blocks(self, name: str, offset: int, length: int) -> Iterator[memoryview]:
        with self._open(name) as (fd, size):
            _check_range(offset, length, size, self.describe(name))
            buffer = memoryview(bytearray(min(_BLOCK, max(length, 1))))
            done = 0
            while done < length:
                n = min(len(buffer), length - done)
                _pread_into(fd, offset + done, buffer[:n], self.describe(name))
                self.io.add(n)
                yield buffer[:n]
                done += n

    def prefetch(self, ranges: Sequence[ByteRange]) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @contextmanager
    def _open(self, name: str) -> Iterator[tuple[int, int]]:
        fd, size = _open_regular(self.root / name, self.describe(name))
        try:
            yield fd, size
        finally:
            os.close(fd)


def _open_regular(path: Path, label: str) -> tuple[int, int]:
    """An fd of a regular file and its size; opening never blocks (``O_NONBLOCK``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:
        raise _error(exc, label) from None
    try:
        info = os.fstat(fd)
        _require_regular(info.st_mode, label)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def _require_regular(mode: int, label: str) -> None:
    for test, what in _SPECIAL:
        if test(mode):
            raise CorruptCheckpointError(f"is {what}, not a regular file", file=label)
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError("is not a regular file", file=label)


def _error(exc: BaseException, label: str) -> Exception:
    """The InspectorError for an OS error met while opening or reading ``label``."""
    number = getattr(exc, "errno", None)
    if number in (errno.ENOENT, errno.ENOTDIR):
        return CheckpointFileMissingError("is missing", file=label)
    if number == errno.ELOOP:
        return CorruptCheckpointError("is a symlink loop", file=label)
    if number == errno.EISDIR:
        return CorruptCheckpointError("is a directory, not a regular file", file=label)
    reason = getattr(exc, "strerror", None) or str(exc)
    return CorruptCheckpointError(f"cannot be read ({reason})", file=label)


def _check_range(offset: int, length: int, size: int, label: str) -> None:
    if offset < 0 or length < 0 or offset + length > size:
        raise CorruptCheckpointError(
            f"has {size} bytes; bytes {offset}..{offset + length} lie past its end (truncated?)",
            file=label,
        )


def _pread(fd: int, offset: int, length: int, label: str) -> bytes:
    """``length`` bytes at ``offset``: up to _ONE_READ read straight into the bytes returned
    (a regular file reads short only at its end), larger ones in pieces and then copied."""
    if length > _ONE_READ:
        buffer = bytearray(length)
        _pread_into(fd, offset, memoryview(buffer), label)
        return bytes(buffer)
    try:
        data = os.pread(fd, length, offset)
    except OSError as exc:
        raise _error(exc, label) from None
    if len(data) < length:
        raise CorruptCheckpointError(
            f"ends {length - len(data)} bytes short of the data at byte {offset}", file=label
        )
    return data


def _pread_into(fd: int, offset: int, buffer: memoryview, label: str) -> None:
    done = 0
    while done < len(buffer):
        try:
            got = os.preadv(fd, [buffer[done:]], offset + done)
        except OSError as exc:
            raise _error(exc, label) from None
        if not got:
            raise CorruptCheckpointError(
                f"ends {len(buffer) - done} bytes short of the data at byte {offset}", file=label
            )
        done += got


class _Window(WindowBase):
    """Bytes ``[start, start+length)`` of an open fd, read with ``pread`` (owns the fd).

    Unbuffered, so parsing a zip's directory reads only the bytes it looks at; ``read(n)``
    never allocates more than the window has left (``n`` may come from damaged data)."""

    def __init__(self, fd: int, start: int, length: int, counter: IOCounter) -> None:
        self._fd, self._start, self._length, self._pos, self._io = fd, start, length, 0, counter

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._start + self._pos)
        self._pos += got
        self._io.add(got)
        return got

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


# --- names that must stay inside the folder ------------------------------------------------


def _inside(root: Path, relative: object, *, referrer: str, key: str | None) -> str:
    """``relative`` as a POSIX name inside ``root``, refusing absolute paths, ``..`` and
    symlinks that lead outside. One kind of outside link is genuine: in a Hugging Face hub
    cache, a snapshot's files link to the same repository's own ``blobs/`` folder."""
    parts = relative_name(relative, referrer=referrer, key=key)
    try:
        real_root = root.resolve()
        real = (root / parts).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise CorruptCheckpointError(
            f"{relative!r} cannot be resolved ({exc})", file=referrer, key=key
        ) from None
    if real != real_root and real_root not in real.parents and real.parent != _hub_blobs(root):
        raise UnsafeCheckpointError(
            f"{relative!r} is a link to {real}, outside the checkpoint folder",
            file=referrer,
            key=key,
        )
    return str(parts)


def _hub_blobs(root: Path) -> Path | None:
    """``<repo>/blobs`` (resolved) when ``root`` lies in ``<repo>/snapshots/<revision>`` and
    ``blobs`` is the repository's own folder (not a link to somewhere else)."""
    here = root.absolute()
    for folder in (here, *here.parents):
        repo = folder.parent.parent
        blobs = repo / "blobs"
        if folder.parent.name != "snapshots" or blobs.is_symlink() or not blobs.is_dir():
            continue
        try:
            real = blobs.resolve()
            if real.parent == repo.resolve():
                return real
        except (RuntimeError, OSError):
            return None
    return None


# --- writing: files appear under their final names only when complete ------------------------


class AtomicFiles:
    """Temporary files in the target folder, renamed to their final names on ``commit``."""

    def __init__(self, folder: Path, overwrite: bool) -> None:
        self.folder, self.overwrite = folder, overwrite
        self._pending: dict[Path, Path] = {}
        self._tag = f".inspector-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def temp_for(self, final: Path) -> Path:
        if final.exists() and not self.overwrite:
            raise output_exists(final)
        temp = final.with_name(f"{final.name}{self._tag}.tmp")
        self._pending[final] = temp
        return temp

    def commit(self) -> list[Path]:
        done: list[Path] = []
        try:
            for final, temp in self._pending.items():
                os.replace(temp, final)
                done.append(final)
        except BaseException:
            for final in done:
                final.unlink(missing_ok=True)
            raise
        self._pending.clear()
        return done

    def discard(self) -> None:
        for temp in self._pending.values():
            temp.unlink(missing_ok=True)
        self._pending.clear()


@contextmanager
def atomic_files(folder: Path, overwrite: bool) -> Iterator[AtomicFiles]:
    """Remove every temporary file on any failure, KeyboardInterrupt included."""
    files = AtomicFiles(folder, overwrite)
    try:
        yield files
    except BaseException:
        files.discard()
        raise


@contextmanager
def new_folder(folder: Path) -> Iterator[Path]:
    """``folder``, made (parents too) if missing; the folders made are removed again, when
    still empty, if the block fails: a failed export leaves no trace."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    except BaseException:
        for path in made:  # deepest first
            try:
                path.rmdir()
            except OSError:
                break
        raise
