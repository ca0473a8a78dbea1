"""Errors shown inside the app in plain words, never as a traceback wall."""

from __future__ import annotations

import functools
import html
from collections.abc import Callable
from typing import Any

import ipywidgets as w

from inspector.errors import InspectorError
from inspector.exporting.options import app_spelling


def describe(exc: BaseException) -> str:
    """An InspectorError's own message (it names file and key, and an option by its form
    label), else the type and message."""
    if isinstance(exc, InspectorError):
        return exc.worded(app_spelling)
    message = str(exc).strip() or "no details"
    return f"{type(exc).__name__}: {message}"


def error_html(what: str, exc: BaseException) -> str:
    """``<what> failed.`` and the error in plain words, in a box marked in the theme's
    error colour (the app's style sheet: :data:`inspector.ui.widgets.markup.STYLE`)."""
    return (
        '<div class="inspector-failure">'
        f"<b>{html.escape(what)} failed.</b> {html.escape(describe(exc))}</div>"
    )


class ErrorBox(w.HTML):
    """A red box above the panels; empty (and invisible) when all is well."""

    def __init__(self) -> None:
        super().__init__()
        self.add_class("inspector-error")

    def show(self, what: str, exc: BaseException) -> None:
        self.value = error_html(what, exc)

    def clear(self) -> None:
        self.value = ""

    def guard(self, what: str) -> Callable[[Callable[..., Any]], Callable[..., None]]:
        """Decorator for anything a user triggers: clear the box, run, show what went wrong."""

        def wrap(fn: Callable[..., Any]) -> Callable[..., None]:
            @functools.wraps(fn)
            def guarded(*args: Any, **kwargs: Any) -> None:
                self.clear()
                try:
                    fn(*args, **kwargs)
                except Exception as exc:
                    self.show(what, exc)

            return guarded

        return wrap
