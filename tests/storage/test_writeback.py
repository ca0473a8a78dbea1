"""durable(): flushes while writing, fsyncs at the end, and never loses a flush's error."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from inspector.storage.writeback import _Flusher, durable


def _writeback_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("inspector-writeback")]


def test_items_are_written_and_reported_in_order(tmp_path: Path) -> None:
    seen: list[int] = []
    path = tmp_path / "out.bin"
    with open(path, "wb", buffering=0) as f, durable(f.fileno(), seen.append) as written:
        for i in range(5):
            f.write(bytes([i]) * 100_000)
            written(i)
    assert seen == [0, 1, 2, 3, 4]
    assert path.read_bytes() == b"".join(bytes([i]) * 100_000 for i in range(5))
    assert _writeback_threads() == []


def test_an_exception_stops_the_flusher_and_propagates(tmp_path: Path) -> None:
    def fails(fd: int) -> None:
        with durable(fd, lambda item: None) as written:
            written("a")
            raise KeyError("b")

    with pytest.raises(KeyError), open(tmp_path / "out.bin", "wb", buffering=0) as f:
        fails(f.fileno())
    for thread in _writeback_threads():  # not waited for (an interrupt must not wait for
        thread.join(10)  # the disk), it ends once the flush in flight is done
    assert _writeback_threads() == []
    assert (tmp_path / "out.bin").exists()  # the flusher's own fd closed, not the caller's


def test_a_failed_flush_is_raised_at_the_end() -> None:
    read, write = os.pipe()  # fdatasync of a pipe fails (EINVAL), as a disk's EIO would
    try:
        with pytest.raises(OSError) as raised, durable(write, lambda item: None) as written:
            written("a")
        assert raised.value.errno == errno.EINVAL
    finally:
        os.close(read)
        os.close(write)


def test_the_flushers_own_error_is_kept_for_the_caller() -> None:
    read, write = os.pipe()
    try:
        flusher = _Flusher(write)
        flusher.wanted.set()
        deadline = time.monotonic() + 10
        while flusher.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        flusher.finish()
        with pytest.raises(OSError) as raised:
            flusher.raise_error()
        assert raised.value.errno == errno.EINVAL
    finally:
        os.close(read)
        os.close(write)
