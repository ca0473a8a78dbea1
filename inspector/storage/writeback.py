"""Flushing an output file to disk while it is still being written.

An export that fsyncs only at the end waits there for the disk to write the whole file;
the copy itself ran from the page cache with the disk idle. Here a thread asks the kernel
to write back what is done (``fdatasync``) after every item, while the next one is
copied, so the closing ``fsync`` finds little left. A failed flush is raised by that
closing step: the kernel reports a writeback error only once per file descriptor, so it
must not be lost in the thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def durable(fd: int, progress: Callable[[T], None]) -> Iterator[Callable[[T], None]]:
    """Yield ``progress`` that also starts flushing ``fd``'s written bytes; on a clean exit
    wait for the flushes and ``fsync`` (the file is on disk when the block is left). On an
    exception nothing more is flushed: the caller discards the file."""
    flusher = _Flusher(fd)

    def done(item: T) -> None:
        flusher.wanted.set()
        progress(item)

    try:
        yield done
    finally:
        flusher.finish()
    flusher.raise_error()
    os.fsync(fd)


class _Flusher(threading.Thread):
    """``fdatasync`` of one fd each time ``wanted`` is set, until ``finish``."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True, name=f"inspector-writeback-{fd}")
        self.fd = fd
        self.wanted = threading.Event()
        self.finished = False
        self.error: OSError | None = None
        self.start()

    def run(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            if self.finished:
                return
            try:
                os.fdatasync(self.fd)
            except OSError as exc:
                self.error = exc
                return

    def finish(self) -> None:
        self.finished = True
        self.wanted.set()
        self.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error
