"""Moving stored bytes into an output file: in the kernel where both are local files
(``copy_file_range``), else by blocks; optionally checksummed on the way (CRC-32).

Work is done in steps of at most ``STEP`` bytes; between two steps the checks of the
enclosing :func:`halting` blocks run, so a pending stop (Ctrl-C recorded while torch's
writer runs, another worker's failure) ends a big tensor's copy within a step.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from inspector.errors import ExportError
from inspector.storage.base import ByteRange
from inspector.storage.digest import crc32

_COPY_BLOCK = 1 << 23
STEP = 1 << 26  # the most bytes written between two checks for a stop (64 MiB)

_halts: ContextVar[tuple[Callable[[], None], ...]] = ContextVar("halts", default=())


@contextmanager
def halting(check: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``check`` (which raises to stop) runs between steps of every copy."""
    token = _halts.set((*_halts.get(), check))
    try:
        yield
    finally:
        _halts.reset(token)


def check_halt() -> None:
    """Raise the pending stop of the enclosing :func:`halting` blocks, if any."""
    for check in _halts.get():
        check()


def write_all(fd: int, data: Any) -> None:
    """Write every byte of ``data`` (a buffer) at the fd's position, a step at a time."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view[:STEP])
        view = view[written:]
        check_halt()


def copy_range(source: ByteRange, fd: int, crc: int | None = None) -> int:
    """Append ``source``'s bytes to ``fd``; returns the running CRC-32 when ``crc`` is given.

    Local sources are copied by the kernel while, for a CRC, a thread reads the same bytes
    and checksums them; other storages stream their blocks (big ranged reads).
    """
    path = source.storage.local_path(source.name)
    if path is None:
        return _copy_by_blocks(source, fd, crc)
    with open(path, "rb", buffering=0) as f:
        checksum = _Checksum(f.fileno(), source, crc) if crc is not None else None
        try:
            done = _kernel_copy(f.fileno(), fd, source)
            for block in _blocks(f.fileno(), source.offset + done, source.length - done, source):
                write_all(fd, block)
        except BaseException:
            if checksum is not None:
                checksum.cancel()
            raise
        value = checksum.result() if checksum is not None else 0
    source.storage.io.add(source.length)
    return value


def _kernel_copy(src: int, dst: int, source: ByteRange) -> int:
    """Bytes copied by ``copy_file_range`` (0 where the kernel cannot: the rest goes by blocks)."""
    done = 0
    if not hasattr(os, "copy_file_range"):
        return 0
    try:
        while done < source.length:
            step = min(source.length - done, STEP)
            got = os.copy_file_range(src, dst, step, source.offset + done)
            if not got:
                break
            done += got
            check_halt()
    except OSError as exc:  # EXDEV and the like: copy what is left by blocks
        if exc.errno in (errno.EFBIG, errno.ENOSPC, errno.EIO):
            raise
    return done


def _copy_by_blocks(source: ByteRange, fd: int, crc: int | None) -> int:
    """The storage's blocks written in order (a remote storage fetches big ranges ahead,
    several at once, so memory stays bounded by a few blocks)."""
    value = crc or 0
    for block in source.storage.blocks(source.name, source.offset, source.length):
        write_all(fd, block)
        if crc is not None:
            value = crc32(block, value)
    return value


def _blocks(fd: int, offset: int, length: int, source: ByteRange) -> Iterator[memoryview]:
    """``length`` bytes from ``offset`` in blocks of one reused buffer (use each before the
    next)."""
    buffer = memoryview(bytearray(min(_COPY_BLOCK, max(length, 1))))
    done = 0
    while done < length:
        got = os.preadv(fd, [buffer[: length - done]], offset + done)
        if not got:
            raise ExportError(
                f"file ended {length - done} bytes early while copying",
                file=source.storage.describe(source.name),
            )
        yield buffer[:got]
        done += got


class _Checksum(threading.Thread):
    """CRC-32 of a byte range, computed in a thread (reads release the GIL)."""

    def __init__(self, fd: int, source: ByteRange, start: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.source, self.value = fd, source, start
        self.error: BaseException | None = None
        self.cancelled = False
        self.start()

    def run(self) -> None:
        try:
            for block in _blocks(self.fd, self.source.offset, self.source.length, self.source):
                if self.cancelled:
                    return
                self.value = crc32(block, self.value)
        except BaseException as exc:  # handed to the caller by result()
            self.error = exc

    def cancel(self) -> None:
        """Stop after the block in hand (the copy failed); wait for it."""
        self.cancelled = True
        self.join()

    def result(self) -> int:
        self.join()
        if self.error is not None:
            raise self.error
        return self.value
