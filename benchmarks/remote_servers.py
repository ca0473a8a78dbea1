"""The remote test servers (tests/fixtures/servers.py), and torch's own fsspec DCP reader on them.

For each backend: the time to start it, and the median latency of a 100-byte ranged
``cat_file`` through the counting proxy and straight to the backend. Then the bytes and
requests, counted at the server, of ``torch.distributed.checkpoint``'s ``FsspecReader``
loading one tensor (the file's first, 2 KiB; its last, 256 KiB) and then every tensor of a
~3.4 MB one-file DCP checkpoint, with
fsspec's default read-ahead and with ``default_cache_type="none"`` (s3 only), against the
bytes a reader that fetches exactly each chunk's range needs.
Run: ``.venv/bin/python benchmarks/remote_servers.py``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.servers import SERVERS, CountedServer

HOME = {"s3": "bench-bucket/", "gs": "bench-bucket/", "http": "", "hf": "bench/repo/"}
READS = 50


def direct_options(server: CountedServer) -> dict:
    """Storage options that skip the proxy (the backend's own latency)."""
    key = {"s3": "endpoint_url", "gs": "endpoint_url", "hf": "endpoint"}.get(server.scheme)
    return {key: server.upstream} if key else {}


def ranged_latency_ms(server: CountedServer, url: str, **options) -> float:
    exact = {"cache_type": "none"} if server.scheme == "hf" else {}
    fs = server.filesystem(**options)
    fs.cat_file(url, start=0, end=100, **exact)
    times = []
    for _ in range(READS):
        began = time.perf_counter()
        fs.cat_file(url, start=1000, end=1100, **exact)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def write_dcp(folder: Path) -> dict:
    """A one-process DCP save, in this order in its one data file: a 512-float tensor
    (2 KiB) and 13 of 256x256 (256 KiB each)."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {"small": torch.randn(512)}
    state.update({f"layer.{i}": torch.randn(256, 256) for i in range(13)})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    return state


def exact_bytes(folder: Path, keys: list[str]) -> int:
    """What an exact reader fetches: ``.metadata`` plus each wanted chunk's byte range."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(folder).read_metadata()
    chunks = sum(info.length for index, info in meta.storage_data.items() if index.fqn in keys)
    return (folder / ".metadata").stat().st_size + chunks


def fsspec_reader(server: CountedServer, url: str, state: dict, keys: list[str],
                  **fs_options) -> tuple[int, int]:
    """Requests and bytes of ``dcp.load`` of ``keys`` through torch's FsspecReader."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    target = {key: torch.empty_like(state[key]) for key in keys}
    reader = FsspecReader(url, skip_instance_cache=True, **server.storage_options, **fs_options)
    server.stats.reset()
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[key], state[key]) for key in keys)
    return server.stats.requests, server.stats.bytes


def main() -> int:
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        state = write_dcp(folder)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"DCP checkpoint: {len(state)} tensors, {size:,} bytes on disk")
        for kind, cls in SERVERS.items():
            with cls() as server:
                url = server.put_bytes(HOME[server.scheme] + "blob.bin", bytes(1 << 20))
                proxied = ranged_latency_ms(server, url)
                direct_url = url.replace(server.url, server.upstream)
                direct = ranged_latency_ms(server, direct_url, **direct_options(server))
                print(f"{kind:4} start {server.start_seconds * 1e3:6.0f} ms; 100-byte ranged "
                      f"GET median {proxied:.1f} ms via proxy, {direct:.1f} ms direct")
                ckpt = server.put_folder(folder, HOME[server.scheme] + "ckpt")
                cases = [("2 KiB, first", ["small"]), ("256 KiB, last", ["layer.12"]),
                         ("every tensor", sorted(state))]
                variants = [("default", {})]
                if kind == "s3":
                    variants.append(("cache none", {"default_cache_type": "none"}))
                for label, keys in cases:
                    for variant, options in variants:
                        requests, nbytes = fsspec_reader(server, ckpt, state, keys, **options)
                        print(f"     FsspecReader {label:13} {variant:10}: {requests:3} requests,"
                              f" {nbytes:>10,} bytes (exact ranges: "
                              f"{exact_bytes(folder, keys):,})")
    print("goal: none (this measures the servers and torch's FsspecReader, the anchors other "
          "benchmarks compare with): PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
