"""Choosing keys by a typed pattern: substring, glob or regular expression."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase

from inspector.entry import Entry
from inspector.errors import InspectorError
from inspector.keys.spellings import view_key

FILTER_MODES = ("substring", "glob", "regex")


def key_filter(pattern: str, mode: str = "substring") -> Callable[[str], bool]:
    """A test for keys: ``substring`` (case-insensitive), ``glob`` (whole key, ``*`` / ``?``
    / ``[...]``) or ``regex`` (searched anywhere in the key); an empty pattern passes all."""
    if mode not in FILTER_MODES:
        raise ValueError(f"filter mode must be one of {FILTER_MODES}, not {mode!r}")
    if not pattern:
        return lambda key: True
    if mode == "substring":
        folded = pattern.casefold()
        return lambda key: folded in key.casefold()
    if mode == "glob":
        return lambda key: fnmatchcase(key, pattern)
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise InspectorError(f"not a valid regular expression {pattern!r}: {exc}") from None
    return lambda key: compiled.search(key) is not None


def filter_entries(entries: Iterable[Entry], view: str, pattern: str, mode: str) -> list[Entry]:
    """The entries whose key, spelled as in ``view``, passes :func:`key_filter`."""
    if not pattern:
        return list(entries)
    test = key_filter(pattern, mode)
    return [e for e in entries if test(view_key(e, view))]
