"""Key tree on a 100k-key checkpoint: build per view, expand a node, list a page of entries.

Writes a synthetic DCP ``.metadata`` (torch's own metadata classes, pickled as DCP does)
and its data file (sparse, sized as the real one, so every record checks out as in a
genuine checkpoint) for a legacy torchtitan checkpoint: 2,222 layers of 9 parameters, each
stored as a ``model.``-prefixed weight plus AdamW ``exp_avg``/``exp_avg_sq``/``step`` and a
``param_groups`` lr (100,006 keys). For each view it times, with ``inspector.open`` of the
same folder as the anchor (ratios printed as x):
- build: ``ck.tree(view)`` with the root's first level and every total shown there (the
  tree groups deeper levels when they are opened),
- whole tree: every node grouped and totalled (``walk()``),
- expand: opening the largest node (2,222 children, each with its totals),
- page: finding a layer below it and listing its entries.
Goals (medians of the rounds, every view): build <= 1 s and expand <= 0.1 s (exit 0 when
met); the whole tree is printed against the same 1 s for reference.
Run: ``.venv/bin/python benchmarks/tree.py [rounds]`` (default 3).
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from peak import goal_line
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import inspector
from inspector.demo.model import TinyLlama, TinyLlamaConfig
from inspector.keys.tree import KeyNode

LAYERS, DIM, FFN, VOCAB = 2222, 64, 256, 1000
BUILD_GOAL, EXPAND_GOAL = 1.0, 0.1
LARGEST = {"stored": "model.layers", "flattened": "layers", "prefixed": "model.layers"}


def parameter_shapes() -> dict[str, tuple[int, ...]]:
    """TinyLlama's own parameter names and shapes at benchmark size (built on meta, no memory)."""
    config = TinyLlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, hidden_dim=FFN)
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in TinyLlama(config).state_dict().items()}


def build_metadata(folder: Path) -> int:
    state, storage, planner = {}, {}, {}
    offset = 0

    def add(key: str, path: tuple, shape: tuple[int, ...] | None, dtype: torch.dtype) -> None:
        nonlocal offset
        if shape is None:
            state[key] = BytesStorageMetadata()
            index, length = MetadataIndex(key), 64
        else:
            zeros = torch.Size((0,) * len(shape))
            state[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype),
                torch.Size(shape),
                [ChunkStorageMetadata(zeros, torch.Size(shape))],
            )
            index, length = MetadataIndex(key, zeros, 0), torch.Size(shape).numel() * 4
        storage[index] = _StorageInfo("__0_0.distcp", offset, length)
        planner[key] = path
        offset += length

    for fqn, shape in parameter_shapes().items():
        add(f"model.{fqn}", ("model", fqn), shape, torch.bfloat16)
        for name in ("exp_avg", "exp_avg_sq"):
            add(
                f"optimizer.state.{fqn}.{name}",
                ("optimizer", f"state.{fqn}.{name}"),
                shape,
                torch.float32,
            )
        add(f"optimizer.state.{fqn}.step", ("optimizer", f"state.{fqn}.step"), (), torch.float32)
        add(
            f"optimizer.param_groups.{fqn}.lr",
            ("optimizer", f"param_groups.{fqn}.lr"),
            None,
            torch.float32,
        )
    add("train_state.step", ("train_state", "step"), (), torch.int64)
    meta = Metadata(state, planner, storage, StorageMeta(checkpoint_id=folder), "1.0.0")
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with open(folder / "__0_0.distcp", "wb") as f:  # sparse: no disk used
        f.truncate(offset)
    return len(state)


def timed(fn, *args) -> float:
    """Seconds ``fn`` takes; what it returns is freed only after the clock stops."""
    start = time.perf_counter()
    kept = fn(*args)
    elapsed = time.perf_counter() - start
    del kept
    return elapsed


def first_screen(ck: inspector.Checkpoint, view: str) -> list[KeyNode]:
    """The root and its first level, with totals: what a viewer shows first."""
    root = ck.tree(view)
    shown = [root, *root.children()]
    for node in shown:
        node.by_dtype  # noqa: B018
    return shown


def whole_tree(ck: inspector.Checkpoint, view: str) -> list[KeyNode]:
    """Every node grouped and totalled."""
    nodes = list(ck.tree(view).walk())
    for node in nodes:
        node.by_dtype  # noqa: B018
    return nodes


def expand_largest(ck: inspector.Checkpoint, view: str) -> float:
    node = ck.tree(view).find(LARGEST[view])
    return timed(lambda: [child.by_dtype for child in node.children()])


def entry_page(ck: inspector.Checkpoint, view: str) -> float:
    node = ck.tree(view).find(LARGEST[view])
    return timed(lambda: node.find(f"{LARGEST[view]}.1500").entries(0, 100))


def median(fn, *args, rounds: int) -> float:
    return statistics.median(fn(*args) for _ in range(rounds))


def main(rounds: int = 3) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        keys = build_metadata(folder)
        print(f"metadata: {keys} keys, {(folder / '.metadata').stat().st_size / 1e6:.1f} MB")
        opened = median(timed, inspector.open, folder, rounds=rounds)
        ck = inspector.open(folder)
        print(f"inspector.open (anchor): {opened:.3f} s (median of {rounds})\n")
        print(f"{'view':10s} {'build':>13s} {'whole tree':>13s} {'expand':>9s} {'page':>9s}")
        builds, expands, wholes = [], [], []
        for view in ("stored", "flattened", "prefixed"):
            build = median(timed, first_screen, ck, view, rounds=rounds)
            whole = median(timed, whole_tree, ck, view, rounds=rounds)
            expand = median(expand_largest, ck, view, rounds=rounds)
            page = median(entry_page, ck, view, rounds=rounds)
            print(
                f"{view:10s} {build:5.3f} s {build / opened:4.2f}x {whole:5.3f} s "
                f"{whole / opened:4.2f}x {expand:7.3f} s {page * 1e3:6.2f} ms"
            )
            builds.append(build)
            expands.append(expand)
            wholes.append(whole)
        print(f"\nload average: {os.getloadavg()[0]:.2f}")
        met = goal_line(f"build <= {BUILD_GOAL} s (each view)", builds, BUILD_GOAL, every=True)
        met &= goal_line(f"expand <= {EXPAND_GOAL} s (each view)", expands, EXPAND_GOAL, every=True)
        goal_line(f"whole tree <= {BUILD_GOAL} s (reference only)", wholes, BUILD_GOAL, every=True)
        return met


if __name__ == "__main__":
    sys.exit(0 if main(int(sys.argv[1]) if len(sys.argv) > 1 else 3) else 1)
