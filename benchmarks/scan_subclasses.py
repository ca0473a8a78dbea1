"""``ck.scan()`` reads pickle records only: its time must not grow with tensor size.

Saves (one process, DCP) two checkpoints with the same 64 keys, half of them wrapped in
torchao's ``WeightWithDynamicFloat8CastTensor`` as float8 training does: one of 64x64
float32 weights (1 MiB in all), one of 1024x1024 (256 MiB in all). Counts the bytes a
fresh ``inspector.open(path).scan()`` reads (``rchar`` of /proc/self/io, deterministic)
and times it, interleaved, with reading every tensor for context.
Goal: scan(large) / scan(small) <= 1.5 in bytes read and in time.
Run: ``.venv/bin/python benchmarks/scan_subclasses.py``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from peak import goal_line

import inspector

TENSORS = 64
SMALL, LARGE = 64, 1024


def build(path: Path, dim: int) -> None:
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    state = {}
    for i in range(TENSORS):
        w = torch.randn(dim, dim)
        if i % 2:
            w = WeightWithDynamicFloat8CastTensor(w, LinearMMConfig(), torch.float8_e4m3fn)
        state[f"layers.{i}.weight"] = w
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def scan(path: Path) -> int:
    ck = inspector.open(path)
    ck.scan(progress=False)
    return sum(ck.facts(k).subclass is not None for k in ck.keys())


def read_all(path: Path) -> int:
    ck = inspector.open(path)
    return sum(ck.read(k).numel() for k in ck.keys())


def timed(fn, path: Path) -> float:
    start = time.perf_counter()
    fn(path)
    return time.perf_counter() - start


def bytes_read(fn, path: Path) -> int:
    """Bytes this process read through read-like system calls while ``fn`` ran."""

    def rchar() -> int:
        return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])

    before = rchar()
    fn(path)
    return rchar() - before


def main(rounds: int = 5) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        small, large = Path(tmp) / "small", Path(tmp) / "large"
        build(small, SMALL)
        build(large, LARGE)
        assert scan(small) == scan(large) == TENSORS // 2
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for what, fn in (("scan", scan), ("read", read_all)):
                for name, path in (("small", small), ("large", large)):
                    times.setdefault((what, name), []).append(timed(fn, path))
        t = {k: statistics.median(v) for k, v in times.items()}
        print(f"{TENSORS} keys, half FP8-wrapped; {SMALL}x{SMALL} vs {LARGE}x{LARGE} float32")
        for what in ("scan", "read"):
            print(
                f"{what:4}: small {t[what, 'small']:.3f} s, large {t[what, 'large']:.3f} s "
                f"(median of {rounds}), ratio {t[what, 'large'] / t[what, 'small']:.2f}"
            )
        read = {name: bytes_read(scan, path) for name, path in (("small", small), ("large", large))}
        print(f"scan bytes read: small {read['small']:,}, large {read['large']:,}")
        ratio = max(t["scan", "large"] / t["scan", "small"], read["large"] / read["small"])
        return goal_line("scan(large) / scan(small), worst of time and bytes, <= 1.5", [ratio], 1.5)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
