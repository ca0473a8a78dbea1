"""Open a 405B-shaped DCP metadata file: inspector.open + table vs torch's read_metadata.

Builds a synthetic ``.metadata`` like a Llama-3 405B run with AdamW state saved from 64
ranks (about 3,400 keys, 218k chunk entries) beside its 64 data files (sparse, sized as the
real ones, so every record checks out as in a genuine checkpoint), then times, interleaved,
torch's ``FileSystemReader.read_metadata()`` and ``inspector.open(path).table()``.
Goal: ours / torch's <= 0.5 in every round (the ratio of each interleaved pair).
Then each C extension against the Python code it stands in for, on the same file (goal:
native / Python <= 0.5, or the extension goes): ``_metadata.c`` (the whole read of
``.metadata`` into entries, vs unpickling and building them in Python), ``_table.c`` (the
entries of the unpickled metadata and the check of their items) and ``_opscan.c`` (the
pickle's size pre-scan); the median of the interleaved rounds' ratios.
Run: ``.venv/bin/python benchmarks/open_metadata.py [rounds]`` (default 3).
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas  # noqa: F401  (imported up front: the table's one-off import is not per-open work)
import torch
from peak import goal_line, spread
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import inspector
from inspector.formats.dcp import reader
from inspector.formats.safe_pickle import direct, prescan
from inspector.storage.local import LocalStorage

GOAL = 0.5
NATIVE_GOAL = 0.5  # native / Python: a C extension must be at least twice as fast

RANKS, DIM, FFN, VOCAB, LAYERS, KV = 64, 16384, 53248, 128256, 126, 1024


def parameter_shapes(
    dim: int = DIM, ffn: int = FFN, vocab: int = VOCAB, layers: int = LAYERS, kv: int = KV
) -> dict[str, tuple[int, ...]]:
    """torchtitan Llama parameter names and shapes (405B by default)."""
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention.wq.weight": (dim, dim),
            p + "attention.wk.weight": (kv, dim),
            p + "attention.wv.weight": (kv, dim),
            p + "attention.wo.weight": (dim, dim),
            p + "feed_forward.w1.weight": (ffn, dim),
            p + "feed_forward.w2.weight": (dim, ffn),
            p + "feed_forward.w3.weight": (ffn, dim),
            p + "attention_norm.weight": (dim,),
            p + "ffn_norm.weight": (dim,),
        }
    return shapes | {"norm.weight": (dim,), "output.weight": (vocab, dim)}


def build_metadata(folder: Path) -> tuple[int, int]:
    state, storage, planner = {}, {}, {}
    ends = [0] * RANKS  # each rank's file: its items one after another, as DCP writes them
    for fqn, shape in parameter_shapes().items():
        for key, path, dtype in (
            (fqn, (fqn,), torch.bfloat16),
            (
                f"optimizer.state.{fqn}.exp_avg",
                ("optimizer", f"state.{fqn}.exp_avg"),
                torch.float32,
            ),
            (
                f"optimizer.state.{fqn}.exp_avg_sq",
                ("optimizer", f"state.{fqn}.exp_avg_sq"),
                torch.float32,
            ),
        ):
            rows, chunks = shape[0], []
            per = -(-rows // RANKS)
            for rank in range(RANKS):
                start = min(rank * per, rows)
                offsets = torch.Size((start,) + (0,) * (len(shape) - 1))
                sizes = torch.Size((max(0, min(per, rows - start)), *shape[1:]))
                chunks.append(ChunkStorageMetadata(offsets, sizes))
                nbytes = sizes.numel() * dtype.itemsize
                storage[MetadataIndex(key, offsets, rank)] = _StorageInfo(
                    f"__{rank}_0.distcp", ends[rank], nbytes
                )
                ends[rank] += nbytes
            state[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(shape), chunks
            )
            planner[key] = path
    meta = Metadata(state, planner, storage, StorageMeta(checkpoint_id=folder), "1.0.0")
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    for rank, size in enumerate(ends):  # sparse files, sized as the real ones: no disk used
        with open(folder / f"__{rank}_0.distcp", "wb") as f:
            f.truncate(size)
    return len(state), len(storage)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def native_gains(folder: Path, rounds: int) -> bool:
    """Each C extension timed against its Python path, interleaved; prints native / Python."""
    storage, data = LocalStorage(folder), (folder / ".metadata").read_bytes()
    native = (direct._metadata, reader._table, prescan._clean)

    def python_only(on: bool) -> None:
        direct._metadata, reader._table, prescan._clean = native if on else (None, None, None)

    def read() -> object:
        return reader._read(storage, [".metadata"], ".metadata")

    decoded, problems = reader._read_metadata(storage, ".metadata", data)

    def table() -> object:
        reader._shared_chunk_lists(decoded.state_dict_metadata, ".metadata")
        entries = reader._entries(decoded, problems, storage, ".metadata")
        return reader._check_items(entries, set(), ".metadata")

    def scan() -> object:
        found = prescan.fast_scan_clean(data, 0)
        return found if found is not None else sum(1 for _ in prescan._claimed_sizes(data, 0))

    met = True
    for name, step in (("_metadata.c", read), ("_table.c", table), ("_opscan.c", scan)):
        ratios = []
        for _ in range(rounds):
            python_only(True)
            fast = timed(step)
            python_only(False)
            ratios.append(fast / timed(step))
        python_only(True)
        met &= goal_line(f"{name} / Python <= {NATIVE_GOAL}", ratios, NATIVE_GOAL)
    return met


def main(rounds: int = 3) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        keys, chunks = build_metadata(folder)
        size = (folder / ".metadata").stat().st_size
        print(f"metadata: {keys} keys, {chunks} chunk entries, {size / 1e6:.1f} MB")
        ours, theirs = [], []
        for _ in range(rounds):
            theirs.append(timed(lambda: FileSystemReader(str(folder)).read_metadata()))
            ours.append(timed(lambda: inspector.open(folder).table()))
        t, o = statistics.median(theirs), statistics.median(ours)
        print(f"torch FileSystemReader.read_metadata: {t:.2f} s (median; {spread(theirs)})")
        print(f"inspector.open + table:               {o:.2f} s (median; {spread(ours)})")
        print(f"load average: {os.getloadavg()[0]:.2f}")
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        met = goal_line(f"inspector / torch <= {GOAL}", ratios, GOAL, every=True)
        return native_gains(folder, rounds) and met


if __name__ == "__main__":
    sys.exit(0 if main(int(sys.argv[1]) if len(sys.argv) > 1 else 3) else 1)
