"""Driving a checkpoint through the inspector's entry points, timing each call and measuring
what the whole run allocated."""

from __future__ import annotations

import re
import resource
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import inspector
from inspector.checkpoint import Checkpoint
from inspector.dtypes import name_of
from inspector.errors import InspectorError
from inspector.formats.safetensors import SAFETENSORS_NAMES


@dataclass
class Probe:
    """Calls inspector functions: an InspectorError is an outcome (returned), anything else
    propagates and fails the test. Records how long each call took."""

    times: list[tuple[float, str]] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)  # calls that raised

    def call(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``(value, None)`` or ``(None, the InspectorError)``."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs), None
        except InspectorError as exc:
            self.errors.append((time.perf_counter() - start, what))
            return None, exc
        finally:
            self.times.append((time.perf_counter() - start, what))

    @property
    def slowest(self) -> tuple[float, str]:
        return max(self.times, default=(0.0, "nothing"))

    @property
    def slowest_error(self) -> tuple[float, str]:
        """The slowest call that ended in an error, or opening (the answers that must be
        quick whatever a file claims)."""
        opening = [t for t in self.times if t[1] == "open"]
        return max(self.errors + opening, default=(0.0, "nothing"))


def read_every_entry(probe: Probe, ck: Checkpoint) -> dict[str, InspectorError]:
    """Read every tensor (checking it has the listed dtype and shape) and object; the
    errors, by key."""
    errors = {}
    for key in ck.keys():
        entry = ck.entry(key)
        read = ck.read if entry.kind == "tensor" else ck.read_object
        value, error = probe.call(f"read {key}", read, key)
        if error is not None:
            errors[key] = error
        elif entry.kind == "tensor":
            assert (name_of(value.dtype), tuple(value.shape)) == (entry.dtype, entry.shape), key
    return errors


def explore(probe: Probe, path: Path) -> tuple[Checkpoint | None, dict[str, InspectorError]]:
    """Open, list, scan and read everything; the checkpoint (None if refused) and the errors
    by key (``None`` for a refusal)."""
    ck, error = probe.call("open", inspector.open, path)
    if error is not None:
        return None, {None: error}
    probe.call("table", ck.table)
    probe.call("scan", ck.scan, progress=False)
    return ck, read_every_entry(probe, ck)


@dataclass
class Usage:
    """Peak memory of a block: Python allocations (tracemalloc) and resident set growth."""

    traced_peak: int = 0
    rss_growth: int = 0


def _status_kb(field_name: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field_name}:\s+(\d+) kB", text, re.MULTILINE).group(1))


@contextmanager
def usage(trace: bool = True, budget: int = 2 << 30) -> Iterator[Usage]:
    """Allow the block ``budget`` more bytes of address space (RLIMIT_AS), so allocating
    what a lying size claims fails (MemoryError, torch's RuntimeError) instead of quietly
    reserving it; and measure its peaks: tracemalloc's (when ``trace``: it slows Python
    down) and the resident set's (reset through /proc/self/clear_refs) above before."""
    used = Usage()
    Path("/proc/self/clear_refs").write_text("5")
    resident = _status_kb("VmRSS")
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status_kb("VmSize") * 1024 + budget, limits[1]))
    if trace:
        tracemalloc.start()
    try:
        yield used
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
        if trace:
            used.traced_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        used.rss_growth = max(0, _status_kb("VmHWM") - resident) * 1024


def warm_up(checkpoints: dict[str, Path], out: Path) -> None:
    """Run every entry point once on genuine checkpoints, so the lazy imports they need
    (pandas, tqdm, the exporter, ...) happen before any guarded block."""
    import numpy  # noqa: F401  (safe_pickle imports it for numpy values in pickles)
    import zstandard  # noqa: F401  (the DCP reader imports it for compressed chunks)

    for name, path in checkpoints.items():
        ck, errors = explore(Probe(), path)
        assert ck is not None and not errors, (name, errors)
        inspector.diff(ck, ck, progress=False)
        for fmt, target in (("safetensors", out / name), ("pt", out / f"{name}.pt")):
            inspector.export(ck, target, **export_options(ck, fmt))


def export_options(ck: Checkpoint, fmt: str) -> dict[str, Any]:
    """Export everything under its stored name; for safetensors, leave out the dtypes it
    cannot store (float8_e8m0fnu)."""
    unstorable = [
        e.key
        for e in ck.entries()
        if fmt == "safetensors" and e.dtype is not None and e.dtype not in SAFETENSORS_NAMES
    ]
    return {
        "format": fmt,
        "model_only": False,
        "flatten": False,
        "exclude": unstorable,
        "progress": False,
    }
