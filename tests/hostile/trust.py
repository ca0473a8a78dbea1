"""The third round of hostile inputs (tests/test_hostile_trust.py): whole classes of input
nobody on the team wrote, each case a function ``run(args, report)`` that builds its input
with the real producers inside a child forked from a zygote (tests/hostile/zygote.py), drives
the public entry points and raises on any broken promise. ``args`` holds ``tmp``, a folder of
its own.

``prepare`` is the zygote's warm-up: every module a case needs is imported, and a figure
drawn, before any child forks, so a case imports nothing new under the audit-hook guard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Report = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class TrustCase:
    """``target``: the ``module:function`` a child runs; ``seconds``: when it counts as hung."""

    target: str
    args: dict[str, Any]
    seconds: float = 60.0


def prepare(setup: dict[str, Any]) -> None:
    """Import and warm up what every case uses (no thread may be left running)."""
    import io

    import aiohttp  # noqa: F401
    import fsspec.implementations.http  # noqa: F401
    import gcsfs  # noqa: F401
    import huggingface_hub.hf_file_system  # noqa: F401
    import matplotlib
    import numpy
    import pandas  # noqa: F401
    import s3fs  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import tqdm.auto  # noqa: F401

    import inspector
    import inspector.ui.cli
    from inspector.analysis.stats import Histogram
    from inspector.ui.views.plots import png
    from tests.hostile import guard  # noqa: F401

    matplotlib.use("Agg")
    figure = Histogram("warm", torch.ones(2), torch.arange(3.0), 0, 0).plot()
    png(figure)
    torch.save({"x": numpy.zeros(2)}, io.BytesIO())
    inspector.diff  # noqa: B018  (loaded on first use)


def timed(report: Report, step: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, its seconds reported under ``step``."""
    began = time.perf_counter()
    result = fn()
    report({"step": step, "seconds": time.perf_counter() - began})
    return result
