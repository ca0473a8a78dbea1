"""Pause the cyclic garbage collector while building many small objects.

Opening a large checkpoint creates millions of small objects (metadata, chunk records);
with the collector running, most of the time goes to rescanning them. When the pause
ends, what it built is moved straight to the oldest generation (``gc.freeze()`` then
``gc.unfreeze()``: two list splices): otherwise the first young collections afterwards
would traverse all of it once more (a full pass, about a quarter second per million
objects) just to promote it there. Skipped when the program froze objects itself
(``gc.unfreeze()`` would let go of those too).
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
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
