"""Long work off the kernel's thread: a :class:`Job` runs one function in a worker thread,
hands it a progress reporter and a cancel token, and keeps its result or error.

The app's panels start jobs for statistics, comparisons, audits and the header's scan, so
a multi-GB tensor never freezes the notebook; scripts and tests ``wait()`` for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inspector.progress import Cancelled

# Progress reports reach ``on_progress`` at most this often (seconds), besides the last.
UPDATE_EVERY = 0.1


@dataclass(frozen=True)
class Step:
    """How far a job is: ``done`` of ``total`` (units of the phase) and what it is doing."""

    done: int
    total: int
    text: str = ""

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0


class Report:
    """What a job's work function calls: ``report(done, total, text)``; reports closer
    together than ``UPDATE_EVERY`` are dropped, except the one that completes a phase."""

    def __init__(self, on_progress: Callable[[Step], None] | None) -> None:
        self.on_progress = on_progress
        self.last = 0.0
        self.text = ""

    def __call__(self, done: int, total: int, text: str | None = None) -> None:
        if text is not None:
            self.text = text
        now = time.monotonic()
        if self.on_progress is None or (done < total and now - self.last < UPDATE_EVERY):
            return
        self.last = now
        self.on_progress(Step(done, total, self.text))

    def phase(self, text: str) -> Callable[[int, int], None]:
        """A ``(done, total)`` callback for the core's ``on_progress``, labelled ``text``."""
        return lambda done, total: self(done, total, text)


class Job:
    """``work(report, cancel)`` in a daemon thread; ``on_done(job)`` runs in it at the end.

    After it ends, ``result`` holds what ``work`` returned, or ``error`` what it raised;
    ``cancelled`` is True when it stopped because :meth:`cancel` was called.
    """

    def __init__(
        self,
        work: Callable[[Report, threading.Event], Any],
        *,
        on_progress: Callable[[Step], None] | None = None,
        on_done: Callable[[Job], None] | None = None,
    ) -> None:
        self.work, self.on_done = work, on_done
        self.report = Report(on_progress)
        self.cancel_token = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Job:
        self.thread.start()
        return self

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def cancel(self) -> None:
        """Ask the work to stop at its next check (between blocks)."""
        self.cancel_token.set()

    def wait(self, timeout: float | None = None) -> Job:
        """Block until the job (and its ``on_done``) has finished."""
        if self.thread.ident is not None:
            self.thread.join(timeout)
        return self

    def _run(self) -> None:
        try:
            self.result = self.work(self.report, self.cancel_token)
        except Cancelled:
            self.cancelled = True
        except Exception as exc:
            self.error = exc
        if self.on_done is not None:
            self.on_done(self)
