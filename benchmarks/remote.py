"""Remote reads and exports on moto's S3 (127.0.0.1, bytes and requests counted at the server):
ours against torch's ``FsspecReader`` side by side, and exporting ~1 GB from S3 vs local disk.

1. A one-process DCP checkpoint (a 2 KiB tensor, then 13 of 256 KiB, as in
   ``remote_servers.py``): open, one tensor (the 2 KiB one; and a 256 KiB one), every tensor.
   Ours: ``inspector.open`` + ``ck.read``; torch: ``dcp.load`` through ``FsspecReader``
   (fsspec's default read-ahead, and ``default_cache_type="none"``). Goal: one tensor <=
   1.1x its items' bytes.
2. The 2-rank FP8 demo checkpoint (torchao wrappers): ``ck.scan()`` (torch has no
   equivalent: learning a chunk's subclass means loading it). Goal: < 10% of the shard bytes.
3. Exporting a ~1 GB 2-rank checkpoint to local safetensors, from moto and from local disk,
   each in a fresh process: wall time and peak RSS (goal: peak from S3 <= peak from disk +
   256 MiB, i.e. memory bounded the same way), against a plain s3fs download of the same
   objects. moto reads a whole object for every ranged GET (a 1 KiB range of a 512 MiB
   object takes 0.6 s), so its wall times say more about moto than about S3.

Run: ``.venv/bin/python benchmarks/remote.py [--export-layers N] [--demo DIR]``
(``--export-layers 0`` skips part 3; ``--demo`` reuses a ``python -m inspector.demo`` folder).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peak import measure, mib
from remote_servers import write_dcp
from synthetic import build, folder_bytes, tensor_shapes

from tests.fixtures.servers import S3Server

DOWNLOAD = """
import json, sys, fsspec
fsspec.filesystem("s3", **json.loads(sys.argv[4])).get(sys.argv[2], sys.argv[3], recursive=True)
"""
EXPORT = """
import json, sys, inspector
options = json.loads(sys.argv[4]) or None
r = inspector.export(sys.argv[2], sys.argv[3], storage_options=options, progress=False,
                     verify=sys.argv[5] == "verify")
assert r.verification is None or r.verification.ok, r.summary()
"""


def counted(server: S3Server, action) -> tuple[int, int]:
    """(requests, bytes) the server answered while ``action()`` ran."""
    server.stats.reset()
    action()
    return server.stats.requests, server.stats.bytes


def items_bytes(folder: Path, keys: list[str]) -> int:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(folder).read_metadata()
    return sum(info.length for index, info in meta.storage_data.items() if index.fqn in keys)


def torch_reader(server: S3Server, url: str, state: dict, keys: list[str] | None,
                 **fs_options) -> tuple[int, int]:
    """(requests, bytes) of torch's FsspecReader: its metadata read alone (``keys`` None)
    or ``dcp.load`` of ``keys``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    def run() -> None:
        reader = FsspecReader(url, skip_instance_cache=True, **server.storage_options,
                              **fs_options)
        if keys is None:
            reader.read_metadata()
            return
        target = {key: torch.empty_like(state[key]) for key in keys}
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert all(torch.equal(target[key], state[key]) for key in keys)

    return counted(server, run)


def ours(server: S3Server, url: str, state: dict | None, keys: list[str] | None,
         scan: bool = False) -> tuple[int, int]:
    import torch

    import inspector

    ck = inspector.open(url, server.storage_options) if keys is not None or scan else None
    if ck is None:
        return counted(server, lambda: inspector.open(url, server.storage_options))

    def run() -> None:
        if scan:
            ck.scan(progress=False)
            return
        for key in keys:
            assert torch.equal(ck.read(key), state[key])

    return counted(server, run)


def row(what: str, measured: tuple[int, int], anchor: int | None = None, goal: float | None = None,
        below: bool = False) -> str:
    requests, nbytes = measured
    text = f"  {what:42} {requests:4} requests {nbytes:>11,} bytes"
    if anchor:
        ratio = nbytes / anchor
        text += f"  {ratio:6.3f}x"
        if goal is not None:
            ok = ratio < goal if below else ratio <= goal
            text += f" (goal {'<' if below else '<='} {goal}) {'PASS' if ok else 'MISS'}"
    return text


