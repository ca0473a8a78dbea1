"""A sound DCP ``.metadata`` read straight into the DCP reader's entries, at C speed.

The unpickler decodes a 100k-key ``.metadata`` into half a million stand-in records before
the reader turns them into entries; ``_metadata.c`` runs the same opcodes over plain C
values and builds the entries directly. It resolves only the globals genuine metadata
names (nothing is imported or called) and only ever accepts: wherever the file is not
plainly sound, it declines and the reader takes the unpickler's path, which names the
problem. What it returns equals what that path builds
(``tests/formats/test_metadata_decoder.py``).
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from inspector import dtypes
from inspector.components import component_of
from inspector.entry import ChunkInfo, Entry, layout_problem
from inspector.formats.safe_pickle import policy
from inspector.formats.safe_pickle.records import DtypeName
from inspector.gc_pause import paused_gc

_metadata: ModuleType | None
try:
    from inspector.formats.safe_pickle import _metadata
except ImportError:  # installed without a C compiler: the unpickler's path does it all
    _metadata = None

_PATHS = {"posix": pathlib.PurePosixPath, "windows": pathlib.PureWindowsPath}


class MetadataEntries(NamedTuple):
    """What the DCP reader takes from ``.metadata``: its entries (with their components where
    ``planner_data`` gave their paths),
    whether it had ``planner_data``, its version and the ``checkpoint_id`` it was saved to."""

    entries: list[Entry]
    has_planner: bool
    version: str | None
    checkpoint_id: str | pathlib.PurePath | None


@functools.cache
def _consts() -> tuple[dict[str, str], type, type, Callable[..., Any], Callable[..., str]]:
    """What ``_metadata.entries`` needs from Python: each ``torch.<name>`` the policy maps to a
    known dtype, with the dtype name the reader gives it; the record types; the layout check;
    the component rule."""
    known = {}
    for name in (*dtypes.NAMES, *dtypes.ALIASES):
        value = policy.metadata_global("torch", name)
        if type(value) is DtypeName and dtypes.is_known(str(value)):
            known[name] = str(value)
    return known, ChunkInfo, Entry, layout_problem, component_of


def metadata_entries(
    data: bytes, file_sizes: Callable[[set[str]], dict[str, Any]]
) -> MetadataEntries | None:
    """The entries of a sound ``.metadata`` (``data``), or None: unpickle it instead.
    ``file_sizes`` is called once, with every file its storage records name."""
    if _metadata is None:
        return None
    with paused_gc():
        found = _metadata.entries(data, file_sizes, _consts())
    if found is None:
        return None
    entries, has_planner, version, checkpoint_id = found
    if isinstance(checkpoint_id, tuple):
        kind, parts = checkpoint_id
        checkpoint_id = _PATHS[kind](*parts)
    return MetadataEntries(entries, has_planner, version, checkpoint_id)
