"""The Jupyter app: ``inspector.Inspector(path)`` (presentation only; the core does the work)."""

from inspector.ui.widgets.app import Inspector

__all__ = ["Inspector"]