def part_reads(server: S3Server, tmp: Path) -> None:
    folder = tmp / "ckpt"
    state = write_dcp(folder)
    url = server.put_folder(folder, "bench-remote/ckpt")
    metadata = (folder / ".metadata").stat().st_size
    print(f"1. one-file DCP: {len(state)} tensors, {folder_bytes(folder):,} bytes; "
          f".metadata {metadata:,} bytes")
    print(row("open: ours", ours(server, url, None, None), metadata))
    print(row("open: torch FsspecReader (read_metadata)",
              torch_reader(server, url, state, None), metadata))
    cases = [("one 2 KiB tensor", ["small"]), ("one 256 KiB tensor", ["layer.12"]),
             ("every tensor", sorted(state))]
    for label, keys in cases:
        exact = items_bytes(folder, keys)
        goal = 1.1 if label.startswith("one") else None
        print(f"  {label} (items: {exact:,} bytes)")
        print(row("  ours", ours(server, url, state, keys), exact, goal))
        print(row("  torch FsspecReader, default read-ahead",
                  torch_reader(server, url, state, keys), exact, goal))
        print(row("  torch FsspecReader, cache_type none",
                  torch_reader(server, url, state, keys, default_cache_type="none"), exact,
                  goal))


def part_scan(server: S3Server, tmp: Path, demo: Path | None) -> None:
    if demo is None:
        from inspector.demo import build_demo

        demo = tmp / "demo"
        build_demo(demo)
    fp8 = demo / "fp8"
    shards = sum(p.stat().st_size for p in fp8.glob("*.distcp"))
    url = server.put_folder(fp8, "bench-remote/fp8")
    print(f"2. FP8 demo (2 ranks, torchao wrappers): shards {shards:,} bytes")
    print(row("FP8 scan: ours", ours(server, url, None, None, scan=True), shards, 0.10,
              below=True))
    print("  FP8 scan: torch                            n/a (loads every tensor: the row above"
          " 'every tensor')")


def part_export(server: S3Server, tmp: Path, layers: int) -> None:
    src = build(tmp / "big", tensor_shapes(layers=layers), ranks=2)
    size = folder_bytes(src)
    url = server.put_folder(src, "bench-remote/big")
    options = json.dumps(server.storage_options)
    print(f"3. export to local safetensors, {size / 1e9:.2f} GB (2 ranks), each in a fresh "
          "process")
    server.stats.reset()
    plain = measure(DOWNLOAD, url, str(tmp / "plain"), options)
    print(f"  anchor: s3fs download of every object: {plain['wall']:6.1f} s "
          f"({server.stats.requests} requests)")
    results = {}
    for verify in ("no-verify", "verify"):
        for where, source, opts in (("local disk", str(src), "null"), ("moto S3", url, options)):
            server.stats.reset()
            out = tmp / f"out-{where.replace(' ', '-')}-{verify}"
            results[where, verify] = measured = measure(EXPORT, source, str(out), opts, verify)
            fetched = (f", {server.stats.requests} requests, {server.stats.bytes / size:.2f}x "
                       "the checkpoint's bytes" if server.stats.requests else "")
            print(f"  {where:10} {verify:9}: {measured['wall']:6.1f} s, peak RSS "
                  f"{mib(measured['peak'])}{fetched}")
        remote, local = results["moto S3", verify], results["local disk", verify]
        extra = remote["peak"] - local["peak"]
        print(f"  {verify}: wall S3 / disk {remote['wall'] / local['wall']:.1f}x, S3 / anchor "
              f"{remote['wall'] / plain['wall']:.1f}x; peak RSS S3 - disk {mib(extra)} "
              f"(goal <= 256 MiB) {'PASS' if extra <= 256 << 20 else 'MISS'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--export-layers", type=int, default=4, help="~1.07 GB at 4; 0 skips")
    parser.add_argument("--demo", type=Path, help="a folder python -m inspector.demo wrote")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    # s3fs's whole-object downloads hang up mid-body at the end; the proxy logs each one
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as tmp, S3Server() as server:
        part_reads(server, Path(tmp))
        part_scan(server, Path(tmp), args.demo)
        if args.export_layers:
            part_export(server, Path(tmp), args.export_layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
