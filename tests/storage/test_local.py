"""Local reads: whole files and ranges, in one pread or in pieces, bytes as on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inspector.errors import InspectorError
from inspector.storage import local
from inspector.storage.local import LocalStorage


@pytest.fixture
def blob(tmp_path: Path) -> bytes:
    data = os.urandom(3 * 4096 + 17)
    (tmp_path / "blob.bin").write_bytes(data)
    return data


@pytest.mark.parametrize("one_read", [local._ONE_READ, 100])
def test_reads_are_the_bytes_on_disk(
    tmp_path: Path, blob: bytes, one_read: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to _ONE_READ bytes come from one pread; larger reads (here 100) from several."""
    monkeypatch.setattr(local, "_ONE_READ", one_read)
    storage = LocalStorage(tmp_path)
    whole = storage.read("blob.bin")
    assert type(whole) is bytes and whole == blob
    assert storage.read("blob.bin", 4000, 5000) == blob[4000:9000]
    assert storage.read("blob.bin", len(blob), 0) == b""
    assert storage.io.count.bytes == len(blob) + 5000


def test_a_read_past_the_end_names_the_file(tmp_path: Path, blob: bytes) -> None:
    with pytest.raises(InspectorError, match=r"blob\.bin"):
        LocalStorage(tmp_path).read("blob.bin", len(blob) - 10, 11)


def test_a_relative_path_is_shown_absolute_and_normalised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f.bin").write_bytes(b"abc")
    monkeypatch.chdir(tmp_path / "notebooks")
    storage = LocalStorage("../data")
    assert storage.location == str(tmp_path / "data") and ".." not in storage.location
    assert storage.read("f.bin", 0, 3) == b"abc"
