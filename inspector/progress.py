"""Progress reports and cancellation for long reads (statistics, histograms, audits, diffs),
so that a worker thread can show how far it is and stop when asked.

A long function takes ``on_progress(done, total)`` (units it names: elements, bytes, keys)
and ``cancel``, a ``threading.Event``; it calls :func:`check` between blocks, which raises
:class:`Cancelled` once the event is set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

ProgressFn = Callable[[int, int], None]


class Cancelled(Exception):
    """The caller cancelled the work (``cancel.set()``). Not an ``InspectorError``: it says
    nothing about the checkpoint, so no read records it as damage."""

    def __init__(self) -> None:
        super().__init__("cancelled")


def check(cancel: threading.Event | None) -> None:
    """Raise :class:`Cancelled` when ``cancel`` is set."""
    if cancel is not None and cancel.is_set():
        raise Cancelled


class Counter:
    """Adds up ``done`` toward ``total`` and reports each step; checks ``cancel`` first."""

    def __init__(
        self,
        total: int,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.total, self.done = total, 0
        self.on_progress, self.cancel = on_progress, cancel

    def step(self, amount: int) -> None:
        check(self.cancel)
        self.done += amount
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)
