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
    exception nothing more is flushed and nothing is waited for: the caller discards the file."""
    flusher = _Flusher(fd)

    def done(item: T) -> None:
        flusher.wanted.set()
        progress(item)

    try:
        yield done
    except BaseException:
        flusher.stop()  # not waited for: an interrupt must not wait for the disk
        raise
    flusher.finish()
    flusher.raise_error()
    os.fsync(fd)


class _Flusher(threading.Thread):
    """``fdatasync`` of one fd each time ``wanted`` is set, until ``finish``."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True, name=f"inspector-writeback-{fd}")
        self.fd = os.dup(fd)  # its own, so the caller may close the file while a flush runs
        self.wanted = threading.Event()
        self.finished = False
        self.error: OSError | None = None
        self.start()

    def run(self) -> None:
        try:
            while True:
                self.wanted.wait()
                self.wanted.clear()
                if self.finished:
                    return
                os.fdatasync(self.fd)
        except OSError as exc:
            self.error = exc
        finally:
            os.close(self.fd)

    def stop(self) -> None:
        """No more flushes; the one in flight, if any, ends on its own."""
        self.finished = True
        self.wanted.set()

    def finish(self) -> None:
        self.stop()
        self.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error
