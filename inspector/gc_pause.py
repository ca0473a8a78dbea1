"""Pause the cyclic garbage collector while building many small objects.

Opening a large checkpoint creates millions of small objects (metadata, chunk records);
with the collector running, most of the time goes to rescanning them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
