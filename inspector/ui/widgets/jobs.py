"""A progress bar, a status line and a Cancel button for one background job at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import ipywidgets as w

from inspector.ui.views.jobs import Job, Report, Step
from inspector.ui.widgets.errors import ErrorBox

# How long closing a bar waits for its cancelled job to stop (seconds).
STOP_WAIT = 10.0


class JobBar(w.HBox):
    """Runs work in a :class:`~inspector.ui.views.jobs.Job` and shows how far it is.

    ``run(work, on_result)`` cancels a job still running, starts the new one and, when it
    succeeds, calls ``on_result(result)`` (from the worker thread); a failure is shown in
    the app's error box as ``<what> failed.``, a cancel as "cancelled". ``finished``:
    callbacks run after every job, whatever its outcome (the header's bytes-read line).
    """

    def __init__(self, errors: ErrorBox, what: str) -> None:
        self.errors, self.what = errors, what
        self.job: Job | None = None
        self.finished: list[Callable[[], None]] = []
        self.progress = w.FloatProgress(value=0.0, min=0.0, max=1.0, layout=w.Layout(width="240px"))
        self.status = w.Label()
        self.cancel_button = w.Button(description="Cancel", icon="stop", disabled=True)
        self.cancel_button.on_click(lambda _: self.cancel())
        self.cancel_button.add_class("inspector-cancel")
        super().__init__([self.progress, self.cancel_button, self.status])
        self.layout.display = "none"

    def run(
        self, work: Callable[[Report, threading.Event], Any], on_result: Callable[[Any], None]
    ) -> Job:
        self.cancel()
        self.layout.display = ""
        self.progress.value, self.progress.bar_style = 0.0, ""
        self.status.value = "starting ..."
        self.cancel_button.disabled = False
        job = Job(work, on_progress=self._show, on_done=lambda j: self._done(j, on_result))
        self.job = job
        return job.start()

    def cancel(self) -> None:
        """Stop the running job (if any) at its next check; its result is not shown."""
        if self.job is not None and self.job.running:
            self.job.cancel()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the current job has finished (for scripts and tests)."""
        if self.job is not None and self.job.thread is not threading.current_thread():
            self.job.wait(timeout)

    def close(self) -> None:
        """Cancel the running job and let it stop (it holds the checkpoint), then close."""
        self.cancel()
        self.wait(STOP_WAIT)
        super().close()

    def _show(self, step: Step) -> None:
        self.progress.value = step.fraction
        self.status.value = f"{step.text} ({step.fraction:.0%})" if step.text else ""

    def _done(self, job: Job, on_result: Callable[[Any], None]) -> None:
        if job is not self.job:
            return  # replaced by a newer job
        try:
            self._outcome(job, on_result)
        finally:
            for callback in self.finished:
                callback()

    def _outcome(self, job: Job, on_result: Callable[[Any], None]) -> None:
        self.cancel_button.disabled = True
        if job.cancelled:
            self.progress.bar_style, self.status.value = "warning", "cancelled"
            return
        if job.error is None:
            try:
                on_result(job.result)
            except Exception as exc:
                job.error = exc
        if job.error is not None:
            self.progress.bar_style, self.status.value = "danger", "failed"
            self.errors.show(self.what, job.error)
            return
        self.progress.value, self.progress.bar_style = 1.0, "success"
        self.status.value = "done"
