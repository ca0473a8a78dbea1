"""Large synthetic DCP checkpoints for the benchmarks, written by torch's real DCP save.

``ranks=2`` spawns two gloo processes that each save their row-shard of every tensor as
a DTensor (as FSDP would), so chunks land in ``__0_0.distcp`` and ``__1_0.distcp``;
``ranks=1`` saves the same values from one process. Shard contents are seeded by
(tensor name, shard index), so both produce identical tensors.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch


def tensor_shapes(layers: int, width: int = 2048, vocab: int = 16000) -> dict[str, tuple[int, int]]:
    """Llama-like names and shapes; ``width=2048`` gives ~200 MB of fp32 per layer."""
    hidden = int(width * 2.6875)
    shapes = {"tok_embeddings.weight": (vocab, width)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"{p}attention.{name}.weight"] = (width, width)
        shapes[f"{p}feed_forward.w1.weight"] = (hidden, width)
        shapes[f"{p}feed_forward.w2.weight"] = (width, hidden)
        shapes[f"{p}feed_forward.w3.weight"] = (hidden, width)
    shapes["output.weight"] = (vocab, width)
    return shapes


def shard(name: str, index: int, rows: int, cols: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{index}".encode()))
    return torch.randn(rows, cols, generator=generator) * 0.02


def shard_rows(total: int, ranks: int) -> list[int]:
    per = -(-total // ranks)
    return [max(0, min(per, total - r * per)) for r in range(ranks)]


def full_tensor(name: str, shape: tuple[int, int], ranks: int = 2) -> torch.Tensor:
    """The whole tensor the ``ranks``-way save holds (concatenated shards)."""
    parts = [shard(name, i, n, shape[1]) for i, n in enumerate(shard_rows(shape[0], ranks))]
    return torch.cat(parts)


def build(
    path: Path, shapes: dict[str, tuple[int, int]], *, ranks: int = 2, perturb: str | None = None
) -> Path:
    """Write the checkpoint; ``perturb`` adds 1.0 to element [0, 0] of that tensor."""
    import torch.distributed.checkpoint as dcp

    if ranks == 1:
        state = {name: full_tensor(name, shape) for name, shape in shapes.items()}
        if perturb:
            state[perturb][0, 0] += 1.0
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        return path
    from inspector.demo.gloo import run_ranks

    run_ranks(_save_rank, str(path), shapes, world_size=ranks)
    return path


def _save_rank(rank: int, ranks: int, path: str, shapes: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ranks,))
    state = {}
    for name, (rows, cols) in shapes.items():
        local = shard(name, rank, shard_rows(rows, ranks)[rank], cols)
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows, cols), stride=(cols, 1)
        )
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
