"""Checkpoints read where they live: s3://, gs://, hf:// and http:// on real servers on
127.0.0.1 (tests/fixtures/servers.py), bytes and requests counted at the server.

Goals checked: opening costs the metadata and a little overhead; a tensor read fetches its
items (<= 1.1x their bytes, one request per coalesced range, several at once); an FP8 scan
fetches < 10% of the shard bytes; values are bit-exact with the local copy; every fault
gives an InspectorError naming the URL and the key, transient ones succeed after retries.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import inspector
from inspector.errors import UsageError
from inspector.storage.base import ByteRange
from inspector.storage.remote import RemoteStorage, display_url, is_url
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import shard_bytes, uploaded

WQ = "layers.0.attention.wq.weight"


def open_remote(server: CountedServer, url: str, **options) -> inspector.Checkpoint:
    """The checkpoint at ``url``, opened afresh; the server's counts start after it."""
    ck = inspector.open(url, {**server.storage_options, **options})
    server.stats.reset()
    return ck


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality for every dtype (float4 and float8 included)."""
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*as_bytes)


def items_bytes(ck: inspector.Checkpoint, key: str) -> int:
    return sum(chunk.byte_length for chunk in ck.entry(key).chunks)


# --- URLs ------------------------------------------------------------------------------------
def test_urls_are_recognised_and_shown_without_credentials() -> None:
    assert is_url("s3://bucket/a") and is_url("HF://org/repo") and is_url("https://h/x")
    assert not is_url("/tmp/s3://x") and not is_url("ftp://h/x") and not is_url(Path("s3:/x"))
    assert display_url("https://user:pw@host:8080/a/b?token=SECRET#frag") == "https://host:8080/a/b"
    assert display_url("s3://bucket/step-10/") == "s3://bucket/step-10/"
    with pytest.raises(UsageError, match="query"):
        RemoteStorage("s3://bucket/x?versionId=1")
    with pytest.raises(UsageError, match="not a URL"):
        RemoteStorage("/tmp/x")


# --- opening and reading on every backend ----------------------------------------------------
def test_open_reads_the_metadata_and_little_else(
    remote_server: CountedServer, demo_dir: Path, fp8_local: inspector.Checkpoint
) -> None:
    url = uploaded(remote_server, demo_dir / "fp8", "fp8")
    remote_server.stats.reset()
    ck = inspector.open(url, remote_server.storage_options)
    stats = remote_server.stats
    metadata = (demo_dir / "fp8" / ".metadata").stat().st_size
    data = {p: t for p, t in stats.by_path.items() if p.endswith(".distcp")}
    # .metadata, a listing, sizes; of the data files only the 9-byte safetensors probe
    assert metadata <= stats.bytes <= metadata + 4096, stats.hits
    assert stats.requests <= 8, stats.hits
    assert sum(t.bytes for t in data.values()) <= 9
    assert (ck.format, ck.layout, ck.keys()) == (fp8_local.format, fp8_local.layout,
                                                 fp8_local.keys())
    assert ck.location == url and ck.io.bytes >= metadata
    assert repr(ck).startswith(f"<Checkpoint dcp flat {url!r}")


def test_one_tensor_costs_its_items_in_one_request_per_file(
    remote_server: CountedServer, demo_dir: Path, fp8_local: inspector.Checkpoint
) -> None:
    ck = open_remote(remote_server, uploaded(remote_server, demo_dir / "fp8", "fp8"))
    value = ck.read(WQ)
    stats = remote_server.stats
    assert torch.equal(value, fp8_local.read(WQ))
    assert stats.bytes <= 1.1 * items_bytes(ck, WQ), stats.hits
    # FSDP2 put one chunk in each rank's file: two requests, made together
    assert stats.requests == len(ck.entry(WQ).files) == 2
    assert all(h.method == "GET" and h.status == 206 for h in stats.hits)


def test_fp8_scan_reads_only_the_pickles(
    remote_server: CountedServer, demo_dir: Path, fp8_local: inspector.Checkpoint
) -> None:
    ck = open_remote(remote_server, uploaded(remote_server, demo_dir / "fp8", "fp8"))
    ck.scan(progress=False)
    fp8_local.scan(progress=False)
    assert remote_server.stats.bytes < 0.10 * shard_bytes(demo_dir / "fp8")
    chunks = sum(len(e.chunks) for e in ck.entries() if e.kind == "tensor")
    assert remote_server.stats.requests < 3 * chunks  # a few records a chunk, not one a read
    assert ck.records() == fp8_local.records()
    assert ck.facts(WQ).subclass == "WeightWithDynamicFloat8CastTensor"
    # a chunk's zip parse never reads outside its item
    items = [(c.file, c.byte_offset, c.byte_offset + c.byte_length)
             for e in ck.entries() for c in e.chunks]
    for hit in remote_server.stats.hits:
        first, last = map(int, hit.range.removeprefix("bytes=").split("-"))
        file = hit.path.rsplit("/", 1)[1]
        assert any(f == file and s <= first and last < e for f, s, e in items), hit


def test_every_tensor_and_object_bit_exact(
    s3_server: CountedServer, demo_dir: Path, fp8_local: inspector.Checkpoint
) -> None:
    ck = open_remote(s3_server, uploaded(s3_server, demo_dir / "fp8", "fp8"))
    total = 0
    for entry in fp8_local.entries():
        if entry.kind == "tensor":
            assert torch.equal(ck.read(entry.key), fp8_local.read(entry.key)), entry.key
        else:
            assert ck.read_object(entry.key) == fp8_local.read_object(entry.key), entry.key
        total += items_bytes(fp8_local, entry.key)
    assert s3_server.stats.bytes <= 1.1 * total
    assert s3_server.stats.requests == sum(len(e.chunks) for e in fp8_local.entries())


def test_quick_audit_fetches_the_archives_ends_in_a_few_requests(
    s3_server: CountedServer, demo_dir: Path, fp8_local: inspector.Checkpoint
) -> None:
    """The app's header audits every record without checksums: each item's zip directory.
    Fetched a batch of items at a time, not a request or two per item (410 items here)."""
    ck = open_remote(s3_server, uploaded(s3_server, demo_dir / "fp8", "fp8"))
    report = inspector.audit(ck, checksums=False)
    here = inspector.audit(fp8_local, checksums=False)
    assert report.ok and report.problems == here.problems
    assert report.checked.records == here.checked.records > 2 * len(fp8_local.entries())
    assert s3_server.stats.requests <= 16, s3_server.stats.requests
    assert s3_server.stats.bytes <= shard_bytes(demo_dir / "fp8")


def test_hf_folder_and_single_files(
    remote_server: CountedServer, safetensors_written: dict, torch_save_written: dict
) -> None:
    """A sharded HF folder (its index, then each shard's header), a .safetensors file and a
    torch.save file, each opened by URL and read bit-exact."""
    cases = [
        (safetensors_written["sharded"].path, "hub"),
        (safetensors_written["single"].path, "zoo.safetensors"),
        (torch_save_written["state_dict"].path, "pytorch_model.bin"),
    ]
    for local_path, name in cases:
        local = inspector.open(local_path)
        url = uploaded(remote_server, local_path, name)
        ck = open_remote(remote_server, url)
        assert ck.format == local.format and ck.keys() == local.keys(), name
        for key in local.keys():
            if local.entry(key).kind == "tensor":
                assert same_bits(ck.read(key), local.read(key)), (name, key)


def test_reads_of_several_ranges_coalesce_and_run_together(s3_server: CountedServer,
                                                           tmp_path: Path) -> None:
    blob = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "a.bin").write_bytes(blob)
    (tmp_path / "b.bin").write_bytes(blob[::-1])
    url = uploaded(s3_server, tmp_path, "blobs")
    storage = RemoteStorage(url, s3_server.storage_options)
    storage.list()
    s3_server.stats.reset()
    ranges = [ByteRange(storage, "a.bin", 0, 1000), ByteRange(storage, "a.bin", 1000, 5000),
              ByteRange(storage, "a.bin", 6000, 100), ByteRange(storage, "a.bin", 900_000, 10),
              ByteRange(storage, "b.bin", 10, 20)]
    s3_server.faults.delay("*.bin", 0.5)
    began = time.perf_counter()
    with storage.prefetch(ranges):
        assert storage.read("a.bin", 1000, 5100) == blob[1000:6100]
        assert storage.read("a.bin", 900_000, 10) == blob[900_000:900_010]
        assert storage.read("b.bin", 10, 20) == blob[::-1][10:30]
        assert s3_server.stats.requests == 3  # a.bin's neighbours as one, its far range, b.bin
    assert time.perf_counter() - began < 1.2  # three 0.5 s answers, waited for together
    assert sorted(h.range for h in s3_server.stats.hits) == [
        "bytes=0-6099", "bytes=10-29", "bytes=900000-900009"]
    s3_server.faults.reset()
    s3_server.stats.reset()
    assert storage.read("a.bin", 2000, 10) == blob[2000:2010]  # the prefetch is over
    assert [h.range for h in s3_server.stats.hits] == ["bytes=2000-2009"]


def test_big_reads_stream_in_parts(s3_server: CountedServer, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from inspector.storage import remote

    monkeypatch.setattr(remote, "PART", 1 << 16)
    blob = torch.randint(0, 256, (300_000,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "big.bin").write_bytes(blob)
    storage = RemoteStorage(uploaded(s3_server, tmp_path, "big"), s3_server.storage_options)
    storage.list()
    s3_server.stats.reset()
    out = bytearray(250_000)
    storage.read_into("big.bin", 25_000, memoryview(out))
    assert out == blob[25_000:275_000] and s3_server.stats.requests == 4
    storage = RemoteStorage(storage.location, s3_server.storage_options)  # nothing cached
    storage.list()
    s3_server.stats.reset()
    assert b"".join(storage.blocks("big.bin", 1, 299_998)) == blob[1:299_999]
    assert s3_server.stats.bytes == 299_998 and s3_server.stats.requests == 5


def test_http_folder_without_an_index_page(http_server: CountedServer, demo_dir: Path,
                                           fp8_local: inspector.Checkpoint) -> None:
    """DCP needs no listing: with a trailing slash a folder URL whose index page is refused
    is still a folder, and .metadata is found by name."""
    url = uploaded(http_server, demo_dir / "fp8", "fp8")
    http_server.faults.fail("*/fp8", 404)
    with pytest.raises(inspector.NotACheckpointError):
        inspector.open(url)
    ck = inspector.open(url + "/")
    assert torch.equal(ck.read(WQ), fp8_local.read(WQ))
