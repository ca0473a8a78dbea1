"""Components set on a checkpoint's entries, and counted.

The rule from a nested path to its component is :mod:`inspector.components` (formats apply
it while they build entries); this module applies it where a format did not, guessing the
path from the dotted key where the format lost it (only a fallback: model FQNs contain dots
and Hugging Face names start with ``model.`` themselves).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from inspector.components import SHARDED_OBJECT, component_name, component_of
from inspector.entry import COMPONENTS, Entry, make_entry


def with_components(entries: list[Entry]) -> list[Entry]:
    """The entries with ``component`` set (and a guessed ``nested_path`` where the format
    lost it); records are rebuilt, never changed. A component the format set (anything but
    the default ``"other"``, on an entry with its path) is kept: formats apply the same rule."""
    todo = [i for i, e in enumerate(entries) if e.component == "other" or not e.nested_path]
    if not todo:
        return entries
    guess_model_prefix = any(
        not entries[i].nested_path
        and component_name(entries[i].key.split(".", 1)[0]) not in (None, "model")
        for i in todo
    )
    out = list(entries)
    for i in todo:
        e = out[i]
        path = e.nested_path or _guess_path(e.key, guess_model_prefix)
        component = component_of(e.kind, path)
        if component != e.component or path is not e.nested_path:
            out[i] = make_entry(e.key, e.kind, e.dtype, e.shape, e.chunks, path, component, e.error)
    return out


def _guess_path(key: str, model_prefix_plausible: bool) -> tuple[str, ...]:
    base, slash, shard = key.partition(SHARDED_OBJECT)
    if slash and "." not in base and component_name(base) is not None:
        return (base, slash[1:] + shard)
    head, _, rest = key.partition(".")
    name = component_name(head)
    if rest and name is not None and (name != "model" or model_prefix_plausible):
        return (head, rest)
    return (key,)


def component_counts(entries: Iterable[Entry]) -> dict[str, int]:
    """Number of keys per component, in the canonical component order."""
    counts = Counter(e.component for e in entries)
    order = [*COMPONENTS, "other"]
    return {c: counts[c] for c in order if counts[c]}
